"""Tests for pcdist.fuse: every path against a Python loop over the original modules (float64)."""

import copy

import pytest
import torch
from torch import nn

from pcdist.engine.fuse import FusedModules, fuse

TOL = 1e-12
DT = torch.float64


def _linear(bias=True):
    return nn.Linear(4, 5, bias=bias)


def _mlp_tanh():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _mlp_gelu_relu():
    return nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))


def _conv(bias=True, groups=1):
    return nn.Conv2d(4, 6, kernel_size=3, stride=2, padding=1, bias=bias, groups=groups)


def _linear_layernorm():
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh())


def _conv_circular():
    return nn.Conv2d(4, 3, kernel_size=3, padding=1, padding_mode="circular")


# (id, factory, per-module input shape, expected path)
CASES = [
    ("linear", _linear, (7, 4), "linear"),
    ("linear_nobias", lambda: _linear(bias=False), (7, 4), "linear"),
    ("linear_extra_batch_dims", _linear, (2, 3, 4), "linear"),
    ("seq_tanh", _mlp_tanh, (7, 4), "sequential_linear"),
    ("seq_gelu_relu", _mlp_gelu_relu, (7, 4), "sequential_linear"),
    ("conv", _conv, (2, 4, 9, 8), "conv2d"),
    ("conv_nobias_groups", lambda: _conv(bias=False, groups=2), (2, 4, 9, 8), "conv2d"),
    ("conv_unbatched", _conv, (4, 9, 8), "conv2d"),
    ("vmap_layernorm", _linear_layernorm, (7, 4), "vmap"),
    ("vmap_circular_conv", _conv_circular, (2, 4, 6, 6), "vmap"),
]
IDS = [c[0] for c in CASES]


def _make(factory, n, seed=0):
    """Build n independently initialised float64 modules."""
    torch.manual_seed(seed)
    mods = [factory().to(DT) for _ in range(n)]
    for m in mods:  # non-trivial affine params for LayerNorm etc.
        for p in m.parameters():
            p.data.add_(0.1 * torch.randn_like(p))
    return mods


def _loop(mods, x, shared):
    """Reference: stack the outputs of a Python loop over the modules."""
    return torch.stack([m(x if shared else x[n]) for n, m in enumerate(mods)])


def _grads_close(fused, mods):
    for name, p_NP in fused.stacked.named_parameters():
        ref = torch.stack([dict(m.named_parameters())[name].grad for m in mods])
        assert torch.allclose(p_NP.grad, ref, atol=TOL, rtol=0), name


@pytest.mark.parametrize("shared", [False, True], ids=["per_module", "shared"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_and_grad_match_loop(case, n, shared):
    _, factory, shape, path = case
    mods = _make(factory, n)
    fused = fuse(nn.ModuleList(mods))
    assert isinstance(fused, FusedModules) and fused.path == path and len(fused) == n
    torch.manual_seed(1)
    x = torch.randn(shape if shared else (n, *shape), dtype=DT)
    y = fused(x, shared_input=shared)
    y_ref = _loop(mods, x, shared)
    assert y.shape == y_ref.shape
    assert torch.allclose(y, y_ref, atol=TOL, rtol=0)
    r = torch.randn_like(y_ref)
    (y * r).sum().backward()
    (y_ref * r).sum().backward()
    _grads_close(fused, mods)


def test_input_gradient_matches_loop():
    mods = _make(_mlp_tanh, 3)
    fused = fuse(mods)
    x = torch.randn(3, 5, 4, dtype=DT, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    r = torch.randn(3, 5, 3, dtype=DT)
    (fused(x) * r).sum().backward()
    (_loop(mods, x_ref, False) * r).sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, atol=TOL, rtol=0)


def test_parameters_and_state_dict_are_stacked():
    mods = _make(_mlp_tanh, 3)
    fused = fuse(mods)
    shapes = {k: tuple(v.shape) for k, v in fused.state_dict().items()}
    assert shapes == {
        "stacked.0.weight": (3, 6, 4), "stacked.0.bias": (3, 6),
        "stacked.2.weight": (3, 3, 6), "stacked.2.bias": (3, 3),
    }
    params = list(fused.parameters())
    assert len(params) == 4 and all(isinstance(p, nn.Parameter) and p.requires_grad for p in params)
    assert torch.equal(getattr(fused.stacked, "0").weight[1], mods[1][0].weight)
    fused2 = fuse(_make(_mlp_tanh, 3, seed=5))
    fused2.load_state_dict(fused.state_dict())
    x = torch.randn(3, 2, 4, dtype=DT)
    assert torch.equal(fused2(x), fused(x))


def _train_steps(fused, mods, make_opt, shape, steps=3):
    """Step the fused params and, separately, reference copies of each module; return the copies."""
    refs = copy.deepcopy(mods)
    opt = make_opt(fused.parameters())
    ref_opts = [make_opt(m.parameters()) for m in refs]
    torch.manual_seed(2)
    for _ in range(steps):
        x = torch.randn(len(mods), *shape, dtype=DT)
        opt.zero_grad()
        y = fused(x)
        r = torch.randn_like(y)
        (y * r).sum().backward()
        opt.step()
        for o in ref_opts:
            o.zero_grad()
        (_loop(refs, x, False) * r).sum().backward()
        for o in ref_opts:
            o.step()
    return refs


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}
OPT_CASES = [c for c in CASES if c[0] in ("linear", "seq_tanh", "conv", "vmap_layernorm")]


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("case", OPT_CASES, ids=[c[0] for c in OPT_CASES])
def test_optimizer_step_then_write_back(case, opt_name):
    _, factory, shape, _ = case
    mods = _make(factory, 3)
    originals = [p for m in mods for p in m.parameters()]
    before = [p.detach().clone() for p in originals]
    fused = fuse(mods)
    refs = _train_steps(fused, mods, OPTIMIZERS[opt_name], shape)
    assert all(torch.equal(a, b) for a, b in zip(before, originals))  # untouched until write_back
    fused.write_back()
    after = [p for m in mods for p in m.parameters()]
    assert all(a is b for a, b in zip(after, originals))  # written in place
    for m, ref in zip(mods, refs):
        for (name, p), p_ref in zip(m.named_parameters(), ref.parameters()):
            assert torch.allclose(p, p_ref, atol=TOL, rtol=0), name
    assert not any(torch.equal(a, b) for a, b in zip(before, originals))


def _bn_net():
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh())


@pytest.mark.parametrize("shared", [False, True], ids=["per_module", "shared"])
def test_batchnorm_buffers_train_and_eval(shared):
    mods = _make(_bn_net, 3)
    refs = copy.deepcopy(mods)
    fused = fuse(mods)
    assert fused.path == "vmap" and fused.training
    torch.manual_seed(3)
    for _ in range(2):
        x = torch.randn((6, 4) if shared else (3, 6, 4), dtype=DT)
        assert torch.allclose(fused(x, shared_input=shared), _loop(refs, x, shared), atol=TOL, rtol=0)
    fused.eval()
    for m in refs:
        m.eval()
    x = torch.randn((6, 4) if shared else (3, 6, 4), dtype=DT)
    assert torch.allclose(fused(x, shared_input=shared), _loop(refs, x, shared), atol=TOL, rtol=0)
    fused.write_back()
    for m, ref in zip(mods, refs):
        for (name, b), b_ref in zip(m.named_buffers(), ref.buffers()):
            assert torch.allclose(b.double(), b_ref.double(), atol=TOL, rtol=0), name
    assert int(mods[2][1].num_batches_tracked) == 2


def test_empty_list_raises():
    with pytest.raises(ValueError, match="at least one module"):
        fuse([])


def test_mixed_types_raise_naming_index():
    with pytest.raises(ValueError, match=r"module 2 has type Conv2d.*module 0 has type Linear"):
        fuse([nn.Linear(3, 4), nn.Linear(3, 4), nn.Conv2d(3, 4, 1)])


def test_mismatched_shapes_raise_naming_index():
    with pytest.raises(ValueError, match=r"module 1 parameter 'weight' has shape \(5, 3\).*\(4, 3\)"):
        fuse([nn.Linear(3, 4), nn.Linear(3, 5)])


def test_mismatched_dtype_raises_naming_index():
    with pytest.raises(ValueError, match=r"module 1 parameter '0.weight' has dtype torch.float64"):
        fuse([_mlp_tanh(), _mlp_tanh().double()])


def test_mismatched_config_raises_naming_index():
    with pytest.raises(ValueError, match=r"module 1 is configured differently.*negative_slope"):
        fuse([nn.Sequential(nn.Linear(2, 2), nn.LeakyReLU(0.1)), nn.Sequential(nn.Linear(2, 2), nn.LeakyReLU(0.2))])


def test_shared_module_raises():
    m = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"module 1 'weight' is the same tensor as module 0"):
        fuse([m, m])


def test_wrong_leading_dim_raises_naming_both_numbers():
    fused = fuse(_make(_linear, 3))
    with pytest.raises(ValueError, match=r"leading dim is 2 but 3 modules"):
        fused(torch.randn(2, 7, 4, dtype=DT))
