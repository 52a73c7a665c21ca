"""Run every benchmark and print one table; results land in benchmarks/results/*.json.

    python benchmarks/run.py [--quick]

``--quick`` uses fewer steps and repetitions (a smoke run, not figures to report).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import ppo_returns  # noqa: E402
import throughput_sb3  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        throughput_sb3.main(["--steps", "10000", "--reps", "1"])
        ppo_returns.main(["--seeds", "2", "--steps", "20000"])
    else:
        throughput_sb3.main(["--steps", "50000", "--reps", "5"])
        ppo_returns.main(["--seeds", "5", "--steps", "500000"])


if __name__ == "__main__":
    main()
