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
