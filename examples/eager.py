"""The same algorithm file, called eagerly: no tracing, no runtime, plain Python.

Useful with a debugger: fragments are ordinary function calls when no fragflow runtime is active.

    python examples/eager.py
"""

from fragflow.algorithms import ppo

if __name__ == "__main__":
    state = ppo.train(ppo.Args(total_timesteps=8192))
    print("trained; actor output layer:", tuple(state["params"]["actor"][-1]["w"].shape))
