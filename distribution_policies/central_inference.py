"""central_inference: env-only worker processes; inference batched across all of them beside the learner.

MSRL's single-learner fine policy, the shape of SEED RL. Each env worker runs the training loop
over its slice of the environments, but keeps only the environments and the buffers: every
inference call becomes a request to the learner's process, which acts once on a batch of requests
with the newest parameters (no parameter broadcast at all) and sends each worker its part of the
answer. Learning calls go the same way, without waiting for an answer.

``max_lag=0`` (the default): the inference group waits for the requests of all workers, and
inference and learning run in the loop's order, so acting always uses the parameters of the
sequential run: this policy reproduces single_process bit for bit, for any number of workers and
with the fast batched arithmetic (one batch, as in one process), for programs without a replay
buffer (one stays on each worker and samples its share of a batch from its own transitions, as
under actor_learner: the same algorithm, not the same numbers) and without a value the loop
computes across the environments (a running normaliser of returns over all of them: each worker's
loop computes it over its own share; normalise inside the learner).

``max_lag >= 1``: bounded wait. A request is answered with the requests that arrived within
``wait_ms`` of it (all workers' when they come in time), so a slow worker no longer holds the
others back; learning takes rollouts as they arrive, and a worker may run up to ``max_lag``
rollouts ahead of the learner (its rollout's version is that of its first answer; the learner
sees each rollout's version and lag through ``ff.delivered()``). A rollout an update leaves more
than ``max_lag`` versions behind (a fast worker's, acted while an update waited for a slow one)
is dropped and counted, never learned from past the bound.

It pays when inference is expensive (a wide network: one batched call instead of one per worker)
and costs a round trip per step when it is cheap.

Placement::

    group actors  x N (program=loop):    env.reset, env.step, buffer.add, buffer.collect
    group learner x 1 (program=service): act (request/reply), learn, log
    channel trajectory  actors -> learner   inference requests and learning calls, ordered (max_lag=0)
                                            or as they arrive (bounded wait)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fragflow.compiler.ir import Graph
from fragflow.placement import Overflow, PlacedGraph, PolicySpec, acting_and_learning


@dataclass(frozen=True)
class Options:
    env_workers: int = 2
    """env worker processes"""
    envs_per_worker: int = 0
    """environments per worker (0: num_envs / env_workers)"""
    max_lag: int = 0
    """rollouts a worker may run ahead of the learner; 0 waits for every worker's request (bit-identical)"""
    wait_ms: float = 0.0
    """with max_lag >= 1: how long a request waits for the other workers' before it is answered without
    them (0: answer what has arrived; measured best on CPU, see the README)"""


def place(graph: Graph, options: Options) -> PlacedGraph:
    return acting_and_learning(
        graph, policy="central_inference", options=tuple(asdict(options).items()),
        actors=options.env_workers, max_lag=options.max_lag, overflow=Overflow.BLOCK,
        trajectory="ordered" if options.max_lag == 0 else "arrival", parameters="exact",
        inference_with_learner=True, batch_wait_ms=options.wait_ms)


POLICY = PolicySpec(
    name="central_inference",
    mirrors="MSRL single-learner fine; SEED RL",
    summary="env-only workers; inference batched across all workers beside the learner, with the newest parameters",
    options=Options,
    place=place,
)
