from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locations print relative to the working directory: run every test from the repository root."""
    monkeypatch.chdir(ROOT)


@pytest.fixture
def write_algo(tmp_path: Path):
    """Write an algorithm file; return (path, {marker: line}) for lines tagged ``# @name``."""

    def write(source: str, name: str = "algo.py") -> tuple[Path, dict[str, int]]:
        text = textwrap.dedent(source).lstrip("\n")
        path = tmp_path / name
        path.write_text(text)
        marks = {}
        for i, line in enumerate(text.splitlines(), 1):
            if "# @" in line:
                marks[line.split("# @", 1)[1].strip()] = i
        return path, marks

    return write


def relpath(p: Path) -> str:
    """A path as fragflow prints it, escaped for a regular expression."""
    from fragflow.source import display_path

    return re.escape(display_path(str(p)))
