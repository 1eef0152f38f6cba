"""Compiling and timing a benchmark's cases: each distinct program compiled once.

A case is a set of rows (one per implementation) on the same arrays. ``run_case``
lowers every row's function, compiles the programs not seen before together on a
thread pool (XLA compiles outside the GIL, so a case costs about its slowest compile),
then times the rows one after another with ``bench.common.time_jax``. Programs are
keyed by their lowered text, so two rows that build the same program (an ``auto``
backend resolving to a backend also timed by name) compile once; the second row says
``same_program_as``. Errors are recorded in their row, never raised.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax

from bench.common import time_jax

GiB = 2**30


def one_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def size(nbytes) -> str:
  return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.0f} MiB"


def _as_program(fn):
  def program(*args):  # one name for every program: equal programs lower to equal text
    return fn(*args)
  return program


@dataclasses.dataclass
class Program:
  """A compiled program, or the error compiling it gave."""
  first: str  # the row that compiled it
  executable: object = None
  error: str | None = None
  compile_s: float = 0.0  # XLA's compile (lowering not included)


def _compile(name, lowered) -> Program:
  start = time.perf_counter()
  try:
    executable = lowered.compile()
  except Exception as e:  # e.g. a kernel that does not fit; recorded in its rows
    return Program(name, error=one_line(e), compile_s=time.perf_counter() - start)
  return Program(name, executable, compile_s=time.perf_counter() - start)


def _peak_mib(executable):
  try:
    m = executable.memory_analysis()
    return round((m.argument_size_in_bytes + m.output_size_in_bytes
                  + m.temp_size_in_bytes) / 2**20, 1)
  except Exception:  # not every backend reports it
    return None


@dataclasses.dataclass
class Programs:
  """The programs compiled so far, and how to time one."""
  reps: int = 12
  inner: int = 5
  warmup: int = 3
  threads: int = 1
  _seen: dict = dataclasses.field(default_factory=dict)  # lowered text -> Program

  def forget(self):
    """Drops the compiled programs (at new arrays: they will not recur)."""
    self._seen.clear()

  def compile(self, jobs) -> list:
    """For each job ``(name, fn, args)``: ``(Program, same_as, seconds)``, where
    ``same_as`` names the row that compiled the same program earlier (else None) and
    ``seconds`` is this job's lowering and compiling; or the exception lowering raised."""
    lowered, new = [], {}
    for name, fn, args in jobs:
      start = time.perf_counter()
      try:
        low = jax.jit(_as_program(fn)).lower(*args)
      except Exception as e:
        lowered.append(e)
        continue
      text = low.as_text()
      fresh = text not in self._seen and text not in new
      if fresh:
        new[text] = (name, low)
      lowered.append((text, fresh, time.perf_counter() - start))
    with concurrent.futures.ThreadPoolExecutor(max(1, min(self.threads, len(new)))) as pool:
      self._seen.update(zip(new, pool.map(lambda item: _compile(*item), new.values())))
    out = []
    for item in lowered:
      if isinstance(item, Exception):
        out.append(item)
        continue
      text, fresh, lower_s = item
      program = self._seen[text]
      out.append((program, None if fresh else program.first,
                  lower_s + (program.compile_s if fresh else 0.0)))
    return out

  def time(self, program: Program, args) -> dict:
    seconds = time_jax(program.executable, *args, reps=self.reps, inner=self.inner,
                       warmup=self.warmup)
    return {"ms": seconds * 1e3, "peak_mib": _peak_mib(program.executable)}

  def measure(self, name, fn, args) -> dict:
    """One program compiled and timed (errors raise)."""
    [result] = self.compile([(name, fn, args)])
    if isinstance(result, Exception):
      raise result
    if result[0].error:
      raise RuntimeError(result[0].error)
    return self.time(result[0], args)


def run_case(programs: Programs, base: dict, builds: dict, *, memory_limit=float("inf"),
             finish=lambda row: None, show=print) -> list:
  """The rows of one case, each ``dict(base, impl=name, ...)``.

  ``builds``: impl -> ``(build, estimated bytes)``; ``build()`` gives ``(fn, args)`` or
  ``(fn, args, params)`` (params: a dict stored in the row). A row estimated over
  ``memory_limit`` is skipped. ``finish(row)`` adds derived fields before ``show(row)``.
  """
  rows, jobs = [], []
  for name, (build, need) in builds.items():
    row = dict(base, impl=name)
    rows.append(row)
    if need > memory_limit:
      row["skipped"] = f"needs about {size(need)}"
      continue
    try:
      fn, args, *params = build()
    except Exception as e:  # e.g. a peer missing from this jax
      row["error"] = one_line(e)
      continue
    if params and params[0]:
      row["params"] = params[0]
    jobs.append((row, fn, args))
  compiled = programs.compile([(row["impl"], fn, args) for row, fn, args in jobs])
  for (row, _, args), result in zip(jobs, compiled):
    _time_row(programs, row, result, args)
  for row in rows:
    finish(row)
    show(row)
  return rows


def _time_row(programs, row, result, args):
  if isinstance(result, Exception):
    row["error"] = one_line(result)
    return
  program, same_as, seconds = result
  row["compile_s"] = round(seconds, 3)
  if same_as:
    row["same_program_as"] = same_as
  if program.error:
    row["error"] = program.error
    return
  try:
    row.update(programs.time(program, args))
  except Exception as e:  # a kernel failing at run time
    row["error"] = one_line(e)
