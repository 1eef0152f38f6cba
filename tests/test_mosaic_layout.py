"""Host-side tiling of the Hopper kernels (the kernels themselves run with ``-m gpu``)."""

from hypothesis import given, settings, strategies as st

from jattn.kernels.flash import MosaicBlockConfig
from jattn.kernels.flash.mosaic import mosaic_layout

blocks = st.sampled_from([64, 128, 192, 256])


@settings(max_examples=60, deadline=None)
@given(q_len=st.integers(1, 5000), kv_len=st.integers(1, 5000), head_dim=st.integers(1, 256),
       bq=blocks, bkv=blocks, bq_dq=blocks, bkv_dq=blocks, bq_dkv=blocks, bkv_dkv=blocks,
       causal=st.booleans())
def test_padding_fits_every_tile(q_len, kv_len, head_dim, bq, bkv, bq_dq, bkv_dq, bq_dkv,
                                 bkv_dkv, causal):
  config = MosaicBlockConfig(block_q=bq, block_kv=bkv, block_q_dq=bq_dq, block_kv_dq=bkv_dq,
                             block_q_dkv=bq_dkv, block_kv_dkv=bkv_dkv)
  q_len_p, kv_len_p, d_p, spec = mosaic_layout(config, q_len, kv_len, head_dim, causal=causal,
                                               local_window=None)
  # Two consumer warpgroups per CTA: query tiles of the forward and dQ kernels and
  # key tiles of the dK/dV kernel cover twice their block.
  for tile in (2 * bq, 2 * bq_dq, bq_dkv):
    assert q_len_p % tile == 0
  for tile in (bkv, bkv_dq, 2 * bkv_dkv):
    assert kv_len_p % tile == 0
  assert q_len <= q_len_p < q_len + max(2 * bq, 2 * bq_dq, bq_dkv) * 4
  assert d_p % 64 == 0 and head_dim <= d_p < head_dim + 64
  assert spec.kv_padded == (kv_len_p != kv_len)
  assert (spec.q_len, spec.kv_len) == (q_len, kv_len)
  assert spec.right == (0 if causal else None)
