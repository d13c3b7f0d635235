"""The residual (μPC) kind against an independent reference written from the paper's formula.

``tests/reference.py``'s ``MuPCReference`` builds u_l from plain tensors and the scalings
a_1 = 1/sqrt(D), a_h = 1/sqrt(N L), a_L = 1/N, and takes every gradient from torch.autograd
of the energy. After every training step pcdist's value nodes, energies, weights and
feed-forward output must equal it to 1e-10 in float64, over pc/ipc, value momentum 0 and
0.5, se/ce, SGD/AdamW, depths 3 to 12 and five activations.
"""

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import pcdist
from pcdist.engine.layers import Residual, ResidualLinear
from reference import PHI, MuPCReference

pytestmark = pytest.mark.usefixtures("single_thread")

ATOL = 1e-10
DT = torch.float64
ACTS = {"relu": pcdist.Activation("relu"), "tanh": pcdist.Activation("tanh"), "gelu": pcdist.Activation("gelu"),
        "leaky_relu": pcdist.Activation("leaky_relu", negative_slope=0.1), "sigmoid": pcdist.Activation("sigmoid")}
OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.01),
}
DEPTHS = (3, 4, 5, 8, 12)
BATCH_SIZES = (5, 7, 6)
D_IN, WIDTH, D_OUT = 5, 7, 3


def pcdist_twin(ref: MuPCReference, phi: str, energy: str, bias: bool, make_opt, **trainer_kw):
    """A pcdist network with the reference's weights, and its trainer."""
    specs = pcdist.mupc_specs(D_IN, WIDTH, ref.L, D_OUT, ACTS[phi], bias=bias)
    net = pcdist.PCNetwork(specs, energy=energy, dtype=DT, init=False)
    state = {f"layers.{l}.weight": W for l, W in enumerate(ref.weights, 1)}
    state.update({f"layers.{l}.bias": b for l, b in enumerate(ref.biases, 1) if b is not None})
    net.load_layer_state_dict({k: v.detach() for k, v in state.items()})
    return net, pcdist.PCTrainer(net, make_opt(net.parameters()), **trainer_kw)


def assert_matches(net, trainer, ref, stats, ref_stats, x, what, w_atol=ATOL):
    for l, (h, r) in enumerate(zip(trainer.value_nodes(), ref.hs)):
        assert_close(h, r, atol=ATOL, rtol=0, msg=lambda m: f"{what}: h_{l}: {m}")
    assert stats["energy"] == pytest.approx(ref_stats["energy"], abs=ATOL, rel=0), f"{what}: energy"
    assert stats["layer_energies"] == pytest.approx(ref_stats["layer_energies"], abs=ATOL, rel=0), f"{what}: layers"
    state = net.layer_state_dict()
    for l, (W, b) in enumerate(zip(ref.weights, ref.biases), 1):
        assert_close(state[f"layers.{l}.weight"], W.detach(), atol=w_atol, rtol=0, msg=lambda m: f"{what}: W_{l}: {m}")
        if b is not None:
            assert_close(state[f"layers.{l}.bias"], b.detach(), atol=ATOL, rtol=0, msg=lambda m: f"{what}: b_{l}: {m}")
    with torch.no_grad():
        assert_close(net(x), ref.forward(x), atol=ATOL, rtol=0, msg=lambda m: f"{what}: net(x): {m}")


GRID = [(a, m, o, e) for a in ("pc", "ipc") for m in (0.0, 0.5) for o in OPTIMIZERS for e in ("se", "ce")]


@pytest.mark.parametrize("algorithm,x_momentum,opt_name,energy", GRID,
                         ids=[f"{a}-mu{m}-{o}-{e}" for a, m, o, e in GRID])
def test_grid(algorithm, x_momentum, opt_name, energy):
    i = GRID.index((algorithm, x_momentum, opt_name, energy))
    depth, phi, bias = DEPTHS[i % len(DEPTHS)], list(ACTS)[i % len(ACTS)], i % 3 == 2
    kw = dict(T=3 + i % 4, x_lr=0.2, x_momentum=x_momentum, algorithm=algorithm)
    ref = MuPCReference(D_IN, WIDTH, depth, D_OUT, phi, OPTIMIZERS[opt_name], energy=energy, bias=bias, seed=i, **kw)
    net, trainer = pcdist_twin(ref, phi, energy, bias, OPTIMIZERS[opt_name], **kw)
    gen = torch.Generator().manual_seed(100 + i)
    for s, B in enumerate(BATCH_SIZES):
        x = torch.randn(B, D_IN, generator=gen, dtype=DT)
        y = nn.functional.one_hot(torch.randint(0, D_OUT, (B,), generator=gen), D_OUT).to(DT)
        stats, ref_stats = trainer.step(x, y), ref.step(x, y)
        assert_matches(net, trainer, ref, stats, ref_stats, x, f"depth {depth}, {phi}, step {s}")


@pytest.mark.parametrize("depth", [3, 12])
def test_inference_moves_values_and_lowers_the_energy(depth):
    """The comparison is not vacuous: hidden values move off the feed-forward pass, the energy
    falls during inference, and every layer's weights change. (From the feed-forward init the
    output error reaches one layer further down per Jacobi step, so T >= L reaches them all.)"""
    kw = dict(T=depth + 2, x_lr=0.2, x_momentum=0.0, algorithm="pc")
    ref = MuPCReference(D_IN, WIDTH, depth, D_OUT, "relu", OPTIMIZERS["adamw"], energy="se", seed=depth, **kw)
    w0 = [W.detach().clone() for W in ref.weights]
    net, trainer = pcdist_twin(ref, "relu", "se", False, OPTIMIZERS["adamw"], **kw)
    x = torch.randn(6, D_IN, generator=torch.Generator().manual_seed(5), dtype=DT)
    y = torch.eye(D_OUT, dtype=DT)[[0, 1, 2, 0, 1, 2]]
    f_init = trainer.trace(x, y)[0]
    with torch.no_grad():
        ff = [x]
        for l in range(1, depth):
            ff.append(ref.predict(l, ff[-1]))
    stats, ref_stats = trainer.step(x, y), ref.step(x, y)
    # AdamW divides by sqrt(v) + eps: where a gradient element is near eps it scales the gradient's rounding
    # by up to lr / (4 eps), so after 14 inference steps through 12 layers the weights agree to 1e-9 (1.1e-10
    # apart on some BLAS builds), the nodes and energies to 1e-10.
    assert_matches(net, trainer, ref, stats, ref_stats, x, "step", w_atol=1e-9)
    assert stats["energy"] < sum(f_init) - 1e-6
    assert all(float((h - u).abs().max()) > 1e-9 for h, u in zip(ref.hs[1:-1], ff[1:])), "every hidden node moved"
    state = net.layer_state_dict()
    assert all((state[f"layers.{l}.weight"] - w0[l - 1]).abs().max() > 1e-4 for l in range(1, depth + 1))


def test_hidden_layers_form_one_group_and_the_scalings_are_global():
    """Layer 1 and the output stand alone; the L - 2 hidden layers stack into one [L-2, N, N] group.
    A slice of layers keeps the global scalings (computed from the global N and L)."""
    specs = pcdist.mupc_specs(64, 32, 10, 10, "relu")
    net = pcdist.PCNetwork(specs, seed=0)
    assert [tuple(g.weight.shape) for g in net.groups] == [(1, 64, 32), (8, 32, 32), (1, 32, 10)]
    assert [s.scale for s in specs] == pytest.approx([1 / 8, *[1 / (32 * 10) ** 0.5] * 8, 1 / 32])
    part = pcdist.PCNetwork(specs, layers=(4, 8), seed=0)
    assert [g.kind.scale for g in part.groups] == pytest.approx([1 / (32 * 10) ** 0.5] * 2)
    # Seeded init is per layer: the slice holds the full network's layers 4..7.
    full, sliced = net.layer_state_dict(), part.layer_state_dict()
    assert all(torch.equal(sliced[k], full[k]) for k in sliced)
    w = torch.cat([net.layer_weight(l).detach().flatten() for l in range(1, 11)])
    assert abs(float(w.mean())) < 0.05 and abs(float(w.std()) - 1.0) < 0.05, "W ~ N(0, 1)"


@pytest.mark.parametrize("bias", [False, True])
def test_mupc_layers_round_trip_and_backprop(bias):
    """mupc_layers are plain torch modules computing the formula; from_layers copies them into the
    residual kind; to_layers gives the same modules back; nn.Sequential(*layers) is the network."""
    torch.manual_seed(0)
    layers = pcdist.mupc_layers(D_IN, WIDTH, 6, D_OUT, "tanh", bias=bias, dtype=DT)
    x = torch.randn(4, D_IN, dtype=DT)
    ref = MuPCReference(D_IN, WIDTH, 6, D_OUT, "tanh", OPTIMIZERS["adamw"], T=1, x_lr=0.1, bias=bias)
    with torch.no_grad():
        for m, W, b in zip(layers, ref.weights, ref.biases):
            m.weight.copy_(W)
            if bias:
                m.bias.copy_(b)
    assert_close(nn.Sequential(*layers)(x), ref.forward(x), atol=1e-12, rtol=0)
    net = pcdist.PCNetwork.from_layers(layers, energy="ce")
    assert all(isinstance(g.kind, Residual) for g in net.groups)
    assert_close(net(x), ref.forward(x), atol=1e-12, rtol=0)
    back = net.to_layers()
    assert [type(m) for m in back] == [ResidualLinear] * 6
    for m, o in zip(back, layers):
        assert (m.scale, m.skip, m.activation) == (o.scale, o.skip, o.activation)
        for p, q in zip(m.parameters(), o.parameters()):
            assert torch.equal(p, q)
    loss = nn.functional.cross_entropy(nn.Sequential(*back)(x), torch.tensor([0, 1, 2, 0]))
    loss.backward()  # trainable by backprop as well
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in back.parameters())


@pytest.mark.parametrize("phi", ["tanh", "gelu"])
def test_deeppcr_init_equals_the_feedforward_init(phi):
    """pc.init=deeppcr solves the residual chain by Newton + cyclic reduction: same value nodes."""
    ref = MuPCReference(D_IN, WIDTH, 9, D_OUT, phi, OPTIMIZERS["sgd_momentum"], T=1, x_lr=0.1, seed=3)
    nodes = {}
    for init in ("ff", "deeppcr"):
        net, trainer = pcdist_twin(ref, phi, "se", False, OPTIMIZERS["sgd_momentum"], T=2, x_lr=0.1, init=init)
        x = torch.randn(5, D_IN, generator=torch.Generator().manual_seed(9), dtype=DT)
        trainer.step(x, torch.eye(D_OUT, dtype=DT)[[0, 1, 2, 0, 1]])
        nodes[init] = trainer.value_nodes()
    for a, b in zip(nodes["ff"], nodes["deeppcr"]):
        assert_close(a, b, atol=1e-9, rtol=0)


def test_mixed_kinds_in_one_network():
    """Dense and residual layers chain in one network (from_layers picks each module's kind)."""
    torch.manual_seed(1)
    layers = [nn.Sequential(nn.Linear(D_IN, WIDTH), nn.Tanh()),
              ResidualLinear(WIDTH, WIDTH, "relu", scale=0.3, dtype=torch.float32),
              ResidualLinear(WIDTH, WIDTH, "relu", scale=0.3, dtype=torch.float32),
              nn.Linear(WIDTH, D_OUT)]
    layers = [copy.deepcopy(m).double() for m in layers]
    net = pcdist.PCNetwork.from_layers(layers, energy="se")
    assert [g.kind.kind for g in net.groups] == ["dense", "residual", "dense"]
    x = torch.randn(3, D_IN, dtype=DT)
    assert_close(net(x), nn.Sequential(*layers)(x), atol=1e-12, rtol=0)
    trainer = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=4, x_lr=0.1)
    stats = trainer.step(x, torch.eye(D_OUT, dtype=DT)[[0, 1, 2]])
    assert len(stats["layer_energies"]) == 4 and all(torch.isfinite(torch.tensor(stats["layer_energies"])))


def test_bad_layers_name_the_module():
    with pytest.raises(ValueError, match=r"layer 2 \(LSTM\) must map a batch \[B, 4\] to one tensor"):
        pcdist.PCNetwork.from_layers([nn.Linear(3, 4), nn.LSTM(4, 4), nn.Linear(4, 2)])
    with pytest.raises(ValueError, match="needs in_features == out_features"):
        ResidualLinear(3, 4, skip=True)
    with pytest.raises(ValueError, match="mupc depth must be an integer >= 2"):
        pcdist.mupc_specs(4, 8, 1, 2)
    assert PHI  # the reference's activations are its own, not pcdist's
