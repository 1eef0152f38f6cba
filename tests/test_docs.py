"""Every ```python block in the README and docs/ runs as written."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page, i, code) for page in PAGES
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))]


@pytest.mark.parametrize("page,index,code", BLOCKS,
                         ids=[f"{p.name}-{i}" for p, i, _ in BLOCKS])
def test_documented_example_runs(page, index, code, monkeypatch):
  if "import torch" in code:
    pytest.importorskip("torch")
  # As a user runs them on a CPU: without interpret mode (an example may set it).
  monkeypatch.delenv("JATTN_INTERPRET", raising=False)
  exec(compile(code, f"{page.name}[{index}]", "exec"), {})


def test_examples_were_found():
  assert len(BLOCKS) >= 5
