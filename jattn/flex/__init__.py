"""FlexAttention for JAX: ``flex_attention`` with user score and mask functions,
``create_block_mask``, and ready functions (``jattn.flex.mods``, re-exported here)."""

from jattn.flex.attention import FLEX, flex_attention
from jattn.flex.block_mask import (EMPTY, FULL, PARTIAL, BlockMask, block_mask_from_array,
                                   create_block_mask)
from jattn.flex.mods import (alibi_score, alibi_slopes, and_masks, bias_score, causal_mask,
                             document_mask, from_arrays, or_masks, prefix_lm_mask,
                             relative_position_score, sliding_window_mask, softcap_score)

__all__ = ["EMPTY", "FLEX", "FULL", "PARTIAL", "BlockMask", "alibi_score", "alibi_slopes",
           "and_masks", "bias_score", "block_mask_from_array", "causal_mask",
           "create_block_mask", "document_mask", "flex_attention", "from_arrays", "or_masks",
           "prefix_lm_mask", "relative_position_score", "sliding_window_mask",
           "softcap_score"]
