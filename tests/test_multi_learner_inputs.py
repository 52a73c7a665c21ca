"""multi_learner: a gradient with respect to a tensor the learner computed (its outputs, its hidden
features: not a leaf) is of the learner's own samples and stays its own; the parameters' gradients
it leads to are averaged. Averaged, sample i of one learner's share was mixed with sample i of
another's, silently."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

import fragflow as ff
from fragflow.program import load
from tests.test_multi_learner import PROGRAM
from tests.test_multiprocess import shm_leftovers

ML = "multi_learner(learners=2, actors=1, max_lag=0)"
MLP = PROGRAM.replace("net = torch.nn.Linear(3, 1)\n    state",
                      "net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))\n    state")


def _equal_runs(write_algo, source, name, **args):
    assert source != MLP
    path, _ = write_algo(source, name)
    prog = load(str(path))
    one = ff.run(prog.train, prog.args_cls(**args), policy="single_process")
    two = ff.run(prog.train, prog.args_cls(**args), policy=ML)
    for p, q in zip(one.value["net"].parameters(), two.value["net"].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("via", ["shared memory", "gloo"])
def test_a_gradient_with_respect_to_the_learners_own_outputs_feeds_the_chain_rule_as_one_learners(write_algo, via,
                                                                                                   monkeypatch):
    """dL/da for the learner's own outputs, then `a.backward(dl_da)` (DDPG's actor step through a
    critic's action gradient has this shape): weights 0.6 apart from single_process's."""
    if via == "gloo":
        monkeypatch.setenv("FRAGFLOW_ALLREDUCE", "gloo")
    _equal_runs(write_algo, MLP.replace("""            opt.zero_grad()
            loss.backward()""", """            opt.zero_grad()
            a = net(x)
            dl_da = torch.autograd.grad(((a - y) ** 2).mean(), a)[0]   # per sample, then the chain rule
            a.backward(dl_da)"""), "chain_rule.py")


def test_a_penalty_on_each_samples_gradient_with_respect_to_its_features_is_one_learners(write_algo):
    """A penalty on the output's gradient with respect to each sample's hidden features (taken with
    create_graph=True, as an input-gradient penalty is): weights 0.009 apart from single_process's."""
    _equal_runs(write_algo, MLP.replace("        loss = ((net(x) - y) ** 2).mean()", """        h = net[0](x)   # each sample's features: computed, not a leaf
        out = net[2](net[1](h))
        gh = torch.autograd.grad(out.sum(), h, create_graph=True)[0]
        loss = ((out - y) ** 2).mean() + 0.5 * ((gh.norm(dim=1) - 0.5) ** 2).mean()"""), "feature_penalty.py")


def test_gradients_with_respect_to_views_of_a_flat_parameter_vector_are_averaged(write_algo):
    """A functional learner whose parameters are views of one flat tensor that takes gradients (not
    leaves themselves): their gradients are the parameters', averaged, not each learner's own."""
    _equal_runs(write_algo, MLP.replace("""            grads = torch.autograd.grad(loss, list(net.parameters()))
            with torch.no_grad():
                for p, g in zip(net.parameters(), grads):
                    p -= 0.05 * g""", """            flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).requires_grad_(True)
            views, at = [], 0
            for p in net.parameters():
                views.append(flat[at:at + p.numel()].view_as(p))
                at += p.numel()
            h = torch.tanh(torch.nn.functional.linear(x, views[0], views[1]))
            loss = ((torch.nn.functional.linear(h, views[2], views[3]) - y) ** 2).mean()
            grads = torch.autograd.grad(loss, views)
            with torch.no_grad():
                for p, g in zip(net.parameters(), grads):
                    p -= 0.05 * g"""), "flat_views.py", functional=True)
