"""The op core. Every public op is an ``Op`` with one ``Impl`` per backend, and every
call takes the same path:

1. ``Op.bind``: validation and normalisation, once, into one hashable *problem*
   (shapes, dtype, flags) and the call's arrays;
2. ``Op.prepare``: the backend (one ``"auto"`` rule: of the implementations that
   this device runs, whose ``gaps`` are empty and, where their resource model is
   exact, whose config fits the device, the fastest where the user's cache or the
   shipped table holds measured times for the problem, else the first in the op's
   order; one error text that lists every backend and why it was skipped) and the
   config (explicit, else the user's tuning cache, else the table shipped with
   jattn, else the implementation's heuristic);
3. ``run``: the implementation's forward, under one ``jax.custom_vjp`` when it
   brings its own backward kernels (autodiff otherwise).

Ops whose outputs are softmax partial results ``(o, lse)`` (``SoftmaxOp``) also
give them without a VJP and give a block's gradients from the final row statistics
of a larger softmax: what the rings compute their blocks with.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import importlib
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
import numpy as np

from jattn.core.device import (PALLAS_MOSAIC, PALLAS_TRITON, XLA, Backend, GPUInfo,
                               current_device, interpret_mode)
from jattn.core.validation import FLOAT_DTYPES
from jattn.kernels.common.config import MAX_HEAD_DIM
from jattn.kernels.common.varying import varying_axes
from jattn.core.cache import RANKING, TuningKey, backend_times, lookup
from jattn.core import sharding

# The modules that define the public ops (each creates its ``Op`` on import).
OP_MODULES = ("jattn.flash", "jattn.flex.attention", "jattn.window", "jattn.dilated",
              "jattn.retention", "jattn.paged", "jattn.varlen", "jattn.fp8")


class OpRegistry(collections.abc.MutableMapping):
  """Every op, by name. Reading it first imports ``OP_MODULES``, so that it lists every
  op however little of jattn is loaded (``import jattn`` loads nothing); creating an
  ``Op`` registers it without that."""

  def __init__(self):
    self._ops: dict[str, Op] = {}
    self._loaded = False

  def _load(self) -> dict[str, "Op"]:
    if not self._loaded:
      self._loaded = True  # first: the modules' own reads while they load see what is there
      for module in OP_MODULES:
        importlib.import_module(module)
    return self._ops

  def register(self, op: "Op") -> None:
    self._ops[op.name] = op

  def __getitem__(self, name: str) -> "Op":
    return self._load()[name]

  def __setitem__(self, name: str, op: "Op") -> None:
    self._load()[name] = op

  def __delitem__(self, name: str) -> None:
    del self._load()[name]

  def __iter__(self):
    return iter(self._load())

  def __len__(self) -> int:
    return len(self._load())

  def __repr__(self):
    return f"OpRegistry({sorted(self)})"


OPS = OpRegistry()  # what lists ops iterates this


@dataclasses.dataclass(frozen=True)
class Problem:
  """Base of the ops' problems: frozen dataclasses (hashable: they key the caches and
  the compiled programs) with a ``dtype`` (one of ``input_dtypes``) and a ``scale``
  field."""

  input_dtypes: ClassVar[tuple] = FLOAT_DTYPES

  def _set(self, **fields) -> None:
    for name, value in fields.items():
      object.__setattr__(self, name, value)

  def _normalize(self, scale_dim: int, **defaults) -> None:
    """In ``__post_init__``: ``dtype`` as a numpy dtype, ``scale`` defaulting to
    ``scale_dim ** -0.5``, and each field named in ``defaults`` that is None set to
    its default."""
    self._set(**{name: value for name, value in defaults.items()
                 if getattr(self, name) is None})
    self._set(dtype=jnp.dtype(self.dtype),
              scale=scale_dim ** -0.5 if self.scale is None else float(self.scale))

  def check_fields(self) -> None:
    """A problem built from keywords (``Op.problem``: ``jattn.gpu``, ``python -m
    jattn.autotune --set``) holds what its op's checked arrays would give: sizes
    (``int`` fields and ``tuple[int, ...]`` ones) positive ints, flags (``bool``
    fields) bools, a dtype the kernels take. A ``ValueError`` naming the field
    otherwise. (Problems bound from arrays are not checked again: their sizes may be
    ``jax.export`` symbolic dimensions.)"""
    if self.dtype not in self.input_dtypes:
      raise ValueError(f"dtype must be one of {', '.join(d.name for d in self.input_dtypes)}, "
                       f"got {self.dtype.name}")
    for field in dataclasses.fields(self):
      value, kind = getattr(self, field.name), str(field.type)
      if kind in ("int", "int | None", "tuple[int, ...]") and value is not None:
        sizes = value if kind.startswith("tuple") else (value,)
        if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1
                   for n in sizes):
          what = "positive ints" if kind.startswith("tuple") else "a positive int"
          raise ValueError(f"{field.name} must be {what}, got {value!r}")
      elif kind == "bool" and not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{field.name} must be True or False, got {value!r}")


@dataclasses.dataclass(frozen=True)
class AttentionProblem(Problem):
  """Base of the problems of q ``[batch, q_len, q_heads, head_dim]`` attending to k, v
  ``[batch, kv_len, kv_heads, head_dim]`` (flash and flex attention)."""

  batch: int = 1
  q_len: int = 1
  kv_len: int | None = None  # default q_len
  q_heads: int = 1
  kv_heads: int | None = None  # default q_heads
  head_dim: int = 64
  dtype: Any = jnp.float16
  scale: float | None = None  # default head_dim ** -0.5

  def __post_init__(self):
    self._normalize(self.head_dim, kv_len=self.q_len, kv_heads=self.q_heads)

  @classmethod
  def of(cls, q, k, **fields):
    """The problem of (validated) ``q`` against ``k``, with the subclass's ``fields``."""
    batch, q_len, q_heads, head_dim = q.shape
    return cls(batch=batch, q_len=q_len, kv_len=k.shape[1], q_heads=q_heads,
               kv_heads=k.shape[2], head_dim=head_dim, dtype=q.dtype, **fields)

  @property
  def head_dims(self) -> tuple[int, ...]:
    return (self.head_dim,)

  def local(self, batch_shards: int, head_shards: int):
    """This problem on one shard of ``batch_shards`` x ``head_shards`` (whole KV-head
    groups per shard)."""
    return dataclasses.replace(self, batch=self.batch // batch_shards,
                               q_heads=self.q_heads // head_shards,
                               kv_heads=self.kv_heads // head_shards)

  def random_qkv(self, keys) -> tuple:
    """Standard-normal q, k, v of this problem's shapes and dtype, one of ``keys`` each."""
    kv_shape = (self.batch, self.kv_len, self.kv_heads, self.head_dim)
    shapes = ((self.batch, self.q_len, self.q_heads, self.head_dim), kv_shape, kv_shape)
    return tuple(jax.random.normal(k, shape, jnp.float32).astype(self.dtype)
                 for k, shape in zip(keys, shapes))


class Impl:
  """One implementation of an op on one backend.

  It declares what it can run (``supported_on`` a device, ``gaps`` of a problem,
  whether a config ``fits`` the device), which config it takes and how one is
  chosen (``config_cls``, ``heuristic_config``, ``cache_key``, ``tuning_stages``),
  and computes: ``forward(call, *arrays) -> (outputs, residuals)`` and, when
  ``has_backward``, ``backward(call, residuals, cotangents) -> one gradient per
  array`` (None for integer arrays; any float dtype, cast to the array's after).
  """

  backend: ClassVar[Backend]
  config_cls: ClassVar[type | None] = None
  has_backward: ClassVar[bool] = False

  def supported_on(self, info: GPUInfo) -> str | None:
    """Why ``info``'s device cannot run this implementation (None: it can)."""
    return self.backend.needs(info)

  def gaps(self, problem) -> tuple[str, ...]:
    """The features of ``problem`` this implementation lacks (empty: it runs it)."""
    return ()

  def auto_passes_over(self, problem) -> str | None:
    """Why ``"auto"`` takes a later implementation for ``problem`` although this one
    runs it when named (None: no reason). For costs the order cannot see, e.g. memory
    that grows with the inputs' layout."""
    return None

  def heuristic_config(self, problem, info: GPUInfo):
    """The config used when none is given or tuned (None for config-less backends)."""
    return None

  def cache_key(self, problem) -> tuple[str, ...] | None:
    """The problem fields a tuned config is stored under (None: nothing is tuned)."""
    return None

  def tuning_stages(self) -> tuple:
    """The ``SearchGrid``s of the config's family (``jattn.kernels.common.config``):
    which config fields the autotuner varies, stage by stage (empty: not tunable)."""
    return ()

  def normalize_config(self, config, problem):
    """The config the kernels really run for ``problem`` (e.g. tiles clamped to the
    lengths), so that the autotuner times each one once."""
    return config

  def fits(self, config, problem, info: GPUInfo, kernels: tuple[str, ...] = ()) -> str | None:
    """Why ``config`` does not fit ``info``'s device (shared memory, registers): the
    family's cost model, restricted to ``kernels`` (a ``SearchGrid``'s; none named:
    every kernel the config runs)."""
    return None

  def compile_misfit(self, config, problem, info: GPUInfo) -> str | None:
    """Why the compiler would refuse ``config`` for ``problem`` on ``info``'s device: a
    hard limit (shared memory per block) counted as the compiler counts it, for every
    kernel the call may compile (None: it compiles, or the family has no such count).
    ``"auto"`` does not take a backend whose chosen config the compiler would refuse."""
    return None

  def forward(self, call: "Call", *arrays):
    raise NotImplementedError

  def backward(self, call: "Call", residuals, cotangents):
    raise NotImplementedError

  def residuals_of(self, call: "Call", arrays: tuple, outputs: tuple):
    """The residuals ``forward`` keeps, rebuilt from the arrays and the outputs (the
    sharded path saves only those): by default ``(arrays, o, lse)``, as softmax ops
    keep them."""
    return (tuple(arrays), outputs[0].astype(arrays[0].dtype), *outputs[1:])

  def __repr__(self):
    return f"<{type(self).__name__} ({self.backend.name})>"


def max_head_dim_gap(problem) -> tuple[str, ...]:
  """The Pallas kernels' head-dim limit as a gap."""
  widest = max(problem.head_dims)
  if widest > MAX_HEAD_DIM:
    return (f"head dims above {MAX_HEAD_DIM} (got {widest})",)
  return ()


class TritonImpl(Impl):
  """Triton-lowered Pallas kernels: Ampere+, or any device in interpret mode."""

  backend = PALLAS_TRITON
  has_backward = True

  def gaps(self, problem):
    return max_head_dim_gap(problem)


class MosaicImpl(Impl):
  """Pallas Mosaic GPU kernels: Hopper only, 16-bit inputs."""

  backend = PALLAS_MOSAIC
  has_backward = True

  def gaps(self, problem):
    f32 = ("float32 inputs",) if jnp.dtype(problem.dtype) == jnp.float32 else ()
    return max_head_dim_gap(problem) + f32


class XlaImpl(Impl):
  """The pure-jnp reference: runs anywhere, differentiated by autodiff."""

  backend = XLA


@dataclasses.dataclass(frozen=True)
class Call:
  """A prepared call: which implementation runs which problem with which config.
  Hashable, so it rides through ``jit`` and ``custom_vjp`` as a static argument."""

  op: "Op"
  impl: Impl
  problem: Any
  config: Any
  interpret: bool
  # In a backward: which of the op's arrays are differentiated (None: all). An
  # implementation may skip the work of a gradient nobody asked for.
  differentiated: tuple[bool, ...] | None = None

  def wants_grad(self, index: int) -> bool:
    """Whether the gradient of the op's array ``index`` is used."""
    return self.differentiated is None or self.differentiated[index]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _with_vjp(call: Call, dtypes, *arrays):
  if sharding.partitions(call):
    return sharding.forward(call, arrays)
  return call.impl.forward(call, *arrays)[0]


def _with_vjp_fwd(call: Call, dtypes, *arrays):
  # Symbolic zeros: each array comes as ``CustomVJPPrimal`` (its value and whether it is
  # differentiated). The flags ride in the residuals' structure (``()``: differentiated).
  flags = tuple(() if a is not None and a.perturbed else None for a in arrays)
  arrays = tuple(None if a is None else a.value for a in arrays)
  if sharding.partitions(call):  # the residuals are rebuilt per shard (``residuals_of``)
    outputs = sharding.forward(call, arrays)
    return outputs, (flags, (arrays, outputs))
  outputs, residuals = call.impl.forward(call, *arrays)
  return outputs, (flags, residuals)


def _with_vjp_bwd(call: Call, dtypes, residuals, cotangents):
  flags, residuals = residuals
  call = dataclasses.replace(call, differentiated=tuple(f is not None for f in flags))
  cotangents = jax.tree.map(
      lambda c: jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c, cotangents,
      is_leaf=lambda c: isinstance(c, SymbolicZero))
  if sharding.partitions(call):
    grads = sharding.backward(call, *residuals, cotangents)
  else:
    grads = call.impl.backward(call, residuals, cotangents)
  # Implementations may return float32 gradients; each takes its array's dtype here.
  return tuple(None if g is None or not f else g.astype(d)
               for g, d, f in zip(grads, dtypes, call.differentiated))


_with_vjp.defvjp(_with_vjp_fwd, _with_vjp_bwd, symbolic_zeros=True)


@functools.partial(jax.jit, static_argnums=0)
def _run(call: Call, arrays: tuple):
  if call.impl.has_backward:
    dtypes = tuple(None if x is None else jnp.dtype(x.dtype) for x in arrays)
    return _with_vjp(call, dtypes, *arrays)
  return call.impl.forward(call, *arrays)[0]


def run(call: Call, arrays: tuple):
  """The outputs of ``call`` on ``arrays``, differentiable: through the
  implementation's backward kernels if it has them, else by autodiff. One compiled
  program per call and shapes (the host-side padding, the kernels, the reference's
  ops together), so an eager call does not compile op by op; under an outer ``jit``
  it is inlined. Arrays sharded over batch or heads run per shard
  (``jattn.core.sharding``)."""
  axes = varying_axes(arrays)
  if axes and call.impl.backend != XLA:
    raise ValueError(
        f"{call.op.name} on the {call.impl.backend.name} kernels cannot run inside a "
        f"jax.shard_map that checks varying axes (here {sorted(axes)}; check_vma=True is "
        "its default): the kernels declare none. Pass check_vma=False to jax.shard_map, "
        "or call the op under jax.jit on arrays sharded over batch or heads "
        "(docs/sharding.md)")
  split = sharding.explicit_split(call, tuple(arrays))
  if split is not None:
    return sharding.run_explicit(_run, split, tuple(arrays))
  return _run(call, tuple(arrays))


class Op:
  """One operation: a problem class, its implementations in ``"auto"`` order, and the
  one path every call takes (see the module docstring).

  Subclasses set ``name`` and ``problem_cls`` (a ``Problem`` dataclass whose fields have
  defaults, so keywords describe a problem without arrays) and implement ``bind``
  (validation: arguments -> ``(problem, arrays)``) and ``example`` (random arrays for
  a problem: tuning, benchmarks, checks); ``finish`` shapes the outputs the public
  function returns.
  """

  name: ClassVar[str]
  problem_cls: ClassVar[type]
  arg_names: ClassVar[tuple[str, ...]]  # the arrays ``bind`` returns, in order
  diff_argnums: ClassVar[tuple[int, ...]] = (0, 1, 2)  # arrays that get gradients

  def __init__(self, *impls: Impl):
    self.impls = impls
    OPS.register(self)

  def __repr__(self):
    return f"<op {self.name}: {', '.join(i.backend.name for i in self.impls)}>"

  @property
  def backends(self) -> tuple[str, ...]:
    return ("auto",) + tuple(dict.fromkeys(i.backend.name for i in self.impls))

  def bind(self, *args, **kwargs):
    raise NotImplementedError

  def example(self, problem, key) -> tuple:
    raise NotImplementedError

  def finish(self, problem, outputs):
    return outputs

  def primary(self, outputs):
    """The output a benchmark's loss sums."""
    return outputs[0] if isinstance(outputs, tuple) else outputs

  def shard_rule(self, problem) -> "sharding.ShardRule | None":
    """Where the call's arrays and outputs keep their batch and head axes, so that it
    runs per shard under ``jit`` (``jattn.core.sharding``); None: it does not split."""
    return None

  def problem(self, **keywords):
    """A problem from keywords (its dataclass fields), for choosing or tuning without
    arrays; a ``ValueError`` naming a field of the wrong kind (``Problem.check_fields``)."""
    problem = self.problem_cls(**keywords)
    problem.check_fields()
    return problem

  def __call__(self, *args, backend: str = "auto", config=None, **kwargs):
    problem, arrays = self.bind(*args, **kwargs)
    return self.finish(problem, run(self.prepare(problem, backend, config), arrays))

  # --- backend and config --------------------------------------------------------------

  def impl(self, backend: str) -> Impl:
    """The implementation on ``backend`` (a name other than ``"auto"``)."""
    for impl in self.impls:
      if impl.backend.name == backend:
        return impl
    raise ValueError(f"backend must be one of {self.backends} for {self.name}, got {backend!r}")

  def config_for(self, impl: Impl, problem, info: GPUInfo, config=None):
    """``config`` if given, else the user's tuned one, else the shipped table's, else
    the implementation's heuristic. Tuned configs apply on GPUs only (in interpret
    mode tiles change speed, never the result)."""
    if config is not None:
      if impl.config_cls is None:
        raise TypeError(f"backend={impl.backend.name!r} takes no config, got "
                        f"{type(config).__name__}")
      if not isinstance(config, impl.config_cls):
        raise TypeError(f"config for backend={impl.backend.name!r} must be a "
                        f"{impl.config_cls.__name__}, got {type(config).__name__}")
      return config
    if impl.config_cls is None:
      return None
    fields = impl.cache_key(problem) if info.is_gpu else None
    if fields is not None:
      tuned = lookup(TuningKey(info.name, self.name, impl.backend.name, fields), impl.config_cls)
      if tuned is not None:
        return tuned
    return impl.heuristic_config(problem, info)

  def _reason(self, impl: Impl, problem, info: GPUInfo, config) -> tuple[str | None, Any]:
    """``(why impl cannot run problem here or None, the config it would run)``."""
    reason = impl.supported_on(info)
    if reason is None:
      gaps = impl.gaps(problem)
      reason = "does not support " + ", ".join(gaps) if gaps else None
    if reason is None and config is not None and not (
        impl.config_cls is not None and isinstance(config, impl.config_cls)):
      reason = f"does not take a {type(config).__name__}"
    if reason is not None:
      return reason, None
    chosen = self.config_for(impl, problem, info, config)
    # The configs jattn picks must compile (a tuned one, kept per shape, may not fit a
    # call with more inputs: then the heuristic's); one the caller gives is the
    # compiler's to accept. Interpret mode has no limits.
    if config is None and info.is_gpu and not (impl.backend.interpretable and info.interpret):
      reason = impl.compile_misfit(chosen, problem, info)
      if reason is not None:
        heuristic = impl.heuristic_config(problem, info)
        if heuristic != chosen and impl.compile_misfit(heuristic, problem, info) is None:
          reason, chosen = None, heuristic
        else:
          reason = f"needs more than the device has with its config ({reason})"
    return reason, chosen

  def choices(self, problem, info: GPUInfo | None = None, config=None) -> list[tuple[str, str | None]]:
    """Every backend of the op in ``"auto"`` order, with why it cannot run ``problem``
    on ``info``'s device (default: this machine), or why ``"auto"`` passes it over
    while another can (``Impl.auto_passes_over``), or None: ``"auto"`` takes the
    first None."""
    info = current_device() if info is None else info
    reasons = [self._reason(impl, problem, info, config)[0] for impl in self.impls]
    passed = [None if why is not None else impl.auto_passes_over(problem)
              for impl, why in zip(self.impls, reasons)]
    if any(why is None and not over for why, over in zip(reasons, passed)):
      reasons = [why or (over and f"auto passes it over while another backend can run it: "
                                  f"{over}") for why, over in zip(reasons, passed)]
    return [(impl.backend.name, why) for impl, why in zip(self.impls, reasons)]

  def _error(self, backend: str, reason: str, problem, info: GPUInfo, config) -> ValueError:
    listed = "; ".join(f"{name}: {why or 'can run it'}"
                       for name, why in self.choices(problem, info, config))
    return ValueError(f"backend={backend!r} cannot run this {self.name} call on "
                      f"{info.name}: it {reason}. Backends: {listed}")

  def prepare(self, problem, backend: str = "auto", config=None,
              info: GPUInfo | None = None) -> Call:
    """The call ``backend`` makes for ``problem``, with its config; ``"auto"`` takes
    the backend ``explain`` describes. Raises ValueError naming why it cannot."""
    info = current_device() if info is None else info
    if backend != "auto":
      impl = self.impl(backend)
      if config is not None:
        self.config_for(impl, problem, info, config)  # a TypeError for the wrong config class
      reason, chosen = self._reason(impl, problem, info, config)
      if reason is not None:
        raise self._error(backend, reason, problem, info, config)
    else:
      impl, chosen, _ = self._auto(problem, info, config)
    return Call(self, impl, problem, chosen, impl.backend.interpretable and interpret_mode())

  def speed_key(self, problem) -> tuple[str, ...] | None:
    """The problem fields measured backend times are stored under: the first
    implementation's tuning key (None: none is kept for this problem)."""
    keys = (impl.cache_key(problem) for impl in self.impls)
    return next((key for key in keys if key is not None), None)

  def speed_tuning_key(self, problem, info: GPUInfo) -> TuningKey | None:
    """Where the measured times of every backend on ``problem`` are stored for ``info``."""
    fields = self.speed_key(problem)
    return None if fields is None else TuningKey(info.name, self.name, RANKING, fields)

  def _auto(self, problem, info: GPUInfo, config):
    """``(impl, config, why)`` of the ``"auto"`` choice: of the implementations that
    can run ``problem`` here, the measured fastest when the user's cache or the shipped
    table has times for the first of them and another, else that first one."""
    runnable, passed_over = [], []
    for impl in self.impls:
      reason, chosen = self._reason(impl, problem, info, config)
      if reason is None:
        (passed_over if impl.auto_passes_over(problem) else runnable).append((impl, chosen))
        if runnable and not info.is_gpu:  # times are kept for GPUs only
          break
    if not runnable and not passed_over:
      raise self._error("auto", "finds no backend that can", problem, info, config)
    if not runnable:  # only those can run it (say, for the config given)
      return self._first_of(passed_over, problem, info)
    impl, chosen, why = self._first_of(runnable, problem, info)
    for skipped, _ in passed_over:
      why += f"; {skipped.backend.name} passed over: {skipped.auto_passes_over(problem)}"
    return impl, chosen, why

  def _first_of(self, runnable, problem, info: GPUInfo):
    """``_auto``'s choice among ``runnable`` ``(impl, config)`` pairs, in order."""
    first = runnable[0]
    if not info.is_gpu:  # the search stopped at the first
      return first + ("the first in the op's order that can run it (times are kept for GPUs "
                      "only)",)
    if len(runnable) == 1:
      return first + ("the only backend that can run it",)
    key = self.speed_tuning_key(problem, info)
    stored = None if key is None else backend_times(key)
    if stored is None or first[0].backend.name not in stored[0]:
      return first + ("the first in the op's order that can run it; no measured times "
                      f"for {'this problem' if key is None else key}",)
    times, mode, source = stored
    impl, chosen = min((r for r in runnable if r[0].backend.name in times),
                       key=lambda r: times[r[0].backend.name])
    listed = ", ".join(f"{name} {ms:.3f} ms" for name, ms in sorted(times.items(),
                                                                     key=lambda t: t[1]))
    return impl, chosen, (f"the fastest measured of those that can run it ({mode}: {listed}; "
                          f"{source}, {key})")

  def explain(self, problem, info: GPUInfo | None = None, config=None) -> str:
    """Which backend ``"auto"`` takes for ``problem`` on ``info``'s device and why,
    then every backend with why it cannot run the problem (or that it can)."""
    info = current_device() if info is None else info
    impl, _, why = self._auto(problem, info, config)
    lines = [f"{impl.backend.name}: {why}"]
    lines += [f"  {name}: {reason or 'can run it'}"
              for name, reason in self.choices(problem, info, config)]
    return "\n".join(lines)

  def select(self, problem, info: GPUInfo | None = None) -> str:
    """The backend ``"auto"`` takes for ``problem`` on ``info``'s device."""
    return self.prepare(problem, "auto", info=info).impl.backend.name


def row_dot(a, b):
  """``sum_d a * b`` of ``[..., seq, heads, d]`` arrays as ``[..., heads, seq]`` float32."""
  return jnp.swapaxes(jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32), axis=-1), -1, -2)


class SoftmaxOp(Op):
  """An op whose forward outputs are softmax results ``(o [..., seq, heads, d],
  lse [..., heads, seq])`` and whose implementations with backward kernels keep the
  residuals ``(arrays, o, lse)``: then a block's gradients follow from the final
  ``(o, lse)`` of any larger softmax the block is merged into."""

  def partial(self, call: Call, arrays: tuple):
    """``(o float32, lse)`` of one block, not differentiable by itself: pair it with
    ``partial_backward``."""
    o, lse = call.impl.forward(call, *arrays)[0]
    return o.astype(jnp.float32), lse

  def partial_backward(self, call: Call, arrays: tuple, o, lse, do) -> tuple:
    """Float32 gradients of one block's arrays (None for integer ones) given the
    final output ``o``, log-sum-exp ``lse`` and output cotangent ``do`` of a softmax
    that merges this block with others (``p = exp(s - lse)``)."""
    if call.impl.has_backward:
      grads = call.impl.backward(call, call.impl.residuals_of(call, arrays, (o, lse)),
                                 (do.astype(arrays[0].dtype), jnp.zeros_like(lse)))
    else:
      # The block's share of d<do, o>: with U_b = exp(lse_b) o_b and Z_b = exp(lse_b),
      # o = sum_b U_b / sum_b Z_b gives d/dθ_b of exp(lse_b - lse) (<do, o_b> - delta).
      delta = jax.lax.stop_gradient(row_dot(o, do))

      def surrogate(*diff):
        args = list(arrays)
        for i, x in zip(self.diff_argnums, diff):
          args[i] = x
        o_b, lse_b = call.impl.forward(call, *args)[0]
        return jnp.sum(jnp.exp(lse_b - lse) * (row_dot(do, o_b) - delta))

      diff = jax.grad(surrogate, argnums=tuple(range(len(self.diff_argnums))))(
          *(arrays[i] for i in self.diff_argnums))
      grads = [None] * len(arrays)
      for i, g in zip(self.diff_argnums, diff):
        grads[i] = g
    return tuple(None if g is None else g.astype(jnp.float32) for g in grads)
