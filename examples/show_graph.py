"""Trace PPO into its fragmented dataflow graph; print it and draw it.

    python examples/show_graph.py        # writes ppo-fdg.svg
"""

import fragflow as ff
from fragflow.algorithms import ppo
from fragflow.compiler.draw import draw
from fragflow.compiler.printer import format_graph

if __name__ == "__main__":
    graph = ff.trace(ppo.train, ppo.Args(num_envs=8))
    print(format_graph(graph))
    print("image:", draw(graph, "ppo-fdg.svg"))
