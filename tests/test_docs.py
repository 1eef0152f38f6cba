"""Every ```python block in the README and docs/ runs as written."""

import importlib.util
import os
import pathlib
import re
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page, i, code) for page in PAGES
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))]


@pytest.mark.parametrize("page,index,code", BLOCKS,
                         ids=[f"{p.name}-{i}" for p, i, _ in BLOCKS])
def test_documented_example_runs(page, index, code, monkeypatch, tmp_path):
  # As a user runs them on a CPU: without interpret mode (an example may set it), in a
  # folder of their own, with a temporary folder that must be left empty (an example
  # that makes temporary files removes them).
  monkeypatch.delenv("JATTN_INTERPRET", raising=False)
  monkeypatch.chdir(tmp_path)
  temporary = tmp_path / "tmp"
  temporary.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(temporary))
  try:
    exec(compile(code, f"{page.name}[{index}]", "exec"), {})
  except ModuleNotFoundError as e:
    # An example of the torch side on an install without it (the light install).
    if e.name in OPTIONAL and importlib.util.find_spec(e.name) is None:
      pytest.skip(f"needs {e.name}, not installed")
    raise
  # torch's own cache folder (torchinductor_<user>, made when transformers loads it) is
  # not the example's.
  left = [n for n in os.listdir(temporary) if not n.startswith("torchinductor_")]
  assert left == [], "the example leaves temporary files behind"


OPTIONAL = ("torch", "safetensors", "PIL", "matplotlib")


def test_examples_were_found():
  assert len(BLOCKS) >= 5
