"""PPO's hand-written pieces against torch's reference implementations."""

import torch

from fragflow.algorithms import ppo


def test_adam_step_matches_torch_optim_adam():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(50, generator=gen, dtype=torch.float64)
    ours = ref.clone()
    m, v = torch.zeros_like(ours), torch.zeros_like(ours)
    ref.requires_grad_(True)
    opt = torch.optim.Adam([ref], lr=3e-3, eps=1e-5)
    for step in range(1, 6):
        grad = torch.randn(50, generator=gen, dtype=torch.float64)
        ref.grad = grad.clone()
        opt.step()
        ppo.adam_step(ours, grad, m, v, step, 3e-3)
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-12, atol=1e-12)


def test_tanh_matches_torch_tanh_with_its_derivative():
    x = torch.linspace(-12, 12, 100_001)
    torch.testing.assert_close(ppo._tanh(x), torch.tanh(x), rtol=0, atol=3e-7)
    x64 = torch.randn(40, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ppo.tanh, (x64,))
    assert ppo.tanh(x64).grad_fn is not None and ppo.tanh(x64.detach()).grad_fn is None


def test_flat_clone_copies_into_views_of_one_tensor():
    tree = {"a": [torch.ones(2, 3)], "b": torch.arange(4.0)}
    copy, flat = ppo.flat_clone(tree)
    assert flat.shape == (2 * ppo.ALIGN,)                    # each leaf starts on an aligned offset
    assert copy["b"].data_ptr() - flat.data_ptr() == ppo.ALIGN * 4
    torch.testing.assert_close(ppo.flat_cat([tree["a"][0], tree["b"]], ppo.flat_layout(ppo.tree_leaves(tree))), flat)
    flat.zero_()
    assert float(copy["a"][0].sum()) == 0.0 and float(copy["b"].sum()) == 0.0
    assert float(tree["a"][0].sum()) == 6.0 and copy["a"][0].shape == (2, 3)


def test_numpy_act_gives_the_log_probabilities_and_values_the_learner_computes():
    """act computes in numpy what evaluate computes in torch: the log-probability of the action it
    chose and the state value, for discrete and continuous actions; the batch-size-invariant form
    computes every row as a batch of one does."""
    import numpy as np

    import fragflow as ff

    for continuous, n_act in ((False, 3), (True, 2)):
        params = ppo.init_params(5, n_act, continuous, 16, seed=3)
        if continuous:
            params["logstd"] = torch.full((1, n_act), -0.5)
        obs = np.random.default_rng(1).normal(size=(6, 5)).astype(np.float32)
        key = ff.random.keys(0, np.arange(6))
        for invariant in (False, True):
            action, logprob, value = ppo.act.fn(params, obs, key, invariant)
            assert logprob.dtype == np.float32 and value.dtype == np.float32 and value.shape == logprob.shape == (6,)
            assert action.dtype == (np.float32 if continuous else np.int64)
            ref_logprob, _, ref_value = ppo.evaluate(params, torch.as_tensor(obs), torch.as_tensor(action))
            np.testing.assert_allclose(logprob, ref_logprob.detach().numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(value, ref_value.detach().numpy(), rtol=1e-5, atol=1e-5)
        rows = [ppo.act.fn(params, obs[i:i + 1], key[i:i + 1], True) for i in range(6)]
        together = ppo.act.fn(params, obs, key, True)
        for j in range(3):
            assert np.array_equal(np.concatenate([r[j] for r in rows]), together[j])
