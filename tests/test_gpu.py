"""Programs whose state is on a GPU, and the parts of the runtime that keep it there.

The first tests run anywhere: how workers start once CUDA is in use, which process group the
replicated learners join, and that a leaf received from another process is put back on the device
it was traced on (checked with torch's ``meta`` device, which every build has). The rest need a GPU
and are skipped without one (CI has none): they run the algorithms with their networks on the GPU
under the policies that place them, and are run on a machine with one (see the README's
measurements for the device and the date).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import fragflow as ff
from fragflow.backends.local import start_method
from fragflow.backends.local.shm import Layout
from fragflow.compiler.pytree import TensorSpec, from_numpy, spec_of
from fragflow.runtime.allreduce import group_backend

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (none here)")


def test_workers_start_from_a_fork_server_once_cuda_is_in_use(monkeypatch):
    monkeypatch.delenv("FRAGFLOW_START_METHOD", raising=False)
    monkeypatch.delitem(sys.modules, "jax", raising=False)   # (an earlier test's program imported it)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)   # a forked child could not use CUDA again
    assert start_method() == "forkserver"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    # a CPU program on a machine with a GPU: the trace's backward pass started autograd's GPU threads,
    # and a forked worker refused its own backward pass ("autograd's threading ... fork")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert start_method() == "forkserver"
    monkeypatch.setenv("FRAGFLOW_START_METHOD", "spawn")
    assert start_method() == "spawn"


def test_replicated_learners_use_nccl_only_with_a_gpu_each():
    assert group_backend(["cpu", "cpu"]) == "gloo"
    assert group_backend(["cuda:0", "cuda:1"]) == "nccl"
    # two learners on one GPU: nccl would refuse them. Every learner chooses from all the learners'
    # devices (learner 0 alone chose nccl here, learner 1 gloo, and the run waited for good)
    assert group_backend(["cuda:0", "cuda:0"]) == "gloo"
    assert group_backend(["cpu,cuda:0", "cpu,cuda:1"]) == "gloo"
    assert group_backend(["cuda:0", ""]) == "gloo"


def test_a_leaf_is_received_on_the_device_it_was_traced_on():
    on_meta = torch.empty(2, 3, device="meta")
    spec = spec_of(on_meta)
    assert spec == TensorSpec((2, 3), "float32", "torch", "meta") and spec.short() == "f32[2,3]@meta"
    assert spec_of(torch.zeros(2, 3)).device == "cpu"
    layout = Layout.of([spec, TensorSpec((2,), "float32", "torch")])
    buf = np.zeros(layout.nbytes, np.uint8)
    layout.write(buf, 0, [np.ones((2, 3), np.float32), torch.arange(2.0)])
    meta, cpu = layout.read(buf, 0)
    assert meta.device.type == "meta" and tuple(meta.shape) == (2, 3)
    assert cpu.device.type == "cpu" and cpu.tolist() == [0.0, 1.0]
    host = np.arange(3, dtype=np.float32)
    assert from_numpy(host, "torch").data_ptr() == host.ctypes.data   # on the CPU: the same memory


def test_a_rollout_buffer_keeps_tensors_on_their_device():
    buffer = ff.RolloutBuffer(3)
    for t in range(3):   # (adding a tensor on another device than the CPU failed: it was copied through numpy)
        buffer.add(x=torch.empty(2, 4, device="meta"), y=np.full(2, t))
    out = buffer.collect()
    assert out["x"].device.type == "meta" and tuple(out["x"].shape) == (3, 2, 4)
    assert out["y"].tolist() == [[0, 0], [1, 1], [2, 2]]


# -- on a GPU ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Args:
    steps: int = 400
    device: str = "cuda"


@ff.fragment("actor")
def act(params, obs, key):
    """Plain tensors in the state (no module to copy into): they must arrive on the GPU."""
    if not params["w"].is_cuda:
        raise AssertionError(f"the actor got its parameters on {params['w'].device}")
    with torch.no_grad():
        logits = torch.as_tensor(obs, dtype=torch.float32, device=params["w"].device) @ params["w"]
    noise = torch.as_tensor(ff.random.gumbel(key, (2,)), dtype=torch.float32, device=logits.device)
    return (logits + noise).argmax(-1).cpu().numpy(), logits


@ff.fragment("learner", writes="state")
def learn(state, batch):
    logits = batch["logits"]            # a tensor made on the GPU by the actor, in another process
    if not logits.is_cuda:
        raise AssertionError(f"the learner got the actor's logits on {logits.device}")
    w = state["w"]
    obs = torch.as_tensor(batch["obs"], dtype=torch.float32, device=w.device).flatten(0, 1)
    reward = torch.as_tensor(batch["reward"], dtype=torch.float32, device=w.device).flatten()
    new_w = w + 1e-3 * obs.T @ (reward[:, None] * torch.softmax(logits.flatten(0, 1), -1))
    return {"w": new_w}, {"mean_logit": logits.mean()}


def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=1)
    state = ff.versioned({"w": torch.zeros(4, 2, device=args.device)})
    buffer = ff.RolloutBuffer(20)
    key = ff.random.keys(1, env.ids)
    obs = env.reset()
    for _ in range(args.steps // 40):
        for _ in range(20):
            key, sub = ff.random.split(key)
            action, logits = act(state, obs, sub)
            next_obs, reward, terminated, truncated, _ = env.step(action)
            buffer.add(obs=obs, logits=logits, reward=reward)
            obs = next_obs
        state, metrics = learn(state, buffer.collect())
        ff.log(metrics)
    return state


@needs_gpu
@pytest.mark.parametrize("policy", ["single_process", "pipelined", "actor_learner(actors=2)", "central_inference"])
def test_tensors_made_on_the_gpu_stay_there_across_processes(policy):
    r = ff.run(train, Args(), policy=policy)
    assert r.value["w"].is_cuda and bool(r.value["w"].isfinite().all())
    assert r.summary["env_steps"] == 400
    if policy in ("single_process", "pipelined"):
        again = ff.run(train, Args(), policy=policy)
        assert torch.equal(again.value["w"], r.value["w"])


@needs_gpu
@pytest.mark.parametrize("policy", ["single_process", "pipelined", "actor_learner(actors=2)", "learner_replay"])
def test_dqn_learns_on_the_gpu_under_every_policy_that_places_it(policy):
    from fragflow.algorithms import dqn

    args = dqn.Args(total_timesteps=3_000, learning_starts=500, num_envs=2, device="cuda")
    r = ff.run(dqn.train, args, policy=policy)
    q = r.value["q"]
    assert next(q.parameters()).is_cuda and r.summary["env_steps"] == 3_000
    assert all(bool(p.isfinite().all()) for p in q.parameters())
    if policy == "single_process":   # the same operations in the same process as the eager loop: the same network
        eager = dqn.train(args)["q"]
        assert all(torch.equal(a, b) for a, b in zip(q.parameters(), eager.parameters()))


@needs_gpu
@pytest.mark.parametrize("policy", ["single_process", "pipelined", "multi_learner(learners=2, actors=1)"])
def test_ppo_atari_learns_on_the_gpu(policy):
    pytest.importorskip("ale_py")
    from fragflow.algorithms import ppo_atari

    r = ff.run(ppo_atari.train, ppo_atari.Args(total_timesteps=2_048, device="cuda"), policy=policy)
    model = r.value["model"]
    assert next(model.parameters()).is_cuda and r.summary["env_steps"] == 2_048
    assert all(bool(p.isfinite().all()) for p in model.parameters())


@needs_gpu
@pytest.mark.parametrize("policy", ["pipelined", "multi_learner(learners=2, actors=1)"])
def test_a_program_all_on_the_cpu_runs_on_a_machine_with_a_gpu(policy):
    # the trace's backward pass in the driver starts autograd's GPU threads even here: workers forked
    # from it refused their own backward pass
    from fragflow.algorithms import ppo

    r = ff.run(ppo.train, ppo.Args(total_timesteps=2_048, num_envs=4, num_steps=128, seed=1), policy=policy)
    assert r.summary["env_steps"] == 2_048 and r.summary["updates"] == 4
