"""pcdist against the independent autograd reference (tests/reference.py), in float64.

After every ``trainer.step`` the value nodes, energy, layer energies, weights/biases
(via ``net.to_sequential()``) and the feed-forward output must equal the reference
to 1e-10.
"""
import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from reference import ReferenceTrainer, feed_forward_values, split_layers

pcdist = pytest.importorskip("pcdist")

pytestmark = pytest.mark.usefixtures("single_thread")

ATOL = 1e-10
DT = torch.float64

ACTIVATIONS = {
    "tanh": lambda: nn.Tanh(),
    "relu": lambda: nn.ReLU(),
    "leaky_relu": lambda: nn.LeakyReLU(negative_slope=0.1),
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "hardtanh": lambda: nn.Hardtanh(),
    "sigmoid": lambda: nn.Sigmoid(),
    "identity": lambda: nn.Identity(),
    "silu": lambda: nn.SiLU(),
    "softplus": lambda: nn.Softplus(beta=2.0, threshold=3.0),  # the linear part reached in the tests
    "elu": lambda: nn.ELU(alpha=0.7),
    "mish": lambda: nn.Mish(),
}
ACT_NAMES = list(ACTIVATIONS)

OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.01),
}

DIMS = {  # name: (dims, same activation in every hidden layer?)
    "1hidden": ([5, 7, 3], False),
    "2hidden": ([6, 8, 8, 4], False),
    "4hidden_same_act": ([5, 9, 9, 9, 9, 3], True),  # layers 2-4: one fusable 9x9 run
    "4hidden_mixed_act": ([5, 9, 9, 9, 9, 3], False),
    "nonuniform": ([6, 8, 5, 8, 3], False),
}

BATCH_SIZES = (5, 7, 6)  # one per step: different random batches


def make_seq(dims, acts, seed):
    """Random float64 Sequential Linear, act, ..., Linear; ``acts`` = one name per hidden layer."""
    torch.manual_seed(seed)
    mods = []
    for l in range(len(dims) - 1):
        mods.append(nn.Linear(dims[l], dims[l + 1]))
        if l < len(dims) - 2:
            mods.append(ACTIVATIONS[acts[l]]())
    return nn.Sequential(*mods).to(DT)


def make_batch(B, d_in, d_out, gen):
    x = torch.randn(B, d_in, generator=gen, dtype=DT)
    y = nn.functional.one_hot(torch.randint(0, d_out, (B,), generator=gen), d_out).to(DT)
    return x, y


def make_pair(seq, make_opt, T, x_lr, x_momentum, algorithm, energy):
    """pcdist trainer and reference trainer built from the same Sequential."""
    net = pcdist.PCNetwork.from_sequential(seq, energy=energy)
    trainer = pcdist.PCTrainer(net, make_opt(net.parameters()), T=T, x_lr=x_lr,
                               x_momentum=x_momentum, algorithm=algorithm)
    ref = ReferenceTrainer(seq, make_opt, T=T, x_lr=x_lr, x_momentum=x_momentum,
                           algorithm=algorithm, energy=energy)
    return net, trainer, ref


def assert_same_sequential(seq, ref_seq, what):
    mods, ref_mods = list(seq), list(ref_seq)
    assert [type(m) for m in mods] == [type(m) for m in ref_mods], f"{what}: structure"
    for m, r in zip(mods, ref_mods):
        if isinstance(r, nn.LeakyReLU):
            assert m.negative_slope == r.negative_slope, f"{what}: LeakyReLU slope"
        if isinstance(r, nn.GELU):
            assert m.approximate == r.approximate, f"{what}: GELU approximate"
    for l, ((lin, _), (rlin, _)) in enumerate(zip(split_layers(seq), split_layers(ref_seq)), 1):
        assert_close(lin.weight.detach(), rlin.weight.detach(), atol=ATOL, rtol=0, msg=lambda m: f"{what}: W_{l}: {m}")
        assert_close(lin.bias.detach(), rlin.bias.detach(), atol=ATOL, rtol=0, msg=lambda m: f"{what}: b_{l}: {m}")


def assert_matches(net, trainer, ref, stats, ref_stats, x, what):
    L = len(split_layers(ref.seq))
    # value nodes at the end of inference
    hs, ref_hs = trainer.value_nodes(), ref.value_nodes()
    assert len(hs) == L + 1, f"{what}: value_nodes() must return L+1 tensors"
    for l, (h, r) in enumerate(zip(hs, ref_hs)):
        assert_close(h.detach(), r, atol=ATOL, rtol=0, msg=lambda m: f"{what}: h_{l}: {m}")
    # energies of the specified evaluation
    assert stats["energy"] == pytest.approx(ref_stats["energy"], abs=ATOL, rel=0), f"{what}: energy"
    assert len(stats["layer_energies"]) == L, f"{what}: layer_energies length"
    for l, (e, r) in enumerate(zip(stats["layer_energies"], ref_stats["layer_energies"]), 1):
        assert float(e) == pytest.approx(r, abs=ATOL, rel=0), f"{what}: layer_energies[{l}]"
    assert sum(map(float, stats["layer_energies"])) == pytest.approx(float(stats["energy"]), abs=ATOL, rel=0)
    # weights after the update(s)
    assert_same_sequential(net.to_sequential(), ref.seq, what)
    # feed-forward prediction
    with torch.no_grad():
        assert_close(net(x), ref.seq(x), atol=ATOL, rtol=0, msg=lambda m: f"{what}: net(x): {m}")


def run_and_compare(seq, make_opt, T, x_lr, x_momentum, algorithm, energy, seed):
    net, trainer, ref = make_pair(seq, make_opt, T, x_lr, x_momentum, algorithm, energy)
    gen = torch.Generator().manual_seed(1000 + seed)
    d_in, d_out = seq[0].in_features, seq[-1].out_features
    for s, B in enumerate(BATCH_SIZES):
        x, y = make_batch(B, d_in, d_out, gen)
        stats = trainer.step(x, y)
        ref_stats = ref.step(x, y)
        assert_matches(net, trainer, ref, stats, ref_stats, x, what=f"step {s}")
    return net, trainer, ref


@pytest.mark.parametrize("algorithm", ["pc", "ipc"])
def test_value_momentum_starts_from_zero_at_every_batch_of_one_size(algorithm):
    """Consecutive batches of one size keep one Stage (BATCH_SIZES' sizes differ, so each step had a fresh one,
    whose velocities are zeros anyway): the value momentum must start from zero at each batch all the same (one
    carried over from the previous batch passed every reference test)."""
    seq = make_seq([6, 8, 8, 8, 4], ["tanh", "relu", "gelu"], seed=3)
    net, trainer, ref = make_pair(seq, OPTIMIZERS["sgd_momentum"], 5, 0.1, 0.5, algorithm, "se")
    gen = torch.Generator().manual_seed(7)
    for s in range(3):
        x, y = make_batch(6, 6, 4, gen)
        assert_matches(net, trainer, ref, trainer.step(x, y), ref.step(x, y), x, what=f"{algorithm} step {s}")


# -- every activation x both energies (pc, no value momentum); two equal 8x8 hidden layers
@pytest.mark.parametrize("energy", ["se", "ce"])
@pytest.mark.parametrize("act", ACT_NAMES)
def test_activations(act, energy):
    seq = make_seq([6, 8, 8, 8, 4], [act] * 3, seed=ACT_NAMES.index(act))
    run_and_compare(seq, OPTIMIZERS["sgd_momentum"], T=5, x_lr=0.1, x_momentum=0.0,
                    algorithm="pc", energy=energy, seed=1)


@pytest.mark.parametrize("name", ["relu", "hard_tanh"])
def test_an_activations_autograd_takes_the_derivative_its_fused_pass_takes_at_the_kinks(name):
    """At the kinks of relu (0) and hard_tanh (-1, 1), autograd through ``act(a)`` (the layers' own functions, the
    μPC residual module, the backprop twin) and the fused passes' ``act.grad`` take the same f': torch's (0 there,
    as nn.ReLU's); through clamp, autograd took 1, and a relu μPC whose free h_0 starts at 0 moved there only."""
    from pcdist.engine.activations import get_activation

    act = get_activation(name)
    a = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    act(a).sum().backward()
    u = act(a.detach())
    assert torch.equal(a.grad, act.grad(torch.ones_like(u), a.detach(), u, out=torch.empty_like(u)))


# -- algorithm x value momentum x optimizer x depth x energy (full product, 80 small cases).
#    Hidden activations cycle through all of them (mixed per layer unless the depth says same).
GRID = [(a, m, o, d, e) for a in ["pc", "ipc"] for m in [0.0, 0.5] for o in OPTIMIZERS
        for d in DIMS for e in ["se", "ce"]]


@pytest.mark.parametrize("algorithm,x_momentum,opt_name,dims_name,energy", GRID,
                         ids=[f"{a}-mu{m}-{o}-{d}-{e}" for a, m, o, d, e in GRID])
def test_grid(algorithm, x_momentum, opt_name, dims_name, energy):
    i = GRID.index((algorithm, x_momentum, opt_name, dims_name, energy))
    dims, same_act = DIMS[dims_name]
    acts = [ACT_NAMES[(i + (0 if same_act else k)) % len(ACT_NAMES)] for k in range(len(dims) - 2)]
    T = 4 + i % 4  # T in 4..7
    seq = make_seq(dims, acts, seed=100 + i)
    run_and_compare(seq, OPTIMIZERS[opt_name], T=T, x_lr=0.1, x_momentum=x_momentum,
                    algorithm=algorithm, energy=energy, seed=i)


# -- the comparison is not vacuous: values move, inference lowers the energy, weights change
@pytest.mark.parametrize("algorithm", ["pc", "ipc"])
def test_nontrivial(algorithm):
    seq = make_seq([5, 9, 9, 9, 3], ["tanh", "gelu", "leaky_relu"], seed=7)
    seq0 = copy.deepcopy(seq)
    net, trainer, ref = make_pair(seq, OPTIMIZERS["adamw"], T=7, x_lr=0.05, x_momentum=0.0,
                                  algorithm=algorithm, energy="se")
    gen = torch.Generator().manual_seed(7)
    for s, B in enumerate(BATCH_SIZES):
        x, y = make_batch(B, 5, 3, gen)
        ref_init = feed_forward_values(ref.seq, x, y)
        F_init = ref.energy_at(ref_init)
        stats, ref_stats = trainer.step(x, y), ref.step(x, y)
        assert_matches(net, trainer, ref, stats, ref_stats, x, what=f"step {s}")
        for l in range(1, 4):  # hidden value nodes moved away from the feed-forward pass
            assert (ref.value_nodes()[l] - ref_init[l]).abs().max() > 1e-5
        if algorithm == "pc":  # weights unchanged before the final evaluation: inference lowered F
            assert ref_stats["energy"] < F_init - 1e-4
        assert min(ref_stats["layer_energies"][:3]) > 1e-9  # hidden errors are non-zero after inference
    for (lin, _), (lin0, _) in zip(split_layers(net.to_sequential()), split_layers(seq0)):
        assert (lin.weight.detach() - lin0.weight).abs().max() > 1e-3
        assert (lin.bias.detach() - lin0.bias).abs().max() > 1e-3


def test_from_sequential_copies_weights():
    """from_sequential copies: round trip before training, and training leaves ``seq`` untouched."""
    seq = make_seq([5, 7, 7, 3], ["gelu_tanh", "sigmoid"], seed=3)
    seq0 = copy.deepcopy(seq)
    net, trainer, _ = make_pair(seq, OPTIMIZERS["sgd_momentum"], T=3, x_lr=0.1, x_momentum=0.0,
                                algorithm="pc", energy="ce")
    assert_same_sequential(net.to_sequential(), seq0, "round trip")
    x, y = make_batch(6, 5, 3, torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(net(x), seq0(x), atol=ATOL, rtol=0)
    trainer.step(x, y)
    assert_same_sequential(seq, seq0, "original Sequential after training")


@pytest.mark.parametrize("seed", [11, 21])
@pytest.mark.parametrize("algorithm", ["pc", "ipc"])
def test_float32_close(algorithm, seed):
    """float32 (the dtype follows the Sequential) against the float64 reference.

    With SGD + momentum the two stay within ~2e-7 (measured over 40 seeds); the bound is
    10x that. AdamW is left to the float64 tests: it divides each gradient by its own
    root mean square, so float32 round-off in near-zero gradients becomes a full-size
    step and the float32 run drifts from the float64 one by up to 1e-2 within four
    batches, whatever computes the gradients.
    """
    seq64 = make_seq([6, 8, 8, 8, 4], ["tanh"] * 3, seed=seed)
    seq = copy.deepcopy(seq64).float()
    ref = ReferenceTrainer(seq64, OPTIMIZERS["sgd_momentum"], T=5, x_lr=0.1, x_momentum=0.5,
                           algorithm=algorithm, energy="ce")
    net = pcdist.PCNetwork.from_sequential(seq, energy="ce")
    trainer = pcdist.PCTrainer(net, OPTIMIZERS["sgd_momentum"](net.parameters()), T=5, x_lr=0.1,
                               x_momentum=0.5, algorithm=algorithm)
    gen = torch.Generator().manual_seed(seed)
    for B in BATCH_SIZES:
        x, y = make_batch(B, 6, 4, gen)
        stats, ref_stats = trainer.step(x.float(), y.float()), ref.step(x, y)
        assert stats["energy"] == pytest.approx(ref_stats["energy"], abs=2e-6)
        for h, r in zip(trainer.value_nodes(), ref.value_nodes()):
            assert h.dtype == torch.float32
            assert_close(h.detach().double(), r, atol=2e-6, rtol=0)
    with torch.no_grad():
        out = net(x.float())
        assert out.dtype == torch.float32
        assert_close(out.double(), ref.seq(x), atol=2e-6, rtol=0)


@pytest.mark.parametrize("solver,T", [("euler", 2), ("heun", 1)])
def test_layers_below_the_error_front_keep_their_weights_under_adam_in_float32(solver, T):
    """pc from the feed-forward init moves the error one layer per evaluation (T x the solver's stages), so the
    lowest L - T x stages layers' weight gradients are exactly zero (docs/solvers.md): under Adam, which would
    scale round-off up to full steps, those layers keep their weights and biases to the bit in float32, as the
    float32 reference's do; the layers above learn as the reference's (7 tanh layers, 10 steps)."""
    seq = make_seq([6, 16, 16, 16, 16, 16, 16, 4], ["tanh"] * 6, seed=3).float()
    start = [p.detach().clone() for p in seq.parameters()]
    make_opt = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    net = pcdist.PCNetwork.from_sequential(seq)
    trainer = pcdist.PCTrainer(net, make_opt(net.parameters()), T=T, x_lr=0.1, solver=solver)
    ref = ReferenceTrainer(seq, make_opt, T=T, x_lr=0.1, solver=solver)
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        x, y = (t.float() for t in make_batch(8, 6, 4, gen))
        trainer.step(x, y, log=False), ref.step(x, y)
    for l, (lin, rlin) in enumerate(zip(split_layers(net.to_sequential()), split_layers(ref.seq)), 1):
        for name, w0 in zip(("weight", "bias"), start[2 * (l - 1): 2 * l]):
            w, r = getattr(lin[0], name).detach(), getattr(rlin[0], name).detach()
            if l < 5:  # below the front: L - T x stages = 7 - 2 = 5
                assert torch.equal(w, w0) and torch.equal(r, w0), f"layer {l}'s {name} moved"
            else:
                assert not torch.equal(w, w0), f"layer {l} learns"
                assert_close(w, r, atol=1e-5, rtol=0, msg=lambda m: f"layer {l}'s {name}: {m}")


# -- the value optimizers and the ODE solvers (issue 30) against the reference's own formulas: Nesterov,
#    Adam and AdamW from their update rules, Heun and RK4 from their Butcher tableaux (tests/reference.py)
METHODS = {
    "nesterov": dict(value_optimizer="nesterov", x_momentum=0.7, x_lr=0.1),
    "adam": dict(value_optimizer="adam", x_lr=0.02),
    # x_lr x decay (0.03 x 0.01) unlike the weights' AdamW lr x decay (0.02 x 0.01): equal, the two decays cancel
    # exactly through an identity layer in iPC and leave round-off for Adam to scale up
    "adamw": dict(value_optimizer="adamw", x_lr=0.03),
    "heun": dict(solver="heun", x_lr=0.1),
    "rk4": dict(solver="rk4", x_lr=0.1),
}
METHOD_GRID = [(m, a, d, e) for m in METHODS for a in ("pc", "ipc") for d in ("2hidden", "4hidden_same_act",
                                                                              "nonuniform") for e in ("se", "ce")]


def method_pair(seq, make_opt, T, energy, algorithm, method):
    """pcdist and the reference with one value optimizer or solver (``METHODS``)."""
    kw = dict(METHODS[method])
    x_lr, mu = kw.pop("x_lr"), kw.pop("x_momentum", 0.0)
    net = pcdist.PCNetwork.from_sequential(seq, energy=energy)
    trainer = pcdist.PCTrainer(net, make_opt(net.parameters()), T=T, x_lr=x_lr, x_momentum=mu, algorithm=algorithm,
                               **kw)
    ref_kw = dict(kw)
    if kw.get("value_optimizer") == "adamw":
        ref_kw["decay"] = 0.01  # the trainer's adamw on the values: torch's default decay
    ref = ReferenceTrainer(seq, make_opt, T=T, x_lr=x_lr, x_momentum=mu, algorithm=algorithm, energy=energy, **ref_kw)
    return net, trainer, ref


@pytest.mark.parametrize("method,algorithm,dims_name,energy", METHOD_GRID,
                         ids=[f"{m}-{a}-{d}-{e}" for m, a, d, e in METHOD_GRID])
def test_value_optimizers_and_solvers(method, algorithm, dims_name, energy):
    i = METHOD_GRID.index((method, algorithm, dims_name, energy))
    dims, same_act = DIMS[dims_name]
    acts = [ACT_NAMES[(i + (0 if same_act else k)) % len(ACT_NAMES)] for k in range(len(dims) - 2)]
    seq = make_seq(dims, acts, seed=300 + i)
    opt = "sgd_momentum" if i % 2 else "adamw"
    if algorithm == "ipc" and method.startswith("adam"):
        # Adam divides each node's gradient by its own scale, so where the exact gradient is zero (below the
        # error front, while SGD leaves the weights there alone) it turns round-off into full steps; in pc the
        # engine knows the front, in iPC an optimizer decides. AdamW's decay moves every weight at once.
        opt = "adamw"
    net, trainer, ref = method_pair(seq, OPTIMIZERS[opt], 3 + i % 3, energy, algorithm, method)
    gen = torch.Generator().manual_seed(500 + i)
    for s, B in enumerate(BATCH_SIZES):
        x, y = make_batch(B, dims[0], dims[-1], gen)
        assert_matches(net, trainer, ref, trainer.step(x, y), ref.step(x, y), x, what=f"{method} step {s}")


def test_the_methods_are_not_the_same_step():
    """Each value optimizer and solver moves the nodes somewhere else than Euler's SGD (the comparison above
    is not vacuous), and every one of them lowers the energy from the feed-forward init."""
    seq = make_seq([5, 9, 9, 9, 3], ["tanh", "gelu", "tanh"], seed=17)
    x, y = make_batch(6, 5, 3, torch.Generator().manual_seed(17))
    ends = {}
    for method in (None, *METHODS):
        if method is None:
            ref = ReferenceTrainer(seq, lambda p: torch.optim.SGD(p, lr=0.0), T=4, x_lr=0.1, energy="se")
        else:
            _, _, ref = method_pair(seq, lambda p: torch.optim.SGD(p, lr=0.0), 4, "se", "pc", method)
        stats = ref.step(x, y)
        assert stats["energy"] < ref.energy_at(feed_forward_values(seq, x, y)) - 1e-4, method
        ends[method] = ref.value_nodes()
    for method in METHODS:
        assert max((a - b).abs().max() for a, b in zip(ends[method], ends[None])) > 1e-4, method


def test_heun_and_rk4_are_higher_order():
    """On a linear network the flow dh/dt = -g(h) is linear and its exact solution over a time t is known
    (a matrix exponential); halving the step divides Euler's error by 2, Heun's by 4 and RK4's by 16."""
    seq = make_seq([4, 6, 6, 6, 3], ["identity"] * 3, seed=5)
    x, y = make_batch(5, 4, 3, torch.Generator().manual_seed(5))
    horizon = 0.8

    def final(solver, T):
        net = pcdist.PCNetwork.from_sequential(seq, energy="se")
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=T, x_lr=horizon / T, solver=solver)
        tr.step(x, y)
        return torch.cat([h.flatten() for h in tr.value_nodes()[1:-1]])

    # The exact solution, written from the energy with autograd (not from pcdist): per sample the flow of the free
    # nodes h (flattened) is dh/dt = -(H h + c), H and c the Hessian and gradient of E = sum_l ||e_l||^2 / 2 at
    # h = 0, so h(t) = h* + expm(-H t) (h(0) - h*) with h* = -H^-1 c, from the feed-forward h(0).
    lins = [m for m in seq if isinstance(m, nn.Linear)]
    width = lins[0].out_features

    def energy(h, xs, ys):
        nodes = [xs, *h.split(width), ys]
        return sum(0.5 * (nodes[l + 1] - lin(nodes[l])).square().sum() for l, lin in enumerate(lins))

    def exact_for(xs, ys):
        ff = [xs]
        for lin in lins[:-1]:
            ff.append(lin(ff[-1]))
        zero = torch.zeros(width * (len(lins) - 1), dtype=DT)
        H = torch.autograd.functional.hessian(lambda h: energy(h, xs, ys), zero)
        c = torch.autograd.functional.jacobian(lambda h: energy(h, xs, ys), zero)
        star = -torch.linalg.solve(H, c)
        return star + torch.linalg.matrix_exp(-H * horizon) @ (torch.cat(ff[1:]).detach() - star)

    per_sample = torch.stack([exact_for(x[b], y[b]) for b in range(x.shape[0])])  # [B, nodes x width]
    exact = torch.cat([per_sample[:, n * width : (n + 1) * width].flatten() for n in range(len(lins) - 1)])
    assert (final("rk4", 256) - exact).abs().max() < 1e-11  # the flow is the one integrated
    for solver, order in (("euler", 1), ("heun", 2), ("rk4", 4)):
        e1, e2 = ((final(solver, T) - exact).norm().item() for T in (4, 8))
        assert e1 / e2 == pytest.approx(2 ** order, rel=0.25), solver
