"""Interval bounds of the integer values in a scalar function's jaxpr.

The tile evaluator (``element_functions``) reads closed-over arrays at indices the
function computes. JAX clamps an index that falls outside its array, but a clamped
index tile hides from Triton that neighbouring elements are adjacent in memory, and
the load then runs element by element (``docs/flex_attention.md``). When the bounds of the arguments (batch, head, query and key positions as the
kernels evaluate them) prove every index in bounds, the clamp is the identity and the
load can go without it.

A bound is ``(lo, hi)`` (inclusive) or None (unknown), of integer and boolean values
only. Rules cover what index arithmetic uses (sums, products, min/max/clamp,
comparisons, selects, the negative-index wrap ``jnp`` inserts); anything else, and
anything computed through floats, is unknown.
"""

from __future__ import annotations

import numpy as np

Bound = tuple  # (lo, hi), inclusive


def literal_bound(value) -> Bound | None:
  """The bound of a constant: a scalar integer or boolean, or None."""
  if np.ndim(value) != 0:
    return None
  x = np.asarray(value)
  if x.dtype == np.bool_ or np.issubdtype(x.dtype, np.integer):
    return (int(x), int(x))
  return None


def dtype_bound(dtype) -> Bound | None:
  """What any value of ``dtype`` can be, where that helps: booleans are 0 or 1."""
  return (0, 1) if np.dtype(dtype) == np.bool_ else None


def _known(bounds):
  return all(b is not None for b in bounds)


def _cmp(name, a, b):
  (a0, a1), (b0, b1) = a, b
  always = {"lt": a1 < b0, "le": a1 <= b0, "gt": a0 > b1, "ge": a0 >= b1,
            "eq": a0 == a1 == b0 == b1, "ne": a1 < b0 or b1 < a0}[name]
  never = {"lt": a0 >= b1, "le": a0 > b1, "gt": a1 <= b0, "ge": a1 < b0,
           "eq": a1 < b0 or b1 < a0, "ne": a0 == a1 == b0 == b1}[name]
  return (1, 1) if always else (0, 0) if never else (0, 1)


def _mul(a, b):
  products = [x * y for x in a for y in b]
  return (min(products), max(products))


def _trunc_div(x: int, y: int) -> int:
  """``x / y`` rounded toward zero, as XLA divides integers (exact: no float)."""
  q = abs(x) // abs(y)
  return q if (x < 0) == (y < 0) else -q


def _div(a, b):
  if b[0] <= 0 <= b[1]:
    return None
  # With the divisor's sign fixed, the quotient is monotone in each operand: the
  # extremes are at the corners.
  quotients = [_trunc_div(x, y) for x in a for y in b]
  return (min(quotients), max(quotients))


def _rem(a, b):
  if b[0] <= 0 <= b[1]:
    return None
  m = max(abs(b[0]), abs(b[1]))
  if a[0] >= 0:
    return (0, min(a[1], m - 1)) if a[1] >= 0 else None
  return (-(m - 1), m - 1)


def _convert(bound, new_dtype):
  if np.dtype(new_dtype) == np.bool_:
    return (0, 0) if bound == (0, 0) else (1, 1) if bound[0] > 0 or bound[1] < 0 else (0, 1)
  return bound  # integer to integer (or to a float, which keeps none)


def _union(bounds):
  return (min(b[0] for b in bounds), max(b[1] for b in bounds)) if _known(bounds) else None


def eqn_bounds(eqn, bounds: list) -> list:
  """Bounds of ``eqn``'s outputs from those of its inputs (None where unknown)."""
  name, params = eqn.primitive.name, eqn.params
  out = [None] * len(eqn.outvars)
  if name == "select_n":  # select_n(which, case0, case1, ...)
    which, cases = bounds[0], bounds[1:]
    if which is not None and which[0] == which[1] and 0 <= which[0] < len(cases):
      out[0] = cases[int(which[0])]  # the predicate is decided: one case only
    else:
      out[0] = _union(cases)
  elif name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy", "copy_p",
                "reduce_precision", "optimization_barrier"):
    out = list(bounds[:len(out)])
  elif name == "convert_element_type" and bounds[0] is not None:
    out[0] = _convert(bounds[0], params["new_dtype"])
  elif not _known(bounds):
    pass
  elif name == "add":
    out[0] = (bounds[0][0] + bounds[1][0], bounds[0][1] + bounds[1][1])
  elif name == "sub":
    out[0] = (bounds[0][0] - bounds[1][1], bounds[0][1] - bounds[1][0])
  elif name == "neg":
    out[0] = (-bounds[0][1], -bounds[0][0])
  elif name == "mul":
    out[0] = _mul(*bounds)
  elif name == "div":
    out[0] = _div(*bounds)
  elif name == "rem":
    out[0] = _rem(*bounds)
  elif name in ("max", "min"):
    pick = max if name == "max" else min
    out[0] = (pick(bounds[0][0], bounds[1][0]), pick(bounds[0][1], bounds[1][1]))
  elif name == "clamp":  # clamp(lo, x, hi) = min(max(x, lo), hi)
    lo, x, hi = bounds
    m = (max(x[0], lo[0]), max(x[1], lo[1]))
    out[0] = (min(m[0], hi[0]), min(m[1], hi[1]))
  elif name == "abs":
    a0, a1 = bounds[0]
    out[0] = (0 if a0 <= 0 <= a1 else min(abs(a0), abs(a1)), max(abs(a0), abs(a1)))
  elif name == "sign":
    out[0] = (-1 if bounds[0][0] < 0 else 0 if bounds[0][0] == 0 else 1,
              1 if bounds[0][1] > 0 else 0 if bounds[0][1] == 0 else -1)
  elif name in ("lt", "le", "gt", "ge", "eq", "ne"):
    out[0] = _cmp(name, *bounds)
  elif name in ("and", "or", "not") and np.dtype(eqn.outvars[0].aval.dtype) == np.bool_:
    if name == "not":
      out[0] = (1 - bounds[0][1], 1 - bounds[0][0])
    else:
      pick = min if name == "and" else max
      out[0] = (pick(bounds[0][0], bounds[1][0]), pick(bounds[0][1], bounds[1][1]))
  return [_representable(b, v.aval.dtype) for b, v in zip(out, eqn.outvars)]


def _representable(bound, dtype):
  """``bound`` where ``dtype`` holds all of it (integers wrap), else what ``dtype`` can be.
  Floats have none: their rounding (float32 in the kernels, not the float64 here) could
  move an index computed through them past a bound."""
  dtype = np.dtype(dtype)
  if bound is not None and np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    if bound[0] < info.min or bound[1] > info.max:
      bound = None
  elif dtype != np.bool_:
    bound = None
  return bound if bound is not None else dtype_bound(dtype)


def within(bound: Bound | None, size: int) -> bool:
  """Whether an index of ``bound`` is always in ``[0, size)``."""
  return bound is not None and bound[0] >= 0 and bound[1] <= size - 1
