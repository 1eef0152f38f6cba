"""How ``jattn.interop`` imports torch: one rule, and the one error where torch is missing.

A module that uses torch (``dlpack``, ``torch_reference``, ``torch_crosscheck``,
``dat_torch``, ``longnet_torch``) imports it at its top, as ordinary code, and defines
its ``nn.Module`` classes at module level. Code that must work without torch (the
package itself, the command-line tools, the checkpoint readers, ``harness``,
``check``) imports such a module only inside the function that needs it, or through
the package's lazy exports: ``import jattn.interop`` then loads no torch, and a tool
checks its options before torch loads. Before such an import, ``require_torch`` says
in one line what needs torch and which extra installs it; ``torch_available`` tells
code that can do without torch whether to skip its torch part.
"""

from __future__ import annotations

import importlib.util


def torch_available() -> bool:
  """Whether torch is installed (found, not imported)."""
  return importlib.util.find_spec("torch") is not None


def require_torch(what: str) -> None:
  """A ``ModuleNotFoundError`` for torch unless it is installed; ``what``: what needs
  it, for the message. The command-line tools report it as a missing extra (exit 2)."""
  if not torch_available():
    raise ModuleNotFoundError(f"{what} needs torch, which jattn's 'torch' extra installs "
                              "(pip install -e '.[torch]' in jattn's folder)", name="torch")


__all__ = ["require_torch", "torch_available"]
