"""The module kind's traced calls (pcdist/engine/layers/graph.py): the recorded aten graphs, rewritten,
against the modules themselves differentiated by autograd; which modules take them; the fallback."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap
from torch.testing import assert_close

import pcdist
from pcdist.engine import native
from pcdist.engine.layers.graph import EagerCall, GraphCall, native_tanh, trace

from test_conv_module import MODES, Branchy, Residual, compare, module_net

pytestmark = pytest.mark.usefixtures("single_thread")

DT = torch.float64
aten = torch.ops.aten


class Gated(nn.Module):
    """Two branches and a product: x * sigmoid(W1 x) + tanh(W2 x) (no bias on W2)."""

    def __init__(self, d):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d, bias=False)

    def forward(self, h):
        return h * torch.sigmoid(self.a(h)) + torch.tanh(self.b(h))


MODULES = {
    "linear-tanh": lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh()),
    "layernorm-linear-tanh": lambda: nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6), nn.Tanh()),
    "residual": lambda: Residual(6),
    "gated": lambda: Gated(6),
    "conv-relu": lambda: nn.Sequential(nn.Conv1d(2, 2, 3, padding=1), nn.ReLU()),
}


def stacked(name, K, dtype=DT):
    torch.manual_seed(len(name) + K)
    mods = [MODULES[name]().to(dtype) for _ in range(K)]
    params, buffers = stack_module_state(mods)
    params = {n: p.detach() for n, p in params.items()}
    fn = vmap(lambda p, b, h: functional_call(mods[0], (p, b), (h,)))
    return mods, params, buffers, (lambda p, b, x: fn(p, b, x))


def shape_of(name):
    return (2, 3) if name.startswith("conv") else (6,)


@pytest.mark.parametrize("name", list(MODULES))
def test_traced_calls_equal_the_modules_under_autograd(name):
    """forward, VJP by the input and VJP by the weights of K = 3 stacked modules, traced once on a
    probe, then called on new inputs: equal to each module called on its own, differentiated by
    autograd, to 1e-12 (float64)."""
    K, B = 3, 5
    mods, params, buffers, fn = stacked(name, K)
    x = torch.randn(K, B, *shape_of(name), dtype=DT)
    by_input = trace(fn, (params, buffers, x), 2)
    by_weight = trace(fn, (params, buffers, x), 0)
    assert isinstance(by_input, GraphCall) and isinstance(by_weight, GraphCall), "these modules trace"
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # new points, not the probe the tracing used
        x = torch.randn(x.shape, generator=gen, dtype=DT)
        d = torch.randn(K, B, *mods[0](x[0]).shape[1:], generator=gen, dtype=DT)
        xs = x.clone().requires_grad_()
        want = torch.stack([m(xs[k]) for k, m in enumerate(mods)])
        w_x = torch.autograd.grad(want, xs, d, retain_graph=True)[0]
        w_p = torch.autograd.grad(want, [p for m in mods for p in m.parameters()], d)
        u, saved = by_input.forward(params, buffers, x)
        assert_close(u, want.detach(), atol=1e-12, rtol=0)
        assert_close(by_input.vjp(saved, d)[0], w_x, atol=1e-12, rtol=0)
        _, saved = by_weight.forward(params, buffers, x)
        grads = by_weight.vjp(saved, d)
        assert len(grads) == len(params)
        for i, g in enumerate(grads):  # stacked [K, ...] against module k's own parameter
            for k in range(K):
                assert_close(g[k], w_p[k * len(params) + i], atol=1e-12, rtol=0)


def test_the_rewrites_leave_one_gemm_per_product_and_the_native_tanh():
    """Linear + tanh: the forward is one baddbmm (bias folded) and tanh; the weight VJP writes the
    gradient in nn.Linear's layout (no transpose of a product left); tanh is pcdist's kernel
    where it builds."""
    _, params, buffers, fn = stacked("linear-tanh", 4, torch.float32)
    x = torch.randn(4, 8, 6)
    by_input, by_weight = (trace(fn, (params, buffers, x), a) for a in (2, 0))
    fw, bw = by_input.graphs
    targets = [n.target for n in fw.graph.nodes if n.op == "call_function"]
    assert aten.baddbmm.default in targets and aten.bmm.default not in targets and aten.add.Tensor not in targets
    tanh = native_tanh if native.library() is not None else aten.tanh.default
    assert tanh in targets and (tanh is aten.tanh.default or aten.tanh.default not in targets)
    assert [n.target for n in bw.graph.nodes if n.op == "call_function"].count(aten.bmm.default) == 1
    _, bw_w = by_weight.graphs
    (outs,) = [n.args[0] for n in bw_w.graph.nodes if n.op == "output"]
    assert outs[0].target is aten.bmm.default, "the weight gradient is the product itself, not its transpose"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_tanh_equals_torch_tanh(dtype):
    if native.library() is None:
        pytest.skip("no C compiler: graphs keep torch's tanh (covered by the other tests)")
    x = torch.cat([torch.linspace(-30, 30, 10001, dtype=dtype), torch.tensor([0.0, -0.0, 1e-30, float("inf"),
                                                                               -float("inf")], dtype=dtype)])
    assert_close(native_tanh(x), torch.tanh(x), atol=0, rtol=4 * torch.finfo(dtype).eps)
    y = torch.randn(7, 5, dtype=dtype).t()  # non-contiguous input
    assert_close(native_tanh(y), torch.tanh(y), atol=0, rtol=4 * torch.finfo(dtype).eps)


def bound_calls(layers, shape, B=4):
    net = pcdist.PCNetwork.from_layers(copy.deepcopy(layers), input_shape=shape)
    trainer = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.05), T=2, x_lr=0.1)
    x = torch.randn(B, *shape, dtype=DT)
    trainer.step(x, torch.eye(4, dtype=DT)[torch.randint(0, 4, (B,))])
    return [b for b in trainer.stage(B).groups if b.g.kind.kind == "module"]


def test_module_groups_take_the_traced_calls_and_copy_an_input_they_keep():
    """Every module group of the reference networks runs traced graphs (so the reference grid
    tests them); a linearisation that keeps its input (LayerNorm) reads a copy of the node the
    value step moves, one that keeps only weights and outputs (Linear + tanh) does not."""
    for name in ("layernorm-linear", "residual-blocks", "mixed"):
        for b in bound_calls(*module_net(name)):
            assert isinstance(b._by_input, GraphCall) and isinstance(b._by_weight, GraphCall), (name, b.first)
            assert b._copy_input, (name, b.first)
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(5, 6), nn.Tanh())] + [pcdist.AnyModule(nn.Sequential(nn.Linear(6, 6), nn.Tanh()))
                                                            for _ in range(3)] + [nn.Linear(6, 4)]
    (b,) = bound_calls([m.to(DT) for m in layers], (5,))
    assert b.K == 3 and isinstance(b._by_input, GraphCall) and b._copy_input is False


def test_a_module_tracing_cannot_take_keeps_the_eager_calls():
    torch.manual_seed(5)
    layers = [m.to(DT) for m in (nn.Sequential(nn.Linear(5, 7), nn.Tanh()), Branchy(7), Branchy(7), nn.Linear(7, 4))]
    (b,) = bound_calls(layers, (5,))
    assert isinstance(b._by_input, EagerCall), "a data-dependent branch cannot be traced"


@pytest.mark.parametrize("algorithm,x_momentum,energy,optimizer", MODES[:2],
                         ids=["-".join(map(str, m)) for m in MODES[:2]])
def test_eager_calls_equal_the_reference_too(monkeypatch, algorithm, x_momentum, energy, optimizer):
    """PCDIST_TRACE=0: every module group on its eager calls, same numbers as the reference."""
    monkeypatch.setenv("PCDIST_TRACE", "0")
    net = compare(*module_net("mixed"), energy, algorithm, x_momentum, optimizer)
    assert "module" in [g.kind.kind for g in net.groups]


# Modules that once broke the traced path (found in review); each must train with the eager numbers.

class SwapMix(nn.Module):
    """[B, 2, 3] -> [B, 2, 3], returned in a transposed (non-contiguous) layout."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, h):
        return torch.tanh(self.lin(h.reshape(len(h), 6))).reshape(len(h), 3, 2).transpose(1, 2)


class PosGate(nn.Module):
    """A zero-initialised gate on tanh of an integer tensor (tanh's input is not its output's dtype)."""

    def __init__(self):
        super().__init__()
        self.lin, self.alpha = nn.Linear(6, 6), nn.Parameter(torch.zeros(()))

    def forward(self, h):
        return torch.tanh(self.lin(h)) + self.alpha * torch.tanh(torch.arange(6) - 3).to(h.dtype)


class Unused(nn.Module):
    """A parameter the output does not depend on: its gradient is zero."""

    def __init__(self):
        super().__init__()
        self.lin, self.spare = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, h):
        return torch.tanh(self.lin(h))


class Memo(nn.Module):
    """Writes a buffer in its forward (AOTAutograd then returns the buffer as an extra output)."""

    def __init__(self):
        super().__init__()
        self.lin, self.gamma = nn.Linear(6, 6), nn.Parameter(torch.ones(6))
        self.register_buffer("last", torch.zeros(6))

    def forward(self, h):
        z = torch.tanh(self.lin(h))
        self.last.copy_(z.detach().mean(0))
        return self.gamma * z


def traced_and_eager(monkeypatch, layers, shape, B=5, steps=3):
    """The same training traced and with PCDIST_TRACE=0 (float64): value nodes, energies and weights
    agree to 1e-10; returns the traced run's module groups."""
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("PCDIST_TRACE", flag)
        net = pcdist.PCNetwork.from_layers(copy.deepcopy(layers), input_shape=shape)
        assert not [n for n, _ in net.named_parameters() if ".base." in n], "the template's tensors are not trained"
        trainer = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), T=4, x_lr=0.1)
        gen = torch.Generator().manual_seed(1)
        energies = [trainer.step(torch.randn(B, *shape, generator=gen, dtype=DT),
                                 torch.randn(B, 4, generator=gen, dtype=DT))["energy"] for _ in range(steps)]
        runs.append((energies, trainer.value_nodes(), [p.detach() for p in net.parameters()],
                     [b for b in trainer.stage(B).groups if b.g.kind.kind == "module"]))
    (e1, h1, p1, bound), (e0, h0, p0, _) = runs
    assert e1 == pytest.approx(e0, abs=1e-10, rel=0)
    for a, b in zip(h1 + p1, h0 + p0):
        assert_close(a, b, atol=1e-10, rtol=0)
    return bound


def test_parameter_free_layers_train(monkeypatch):
    for inner in (nn.Identity(), nn.Tanh()):
        layers = [nn.Sequential(nn.Linear(5, 6), nn.Tanh()).to(DT), pcdist.AnyModule(inner),
                  pcdist.AnyModule(copy.deepcopy(inner)), nn.Linear(6, 4).to(DT)]
        traced_and_eager(monkeypatch, layers, (5,))


def test_a_parameter_the_output_ignores_gets_a_zero_gradient(monkeypatch):
    torch.manual_seed(1)
    layers = [nn.Sequential(nn.Linear(5, 6), nn.Tanh()).to(DT), Unused().to(DT), Unused().to(DT),
              nn.Linear(6, 4).to(DT)]
    (b,) = traced_and_eager(monkeypatch, layers, (5,))
    assert isinstance(b._by_weight, GraphCall)
    assert torch.count_nonzero(b.g.stacked["spare__weight"].grad) == 0


def test_a_non_contiguous_output_feeds_the_next_layer(monkeypatch):
    torch.manual_seed(2)
    layers = [nn.Sequential(nn.Flatten(), nn.Linear(6, 6), nn.Tanh(), nn.Unflatten(1, (2, 3))), SwapMix(), SwapMix(),
              nn.Sequential(nn.Flatten(), nn.Linear(6, 4))]
    bound = traced_and_eager(monkeypatch, [m.to(DT) for m in layers], (2, 3))
    assert any(b.K == 2 and isinstance(b._one, GraphCall) for b in bound)


def test_tanh_of_another_dtype_keeps_torchs_tanh(monkeypatch):
    torch.manual_seed(3)
    layers = [nn.Sequential(nn.Linear(5, 6), nn.Tanh()), PosGate(), nn.Linear(6, 4)]
    (b,) = traced_and_eager(monkeypatch, [m.to(DT) for m in layers], (5,))
    assert isinstance(b._by_input, GraphCall)
    fw = b._by_input.graphs[0]
    assert aten.tanh.default in [n.target for n in fw.graph.nodes], "tanh of the int64 positions stays torch's"


def test_a_module_that_writes_a_buffer_keeps_the_eager_calls(monkeypatch):
    torch.manual_seed(4)
    layers = [nn.Sequential(nn.Linear(5, 6), nn.Tanh()), Memo(), nn.Linear(6, 4)]
    (b,) = traced_and_eager(monkeypatch, [m.to(DT) for m in layers], (5,), steps=6)
    assert isinstance(b._by_input, EagerCall) and isinstance(b._one, EagerCall)
