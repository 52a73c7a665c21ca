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


@pytest.fixture(autouse=True)
def _signal_handlers_kept():
    """A test leaves the process's Ctrl-C and SIGTERM handlers as it found them: one left ignoring
    SIGINT made a later test's Ctrl-C stop nothing."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    after = {sig: signal.getsignal(sig) for sig in before}
    changed = {signal.Signals(sig).name: (before[sig], after[sig]) for sig in before if after[sig] != before[sig]}
    for sig, handler in before.items():
        signal.signal(sig, handler)
    assert not changed, f"the test changed the process's signal handlers (before, after): {changed}"


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


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for the whole session, bound to 127.0.0.1, no dashboard, no usage stats;
    the tests of the Ray backend use it (the backend joins an instance already started)."""
    import os

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (make setup installs it)")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                 configure_logging=False)
    yield ray
    ray.shutdown()
