"""Package attributes imported on first use (PEP 562).

``import jattn`` and the command-line tools then start without loading JAX, Flax and
every kernel: a tool reports a mistake in its options at once, and ``import jattn``
costs nothing until an op is used. ``jattn`` and ``jattn.interop`` export this way.
"""

from __future__ import annotations

import importlib
import sys
import types


def import_attribute(where: str):
  """What ``where`` names, imported now: ``"module:attribute"``, or ``"module"`` for a
  module itself."""
  module_name, _, attribute = where.partition(":")
  module = importlib.import_module(module_name)
  return getattr(module, attribute) if attribute else module


def lazy_exports(package: str, exports: dict[str, str]) -> None:
  """Makes ``exports``' keys the public names of ``package`` (``__all__``), each
  imported on first use and then kept. A value says where its name lives, as
  ``import_attribute`` reads it."""
  exported_attributes = {name for name, where in exports.items() if ":" in where}

  class LazyPackage(types.ModuleType):
    def __getattr__(self, name: str):
      where = exports.get(name)
      if where is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
      value = import_attribute(where)
      super().__setattr__(name, value)
      return value

    def __setattr__(self, name: str, value) -> None:
      # The import system binds each submodule in its package once it loads. Where a
      # public name is a function of a submodule of that name (jattn.retention, the op
      # in jattn/retention.py), the function keeps the name, as an eager import gave.
      if not (name in exported_attributes and isinstance(value, types.ModuleType)):
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
      return sorted(set(self.__dict__) | set(exports))

  module = sys.modules[package]
  module.__all__ = sorted(exports)
  module.__class__ = LazyPackage
