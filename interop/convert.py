"""Torch state dicts <-> Flax NNX modules, by parameter name.

jattn's Flax modules name their parameters after the torch modules they mirror
(``nn.Sequential`` members sit at their index in an ``nnx.List``), so a torch key
``a.b.weight`` is the NNX variable ``a.b.<leaf>`` with a layout change:

| NNX layer | NNX leaf | torch key | layout |
|---|---|---|---|
| ``nnx.Linear`` | ``kernel [in, out]``, ``bias`` | ``weight [out, in]``, ``bias`` | transposed |
| ``nnx.Conv`` | ``kernel [kh, kw, in/groups, out]``, ``bias`` | ``weight [out, in/groups, kh, kw]`` | transposed |
| ``nnx.LayerNorm``, ``nnx.BatchNorm`` | ``scale``, ``bias``, ``mean``, ``var`` | ``weight``, ``bias``, ``running_mean``, ``running_var`` | as is |
| ``nnx.Embed`` | ``embedding [vocab, dim]`` | ``weight`` | as is |
| any other ``nnx.Param`` (e.g. a temperature) | its name | the same name | as is |

Buffers the Flax module recomputes (``num_batches_tracked``, and the ``derived`` key
suffixes a model names) are accepted and not loaded.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn.interop.stored_tensors import as_numpy

_NORM_NAMES = {"scale": "weight", "bias": "bias", "mean": "running_mean", "var": "running_var"}
ALWAYS_DERIVED = ("num_batches_tracked",)


# Axis permutations (NNX -> torch, torch -> NNX) of the kernels whose layouts differ.
_PERMUTATIONS = {"linear": ((1, 0), (1, 0)), "conv": ((3, 2, 0, 1), (2, 3, 1, 0))}


def _relayout(kind: str, value: np.ndarray, *, to_torch: bool) -> np.ndarray:
  perms = _PERMUTATIONS.get(kind)
  return value if perms is None else value.transpose(perms[0 if to_torch else 1])


def torch_names(module) -> dict[str, tuple[nnx.Variable, str]]:
  """Every parameter / statistic of ``module`` by its torch key: ``(variable, kind)``
  with kind ``"linear"``, ``"conv"`` (layout changes) or ``"plain"``."""
  nodes = dict(nnx.iter_graph(module))
  out = {}
  for path, var in nodes.items():
    if not isinstance(var, (nnx.Param, nnx.BatchStat)):
      continue
    parent, leaf = nodes[path[:-1]], str(path[-1])
    prefix = ".".join(str(p) for p in path[:-1])
    kind, name = "plain", leaf
    if isinstance(parent, (nnx.Linear, nnx.Conv)):
      kind = "linear" if isinstance(parent, nnx.Linear) else "conv"
      name = "weight" if leaf == "kernel" else leaf
      if leaf == "bias":
        kind = "plain"
    elif isinstance(parent, (nnx.LayerNorm, nnx.BatchNorm)):
      name = _NORM_NAMES[leaf]
    elif isinstance(parent, nnx.Embed):
      name = "weight"  # [vocab, dim] in both
    out[f"{prefix}.{name}" if prefix else name] = (var, kind)
  return out


def _is_derived(key: str, derived) -> bool:
  return key.rsplit(".", 1)[-1] in (*ALWAYS_DERIVED, *derived)


def load_torch_state_dict(module, state_dict, *, derived=()) -> None:
  """Copies a torch ``state_dict`` into the NNX ``module`` in place.

  Args:
    state_dict: torch tensors, numpy arrays or ``StoredTensor``s by torch key; every
      shape is checked before any value is read.
    derived: key suffixes (the part after the last dot) of buffers the module
      recomputes, accepted and ignored (``num_batches_tracked`` always is).

  Raises ValueError naming every missing and unexpected key and every shape mismatch
  (shapes in the checkpoint's torch layout).
  """
  expected = torch_names(module)
  given = {k for k in state_dict if not _is_derived(k, derived)}
  missing, unexpected = sorted(set(expected) - given), sorted(given - set(expected))
  names = [f"missing keys {_few(missing)}"] if missing else []
  names += [f"unexpected keys {_few(unexpected)}"] if unexpected else []
  problems = [", ".join(names)] if names else []
  matched = sorted(set(expected) & given)
  for key in matched:  # shapes first: no value is read from a checkpoint that does not fit
    var, kind = expected[key]
    shape = tuple(np.shape(state_dict[key]))
    want = _relayout(kind, np.empty(var.shape, np.bool_), to_torch=True).shape
    if shape != want:
      problems.append(f"{key!r} has shape {shape}, the module expects {want}")
  if problems:
    raise ValueError(f"checkpoint does not match {type(module).__name__}: "
                     + "; ".join(problems[:4]) + ("" if len(problems) <= 4 else
                                                  f"; ... {len(problems) - 4} more"))
  for key in matched:
    var, kind = expected[key]
    value = _relayout(kind, as_numpy(state_dict[key]), to_torch=False)
    _assign(var, jnp.asarray(value, var.dtype))


def _few(keys: list[str], shown: int = 4) -> str:
  """``keys`` as a list, the first ``shown`` of them (the message stays one line)."""
  if len(keys) <= shown:
    return str(keys)
  return f"{str(keys[:shown])[:-1]}, ... {len(keys) - shown} more]"


def _assign(var: nnx.Variable, value) -> None:
  if hasattr(var, "set_value"):  # flax >= 0.12 (where ``.value =`` is deprecated)
    var.set_value(value)
  else:
    var.value = value


def to_torch_state_dict(module) -> dict[str, np.ndarray]:
  """``module``'s parameters and statistics as a torch-layout state dict of numpy arrays.

  Each batch norm also gets torch's ``num_batches_tracked`` (0: NNX keeps no count),
  so a strict ``load_state_dict`` accepts the result."""
  state = {key: np.ascontiguousarray(_relayout(kind, np.asarray(var[...]), to_torch=True))
           for key, (var, kind) in torch_names(module).items()}
  for key in [k for k in state if k.endswith(".running_mean")]:
    state[key[:-len("running_mean")] + "num_batches_tracked"] = np.array(0, np.int64)
  return state
