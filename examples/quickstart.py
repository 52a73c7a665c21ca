"""Train PPO on CartPole-v1 from Python and print the summary.

    python examples/quickstart.py
"""

import fragflow as ff
from fragflow.algorithms import ppo

if __name__ == "__main__":
    result = ff.run(ppo.train, ppo.Args(total_timesteps=100_000), policy="single_process",
                    out="runs/quickstart", target_return=475, progress=True)
    print({k: result.summary[k] for k in ("env_steps", "steps_per_second", "final_return_mean", "solved_at_steps")})
