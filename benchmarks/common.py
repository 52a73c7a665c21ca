"""Shared helpers for the benchmarks: repetition statistics, the machine, results files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def run_json(code: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; its last line of output is a JSON object. Its temporary
    files go to a directory removed after it (SB3's logger makes a directory of its own in the
    system's temporary directory at every ``learn``, even when it writes nothing)."""
    with tempfile.TemporaryDirectory(prefix="fragflow-bench-") as tmp:
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                             env=dict(os.environ, **(env or {}), TMPDIR=tmp)).stdout
    return json.loads(out.strip().splitlines()[-1])


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    found = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(terse=True),
             "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def row(figure: str, value: dict[str, float], baseline_name: str, baseline: dict[str, float], unit: str,
        target: str) -> dict[str, Any]:
    return {"figure": figure, "unit": unit, "fragflow": value, "baseline_name": baseline_name, "baseline": baseline,
            "ratio": value["median"] / baseline["median"], "target": target}


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'figure':<48} {'fragflow (min/med/max)':<28} {'baseline (min/med/max)':<34} {'ratio':>6}  target")
    for r in rows:
        f, b = r["fragflow"], r["baseline"]
        fv = f"{f['min']:.4g}/{f['median']:.4g}/{f['max']:.4g}"
        bv = f"{r['baseline_name']} {b['min']:.4g}/{b['median']:.4g}/{b['max']:.4g}"
        print(f"{r['figure']:<48} {fv:<28} {bv:<34} {r['ratio']:>6.2f}  {r['target']}")
