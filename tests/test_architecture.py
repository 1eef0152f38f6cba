"""The shape of the code: which modules may import which, no import cycles, no long
functions. Read from the source with ``ast`` (nothing is imported), so it is fast.

Modules are found by walking the three source folders that pyproject.toml's
``package-dir`` installs as ``jattn`` (``jattn/``, ``pallas_kernels/`` ->
``jattn.kernels``, ``interop/`` -> ``jattn.interop``), so moved and new files are
checked without editing this test.

Imports: ``import jattn.x``, ``from jattn.x import y`` (to ``jattn.x.y`` where that is a
module, else to ``jattn.x``) and relative imports, wherever they stand (an import inside
a function is a dependency all the same). An import of a module's own parent package is
no edge: Python runs that ``__init__`` before the module anyway. Imports by name in a
string (``importlib.import_module``, the lazy exports' tables) are not seen.

Checks:
- layers (``LAYERS``): no module imports a module of a higher layer;
- no import cycle among modules, nor among units (``UNIT_PACKAGES``: each of those
  packages, with everything under it, is one unit; every other module is its own);
- no function longer than ``MAX_FUNCTION_LINES`` (from its ``def`` to its last line,
  decorators not counted). A top-level function or a method of a class is checked;
  a function nested in another counts in its parent's length. Kernel bodies may take
  ``MAX_KERNEL_LINES``: a kernel body is a function whose name ends in ``_kernel``
  (``_fwd_kernel``, ``_dkv_kernel``, ``_kernel``) or is ``kernel_body``.
"""

import ast
import functools
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The layers, lowest first: a module may import its own layer and those below it, never
# one above. A module is in the layer of the longest listed prefix of its name (by whole
# dotted parts: "jattn.flash" is no prefix of "jattn.flashy"), except "jattn", which is
# the package's __init__ alone: a new top-level module needs a line here.
LAYERS = {
    0: ("jattn.kernels",),
    1: ("jattn.core", "jattn.lazy_exports"),
    2: ("jattn.tuning", "jattn.reference", "jattn.flash", "jattn.window", "jattn.dilated",
        "jattn.retention", "jattn.paged", "jattn.varlen", "jattn.gpu", "jattn.fp8",
        "jattn.fp8_training"),
    3: ("jattn.nn", "jattn.parallel", "jattn.flex", "jattn.dot_product"),
    4: ("jattn.autotune", "jattn.command_line", "jattn.upscale", "jattn"),
    5: ("jattn.interop",),
}
EXACT_ONLY = {"jattn"}  # listed names that are no prefix of others

# Packages that are one unit each for the unit-level cycle check.
UNIT_PACKAGES = ("jattn.kernels", "jattn.core", "jattn.tuning", "jattn.nn",
                 "jattn.parallel", "jattn.flex", "jattn.interop")

MAX_FUNCTION_LINES = 120
MAX_KERNEL_LINES = 150

ROOT_PACKAGE = "jattn"


# --- finding the modules and their imports ---------------------------------------------

def package_dirs(root: Path = ROOT) -> dict[str, Path]:
  """pyproject.toml's ``[tool.setuptools] package-dir``: package -> its folder."""
  with open(root / "pyproject.toml", "rb") as f:
    mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
  return {package: root / folder for package, folder in mapping.items()}


def source_files(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
  """Every installed module: name -> (its file, whether it is a package's __init__).
  A file under two mapped folders takes the name from the deeper mapping."""
  found: dict[str, tuple[Path, bool]] = {}
  owner: dict[Path, str] = {}
  for package, folder in sorted(package_dirs(root).items(), key=lambda kv: len(kv[0])):
    for path in sorted(folder.rglob("*.py")):
      parts = path.relative_to(folder).with_suffix("").parts
      if any(part == "__pycache__" or part.startswith(".") for part in parts):
        continue
      is_package = parts[-1] == "__init__"
      name = ".".join((package,) + (parts[:-1] if is_package else parts))
      if path in owner:  # a deeper package-dir entry names it
        del found[owner[path]]
      owner[path] = name
      found[name] = (path, is_package)
  return found


def _known_prefix(name: str, modules) -> str | None:
  """The longest prefix of dotted ``name`` that is a module."""
  parts = name.split(".")
  for end in range(len(parts), 0, -1):
    candidate = ".".join(parts[:end])
    if candidate in modules:
      return candidate
  return None


def _is_ours(name: str) -> bool:
  return name == ROOT_PACKAGE or name.startswith(ROOT_PACKAGE + ".")


def imports_of(name: str, is_package: bool, tree: ast.AST, modules) -> set[str]:
  """The modules among ``modules`` that module ``name`` imports, anywhere in ``tree``,
  less its own parent package."""
  targets: set[str] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if _is_ours(alias.name):
          targets.add(_known_prefix(alias.name, modules) or alias.name)
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # relative: from the module's package, up level - 1 more
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module or ""
      if not _is_ours(source):
        continue
      for alias in node.names:
        submodule = f"{source}.{alias.name}"
        if alias.name != "*" and submodule in modules:
          targets.add(submodule)
        else:
          targets.add(_known_prefix(source, modules) or source)
  parent = name.rpartition(".")[0]
  return targets - {name, parent}


def import_graph(sources: dict[str, tuple[bool, ast.AST]]) -> dict[str, set[str]]:
  """module -> the modules it imports; ``sources``: module -> (is package, its tree)."""
  return {name: imports_of(name, is_package, tree, sources)
          for name, (is_package, tree) in sources.items()}


@functools.cache
def parsed() -> dict[str, tuple[Path, bool, ast.AST]]:
  """Every module of the checkout: name -> (file, is package, syntax tree)."""
  return {name: (path, is_package, ast.parse(path.read_text(), filename=str(path)))
          for name, (path, is_package) in source_files().items()}


@functools.cache
def graph() -> dict[str, set[str]]:
  return import_graph({name: (is_package, tree)
                       for name, (_, is_package, tree) in parsed().items()})


# --- layers --------------------------------------------------------------------------

def layer_of(name: str) -> int | None:
  best, best_length = None, -1
  for layer, prefixes in LAYERS.items():
    for prefix in prefixes:
      matches = name == prefix or (prefix not in EXACT_ONLY and name.startswith(prefix + "."))
      if matches and len(prefix) > best_length:
        best, best_length = layer, len(prefix)
  return best


def unlayered(modules) -> list[str]:
  return [f"{name} is in no layer (add it to LAYERS)"
          for name in sorted(modules) if layer_of(name) is None]


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
  problems = []
  for importer in sorted(edges):
    for imported in sorted(edges[importer]):
      a, b = layer_of(importer), layer_of(imported)
      if a is not None and b is not None and a < b:
        problems.append(f"{importer} -> {imported} (layer {a} < {b})")
  return problems


# --- cycles --------------------------------------------------------------------------

def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
  """Tarjan's strongly connected components of more than one node, each sorted
  (iterative, so that no depth of import chain reaches Python's recursion limit)."""
  nodes = sorted(set(edges) | {b for targets in edges.values() for b in targets})
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  components = []
  for start in nodes:
    if start in index:
      continue
    work = [(start, iter(sorted(edges.get(start, ()))))]
    index[start] = low[start] = len(index)
    stack.append(start)
    on_stack.add(start)
    while work:
      node, successors = work[-1]
      for successor in successors:
        if successor not in index:
          index[successor] = low[successor] = len(index)
          stack.append(successor)
          on_stack.add(successor)
          work.append((successor, iter(sorted(edges.get(successor, ())))))
          break
        if successor in on_stack:
          low[node] = min(low[node], index[successor])
      else:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
          component = []
          while True:
            member = stack.pop()
            on_stack.discard(member)
            component.append(member)
            if member == node:
              break
          if len(component) > 1:
            components.append(sorted(component))
  return sorted(components)


def _path(edges: dict[str, set[str]], start: str, goal: str, members: set[str]) -> list[str]:
  """A shortest path of at least one edge from ``start`` to ``goal`` through
  ``members`` (``start`` = ``goal``: a shortest cycle through it)."""
  came_from = {start: None}
  frontier = [start]
  while frontier:
    following = []
    for node in frontier:
      for successor in sorted(edges.get(node, ())):
        if successor == goal:
          path = [node]
          while came_from[path[-1]] is not None:
            path.append(came_from[path[-1]])
          return path[::-1] + [goal]
        if successor in members and successor not in came_from:
          came_from[successor] = node
          following.append(successor)
    frontier = following
  raise AssertionError(f"no path from {start} to {goal}")


def cycles(edges: dict[str, set[str]]) -> list[str]:
  return [f"cycle among {', '.join(component)}: "
          f"{' -> '.join(_path(edges, component[0], component[0], set(component)))}"
          for component in strongly_connected(edges)]


def unit_of(name: str) -> str:
  for package in UNIT_PACKAGES:
    if name == package or name.startswith(package + "."):
      return package
  return name


def unit_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
  units: dict[str, set[str]] = {}
  for importer, targets in edges.items():
    units.setdefault(unit_of(importer), set())
    for imported in targets:
      if unit_of(imported) != unit_of(importer):
        units[unit_of(importer)].add(unit_of(imported))
  return units


def unit_cycles(edges: dict[str, set[str]], shown: int = 3) -> list[str]:
  """Each cycle among units: for every unit import inside a strongly connected set of
  units, a shortest cycle through it (once each), with the module imports of each step
  (``shown`` of them at most)."""
  units = unit_graph(edges)
  problems = []
  for component in strongly_connected(units):
    inside, seen = set(component), set()
    for a in component:
      for b in sorted(units[a] & inside):
        path = [a] + _path(units, b, a, inside)
        steps = list(zip(path, path[1:]))
        if frozenset(steps) in seen:
          continue
        seen.add(frozenset(steps))
        described = []
        for x, y in steps:
          by = [f"{i} -> {j}" for i in sorted(edges) for j in sorted(edges[i])
                if unit_of(i) == x and unit_of(j) == y]
          more = f" and {len(by) - shown} more" if len(by) > shown else ""
          described.append(f"{x} -> {y} by {', '.join(by[:shown])}{more}")
        problems.append(f"unit cycle {' -> '.join(path)}: {'; '.join(described)}")
  return problems


# --- function length -----------------------------------------------------------------

def is_kernel_body(name: str) -> bool:
  return name.endswith("_kernel") or name == "kernel_body"


def checked_functions(tree: ast.AST):
  """The top-level functions and methods (of classes at any depth outside functions)."""
  for node in ast.iter_child_nodes(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      yield node
    else:
      yield from checked_functions(node)


def long_functions(tree: ast.AST, where: str) -> list[str]:
  problems = []
  for function in checked_functions(tree):
    lines = function.end_lineno - function.lineno + 1  # lineno: the def, not decorators
    limit = MAX_KERNEL_LINES if is_kernel_body(function.name) else MAX_FUNCTION_LINES
    if lines > limit:
      problems.append(f"{where}:{function.lineno} {function.name} is {lines} lines "
                      f"(at most {limit})")
  return problems


# --- the checks ----------------------------------------------------------------------

def _report(problems: list[str]) -> str:
  return f"{len(problems)} problem(s):\n  " + "\n  ".join(problems)


def test_walker_finds_the_package():
  modules = parsed()
  edges = graph()
  assert len(modules) > 50, sorted(modules)
  assert sum(map(len, edges.values())) > 100
  for package in package_dirs():
    assert package in modules, f"{package}'s __init__ not found"
  assert all(_is_ours(b) for targets in edges.values() for b in targets)


def test_every_module_has_a_layer():
  problems = unlayered(parsed())
  assert not problems, _report(problems)


def test_no_module_imports_a_higher_layer():
  problems = upward_imports(graph())
  assert not problems, _report(problems)


def test_no_import_cycle_among_modules():
  problems = cycles(graph())
  assert not problems, _report(problems)


def test_no_import_cycle_among_units():
  problems = unit_cycles(graph())
  assert not problems, _report(problems)


def test_no_long_functions():
  problems = []
  for path, _, tree in parsed().values():
    problems += long_functions(tree, str(path.relative_to(ROOT)))
  assert not problems, _report(problems)


# --- the checks fail where they should -------------------------------------------------

def _fake(sources: dict[str, str]) -> dict[str, set[str]]:
  """The import graph of modules given as source text (a name ending in ``.__init__``
  is that package)."""
  trees = {}
  for name, text in sources.items():
    is_package = name.endswith(".__init__")
    trees[name.removesuffix(".__init__")] = (is_package, ast.parse(text))
  return import_graph(trees)


def test_the_checks_catch_bad_code():
  edges = _fake({
      "jattn.__init__": "",
      "jattn.core.__init__": "from . import op\n",
      "jattn.core.op": "import numpy\nfrom jattn.core import validation\n"
                       "def run():\n  from jattn.tuning.cache import lookup\n",
      "jattn.core.validation": "from jattn.core import op  # cycle in a unit\n",
      "jattn.tuning.__init__": "",
      "jattn.tuning.cache": "from ..core.op import run\nfrom jattn.tuning import x\n",
      "jattn.kernels.__init__": "",
      "jattn.kernels.flash.__init__": "",
      "jattn.kernels.flash.mosaic": "from jattn.kernels.flash import mosaic_pipeline\n"
                                    "import jattn.nn.dat as dat\n",
      "jattn.kernels.flash.mosaic_pipeline": "from . import *\n",
      "jattn.nn.__init__": "",
      "jattn.nn.dat": "",
  })
  assert edges == {
      "jattn": set(),
      "jattn.core": {"jattn.core.op"},
      "jattn.core.op": {"jattn.core.validation", "jattn.tuning.cache"},  # the lazy one too
      "jattn.core.validation": {"jattn.core.op"},
      "jattn.tuning": set(),
      "jattn.tuning.cache": {"jattn.core.op"},  # its own package is no edge
      "jattn.kernels": set(),
      "jattn.kernels.flash": set(),
      "jattn.kernels.flash.mosaic": {"jattn.kernels.flash.mosaic_pipeline", "jattn.nn.dat"},
      "jattn.kernels.flash.mosaic_pipeline": set(),
      "jattn.nn": set(),
      "jattn.nn.dat": set(),
  }
  assert upward_imports(edges) == [
      "jattn.core.op -> jattn.tuning.cache (layer 1 < 2)",
      "jattn.kernels.flash.mosaic -> jattn.nn.dat (layer 0 < 3)",
  ]
  assert cycles(edges) == [
      "cycle among jattn.core.op, jattn.core.validation, jattn.tuning.cache: "
      "jattn.core.op -> jattn.core.validation -> jattn.core.op"]
  assert unit_cycles(edges) == [
      "unit cycle jattn.core -> jattn.tuning -> jattn.core: "
      "jattn.core -> jattn.tuning by jattn.core.op -> jattn.tuning.cache; "
      "jattn.tuning -> jattn.core by jattn.tuning.cache -> jattn.core.op"]
  acyclic = {"a": {"b", "c"}, "b": {"c"}, "c": set()}
  assert strongly_connected(acyclic) == [] and cycles(acyclic) == []
  assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
      ["a", "b", "c"]]
  assert layer_of("jattn") == 4 and layer_of("jattn.flashy") is None
  assert layer_of("jattn.kernels.hopper.fwd") == 0 and layer_of("jattn.interop.cli") == 5
  assert unlayered(["jattn.new_module", "jattn.core.x"]) == [
      "jattn.new_module is in no layer (add it to LAYERS)"]

  def body(lines: int, indent: int = 2) -> str:
    return f"{' ' * indent}x = 1\n" * lines

  tree = ast.parse(
      f"@decorated\ndef long():\n{body(130)}"  # 131 lines from its def
      f"def _dkv_kernel():\n{body(140)}"
      f"def kernel_body():\n{body(160)}"
      f"class A:\n  class B:\n    def method(self):\n{body(130, 6)}"
      f"def outer():\n  def nested():\n{body(130, 4)}  return nested\n")
  assert long_functions(tree, "f.py") == [
      "f.py:2 long is 131 lines (at most 120)",
      "f.py:274 kernel_body is 161 lines (at most 150)",
      "f.py:437 method is 131 lines (at most 120)",
      "f.py:568 outer is 133 lines (at most 120)",  # its nested function counts in it
  ]
