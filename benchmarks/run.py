"""Run every benchmark; each prints its table and writes benchmarks/results/*.json.

    python benchmarks/run.py [--quick]

The full set takes about two hours on 2 cores (DQN's learning runs alone are an hour). ``--quick`` uses few steps and repetitions: a
smoke run that checks the scripts work, not figures to report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import async_staleness  # noqa: E402
import central_inference  # noqa: E402
import channel_bandwidth  # noqa: E402
import common  # noqa: E402
import dqn_returns  # noqa: E402
import env_ratio  # noqa: E402
import ppo_returns  # noqa: E402
import throughput_sb3  # noqa: E402
import time_to_solve  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        common.RESULTS = common.RESULTS / "quick"   # smoke figures never replace reported ones
        throughput_sb3.main(["--steps", "10000", "--reps", "1"])
        ppo_returns.main(["--seeds", "2", "--steps", "20000"])
        channel_bandwidth.main(["--reps", "1"])
        env_ratio.main(["--envs", "16", "--steps", "20000", "--reps", "1"])
        async_staleness.main(["--steps", "20000"])
        time_to_solve.main(["--seeds", "1"])
        central_inference.main(["--steps", "20000", "--reps", "1", "--hidden", "64"])
        dqn_returns.main(["--seeds", "1", "--steps", "20000"])
    else:
        throughput_sb3.main(["--steps", "50000", "--reps", "5"])
        ppo_returns.main(["--seeds", "5", "--steps", "500000"])
        for capacity in ("3", "2", "4"):      # 3: the default policy's ring (max_lag 1)
            channel_bandwidth.main(["--reps", "5", "--capacity", capacity])
        env_ratio.main(["--envs", "4", "16", "64", "256", "--steps", "400000", "--reps", "3", "--no-invariant"])
        async_staleness.main(["--steps", "200000"])
        time_to_solve.main(["--seeds", "10"])
        central_inference.main(["--steps", "200000", "--reps", "3", "--hidden", "64", "512"])
        dqn_returns.main(["--seeds", "3", "--steps", "500000"])


if __name__ == "__main__":
    main()
