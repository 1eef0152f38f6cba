"""flex_attention against PyTorch's own FlexAttention on the same inputs (through the
DLPack bridge): the named examples of ``jattn.flex.examples``, each spelled for torch
in ``interop.torch_reference``. On the CPU the comparison is of the forward (torch's
FlexAttention has no backward there; the gradients are tests/test_flex.py's); on a GPU
(``-m gpu``) of the gradients too."""

import pytest

pytest.importorskip("torch.nn.attention.flex_attention")

from jattn.flex.examples import EXAMPLES  # noqa: E402
from jattn.interop.harness import crosscheck  # noqa: E402

# Eager torch FlexAttention warns that it is unfused: that is all it is needed for here.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.kernel
@pytest.mark.parametrize("example", EXAMPLES)
def test_equals_torch_flex_attention(example):
  report = crosscheck("flex_attention", example=example, backend="pallas_triton", batch=2,
                      q_len=40, kv_len=48, q_heads=4, kv_heads=2, head_dim=16)
  assert report.ok, str(report)
  assert "out" in report.errors
