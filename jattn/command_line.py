"""What every jattn command-line tool shares (``jattn``, ``jattn-convert``,
``jattn-upscale``, ``python -m jattn.autotune``).

A user's mistake (a bad option, a missing or unreadable file, a checkpoint of another
model) is a ``UsageError``: the tool prints it as one line, ``<prog>: error: ...``, and
exits with status 2, before any slow work where it can be known then; so is an
optional module missing from the install (the line names the extra that adds it).
Anything else is a bug: one line saying so and exit status 1; ``--verbose`` prints the
traceback of either. Outputs go to a temporary name beside the destination and are
renamed into place only once complete (``atomic_output``), so a failed run leaves no
partial file.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import shutil
import stat
import sys
import tempfile
import traceback
import warnings
from typing import Callable, Iterator


# The optional modules a tool may need (pillow for images; torch for the torch side),
# and the extra of pyproject.toml that installs each.
EXTRAS = {"PIL": "image", "torch": "torch"}


class UsageError(Exception):
  """A user's mistake, said in one line that names the option or file and what to do."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """``--help`` with every option's default (where it has one: not for flags and
  required options), and descriptions laid out as written."""

  def _get_help_string(self, action):
    text = action.help or ""
    if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS):
      return text
    if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
      text += " (default: %(default)s)"
    return text


class Parser(argparse.ArgumentParser):
  """An ``ArgumentParser`` whose errors are ``UsageError`` (one line, no usage dump) and
  whose ``--help`` shows every default (its subcommands' too)."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("formatter_class", HelpFormatter)
    super().__init__(*args, **kwargs)

  def error(self, message):
    raise UsageError(f"{message} (see {self.prog} --help)")


def add_verbose(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--verbose", action="store_true",
                      help="print the full traceback of an error (for bug reports)")


def run_tool(prog: str, parser: argparse.ArgumentParser, handler: Callable[[argparse.Namespace], int],
             argv=None) -> int:
  """Parses ``argv`` and runs ``handler(args)``, turning its errors into exit statuses:
  0 (or the handler's own), 2 for a ``UsageError`` or a missing optional module (the
  extra that installs it named), 1 for a bug or a closed output pipe, 130 on Ctrl-C;
  warnings print as one line each."""
  verbose = "--verbose" in (sys.argv[1:] if argv is None else argv)
  try:
    with warnings.catch_warnings():
      # A warning (a corrupt tuning cache, say) is one line too, not Python's two.
      warnings.showwarning = lambda message, *_, **__: print(
          f"{prog}: warning: {first_line(message, 300)}", file=sys.stderr)
      status = handler(parser.parse_args(argv))
      sys.stdout.flush()  # a closed pipe found here, not in the interpreter's last flush
      return status
  except BrokenPipeError:  # the reader went away (`... | head`): nothing left to say
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1
  except UsageError as e:
    if verbose:
      traceback.print_exc()
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"{prog}: interrupted", file=sys.stderr)
    return 130
  except Exception as e:  # a bug: say so in one line unless asked for the traceback
    if verbose:
      traceback.print_exc()
    extra = isinstance(e, ModuleNotFoundError) and EXTRAS.get((e.name or "").split(".")[0])
    if extra:  # an install without the extra that adds it: the user's to fix
      print(f"{prog}: error: this needs {e.name}, which jattn's {extra!r} extra installs "
            f"(pip install -e '.[{extra}]' in jattn's folder)", file=sys.stderr)
      return 2
    print(f"{prog}: internal error: {type(e).__name__}: {first_line(e)} (run again with --verbose "
          "and report the traceback)", file=sys.stderr)
    return 1


def first_line(error: BaseException, limit: int = 160) -> str:
  """An exception's first line (its type's name if it has no text), cut to ``limit``
  characters: what a one-line message quotes of a library's error."""
  return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


def about(path: str, error: BaseException) -> str:
  """``error``'s message, led by ``path`` unless it names it already."""
  text = str(error)
  return text if repr(path) in text else f"{path!r}: {text}"


def positive_int(text: str) -> int:
  """An argparse type: an int >= 1."""
  return _bounded_int(text, 1)


def non_negative_int(text: str) -> int:
  """An argparse type: an int >= 0."""
  return _bounded_int(text, 0)


def positive_float(text: str) -> float:
  """An argparse type: a finite float > 0."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
  return value


def _bounded_int(text: str, low: int) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
  if value < low:
    raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
  return value


def comma_list(text: str) -> list[str]:
  """An argparse type: ``a,b,c`` -> ``["a", "b", "c"]`` (empty items dropped; at least
  one item: an empty list is not the option's default)."""
  items = [item.strip() for item in text.split(",") if item.strip()]
  if not items:
    raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
  return items


def check_choices(option: str, given, allowed) -> None:
  """Raises a ``UsageError`` naming ``option`` if any of ``given`` is not ``allowed``."""
  unknown = [g for g in given if g not in allowed]
  if unknown:
    raise UsageError(f"{option}: {', '.join(map(repr, unknown))} "
                     f"{'is' if len(unknown) == 1 else 'are'} not one of "
                     f"{', '.join(allowed)}")


def existing_file(option: str, path: str) -> str:
  """``path`` if it is a readable regular file, else a ``UsageError`` naming ``option``
  (a pipe or a device would block or never end)."""
  if not os.path.exists(path):
    raise UsageError(f"{option} {path!r}: no such file")
  if os.path.isdir(path):
    raise UsageError(f"{option} {path!r} is a folder; expected a file")
  if not os.path.isfile(path):
    raise UsageError(f"{option} {path!r} is not a regular file")
  if not os.access(path, os.R_OK):
    raise UsageError(f"{option} {path!r}: permission denied")
  return path


def writable_destination(option: str, path: str) -> str:
  """``path`` if a file can be written there (its folder exists, or can be made, and
  ``path`` is not a folder), else a ``UsageError`` naming ``option``."""
  if not path:
    raise UsageError(f"{option} is empty; expected a file name")
  if os.path.isdir(path):
    raise UsageError(f"{option} {path!r} is a folder; expected a file name")
  _check_can_make(option, path, os.path.dirname(os.path.abspath(path)))
  return path


def writable_folder(option: str, path: str, names=()) -> str:
  """``path`` if it is a folder, or one can be made there, whose files ``names`` can be
  written (none of them a folder), else a ``UsageError`` naming ``option``."""
  if not path:
    raise UsageError(f"{option} is empty; expected a folder")
  if os.path.isdir(path):
    if not os.access(path, os.W_OK | os.X_OK):
      raise UsageError(f"{option} {path!r}: cannot write in it (permission denied)")
    taken = [n for n in names if os.path.isdir(os.path.join(path, n))]
    if taken:
      raise UsageError(f"{option} {path!r} holds a folder named {taken[0]!r} where a file "
                       "is to be written")
    return path
  if os.path.exists(path) or os.path.islink(path):
    raise UsageError(f"{option} {path!r} is not a folder")
  _check_can_make(option, path, path)
  return path


def _check_can_make(option: str, path: str, folder: str) -> None:
  """A ``UsageError`` unless ``folder`` exists, or can be made below the first of its
  parents that exists, and can be written in."""
  folder = os.path.abspath(folder)  # a relative name's parents end at the working folder
  while not os.path.exists(folder) and os.path.dirname(folder) != folder:
    if os.path.islink(folder):
      raise UsageError(f"{option} {path!r}: {folder!r} is a broken link")
    folder = os.path.dirname(folder)
  if not os.path.isdir(folder):
    raise UsageError(f"{option} {path!r}: {folder!r} is not a folder")
  if not os.access(folder, os.W_OK | os.X_OK):
    raise UsageError(f"{option} {path!r}: cannot write in {folder!r} (permission denied)")


@functools.cache
def _umask() -> int:
  """The process's umask, read once (reading it means setting it for a moment)."""
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def _finished_mode(path: str, temporary: str) -> None:
  """Gives ``temporary`` (made 0600 / 0700 by ``tempfile``) the mode it will have as
  ``path``: an existing file's own, else what the umask gives a new file or folder."""
  if os.path.exists(path) and not os.path.isdir(path):
    mode = stat.S_IMODE(os.stat(path).st_mode)
  else:
    mode = (0o777 if os.path.isdir(temporary) else 0o666) & ~_umask()
  os.chmod(temporary, mode)


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
  """Turns an ``OSError`` of making, renaming or removing files for ``path`` into a
  one-line ``UsageError`` (a full disk, a read-only or special file system)."""
  try:
    yield
  except OSError as e:
    raise UsageError(f"cannot write {path!r}: {e.strerror or first_line(e)}") from None


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
  """Yields a temporary file name beside ``path``; on success it is renamed to ``path``,
  on any error removed (as are the folders made for it)."""
  folder = os.path.dirname(os.path.abspath(path))
  with _writing(path):
    made = _make_folders(folder)
    base = os.path.basename(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{base}.", suffix=".partial")
    os.close(fd)
  try:
    with _writing(path):  # a full disk or a file-size limit while writing, too
      yield tmp
      _finished_mode(path, tmp)
      os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    _remove_empty(made)
    raise


@contextlib.contextmanager
def atomic_folder(path: str) -> Iterator[str]:
  """Yields a temporary folder beside ``path``; on success its files move into ``path``
  (made if missing, other files there kept), on any error it is removed."""
  parent = os.path.dirname(os.path.abspath(path))
  with _writing(path):
    made = _make_folders(parent)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(os.path.abspath(path))}.",
                           suffix=".partial")
  try:
    with _writing(path):  # a full disk or a file-size limit while writing, too
      yield tmp
      names = os.listdir(tmp)
      for name in names:
        _finished_mode(os.path.join(path, name), os.path.join(tmp, name))
      if not os.path.exists(path):
        _finished_mode(path, tmp)
        os.replace(tmp, path)
        return
      writable_folder("folder", path, names)  # no file moves unless every one can
      for name in names:
        os.replace(os.path.join(tmp, name), os.path.join(path, name))
      os.rmdir(tmp)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    _remove_empty(made)
    raise


def _make_folders(folder: str) -> list[str]:
  """Makes ``folder`` and its missing parents; returns those made, deepest first."""
  made = []
  while not os.path.exists(folder):
    made.append(folder)
    folder = os.path.dirname(folder)
  try:
    for f in reversed(made):
      os.mkdir(f)
  except OSError:
    _remove_empty(made)
    raise
  return made


def _remove_empty(folders: list[str]) -> None:
  for f in folders:
    with contextlib.suppress(OSError):
      os.rmdir(f)


__all__ = ["HelpFormatter", "Parser", "UsageError", "about", "add_verbose", "atomic_folder",
           "atomic_output", "check_choices", "comma_list", "existing_file", "first_line",
           "non_negative_int", "positive_float", "positive_int", "run_tool",
           "writable_destination", "writable_folder"]
