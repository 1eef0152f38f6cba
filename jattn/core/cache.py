"""Tuned configs on disk: the user's cache and the table shipped with jattn.

An entry is stored under a key of the GPU's name, the op and backend, and the fields
an implementation says its config depends on (``Impl.cache_key``), e.g.
``"NVIDIA H100 80GB HBM3|flash_attention/pallas_triton|float16|d128|causal|s4096"``.
``lookup`` answers from the user cache, then from the shipped table
(``shipped.json``), else None.

Under the backend name ``"auto"`` an entry holds measured times of every backend
that ran a problem (``{"backend_ms": {backend: ms}, "mode": ...}``): what ``"auto"``
ranks backends by (``backend_times``, ``save_backend_times``).

User cache file: ``$JATTN_CACHE_DIR/autotune.json`` (an empty value is an error,
not the default), else ``$XDG_CACHE_HOME/jattn/autotune.json``, else
``~/.cache/jattn/autotune.json``:
``{"version": 1, "entries": {key: {"config": {...}, "ms": ..., "mode": ...,
"jax": ..., "tuned_at": ...}}}``. Writes are atomic; a corrupt file warns once and
counts as empty.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib.resources
import json
import os
import tempfile
import warnings

import jax

from jattn.kernels.common.config import next_power_of_two

CACHE_VERSION = 1
CACHE_DIR_ENV = "JATTN_CACHE_DIR"
MIN_BUCKET, MAX_BUCKET = 128, 65536


def bucket(length: int) -> int:
  """Next power of two of ``length``, clamped to [128, 65536]: lengths in one bucket
  share a tuned config."""
  return min(MAX_BUCKET, max(MIN_BUCKET, next_power_of_two(length)))


@dataclasses.dataclass(frozen=True)
class TuningKey:
  """Where a tuned config applies; ``str(key)`` is its name in the cache file."""

  gpu: str
  op: str
  backend: str
  fields: tuple[str, ...]  # the implementation's (``Impl.cache_key``)

  def __str__(self) -> str:
    return "|".join((self.gpu, f"{self.op}/{self.backend}", *self.fields))


def cache_path() -> str:
  """The user cache file (see the module docstring for the environment variables); a
  ``ValueError`` if ``JATTN_CACHE_DIR`` is set but empty (a script's unset variable:
  not a request for the home folder's cache)."""
  folder = os.environ.get(CACHE_DIR_ENV)
  if folder is not None:
    if not folder:
      raise ValueError(f"{CACHE_DIR_ENV} is set but empty: name a folder, or unset it for "
                       "the default cache")
    return os.path.join(folder, "autotune.json")
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jattn", "autotune.json")


def writable_cache_path(path: str | None = None) -> str:
  """The user cache file (or ``path``) once its folder exists (made if missing) and a
  file and its lock can be made there; a one-line ``ValueError`` otherwise. A tuning
  run calls it before it starts, so that its result is not lost at the end."""
  path = cache_path() if path is None else path
  directory = os.path.dirname(path) or "."
  try:
    if os.path.isdir(path):
      raise IsADirectoryError(f"{path} is a folder")
    os.makedirs(directory, exist_ok=True)
    with open(path + ".lock", "a"):
      pass
    fd, probe = tempfile.mkstemp(dir=directory, prefix=".autotune.", suffix=".probe")
    os.close(fd)
    os.unlink(probe)
  except OSError as e:  # a file in the way, a read-only or special file system
    raise ValueError(f"cannot write the autotune cache {path!r}: {e.strerror or e} (set "
                     f"{CACHE_DIR_ENV} to a folder you can write)") from None
  return path


_LOADED: dict[str, tuple[tuple[int, int], dict]] = {}  # path -> ((mtime_ns, size), entries)


def _parse_entries(text: str) -> dict:
  data = json.loads(text)
  if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
    raise ValueError(f"expected an object with version {CACHE_VERSION}")
  entries = data.get("entries")
  if not isinstance(entries, dict):
    raise ValueError("expected an 'entries' object")
  return entries


def load_cache(path: str | None = None) -> dict:
  """Entries of the user cache, read once per change of the file (``{}`` if absent).

  An unreadable or corrupt file, or an empty ``JATTN_CACHE_DIR``, warns once and
  counts as empty.
  """
  if path is None:
    try:
      path = cache_path()
    except ValueError as e:  # told once per place it is read from (warnings' default)
      warnings.warn(f"no autotune cache: {e}", RuntimeWarning, stacklevel=2)
      return {}
  try:
    st = os.stat(path)
  except OSError:
    return {}
  stamp = (st.st_mtime_ns, st.st_size)
  cached = _LOADED.get(path)
  if cached is not None and cached[0] == stamp:
    return cached[1]
  try:
    with open(path, encoding="utf-8") as f:
      entries = _parse_entries(f.read())
  # JSONDecodeError is a ValueError; RecursionError: a file of deeply nested brackets.
  except (OSError, ValueError, RecursionError) as e:
    # Remembered below as empty: the warning comes once per version of the file.
    warnings.warn(f"ignoring the autotune cache {path}: {e}", RuntimeWarning, stacklevel=2)
    entries = {}
  _LOADED[path] = (stamp, entries)
  return entries


@functools.lru_cache(maxsize=None)
def shipped_entries() -> dict:
  """Entries of the table shipped with jattn (measured on the GPUs it names)."""
  text = importlib.resources.files("jattn.core").joinpath("shipped.json").read_text("utf-8")
  return _parse_entries(text)


RANKING = "auto"  # the backend name of the entries that hold every backend's times


def save_config(key: TuningKey, config, *, ms: float | None, mode: str,
                path: str | None = None) -> str:
  """Adds or replaces one entry of the user cache (atomically); returns the file's path."""
  return _save_entry(key, {"config": dataclasses.asdict(config), "ms": ms, "mode": mode}, path)


def save_backend_times(key: TuningKey, times: dict[str, float], *, mode: str,
                       path: str | None = None) -> str:
  """Stores measured milliseconds per backend for ``key`` (whose backend is
  ``RANKING``) in the user cache; returns the file's path."""
  if key.backend != RANKING:
    raise ValueError(f"backend times go under backend {RANKING!r}, got {key.backend!r}")
  return _save_entry(key, {"backend_ms": {name: float(ms) for name, ms in times.items()},
                           "mode": mode}, path)


@contextlib.contextmanager
def _locked(path: str):
  """Holds an exclusive lock on ``path + ".lock"``: writers of the cache (tuning runs
  in several processes) read, change and replace the file one at a time, so none loses
  another's entries."""
  import fcntl

  with open(path + ".lock", "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    yield


def _save_entry(key: TuningKey, entry: dict, path: str | None) -> str:
  path = cache_path() if path is None else path
  directory = os.path.dirname(path) or "."
  os.makedirs(directory, exist_ok=True)
  with _locked(path):
    _LOADED.pop(path, None)  # read afresh: another process may have written a moment ago
    entries = dict(load_cache(path))
    entries[str(key)] = {
        **entry, "jax": jax.__version__,
        "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    # A reader (another process) sees either the old file or the new one, never half.
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".autotune.", suffix=".json")
    try:
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
      os.replace(tmp, path)
    except BaseException:
      os.unlink(tmp)
      raise
    st = os.stat(path)
    _LOADED[path] = ((st.st_mtime_ns, st.st_size), entries)
  return path


def _same_kind(value, default) -> bool:
  """A stored field's value is of its default's type (bool, int, float, str; None where
  the default is None): a hand-edited or stale entry never reaches a kernel launch."""
  if default is None or value is None:
    return value is None or isinstance(value, (bool, int, float, str))
  if isinstance(default, bool) or isinstance(value, bool):
    return type(value) is type(default)
  return type(value) is type(default) or (type(default) is float and type(value) is int)


def config_from_entry(config_cls: type, entry):
  """The entry's config, or None if it does not match ``config_cls`` exactly (its
  fields, each of its default's type, and the class's own checks)."""
  fields = {f.name: f.default for f in dataclasses.fields(config_cls)}
  config = entry.get("config") if isinstance(entry, dict) else None
  if not isinstance(config, dict) or set(config) != set(fields):
    return None
  if not all(_same_kind(value, fields[name]) and not (type(value) is int and value < 1)
             for name, value in config.items()):  # sizes, warps and stages are >= 1
    return None
  try:
    return config_cls(**config)
  except (TypeError, ValueError):
    return None


def lookup(key: TuningKey, config_cls: type):
  """The tuned config under ``key``: the user cache's, then the shipped table's, else None."""
  name = str(key)
  for entries in (load_cache(), shipped_entries()):
    if name in entries:
      config = config_from_entry(config_cls, entries[name])
      if config is not None:
        return config
  return None


def backend_times(key: TuningKey) -> tuple[dict[str, float], str, str] | None:
  """``(ms per backend, mode, "user cache" or "shipped table")`` stored under ``key``
  (backend ``RANKING``), the user cache first; None if neither has a valid entry."""
  name = str(key)
  for source, entries in (("user cache", load_cache()), ("shipped table", shipped_entries())):
    entry = entries.get(name)
    times = entry.get("backend_ms") if isinstance(entry, dict) else None
    if isinstance(times, dict) and times and all(
        isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0
        for ms in times.values()):
      return {str(b): float(ms) for b, ms in times.items()}, str(entry.get("mode")), source
  return None
