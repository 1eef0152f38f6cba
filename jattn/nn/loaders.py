"""Checkpoint loaders that another package offers to the Flax models (``DAT.from_torch``).

Loading a torch checkpoint needs torch, which jattn never imports: the torch side
(``jattn.interop``) declares its loaders as entry points of the group
``jattn.checkpoint_loaders`` (see pyproject.toml), and they are looked up by name
when a model asks for one.
"""

from __future__ import annotations

import importlib.metadata

GROUP = "jattn.checkpoint_loaders"


def checkpoint_loader(model: str):
  """The loader registered for ``model`` (``"dat"``): ``loader(path, **kwargs) -> model``."""
  found = importlib.metadata.entry_points(group=GROUP, name=model)
  if not found:
    raise RuntimeError(f"no checkpoint loader for {model!r}: install jattn with pip (its "
                       f"entry points register jattn.interop's loaders), or call "
                       f"jattn.interop.load_{model}")
  return next(iter(found)).load()
