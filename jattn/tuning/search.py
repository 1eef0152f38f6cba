"""Block-size search for any op's implementation, with the winner saved to the cache.

An implementation lists its config family's ``SearchGrid``s (``Impl.tuning_stages``):
a stage varies some config fields over a small grid, keeps the others at the previous
stage's winner, and is timed in its mode (``"fwd"`` or ``"fwd+bwd"``). Before anything
is compiled, the part of the implementation's cost model that the stage's fields
change (``impl.fits(..., stage.kernels)``) prunes candidates that cannot fit the device,
as does any limit the compiler enforces on the kernels a candidate runs
(``impl.compile_misfit``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
from typing import Any

from jattn.core.cache import TuningKey, save_config, writable_cache_path
from jattn.core.device import GPUInfo, gpu_info
from jattn.core.op import OPS, Impl, Op
from jattn.core.timing import time_op
from jattn.kernels.common.config import SearchGrid


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One config of one stage; ``reason`` says why the cost model pruned it (None: kept)."""

  stage: SearchGrid
  config: Any
  reason: str | None


def tunable(op_name: str, backend: str) -> tuple[Op, Impl]:
  """The op and implementation named, if the implementation has a search space."""
  choices = sorted(f"{o.name}/{i.backend.name}" for o in OPS.values() for i in o.impls
                   if i.tuning_stages())
  op = OPS.get(op_name)
  impl = next((i for i in op.impls if i.backend.name == backend), None) if op else None
  if impl is None or not impl.tuning_stages():
    raise ValueError(f"nothing to tune for op {op_name!r} on backend {backend!r}; "
                     f"tunable: {', '.join(choices)}")
  return op, impl


def _candidates(impl: Impl, problem, stage: SearchGrid, base) -> list:
  """``base`` first, then the stage's grid around it, normalised, without duplicates."""
  names = list(stage.space)
  grid = (dataclasses.replace(base, **dict(zip(names, values)))
          for values in itertools.product(*stage.space.values()))
  return list(dict.fromkeys(impl.normalize_config(c, problem)
                            for c in itertools.chain([base], grid)))


def _misfit(impl: Impl, config, problem, info: GPUInfo, stage: SearchGrid) -> str | None:
  """Why ``config`` is pruned: the stage's part of the cost model, or a limit the
  compiler enforces on any kernel the config runs (``Impl.compile_misfit``)."""
  return (impl.fits(config, problem, info, stage.kernels)
          or impl.compile_misfit(config, problem, info))


def _start(impl: Impl, problem, info: GPUInfo):
  """The heuristic config, with any stage that does not fit ``info`` moved to its first
  candidate that does (e.g. the d128 tiles on a 99 KiB GPU)."""
  base = impl.normalize_config(impl.heuristic_config(problem, info), problem)
  for stage in impl.tuning_stages():
    if _misfit(impl, base, problem, info, stage) is not None:
      base = next((c for c in _candidates(impl, problem, stage, base)
                   if _misfit(impl, c, problem, info, stage) is None), base)
  return base


def _split(impl: Impl, problem, stage: SearchGrid, base, info) -> list[Candidate]:
  return [Candidate(stage, c, _misfit(impl, c, problem, info, stage))
          for c in _candidates(impl, problem, stage, base)]


def plan(op_name: str, backend: str, problem, *, info: GPUInfo | None = None) -> list[Candidate]:
  """Every stage's candidates, pruned or kept, without timing anything (every stage
  is shown around the start config; ``tune`` centres later stages on the previous
  stage's winner)."""
  _, impl = tunable(op_name, backend)
  info = gpu_info() if info is None else info
  base = _start(impl, problem, info)
  return [c for stage in impl.tuning_stages()
          for c in _split(impl, problem, stage, base, info)]


def tuning_key(op_name: str, backend: str, problem, info: GPUInfo) -> TuningKey:
  """Where the winner for ``problem`` is stored."""
  _, impl = tunable(op_name, backend)
  return TuningKey(info.name, op_name, backend, impl.cache_key(problem))


class _Progress:
  """``[#####.....] 12/40 best 1.234 ms``, redrawn in place on ``stream``."""

  def __init__(self, total: int, stream, width: int = 20):
    self.total, self.stream, self.width = total, stream, width

  def update(self, done: int, best_ms: float | None):
    filled = round(self.width * done / max(self.total, 1))
    best = "-" if best_ms is None else f"{best_ms:.3f} ms"
    self.stream.write(f"\r  [{'#' * filled}{'.' * (self.width - filled)}] "
                      f"{done}/{self.total} best {best}")
    self.stream.flush()

  def close(self):
    self.stream.write("\n")


def fields_text(config, names) -> str:
  return " ".join(f"{n}={getattr(config, n)}" for n in names)


def _reason_counts(pruned: list[Candidate]) -> str:
  counts = collections.Counter(c.reason.split(":")[0] for c in pruned)
  return ", ".join(f"{reason}: {n}" for reason, n in counts.most_common())


def tune(op_name: str, backend: str, problem, *, reps: int = 10, info: GPUInfo | None = None,
         progress: bool = True, save: bool = True, max_candidates: int | None = None,
         timings: list | None = None):
  """Times the candidates stage by stage on this device and returns the fastest config.

  Each timing is ``median_ms``'s over ``reps`` samples. Candidates that fail to
  compile or run are skipped. ``max_candidates`` caps how many are timed per stage (the
  current best comes first: the first stage's first is the heuristic config). With
  ``save``, the winner goes to the user cache (a ``ValueError`` before any timing if
  it cannot be written). ``timings``: a list that gets one ``{"stage", "mode",
  "config", "ms"}`` per candidate timed, in order (``ms`` None where it failed).
  """
  op, impl = tunable(op_name, backend)
  if not (isinstance(reps, int) and reps >= 1):
    raise ValueError(f"reps must be a positive int, got {reps!r}")
  if max_candidates is not None and not (isinstance(max_candidates, int) and max_candidates >= 1):
    raise ValueError(f"max_candidates must be a positive int or None, got {max_candidates!r}")
  info = gpu_info() if info is None else info
  unusable = impl.supported_on(info)
  if unusable is not None:
    raise ValueError(f"backend {backend!r} is not usable on {info.name}: it {unusable}")
  if save:
    writable_cache_path()  # now, not after the search: its result would be lost
  out = sys.stderr if progress else None
  stages = impl.tuning_stages()
  best = _start(impl, problem, info)
  best_ms, best_mode = None, None
  timed: dict[tuple[Any, str], float | None] = {}  # (config, mode) -> ms, None if it failed
  errors = []
  for n, stage in enumerate(stages, 1):
    cands = _split(impl, problem, stage, best, info)
    kept = [c.config for c in cands if c.reason is None][:max_candidates]
    pruned = [c for c in cands if c.reason is not None]
    if out:
      out.write(f"stage {n}/{len(stages)} {stage.name} ({stage.mode}; "
                f"{', '.join(stage.space)}): {len(cands)} candidates, timing {len(kept)}, "
                f"pruned {len(pruned)}" + (f" ({_reason_counts(pruned)})" if pruned else "") + "\n")
    bar = _Progress(len(kept), out) if out else None
    stage_best, stage_errors = None, []
    for i, config in enumerate(kept, 1):
      if (config, stage.mode) not in timed:
        try:
          timed[(config, stage.mode)] = time_op(op, problem, backend, config=config,
                                                mode=stage.mode, reps=reps)
        except Exception as e:  # tiles the compiler rejects, out of resources, ...
          timed[(config, stage.mode)] = None
          first_line = str(e).splitlines()[0][:200] if str(e) else ""
          stage_errors.append(f"{fields_text(config, stage.space)}: {type(e).__name__}: "
                              f"{first_line}")
      ms = timed[(config, stage.mode)]
      if timings is not None:
        timings.append({"stage": stage.name, "mode": stage.mode,
                        "config": dataclasses.asdict(config), "ms": ms})
      if ms is not None and (stage_best is None or ms < stage_best[1]):
        stage_best = (config, ms)
      if bar:
        bar.update(i, stage_best and stage_best[1])
    if bar:
      bar.close()
    errors += stage_errors
    failed = sum(timed[(c, stage.mode)] is None for c in kept)
    if stage_best is not None:
      best, best_ms, best_mode = stage_best[0], stage_best[1], stage.mode
    if out:
      winner = "none timed; keeping the previous" if stage_best is None else (
          f"best {stage_best[1]:.3f} ms: {fields_text(best, stage.space)}")
      first = f" (first: {stage_errors[0]})" if stage_errors else ""
      out.write(f"  failed {failed}{first}; {winner}\n")
  if best_ms is None:
    raise RuntimeError(f"no candidate ran for {op_name}/{backend} on {problem}; errors: "
                       + "; ".join(errors[:3]))
  if save:
    key = tuning_key(op_name, backend, problem, info)
    path = save_config(key, best, ms=best_ms, mode=best_mode)
    if out:
      out.write(f"saved {key} -> {path}\n")
  return best
