"""Serving benchmark (issue 39): decode, paged-KV and varlen attention on one GPU, bf16.

Three sections; each runs on its own, and one whose jattn API is missing prints a
one-line message while the others still run:

  decode  q_len 1, 16, 64 against a cache of (batch, tokens) (8, 32k), (32, 8k),
          (1, 128k), (64, 4k); GQA 32/8 and MHA 8/8; head dims 64 and 128. Rows: jattn
          ``flash_attention`` with ``kv_lengths`` = the cache length (``auto``,
          ``pallas_triton``, ``pallas_mosaic``; causal, bottom-right, for q_len > 1),
          cuDNN and plain XLA through ``jax.nn.dot_product_attention`` (non-causal:
          jax.nn's causal mask is top-left aligned), and, at q_len 1, JAX's Pallas
          split-K decode kernel twice: ``decode_attention.gqa`` as its API takes K/V
          (``[batch, seq, kv_heads, dim]``; it transposes them inside, timed), and the
          same kernel on K/V made head-major outside the timed region (``mqa`` per KV
          head, gqa's tiles). Each row's K/V bandwidth (bytes of K and V attended /
          time) and its fraction of the device copy bandwidth measured in the same run
          (a jitted copy of a 2 GiB array, and ``x + 1`` on it: read + write bytes;
          the faster of the two is the reference).
  paged   q_len 1, GQA 32/8, head dim 128, the same (batch, cache) rows, pages of 16,
          64 and 256 tokens dealt to the sequences in a random order: jattn
          ``paged_attention`` (auto), jattn's contiguous decode (``flash_attention``
          with ``kv_lengths``) on the same keys, and JAX's Pallas ``paged_attention``
          (K/V pages transposed to its ``[kv_heads, pages, page_size, dim]`` layout
          outside the timed region).
  varlen  64 packed causal sequences, lengths drawn log-uniformly from 128-8192 (seed 0;
          document lengths: many short, a few long; 64 such draws average ~124k
          tokens) and scaled to 131072 tokens in all, kept within 128-8192; 16 q / 16
          kv heads, head dim 128: forward and forward+backward (gradients of sum(o)
          for q, k, v) of ``flash_attention_varlen``, of ``flash_attention`` on 64 x
          2048 (the same sequences count and tokens, equal lengths: the bar's peer)
          and on 16 x 8192 (longer equal sequences, for context), and of
          ``flash_attention`` with segment ids on the same packing. Real-FLOP
          TFLOP/s: causal forward 2 * sum(L_i^2) * H * D, forward+backward 3.5x.

Timing (``bench/programs.py``): ``bench.common.time_jax`` (median of ``--reps``
samples of ``--inner`` queued calls, after ``--warmup`` calls, each sample ended by
``block_until_ready``) on jitted programs; a case's programs are compiled together
(``--compile-threads``), and a program equal to one already compiled (jattn ``auto``
resolving to a backend also timed by name) is compiled once and timed again for its
own row (``same_program_as`` in the JSON). An error is recorded in its row; one
outside a row (e.g. no memory for a cache) ends only that cache's cases.

    python bench/decode.py --out bench/results              # every section (GPU)
    python bench/decode.py --section decode --quick         # GQA 32/8, hd 128, q_len 1
    python bench/decode.py --section paged --label h100_paged
    python bench/decode.py --smoke                          # CPU: tiny shapes, plumbing

Writes ``decode_<label>.json`` and ``decode_<label>.md`` under ``--out`` after every
section (``--label`` defaults to the GPU's short name, e.g. h100): the environment,
every timing, the ratios the issue's bars use and each bar marked pass or fail
(thresholds in BARS; ``--bar NAME=VALUE`` overrides one). ``--smoke`` runs on the
CPU with ``JATTN_INTERPRET=1`` (jattn backends auto / pallas_triton / xla, JAX's
kernels in interpret mode, one warm-up and two timed calls) and writes under the
temporary folder unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import itertools
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import environment, write_results  # noqa: E402
from bench.programs import GiB, Programs, one_line, run_case, size  # noqa: E402

DTYPE = jnp.bfloat16
MEMORY_LIMIT = 60 * GiB  # configurations estimated above this are skipped, not run
SECTIONS = ("decode", "paged", "varlen")

# name: (what is measured, threshold); a case passes when its value >= the threshold.
# Speedups are peer ms / jattn ms (> 1: jattn faster).
# Issue 39's bars.
BARS = {
    "decode_vs_cudnn": ("decode, q_len 1: cuDNN ms / jattn auto ms", 1.15),
    "decode_multi_query_vs_cudnn": ("decode, q_len 16 and 64: cuDNN ms / jattn auto ms", 1.2),
    "decode_vs_xla": ("decode, q_len 1: XLA ms / jattn auto ms", 1.0),
    "decode_vs_jax_pallas": ("decode, q_len 1: JAX Pallas decode ms (the faster of its two "
                             "rows) / jattn auto ms", 2.0),
    "decode_copy_fraction": ("decode, q_len 1, batch x cache >= 256k tokens: jattn auto K/V "
                             "bandwidth / copy bandwidth", 0.8),
    "paged_vs_contiguous": ("paged: jattn contiguous decode ms / jattn paged ms", 0.9),
    "paged_vs_jax_paged": ("paged: JAX Pallas paged ms / jattn paged ms", 2.0),
    "varlen_vs_equal": ("varlen, fwd+bwd: varlen TFLOP/s / equal-length TFLOP/s", 0.9),
    "varlen_vs_segments": ("varlen, fwd+bwd: segment-ids ms / varlen ms", 1.3),
}


@dataclasses.dataclass(frozen=True)
class Varlen:
  """The packed batch: ``num_seqs`` lengths drawn log-uniformly from [min_len, max_len],
  rescaled to ``total`` tokens; the equal-length peers are ``b x (total / b)`` for ``b``
  in ``equal_batches`` (the first, the bar's: ``num_seqs`` sequences)."""
  num_seqs: int
  min_len: int
  max_len: int
  total: int
  heads: int
  head_dim: int
  equal_batches: tuple


@dataclasses.dataclass(frozen=True)
class Grid:
  q_lens: tuple
  caches: tuple  # (batch, cache tokens)
  heads: tuple  # (q_heads, kv_heads)
  head_dims: tuple
  copy_min_tokens: int  # batch x cache from which the copy-fraction bar applies
  paged_heads: tuple
  paged_head_dim: int
  page_sizes: tuple
  copy_bytes: int
  varlen: Varlen


FULL = Grid(q_lens=(1, 16, 64), caches=((8, 32768), (32, 8192), (1, 131072), (64, 4096)),
            heads=((32, 8), (8, 8)), head_dims=(64, 128), copy_min_tokens=256 * 1024,
            paged_heads=(32, 8), paged_head_dim=128, page_sizes=(16, 64, 256),
            copy_bytes=2 * GiB, varlen=Varlen(64, 128, 8192, 131072, 16, 128, (64, 16)))
QUICK = dataclasses.replace(FULL, q_lens=(1,), heads=((32, 8),), head_dims=(128,))
SMOKE = Grid(q_lens=(1, 4), caches=((2, 256), (1, 512)), heads=((4, 2), (2, 2)),
             head_dims=(64,), copy_min_tokens=512, paged_heads=(4, 2), paged_head_dim=64,
             page_sizes=(16, 64), copy_bytes=4 * 2**20, varlen=Varlen(4, 16, 128, 256, 2, 64, (4, 2)))


@dataclasses.dataclass(frozen=True)
class Settings:
  grid: Grid
  jattn_backends: tuple
  reps: int
  inner: int
  warmup: int
  interpret: bool  # JAX's Pallas peers in interpret mode (--smoke)
  compile_threads: int = 1

  def programs(self) -> Programs:
    return Programs(self.reps, self.inner, self.warmup, self.compile_threads)


# ---------------------------------------------------------------- rows

def _run(programs, base, builds, finish=lambda row: None) -> list:
  """``run_case`` with this benchmark's memory limit and row printing."""
  return run_case(programs, base, builds, memory_limit=MEMORY_LIMIT, finish=finish,
                  show=lambda row: print(_fmt_row(row), flush=True))


def _fmt_row(row) -> str:
  head = f"{row['section']:>6} {row['case']:>24} {row['impl']:>18}"
  if "error" in row or "skipped" in row:
    return f"{head}  {'ERROR ' + row['error'] if 'error' in row else 'skipped: ' + row['skipped']}"
  extra = "".join(f" {row[k]:8.1f} {unit}" for k, unit in (("gbps", "GB/s"), ("tflops", "TFLOP/s"))
                  if k in row)
  same = f"  (= {row['same_program_as']})" if "same_program_as" in row else ""
  return f"{head} {row['ms']:9.4f} ms{extra}  compile {row['compile_s']:.1f} s{same}"


def _normal(seed, shape, dtype=DTYPE):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, dtype)


def _parameters(fn) -> dict:
  try:
    return dict(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    return {}


def _takes(fn, name) -> bool:
  params = _parameters(fn).values()
  return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _largest_divisor(n: int, at_most: int) -> int:
  return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


# ---------------------------------------------------------------- the APIs under test

def missing_api(section: str) -> str | None:
  """Why ``section`` cannot run in this checkout (one line), or None."""
  import jattn

  name = {"decode": "flash_attention", "paged": "paged_attention",
          "varlen": "flash_attention_varlen"}[section]
  try:
    fn = getattr(jattn, name, None)
  except Exception as e:  # the name exists but its module fails to import
    return f"importing jattn.{name} failed ({one_line(e)})"
  if fn is None:
    return f"jattn has no {name} in this checkout"
  if section == "decode" and not _takes(fn, "kv_lengths"):
    return "jattn.flash_attention takes no kv_lengths in this checkout"
  return None


def _jattn_decode(q, k, v, lengths, *, causal, backend):
  import jattn
  return jattn.flash_attention(q, k, v, causal=causal, kv_lengths=lengths, backend=backend)


def _jattn_paged(q, k_pages, v_pages, table, lengths, *, backend):
  import jattn
  return jattn.paged_attention(q, k_pages, v_pages, table, lengths, backend=backend)


def _jax_nn(q, k, v, *, implementation):
  return jax.nn.dot_product_attention(q, k, v, implementation=implementation)


def _split_k_params(fn, seq_len, interpret) -> dict:
  """Keyword arguments of JAX's decode kernel that exist in this jax: interpret, and
  its default k_splits unless that does not divide the cache into >= 16-key splits."""
  params = _parameters(fn)
  kw = {"interpret": interpret} if "interpret" in params else {}
  if "k_splits" in params:
    default = params["k_splits"].default
    kw["k_splits"] = _largest_divisor(seq_len, min(default, max(1, seq_len // 16)))
  return kw


def _jax_decode(q, k, v, lengths, *, params):
  """JAX's split-K decode kernel through ``gqa`` (it transposes K/V to head-major)."""
  from jax.experimental.pallas.ops.gpu import decode_attention
  if "kv_seq_len" in _parameters(decode_attention.gqa):
    params = dict(params, kv_seq_len=lengths)
  return decode_attention.gqa(q[:, 0], k, v, **params)[:, None]


def _jax_decode_head_major(q, k_hm, v_hm, lengths, *, params):
  """The kernel ``gqa`` runs, on K/V already ``[batch, kv_heads, seq, dim]``: ``mqa``
  for each KV head (``params`` carry ``gqa``'s key tile)."""
  from jax.experimental.pallas.ops.gpu import decode_attention
  batch, _, q_heads, dim = q.shape
  kv_heads = k_hm.shape[1]
  if "kv_seq_len" in _parameters(decode_attention.mqa):
    params = dict(params, kv_seq_len=lengths)
  per_head = lambda q, k, v: decode_attention.mqa(q, k, v, **params)
  grouped = q[:, 0].reshape(batch, kv_heads, q_heads // kv_heads, dim)
  o = jax.vmap(per_head, in_axes=1, out_axes=1)(grouped, k_hm, v_hm)
  return o.reshape(batch, 1, q_heads, dim)


def _jax_paged_params(pages_per_seq, page_size, interpret) -> dict:
  """JAX's paged kernel: its 16 splits where they divide the block table, and about
  128 keys per compute block (its default, 8 pages, is that at page size 16)."""
  from jax.experimental.pallas.ops.gpu import paged_attention
  params = _parameters(paged_attention.paged_attention)
  kw = {"interpret": interpret} if "interpret" in params else {}
  splits = _largest_divisor(pages_per_seq, 16)
  if "k_splits" in params:
    kw["k_splits"] = splits
  if "pages_per_compute_block" in params:
    kw["pages_per_compute_block"] = _largest_divisor(pages_per_seq // splits,
                                                     max(1, 128 // page_size))
  return kw


def _jax_paged(q, k_pages, v_pages, table, lengths, *, params):
  from jax.experimental.pallas.ops.gpu import paged_attention
  return paged_attention.paged_attention(q[:, 0], k_pages, v_pages, table, lengths,
                                         **params)[:, None]


def _jattn_name(backend: str) -> str:
  return "jattn_" + backend.removeprefix("pallas_")


# ---------------------------------------------------------------- copy bandwidth

def copy_bandwidth(programs, nbytes: int) -> dict:
  """GB/s of a jitted device copy of ``nbytes`` (2 x bytes / time: read + write), as
  XLA's copy and as an elementwise ``x + 1``; ``gbps`` is the faster."""
  x = jnp.arange(nbytes // 4, dtype=jnp.uint32)
  result = {"bytes": nbytes}
  for name, fn in (("copy", jnp.copy), ("x+1", lambda x: x + 1)):
    ms = programs.measure(name, fn, (x,))["ms"]
    result[name] = {"ms": ms, "gbps": 2 * nbytes / ms / 1e6}
    print(f"copy bandwidth ({name}, {size(nbytes)}): {ms:.3f} ms, "
          f"{result[name]['gbps']:.0f} GB/s", flush=True)
  result["gbps"] = max(result["copy"]["gbps"], result["x+1"]["gbps"])
  return result


def _add_bandwidth(row, kv_bytes, copy_gbps):
  if "ms" in row:
    row["gbps"] = kv_bytes / row["ms"] / 1e6
    if copy_gbps:
      row["copy_fraction"] = row["gbps"] / copy_gbps


# ---------------------------------------------------------------- decode

@dataclasses.dataclass(eq=False)
class Cache:
  """A full K/V cache ``[batch, tokens, kv_heads, dim]`` and its lengths."""
  k: jax.Array
  v: jax.Array
  lengths: jax.Array

  @classmethod
  def random(cls, batch, tokens, kv_heads, dim, seed=1):
    shape = (batch, tokens, kv_heads, dim)
    return cls(_normal(seed, shape), _normal(seed + 1, shape),
               jnp.full((batch,), tokens, jnp.int32))

  @functools.cached_property
  def head_major(self):
    return tuple(jax.block_until_ready(jnp.swapaxes(x, 1, 2)) for x in (self.k, self.v))


def _kv_bytes(batch, tokens, kv_heads, dim) -> int:
  return 2 * batch * tokens * kv_heads * dim * jnp.dtype(DTYPE).itemsize


def decode_builds(c: dict, q, cache: Cache, s: Settings) -> dict:
  """name -> (build, estimated bytes) for one decode configuration."""
  causal = c["q_len"] > 1
  kv = _kv_bytes(c["batch"], c["cache"], c["kv_heads"], c["head_dim"])
  logits = 2 * c["batch"] * c["q_heads"] * c["q_len"] * c["cache"] * 4  # XLA: scores, probs
  builds = {}
  for backend in s.jattn_backends:
    fn = functools.partial(_jattn_decode, causal=causal, backend=backend)
    builds[_jattn_name(backend)] = (lambda fn=fn: (fn, (q, cache.k, cache.v, cache.lengths)),
                                    kv)
  for impl in ("cudnn", "xla"):
    fn = functools.partial(_jax_nn, implementation=impl)
    need = kv + (logits if impl == "xla" else 0)
    builds[impl] = (lambda fn=fn: (fn, (q, cache.k, cache.v)), need)
  if c["q_len"] == 1:
    # + the head-major copy kept for jax_decode_hm, + gqa's own transposed copy
    builds["jax_decode"] = (lambda: _jax_decode_build(c, q, cache, s, head_major=False), 3 * kv)
    builds["jax_decode_hm"] = (lambda: _jax_decode_build(c, q, cache, s, head_major=True), 2 * kv)
  return builds


def _jax_decode_build(c, q, cache: Cache, s: Settings, head_major: bool):
  from jax.experimental.pallas.ops.gpu import decode_attention
  kernel = decode_attention.mqa if head_major else decode_attention.gqa
  params = _split_k_params(kernel, c["cache"], s.interpret)
  if head_major:
    gqa_block_k = _parameters(decode_attention.gqa).get("block_k")
    if gqa_block_k is not None and "block_k" in _parameters(kernel):
      params["block_k"] = gqa_block_k.default  # mqa's own default differs
    k, v = cache.head_major
    fn = functools.partial(_jax_decode_head_major, params=params)
  else:
    k, v = cache.k, cache.v
    fn = functools.partial(_jax_decode, params=params)
  return fn, (q, k, v, cache.lengths), params


def _decode_case(c) -> str:
  return (f"q{c['q_len']} {c['batch']}x{c['cache']} {c['q_heads']}/{c['kv_heads']} "
          f"d{c['head_dim']}")


def decode_section(programs, s: Settings, copy: dict | None, rows: list) -> dict:
  g = s.grid
  for dim, (batch, tokens), kv_heads in itertools.product(
      g.head_dims, g.caches, sorted({kv for _, kv in g.heads})):
    programs.forget()  # the programs of one cache do not recur with the next
    where = dict(section="decode", q_len="all", batch=batch, cache=tokens, q_heads="all",
                 kv_heads=kv_heads, head_dim=dim, case=f"{batch}x{tokens} kv {kv_heads} d{dim}")
    _guarded(rows, where, _decode_cache, programs, s, copy, rows, dim, batch, tokens, kv_heads)
  return {}


def _guarded(rows, where: dict, fn, *args):
  """``fn(*args)``; an error outside a row (e.g. no memory for the arrays) ends only
  this cache's cases, recorded as a row ``where``."""
  try:
    fn(*args)
  except Exception as e:
    rows.append(dict(where, impl="all", error=one_line(e)))
    print(_fmt_row(rows[-1]), flush=True)


def _decode_cache(programs, s: Settings, copy, rows, dim, batch, tokens, kv_heads):
  """The cases on one cache (its arrays are freed on return)."""
  g = s.grid
  kv = _kv_bytes(batch, tokens, kv_heads, dim)
  cache = Cache.random(batch, tokens, kv_heads, dim) if 2 * kv <= MEMORY_LIMIT else None
  for (q_heads, _), q_len in itertools.product([h for h in g.heads if h[1] == kv_heads],
                                               g.q_lens):
    c = dict(q_len=q_len, batch=batch, cache=tokens, q_heads=q_heads, kv_heads=kv_heads,
             head_dim=dim)
    base = dict(c, section="decode", case=_decode_case(c))
    if cache is None:
      rows.append(dict(base, impl="all", skipped=f"K/V alone need {size(2 * kv)}"))
      continue
    q = _normal(0, (batch, q_len, q_heads, dim))
    rows += _run(programs, base, decode_builds(c, q, cache, s),
                 finish=lambda row: _add_bandwidth(row, kv, copy and copy["gbps"]))


# ---------------------------------------------------------------- paged

@dataclasses.dataclass(eq=False)
class Pages:
  """A paged cache: ``[num_pages, page_size, kv_heads, dim]`` pages dealt to the
  sequences in a random order through ``table`` ``[batch, pages_per_seq]``."""
  k: jax.Array
  v: jax.Array
  table: jax.Array
  lengths: jax.Array

  @classmethod
  def random(cls, batch, tokens, page_size, kv_heads, dim, seed=1):
    pages_per_seq = tokens // page_size
    num_pages = batch * pages_per_seq
    shape = (num_pages, page_size, kv_heads, dim)
    order = jax.random.permutation(jax.random.PRNGKey(seed + 2), num_pages)
    return cls(_normal(seed, shape), _normal(seed + 1, shape),
               order.reshape(batch, pages_per_seq).astype(jnp.int32),
               jnp.full((batch,), tokens, jnp.int32))

  @functools.cached_property
  def contiguous(self):
    """The same keys as ``[batch, tokens, kv_heads, dim]``."""
    batch, pages_per_seq = self.table.shape
    shape = (batch, pages_per_seq * self.k.shape[1], *self.k.shape[2:])
    return tuple(jax.block_until_ready(x[self.table].reshape(shape)) for x in (self.k, self.v))

  @functools.cached_property
  def head_major(self):
    """JAX's paged layout, ``[kv_heads, num_pages, page_size, dim]``."""
    return tuple(jax.block_until_ready(jnp.transpose(x, (2, 0, 1, 3))) for x in (self.k, self.v))


def paged_builds(q, pages: Pages, s: Settings) -> dict:
  page_size, pages_per_seq = pages.k.shape[1], pages.table.shape[1]

  def jax_paged():  # its kernel applies no logit scale: q comes scaled, outside the timing
    params = _jax_paged_params(pages_per_seq, page_size, s.interpret)
    q_scaled = (q * q.shape[-1] ** -0.5).astype(q.dtype)
    return (functools.partial(_jax_paged, params=params),
            (q_scaled, *pages.head_major, pages.table, pages.lengths), params)

  contiguous = functools.partial(_jattn_decode, causal=False, backend="auto")
  paged = lambda backend: lambda: (functools.partial(_jattn_paged, backend=backend),
                                   (q, pages.k, pages.v, pages.table, pages.lengths))
  builds = {"jattn_paged": paged("auto"),
            "jattn_contiguous": lambda: (contiguous, (q, *pages.contiguous, pages.lengths)),
            "jax_paged": jax_paged}
  # Each kernel family on its own (the Hopper one takes pages of whole 64-key tiles).
  for backend in s.jattn_backends:
    if backend != "auto" and (backend != "pallas_mosaic" or page_size % 64 == 0):
      builds[f"jattn_paged_{backend.removeprefix('pallas_')}"] = paged(backend)
  return builds


def paged_section(programs, s: Settings, copy: dict | None, rows: list) -> dict:
  g = s.grid
  for (batch, tokens), page_size in itertools.product(g.caches, g.page_sizes):
    if page_size == g.page_sizes[0]:
      programs.forget()  # the contiguous program recurs across page sizes only
    where = dict(section="paged", batch=batch, cache=tokens, page_size=page_size,
                 case=f"{batch}x{tokens} page {page_size}")
    _guarded(rows, where, _paged_case, programs, s, copy, rows, batch, tokens, page_size)
  return {}


def _paged_case(programs, s: Settings, copy, rows, batch, tokens, page_size):
  """One (cache, page size) case (its arrays are freed on return)."""
  q_heads, kv_heads = s.grid.paged_heads
  dim = s.grid.paged_head_dim
  c = dict(q_len=1, batch=batch, cache=tokens, page_size=page_size, q_heads=q_heads,
           kv_heads=kv_heads, head_dim=dim)
  base = dict(c, section="paged", case=f"{batch}x{tokens} page {page_size}")
  kv = _kv_bytes(batch, tokens, kv_heads, dim)
  if tokens % page_size or 3 * kv > MEMORY_LIMIT:  # pages, contiguous copy, JAX layout
    why = ("page size does not divide the cache" if tokens % page_size
           else f"pages, contiguous and JAX-layout copies need {size(3 * kv)}")
    rows.append(dict(base, impl="all", skipped=why))
    return
  pages = Pages.random(batch, tokens, page_size, kv_heads, dim)
  q = _normal(0, (batch, 1, q_heads, dim))
  builds = {name: (build, 3 * kv) for name, build in paged_builds(q, pages, s).items()}
  rows += _run(programs, base, builds,
               finish=lambda row: _add_bandwidth(row, kv, copy and copy["gbps"]))


# ---------------------------------------------------------------- varlen

def varlen_lengths(spec: Varlen, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(drawn, used): lengths drawn log-uniformly from [min_len, max_len], and the same
  rescaled to sum to exactly ``spec.total`` within those bounds (the rounding
  remainder spread by one over the sequences that have room)."""
  rng = np.random.default_rng(seed)
  drawn = np.rint(np.exp(rng.uniform(np.log(spec.min_len), np.log(spec.max_len),
                                     spec.num_seqs))).astype(np.int64)
  used = np.clip(np.floor(drawn * spec.total / drawn.sum()), spec.min_len,
                 spec.max_len).astype(np.int64)
  while used.sum() != spec.total:
    step = 1 if used.sum() < spec.total else -1
    room = np.flatnonzero((used + step >= spec.min_len) & (used + step <= spec.max_len))
    used[room[:abs(spec.total - used.sum())]] += step
  return drawn, used


def varlen_flops(lengths, heads, head_dim, mode) -> float:
  """Causal FLOPs actually needed: forward 2 * sum(L^2) * H * D, forward+backward 3.5x."""
  fwd = 2.0 * float(np.sum(np.asarray(lengths, np.float64) ** 2)) * heads * head_dim
  return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


def _with_grads(fn):
  """Gradients of sum(fn(q, k, v, *rest)) for q, k and v."""
  def grads(q, k, v, *rest):
    loss = lambda q, k, v: fn(q, k, v, *rest).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  return grads


def varlen_builds(lengths, spec: Varlen) -> dict:
  """name -> (fn, args, FLOPs-counting lengths) for the three ways to run the batch."""
  import jattn

  total, h, d = spec.total, spec.heads, spec.head_dim
  q, k, v = (_normal(seed, (total, h, d)) for seed in (0, 1, 2))
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  ids = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths), jnp.int32)
  longest = int(np.max(lengths))

  def varlen(q, k, v, cu):
    return jattn.flash_attention_varlen(q, k, v, cu, cu, max_seqlen_q=longest,
                                        max_seqlen_k=longest, causal=True)

  def equal(q, k, v):
    return jattn.flash_attention(q, k, v, causal=True)

  def segments(q, k, v, ids):
    return jattn.flash_attention(q[None], k[None], v[None], causal=True,
                                 q_segment_ids=ids[None], kv_segment_ids=ids[None])[0]

  impls = {"jattn_varlen": (varlen, (q, k, v, cu), lengths)}
  for name, batch in zip(("jattn_equal", "jattn_equal_long"), spec.equal_batches):
    as_equal = lambda x, batch=batch: x.reshape(batch, total // batch, h, d)
    impls[name] = (equal, tuple(map(as_equal, (q, k, v))), [total // batch] * batch)
  impls["jattn_segments"] = (segments, (q, k, v, ids), lengths)
  return impls


def _add_tflops(row, impls, spec: Varlen, mode):
  if "ms" in row:
    flops = varlen_flops(impls[row["impl"]][2], spec.heads, spec.head_dim, mode)
    row["tflops"] = flops / row["ms"] / 1e9


def varlen_section(programs, s: Settings, copy: dict | None, rows: list) -> dict:
  spec = s.grid.varlen
  drawn, lengths = varlen_lengths(spec)
  print(f"varlen: {len(lengths)} sequences, {lengths.sum()} tokens, lengths "
        f"{lengths.min()}-{lengths.max()} (drawn {drawn.min()}-{drawn.max()}, sum {drawn.sum()})",
        flush=True)
  impls = varlen_builds(lengths, spec)
  for mode in ("fwd", "fwd+bwd"):
    base = dict(section="varlen", case=f"{mode} {len(lengths)} seqs {spec.total}",
                mode=mode, tokens=spec.total, heads=spec.heads, head_dim=spec.head_dim)
    wrap = (lambda fn: fn) if mode == "fwd" else _with_grads
    builds = {name: (lambda fn=fn, args=args: (wrap(fn), args), 0)
              for name, (fn, args, _) in impls.items()}
    rows += _run(programs, base, builds,
                 finish=lambda row, mode=mode: _add_tflops(row, impls, spec, mode))
  return {"lengths": [int(x) for x in lengths], "drawn_lengths": [int(x) for x in drawn]}


# ---------------------------------------------------------------- ratios and bars

def _timed(rows, section, keys) -> dict:
  """{case: {impl: row}} of the rows of ``section`` that have a time."""
  cases = {}
  for r in rows:
    if r["section"] == section and "ms" in r:
      cases.setdefault(tuple(r[k] for k in keys), {})[r["impl"]] = r
  return cases


def _speedup(by, peer, ours):
  """peer ms / ours ms, where both were timed (peer may be a tuple: the fastest)."""
  peers = [by[p]["ms"] for p in (peer if isinstance(peer, tuple) else (peer,)) if p in by]
  return min(peers) / by[ours]["ms"] if peers and ours in by else None


def decode_ratios(rows, grid: Grid) -> list:
  out = []
  for by in _timed(rows, "decode", ("case",)).values():
    r = next(iter(by.values()))
    if r["q_len"] == 1:
      pairs = {"decode_vs_cudnn": _speedup(by, "cudnn", "jattn_auto"),
               "decode_vs_xla": _speedup(by, "xla", "jattn_auto"),
               "decode_vs_jax_pallas": _speedup(by, ("jax_decode", "jax_decode_hm"),
                                                "jattn_auto")}
    else:
      pairs = {"decode_multi_query_vs_cudnn": _speedup(by, "cudnn", "jattn_auto")}
    if (r["q_len"] == 1 and r["batch"] * r["cache"] >= grid.copy_min_tokens
        and "jattn_auto" in by):
      pairs["decode_copy_fraction"] = by["jattn_auto"].get("copy_fraction")
    out += [{"bar": b, "case": r["case"], "value": v} for b, v in pairs.items() if v is not None]
  return out


def paged_ratios(rows, grid: Grid) -> list:
  out = []
  for by in _timed(rows, "paged", ("case",)).values():
    case = next(iter(by.values()))["case"]
    pairs = {"paged_vs_contiguous": _speedup(by, "jattn_contiguous", "jattn_paged"),
             "paged_vs_jax_paged": _speedup(by, "jax_paged", "jattn_paged")}
    out += [{"bar": b, "case": case, "value": v} for b, v in pairs.items() if v is not None]
  return out


def varlen_ratios(rows, grid: Grid) -> list:
  out = []
  for by in _timed(rows, "varlen", ("mode",)).values():
    r = next(iter(by.values()))
    if r["mode"] != "fwd+bwd" or "jattn_varlen" not in by:
      continue
    if "jattn_equal" in by:
      out.append({"bar": "varlen_vs_equal", "case": r["case"],
                  "value": by["jattn_varlen"]["tflops"] / by["jattn_equal"]["tflops"]})
    if "jattn_segments" in by:
      out.append({"bar": "varlen_vs_segments", "case": r["case"],
                  "value": _speedup(by, "jattn_segments", "jattn_varlen")})
  return out


RATIOS = {"decode": decode_ratios, "paged": paged_ratios, "varlen": varlen_ratios}


def judge(ratios: list, thresholds: dict, sections) -> list:
  """One line per bar of the sections run: its worst case, how many pass, pass or fail
  (``pass`` None: no case had both times, e.g. a peer failed everywhere)."""
  bars = []
  for name, (what, _) in BARS.items():
    if name.split("_")[0] not in sections:
      continue
    cases = [r for r in ratios if r["bar"] == name]
    threshold = thresholds[name]
    if not cases:
      bars.append({"bar": name, "what": what, "threshold": threshold, "cases": 0,
                   "pass": None})
      continue
    for r in cases:
      r["pass"] = r["value"] >= threshold
    worst = min(cases, key=lambda r: r["value"])
    bars.append({"bar": name, "what": what, "threshold": threshold, "worst": worst["value"],
                 "worst_case": worst["case"], "passing": sum(r["pass"] for r in cases),
                 "cases": len(cases), "pass": all(r["pass"] for r in cases)})
  return bars


# ---------------------------------------------------------------- markdown

def pivot(rows, keys, cell, extras=()) -> str:
  """A markdown table: one line per distinct key (first-seen order), one column per
  impl (``cell(row)``; n/a where it failed, skip where skipped), then ``extras``:
  ``[(header, {impl: timed row} -> str)]``."""
  key_of = lambda r: tuple(f(r) for _, f in keys)
  lines_by = {}
  for r in rows:
    lines_by.setdefault(key_of(r), {})[r["impl"]] = r
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  out = ["| " + " | ".join([h for h, _ in keys] + impls + [h for h, _ in extras]) + " |",
         "|" + "---|" * (len(keys) + len(impls) + len(extras))]
  for key, by in lines_by.items():
    cells = ["" if i not in by else "n/a" if "error" in by[i] else "skip" if "skipped" in by[i]
             else cell(by[i]) for i in impls]
    timed = {i: r for i, r in by.items() if "ms" in r}
    out.append("| " + " | ".join(list(key) + cells + [f(timed) for _, f in extras]) + " |")
  return "\n".join(out) + "\n"


def _x(value) -> str:
  return "" if value is None else f"{value:.2f}x"


def _gbps(by, impl) -> str:
  return f"{by[impl]['gbps']:.0f}" if impl in by else ""


def _frac(by, impl) -> str:
  f = by.get(impl, {}).get("copy_fraction")
  return "" if f is None else f"{100 * f:.0f}%"


def decode_markdown(rows) -> str:
  keys = [("q_len", lambda r: str(r["q_len"])),
          ("batch x cache", lambda r: f"{r['batch']}x{r['cache']}"),
          ("heads q/kv", lambda r: f"{r['q_heads']}/{r['kv_heads']}"),
          ("head dim", lambda r: str(r["head_dim"]))]
  jattn_impls = [i for i in dict.fromkeys(r["impl"] for r in rows) if i.startswith("jattn_")]
  extras = [("auto GB/s", lambda by: _gbps(by, "jattn_auto"))]
  extras += [(f"{i.removeprefix('jattn_')} / copy", lambda by, i=i: _frac(by, i))
             for i in jattn_impls]
  extras += [("cuDNN / auto", lambda by: _x(_speedup(by, "cudnn", "jattn_auto"))),
             ("XLA / auto", lambda by: _x(_speedup(by, "xla", "jattn_auto"))),
             ("JAX decode / auto",
              lambda by: _x(_speedup(by, ("jax_decode", "jax_decode_hm"), "jattn_auto")))]
  return pivot(rows, keys, lambda r: f"{r['ms']:.3f}", extras)


def paged_markdown(rows) -> str:
  keys = [("batch x cache", lambda r: f"{r['batch']}x{r['cache']}"),
          ("page", lambda r: str(r["page_size"]))]
  extras = [("paged GB/s", lambda by: _gbps(by, "jattn_paged")),
            ("paged / copy", lambda by: _frac(by, "jattn_paged")),
            ("contiguous / paged", lambda by: _x(_speedup(by, "jattn_contiguous", "jattn_paged"))),
            ("JAX paged / paged", lambda by: _x(_speedup(by, "jax_paged", "jattn_paged")))]
  return pivot(rows, keys, lambda r: f"{r['ms']:.3f}", extras)


def varlen_markdown(rows) -> str:
  def tflops_ratio(by, peer):
    both = "jattn_varlen" in by and peer in by
    return _x(by["jattn_varlen"]["tflops"] / by[peer]["tflops"]) if both else ""

  extras = [("varlen / equal (TFLOP/s)", lambda by: tflops_ratio(by, "jattn_equal")),
            ("varlen / equal long (TFLOP/s)", lambda by: tflops_ratio(by, "jattn_equal_long")),
            ("segments / varlen (ms)",
             lambda by: _x(_speedup(by, "jattn_segments", "jattn_varlen")))]
  return pivot(rows, [("mode", lambda r: r["mode"])],
               lambda r: f"{r['ms']:.3f} ({r['tflops']:.0f})", extras)


SECTION_NOTES = {
    "decode": ["Median ms. jattn rows: `flash_attention(..., kv_lengths=cache length)`, "
               "causal (bottom-right) for q_len > 1, non-causal at q_len 1. cuDNN and XLA: "
               "`jax.nn.dot_product_attention`, non-causal at every q_len (its causal mask "
               "is top-left aligned, which is not decode's), no lengths (the cache is full).",
               "jax_decode: `decode_attention.gqa` (its transpose of K/V to head-major is "
               "inside the timed call); jax_decode_hm: the same kernel on head-major K/V "
               "(transposed outside the timed call; `mqa` per KV head, gqa's block_k); "
               "q_len 1 only. The JAX ratio uses the faster of the two.",
               "GB/s: bytes of K and V attended / time; '/ copy': that over the copy "
               "bandwidth above. Ratios: peer ms / jattn auto ms (> 1: jattn faster)."],
    "paged": ["q_len 1, non-causal. jattn_paged: `paged_attention(backend='auto')` with "
              "the pages in a random order; jattn_contiguous: `flash_attention(kv_lengths)` "
              "on the same keys laid out contiguously; jax_paged: "
              "`jax.experimental.pallas.ops.gpu.paged_attention` (K/V transposed to its layout "
              "and q scaled by head_dim^-0.5, which its kernel does not apply, outside the "
              "timed call; its k_splits and pages_per_compute_block in the JSON)."],
    "varlen": ["Median ms (real-FLOP TFLOP/s: causal forward 2 * sum(L_i^2) * H * D, "
               "forward+backward 3.5x). jattn_varlen: `flash_attention_varlen`; jattn_equal: "
               "`flash_attention` on as many equal sequences with the same token count "
               "(the bar's peer); jattn_equal_long: on fewer, longer equal sequences (the same tokens); "
               "jattn_segments: `flash_attention` with segment ids on the same packing. "
               "Backward: gradients of sum(o) for q, k, v."],
}
SECTION_TABLES = {"decode": decode_markdown, "paged": paged_markdown, "varlen": varlen_markdown}


def errors_markdown(rows) -> list:
  """One line per distinct (impl, error or reason skipped), with how many cases."""
  seen = {}
  for r in rows:
    why = r.get("error") or r.get("skipped")
    if why:
      seen.setdefault((r["impl"], why), []).append(r["case"])
  return [f"- {impl} not timed in {len(cases)} case(s) (first: {cases[0]}): {why}"
          for (impl, why), cases in seen.items()]


def bars_markdown(bars) -> str:
  lines = ["| bar | what | threshold | worst (case) | cases passing | result |",
           "|---|---|---|---|---|---|"]
  for b in bars:
    if b["pass"] is None:
      lines.append(f"| {b['bar']} | {b['what']} | {b['threshold']:.2f} | | 0/0 | no data |")
      continue
    lines.append(f"| {b['bar']} | {b['what']} | {b['threshold']:.2f} | {b['worst']:.2f} "
                 f"({b['worst_case']}) | {b['passing']}/{b['cases']} | "
                 f"{'PASS' if b['pass'] else 'FAIL'} |")
  return "\n".join(lines) + "\n"


def markdown(result) -> str:
  env, copy = result["env"], result.get("copy")
  out = [f"# Serving attention (issue 39), {env['device']} (jax {env['jax']}, {env['time']})", "",
         f"bf16; medians of {result['timing']}.", ""]
  if copy:
    out += [f"Copy bandwidth: {copy['gbps']:.0f} GB/s (jitted copy {copy['copy']['gbps']:.0f}, "
            f"x + 1 {copy['x+1']['gbps']:.0f}; {size(copy['bytes'])} array, "
            "2 x bytes / time).", ""]
  if result["bars"]:
    out += ["## Bars", "", bars_markdown(result["bars"])]
  for name, section in result["sections"].items():
    out += [f"## {name}", ""]
    if "skipped" in section or "failed" in section:
      out += [f"Not run: {section.get('skipped') or section.get('failed')}", ""]
    if section.get("rows"):
      errors = errors_markdown(section["rows"])
      out += [SECTION_TABLES[name](section["rows"]), *SECTION_NOTES[name], "",
              *(errors + [""] if errors else []),
              f"Section time (compiles included): {section['seconds']:.0f} s.", ""]
  return "\n".join(out) + "\n"


# ---------------------------------------------------------------- main

SECTION_RUNNERS = {"decode": decode_section, "paged": paged_section, "varlen": varlen_section}


def run_section(name, settings, copy) -> dict:
  """A section's rows; a missing API or a failure outside a row ends only this section."""
  missing = missing_api(name)
  if missing:
    print(f"{name}: not run: {missing}", flush=True)
    return {"skipped": missing}
  start, rows = time.perf_counter(), []
  section = {"rows": rows}
  try:
    section.update(SECTION_RUNNERS[name](settings.programs(), settings, copy, rows))
  except Exception as e:
    section["failed"] = one_line(e)
    print(f"{name}: stopped: {section['failed']}", flush=True)
  section["seconds"] = time.perf_counter() - start
  print(f"{name}: {section['seconds']:.0f} s", flush=True)
  return section


def short_device_name(kind: str) -> str:
  match = re.search(r"[A-Za-z]+\d{2,4}", kind.replace("NVIDIA", ""))
  return match.group(0).lower() if match else re.sub(r"\W+", "_", kind.lower()).strip("_")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--section", choices=(*SECTIONS, "all"), default=None,
                      help="default: all (decode with --quick)")
  parser.add_argument("--quick", action="store_true",
                      help="decode: GQA 32/8, head dim 128, q_len 1 only (and copy bandwidth)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes on the CPU, JATTN_INTERPRET=1: the plumbing only")
  parser.add_argument("--label", default=None,
                      help="output stem decode_<label> (default: the GPU's short name)")
  parser.add_argument("--out", default=None, help="output folder (default: bench/results)")
  parser.add_argument("--reps", type=int, default=None, help="timed samples (default 10)")
  parser.add_argument("--inner", type=int, default=None, help="calls per sample (default 10)")
  parser.add_argument("--warmup", type=int, default=None, help="untimed calls (default 2)")
  parser.add_argument("--compile-threads", type=int, default=None,
                      help="programs of a case compiled at once (default: min(8, cores))")
  parser.add_argument("--bar", action="append", default=[], metavar="NAME=VALUE",
                      help=f"override a bar's threshold ({', '.join(BARS)})")
  args = parser.parse_args(argv)
  thresholds = {name: t for name, (_, t) in BARS.items()}
  for item in args.bar:
    name, _, value = item.partition("=")
    if name not in BARS:
      parser.error(f"--bar {item}: no bar {name!r} (bars: {', '.join(BARS)})")
    thresholds[name] = float(value)
  args.thresholds = thresholds
  return args


def settings_for(args) -> Settings:
  threads = args.compile_threads or min(8, os.cpu_count() or 1)
  if args.smoke:
    return Settings(SMOKE, ("auto", "pallas_triton", "xla"), reps=args.reps or 2,
                    inner=args.inner or 1, warmup=args.warmup or 1, interpret=True,
                    compile_threads=threads)
  return Settings(QUICK if args.quick else FULL, ("auto", "pallas_triton", "pallas_mosaic"),
                  reps=args.reps or 10, inner=args.inner or 10,
                  warmup=2 if args.warmup is None else args.warmup, interpret=False,
                  compile_threads=threads)


def main(argv=None):
  args = parse_args(argv)
  if args.smoke:
    os.environ["JATTN_INTERPRET"] = "1"
    jax.config.update("jax_platforms", "cpu")
  elif jax.devices()[0].platform != "gpu":
    sys.exit("decode.py: no GPU here; --smoke runs the plumbing on the CPU")
  settings = settings_for(args)
  env = environment()
  label = args.label or ("smoke" if args.smoke else short_device_name(env["device"]))
  out = args.out or (os.path.join(tempfile.gettempdir(), "jattn_decode_smoke") if args.smoke
                     else os.path.join(os.path.dirname(__file__), "results"))
  section_arg = args.section or ("decode" if args.quick else "all")
  names = SECTIONS if section_arg == "all" else (section_arg,)
  copy = None
  if "decode" in names or "paged" in names:
    copy = copy_bandwidth(settings.programs(), settings.grid.copy_bytes)
  result = {"env": env, "label": label, "args": {k: v for k, v in vars(args).items()},
            "grid": dataclasses.asdict(settings.grid), "jattn_backends": settings.jattn_backends,
            "timing": (f"{settings.reps} samples of {settings.inner} calls after "
                       f"{settings.warmup} warm-up calls; programs of a case compiled "
                       f"{settings.compile_threads} at a time"),
            "memory_limit_gib": MEMORY_LIMIT / GiB, "copy": copy, "sections": {},
            "ratios": [], "bars": []}
  for name in names:
    section = run_section(name, settings, copy)
    result["sections"][name] = section
    result["ratios"] += RATIOS[name](section.get("rows", []), settings.grid)
    ran = [n for n, sec in result["sections"].items() if sec.get("rows")]
    result["bars"] = judge(result["ratios"], args.thresholds, ran)
    md = markdown(result)
    write_results(out, f"decode_{label}", result, md)  # every section: a cut run keeps rows
  print(md)
  print(f"wrote {os.path.join(out, f'decode_{label}')}.json and .md")


if __name__ == "__main__":
  main()
