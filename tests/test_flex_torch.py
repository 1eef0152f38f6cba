"""flex_attention against PyTorch's own FlexAttention on the same inputs (through the
DLPack bridge): the ready functions and their torch spellings. Forward only: torch's
FlexAttention has no backward on CPU (the gradients are tests/test_flex.py's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch_flex = pytest.importorskip("torch.nn.attention.flex_attention")

import jattn  # noqa: E402
from conftest import rel_err  # noqa: E402
from jattn import flex  # noqa: E402
from jattn.interop.dlpack import to_jax, to_torch  # noqa: E402

B, S, HQ, HK, D = 2, 24, 4, 2, 16
DOCS = np.repeat(np.arange(4), S // 4)  # 4 documents per row
SLOPES = np.array(flex.alibi_slopes(HQ))  # a writable copy: torch.from_numpy shares it
# Eager torch FlexAttention warns that it is unfused: that is all it is needed for here.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:torch.nn.attention.flex_attention")


def _torch_mods(name):
  """(score_mod, mask_mod) written for torch, as its documentation spells them."""
  slopes, docs = torch.from_numpy(SLOPES), torch.from_numpy(DOCS)
  causal = lambda b, h, q, k: k <= q
  return {
      "alibi-causal": (lambda s, b, h, q, k: s + slopes[h] * (k - q), causal),
      "documents": (None, lambda b, h, q, k: docs[q] == docs[k]),
      "sliding-window": (None, lambda b, h, q, k: (k <= q) & (q - k <= 5)),
      "softcap": (lambda s, b, h, q, k: 3.0 * torch.tanh(s / 3.0), None),
  }[name]


def _jax_mods(name):
  return {
      "alibi-causal": (flex.alibi_score(jnp.asarray(SLOPES)), flex.causal_mask()),
      "documents": (None, flex.document_mask(DOCS)),
      "sliding-window": (None, flex.sliding_window_mask(5)),
      "softcap": (flex.softcap_score(3.0), None),
  }[name]


@pytest.mark.parametrize("name", ["alibi-causal", "documents", "sliding-window", "softcap"])
def test_equals_torch_flex_attention(name):
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (B, S, HQ, D))
  k, v = (jax.random.normal(key, (B, S, HK, D)) for key in keys[1:])
  score_mod, mask_mod = _jax_mods(name)
  ours = jattn.flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)

  t_score, t_mask = _torch_mods(name)
  to_heads_first = lambda x: to_torch(x).permute(0, 2, 1, 3).contiguous()
  block_mask = None if t_mask is None else torch_flex.create_block_mask(
      t_mask, None, None, S, S, device="cpu")
  theirs = torch_flex.flex_attention(to_heads_first(q), to_heads_first(k), to_heads_first(v),
                                     score_mod=t_score, block_mask=block_mask, enable_gqa=True)
  theirs = to_jax(theirs.permute(0, 2, 1, 3).contiguous())
  assert rel_err(ours, theirs) < 1e-5
