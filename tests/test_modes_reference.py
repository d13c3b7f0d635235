"""Free end nodes, priors, precisions, the new energies and value noise against the autograd reference.

The reference (tests/reference.py ``pc_step``) writes the energy with free ends down as a
formula (a prior 0.5 pi_0 ||h_0 - m_0||^2 on a free h_0, pi_l on every layer, the output energy
se / ce / bce / zero / a callable, a schedule scaling pi_l per inference step, Langevin noise)
and takes every gradient from torch.autograd; pcdist computes the same steps with each layer
kind's fused phases. After every step the value nodes, energies, weights (and a learned prior
mean) must agree to 1e-10 in float64, for every kind (dense, residual, conv, module), pc and ipc,
value momentum 0 and 0.5, SGD and AdamW.
"""

import copy
import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import pcdist
from pcdist.engine.layers.prior import Prior
from pcdist.engine.network import split_sequential
from pcdist.engine.schedules import top_down
from reference import pc_step

pytestmark = pytest.mark.usefixtures("single_thread")

DT = torch.float64
ATOL = 1e-10
OUT = 4


def quartic(u, target):
    """A callable output energy with its minimum at the target: 0.5 r^2 + 0.05 r^4 per entry."""
    r = u - target
    return (0.5 * r**2 + 0.05 * r**4).flatten(1).sum(1)


class Block(nn.Module):
    """A generic block for the module kind: h + 0.5 tanh(W LayerNorm(h))."""

    def __init__(self, d):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, h):
        return h + 0.5 * torch.tanh(self.lin(self.norm(h)))


def network(kind):
    """(layers, input shape) of a small float64 network of one kind (its first layer of that kind too)."""
    torch.manual_seed(sum(map(ord, kind)))
    if kind == "dense":
        layers = [nn.Sequential(nn.Linear(5, 7), nn.Tanh()), nn.Sequential(nn.Linear(7, 7), nn.GELU()),
                  nn.Sequential(nn.Linear(7, 7), nn.GELU()), nn.Linear(7, OUT)]
        shape = (5,)
    elif kind == "residual":
        layers = list(pcdist.mupc_layers(5, 6, 5, OUT, "tanh", bias=True, dtype=DT,
                                         generator=torch.Generator().manual_seed(3)))
        for m in layers:  # μPC's init is N(0, 1) with the scale in the forward pass: keep the test well scaled
            with torch.no_grad():
                m.weight.mul_(0.5)
        shape = (5,)
    elif kind == "conv":
        layers = split_sequential(nn.Sequential(
            nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Conv2d(3, 3, 3, padding=1), nn.ReLU(),
            nn.Conv2d(3, 3, 3, padding=1), nn.Sigmoid(), nn.Flatten(), nn.Linear(48, OUT)))
        shape = (1, 8, 8)
    else:  # module: three identical generic blocks (one vmapped group) between dense layers
        layers = [nn.Sequential(nn.Linear(5, 6), nn.Tanh()), Block(6), Block(6), Block(6), nn.Linear(6, OUT)]
        shape = (5,)
    return [m.to(DT) for m in layers], shape


OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
              "adamw": lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.01)}

# One feature set each: which ends are free, the prior, precisions (and schedule), the energy, noise.
FEATURES = {
    "unsupervised-prior": dict(bottom="free", prior=Prior(1.0, "zero")),
    "unsupervised-learned-prior-bce": dict(bottom="free", prior=Prior(0.5, "learned"), energy="bce"),
    "generative-uniform-prior-free-bottom": dict(bottom="free", prior=Prior(2.0, "uniform"), energy="se"),
    "generative-precision": dict(bottom="onehot", precision=2.0),
    # (noise: from the feed-forward init a free top sits at u_L, where its gradient is zero and any is right)
    "free-top-callable": dict(top="free", energy=quartic, precision=[0.5, 1.5, 2.0, 1.0, 0.7], noise=0.02),
    "se-top-precision": dict(precision=[2.0] * 5),  # (se's logged energy divides its pi-scaled signal back)
    "precision-per-layer-ce": dict(precision=[0.5, 1.5, 2.0, 1.0, 3.0], energy="ce"),
    "top-down-schedule-zero-energy-noise": dict(schedule=top_down(0.3), energy="zero", noise=0.05),
    "noise-unsupervised": dict(bottom="free", noise=0.05, prior=Prior(1.0, "learned")),
    # h_0 free, then clamped, then free: the clamped step has no prior term, so the learned mean stays put
    "semi-supervised-learned-prior": dict(bottom="mixed", prior=Prior(0.5, "learned")),
    "noise-free-top-schedule": dict(top="free", noise=0.02, schedule=top_down(0.5), precision=1.5),
}
KINDS = ("dense", "residual", "conv", "module")
SETTINGS = [(a, m, o) for a in ("pc", "ipc") for m in (0.0, 0.5) for o in OPTIMIZERS]


def fit_precision(p, L):
    """A per-layer list cut or padded to the network's depth (every kind's depth differs)."""
    if p is None or isinstance(p, (int, float)):
        return p
    return (list(p) + [1.0] * L)[:L]


def batches(feature, shape, steps, gen):
    """(x, y) per step: x one-hot for the generative cases, None where h_0 / h_L are free (bottom "mixed": free at
    even steps, clamped at odd ones)."""
    out = []
    for B in (5, 7, 6)[:steps]:
        energy = feature.get("energy", "se")
        x = torch.randn(B, *shape, generator=gen, dtype=DT)
        if feature.get("bottom") == "onehot":  # generative: a label at h_0 (a vector input only)
            x = nn.functional.one_hot(torch.randint(0, shape[0], (B,), generator=gen), shape[0]).to(DT)
        if energy in ("ce",):
            y = nn.functional.one_hot(torch.randint(0, OUT, (B,), generator=gen), OUT).to(DT)
        elif energy == "bce":
            y = torch.rand(B, OUT, generator=gen, dtype=DT)
        else:
            y = torch.randn(B, OUT, generator=gen, dtype=DT)
        free_bottom = feature.get("bottom") == "free" or feature.get("bottom") == "mixed" and len(out) % 2 == 0
        out.append((None if free_bottom else x, None if feature.get("top") == "free" else y))
    return out


def compare(kind, feature, algorithm, x_momentum, optimizer, steps=3, T=4, method=None):
    """pcdist against ``pc_step`` on ``steps`` batches; ``method``: the value optimizer / solver options (of
    both) and the value step, e.g. dict(solver="heun", x_lr=0.1)."""
    method = dict(method or {})
    x_lr = method.pop("x_lr", 0.1)
    layers, shape = network(kind)
    L = len(layers)
    f = FEATURES[feature]
    prior = f.get("prior", Prior())
    precision = fit_precision(f.get("precision"), L)
    energy, schedule, noise = f.get("energy", "se"), f.get("schedule"), f.get("noise", 0.0)
    net = pcdist.PCNetwork.from_layers(copy.deepcopy(layers), energy=energy, input_shape=shape, precision=precision,
                                       prior=prior)
    make_opt = OPTIMIZERS[optimizer]
    trainer = pcdist.PCTrainer(net, make_opt(net.parameters()), T=T, x_lr=x_lr, x_momentum=x_momentum,
                               algorithm=algorithm, precision_schedule=schedule, value_noise=noise, noise_seed=5,
                               **{k: v for k, v in method.items() if k in ("value_optimizer", "solver")})
    ref = copy.deepcopy(layers)
    params = [p for m in ref for p in m.parameters()]
    fill = {"zero": 0.0, "uniform": 1.0 / math.prod(shape), "learned": 0.0}[prior.mean]
    m0 = torch.full(shape, fill, dtype=DT, requires_grad=prior.mean == "learned")
    opt = make_opt(params + ([m0] if prior.mean == "learned" else []))
    pis = None if precision is None else ([float(precision)] * (L - 1) + [1.0] if isinstance(precision, float)
                                          else precision)
    for s, (x, y) in enumerate(batches(f, shape, steps, torch.Generator().manual_seed(7))):
        stats = trainer.step(x, y)
        ref_stats, hs = pc_step(lambda l, h: ref[l - 1](h), L, params + ([m0] if prior.mean == "learned" else []),
                                opt, x, y, T, x_lr, x_momentum, algorithm, energy, precision=pis, schedule=schedule,
                                prior_precision=prior.precision, prior_mean=m0, noise=noise, noise_seed_=5, call=s,
                                **method)
        what = f"{kind} {feature} {algorithm} mu={x_momentum} {optimizer} step {s}"
        for n, (a, b) in enumerate(zip(trainer.value_nodes(), hs)):
            assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m: f"{what}: h_{n}: {m}")
        assert stats["energy"] == pytest.approx(ref_stats["energy"], abs=ATOL, rel=0), what
        assert stats["layer_energies"] == pytest.approx(ref_stats["layer_energies"], abs=ATOL, rel=0), what
        assert stats.get("prior_energy", 0.0) == pytest.approx(ref_stats["prior_energy"], abs=ATOL, rel=0), what
        for a, b in zip(net.to_layers().parameters(), params):
            assert_close(a.detach(), b.detach(), atol=ATOL, rtol=0, msg=lambda m: f"{what}: weights: {m}")
        if prior.mean == "learned":
            assert_close(net.layer_state_dict()["layers.0.mean"], m0.detach(), atol=ATOL, rtol=0)
    return net, trainer, hs


# A one-hot label sits on a vector h_0: the conv network (an image at h_0) takes no generative case.
CASES = [(k, f) for f in FEATURES for k in KINDS if not (FEATURES[f].get("bottom") == "onehot" and k == "conv")]


@pytest.mark.parametrize("kind,feature", CASES, ids=[f"{k}-{f}" for k, f in CASES])
def test_features_on_every_kind(kind, feature):
    """Every feature on every kind, the (algorithm, momentum, optimizer) setting cycled over them."""
    i = CASES.index((kind, feature))
    algorithm, x_momentum, optimizer = SETTINGS[i % len(SETTINGS)]
    if FEATURES[feature].get("top") == "free":
        # A free top starts at u_L, so the output layer's weight gradient is ~0 throughout: AdamW divides
        # it by its own root mean square and turns float64 round-off (1e-17) into steps of ~1e-11.
        optimizer = "sgd"
    compare(kind, feature, algorithm, x_momentum, optimizer)


@pytest.mark.parametrize("algorithm,x_momentum,optimizer", SETTINGS, ids=[f"{a}-mu{m}-{o}" for a, m, o in SETTINGS])
@pytest.mark.parametrize("kind", KINDS)
def test_every_setting_on_every_kind(kind, algorithm, x_momentum, optimizer):
    """The full (algorithm, momentum, optimizer) product per kind, on the feature that exercises most at
    once: a free h_0 with a learned prior, noise."""
    compare(kind, "noise-unsupervised", algorithm, x_momentum, optimizer, steps=2)


def test_the_comparison_is_not_vacuous():
    """A free h_0 moves away from its prior mean, the learned mean moves, noise changes the result."""
    net, trainer, hs = compare("dense", "noise-unsupervised", "pc", 0.0, "adamw")
    assert hs[0].abs().max() > 1e-3  # h_0 inferred away from m_0 = 0
    assert net.layer_state_dict()["layers.0.mean"].abs().max() > 1e-4
    quiet = copy.deepcopy(FEATURES["noise-unsupervised"])
    quiet["noise"] = 0.0
    FEATURES["quiet"] = quiet
    try:
        _, _, hs_quiet = compare("dense", "quiet", "pc", 0.0, "adamw")
    finally:
        del FEATURES["quiet"]
    assert (hs[1] - hs_quiet[1]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_infer_equals_the_reference_inference(kind):
    """``infer`` clamps what is given and leaves the weights alone: classification by inference (free h_0,
    h_L = data), a free top, and sampling with both ends free under noise."""
    layers, shape = network(kind)
    L = len(layers)
    net = pcdist.PCNetwork.from_layers(copy.deepcopy(layers), input_shape=shape, prior=Prior(0.5, "uniform"))
    trainer = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=5, x_lr=0.1, noise_seed=9)
    before = [p.detach().clone() for p in net.parameters()]
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, *shape, generator=gen, dtype=DT), torch.randn(6, OUT, generator=gen, dtype=DT)
    m0 = torch.full(shape, 1.0 / math.prod(shape), dtype=DT)
    for call, (xx, yy, tau) in enumerate(((None, y, 0.0), (x, None, 0.0), (None, None, 0.3))):
        got = trainer.infer(xx, yy, T=6, noise=tau, batch_size=6)
        ref = copy.deepcopy(layers)
        params = [p for m in ref for p in m.parameters()]
        opt = torch.optim.SGD(params, lr=0.0)
        _, want = pc_step(lambda l, h: ref[l - 1](h), L, params, opt, xx, yy, 6, 0.1, 0.0, "pc", "se",
                          prior_precision=0.5, prior_mean=m0, noise=tau, noise_seed_=9, call=-1 - call, batch_size=6)
        for n, (a, b) in enumerate(zip(got, want)):
            assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m: f"{kind} infer call {call}: h_{n}: {m}")
    for p, q in zip(net.parameters(), before):
        assert torch.equal(p.detach(), q)


# The value optimizers and solvers of issue 30 on every kind: each cycles through the features without noise
# (noise is an Euler-Maruyama step) and through pc / ipc.
METHODS = {"nesterov": dict(value_optimizer="nesterov", x_lr=0.1), "adam": dict(value_optimizer="adam", x_lr=0.02),
           "adamw": dict(value_optimizer="adamw", x_lr=0.03, decay=0.01), "heun": dict(solver="heun", x_lr=0.1),
           "rk4": dict(solver="rk4", x_lr=0.1)}
QUIET = [f for f in FEATURES if not FEATURES[f].get("noise")]
METHOD_CASES = [(k, m) for k in KINDS for m in METHODS]


@pytest.mark.parametrize("kind,method", METHOD_CASES, ids=[f"{k}-{m}" for k, m in METHOD_CASES])
def test_value_optimizers_and_solvers_on_every_kind(kind, method):
    """Adam divides each gradient by its own scale, so wherever the exact gradient is zero it turns round-off into
    full steps (tests/test_reference.py): Adam on the values meets no free top (it starts where its energy is
    flat) and, in iPC, AdamW on the weights (its decay moves the weights below the error front, which SGD leaves
    alone) and no learned prior mean (AdamW would scale up the round-off of its first, exactly zero gradient)."""
    i = METHOD_CASES.index((kind, method))
    algorithm = ("pc", "ipc")[i % 2]
    adam = method.startswith("adam")
    quiet = [f for f in QUIET if not (FEATURES[f].get("bottom") == "onehot" and kind == "conv")
             and not (adam and (FEATURES[f].get("top") == "free"
                                or algorithm == "ipc" and FEATURES[f].get("prior", Prior()).mean == "learned"))]
    feature = quiet[i % len(quiet)]
    optimizer = "adamw" if adam and algorithm == "ipc" else "sgd"
    mu = 0.6 if method == "nesterov" else 0.0
    compare(kind, feature, algorithm, mu, optimizer, steps=2, T=3, method=METHODS[method])


@pytest.mark.parametrize("algorithm", ["pc", "ipc"])
def test_top_down_acts_only_where_layers_have_errors_before_the_front_and_says_so_where_it_cannot(algorithm, recwarn):
    """top_down damps the layers the output's error has not reached. After the feed-forward init, without value
    noise or a value decay, those have no error (layer l has none before step L - l), so it changes nothing beyond
    round-off (the docs said it re-balanced the errors there) and the trainer warns; after init='backward' or under
    noise it changes the step, without the warning."""
    x, y = torch.randn(6, 5, dtype=DT), torch.randn(6, 3, dtype=DT)

    def step(schedule, **kw):
        net = pcdist.PCNetwork.from_dims([5, 8, 8, 8, 8, 3], activation="tanh", seed=0, dtype=DT)
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=3, x_lr=0.1, algorithm=algorithm,
                              precision_schedule=schedule, **kw)
        return tr.step(x, y)["energy"], [p.detach().clone() for p in net.parameters()]

    for kw, inert in ((dict(init="ff"), True), (dict(init="deeppcr"), True), (dict(init="backward"), False),
                      (dict(value_noise=0.05), False), (dict(value_optimizer=pcdist.ValueRule("adamw")), False)):
        recwarn.clear()
        with_it, without = step(top_down(0.3), **kw), step(None, **kw)
        said = [str(w.message) for w in recwarn if "changes nothing here" in str(w.message)]
        moved = max(float((a - b).abs().max()) for a, b in zip(with_it[1], without[1]))
        assert (moved < 1e-14) == inert and (inert or moved > 1e-6), (kw, moved)  # (round-off: the ff state's errors)
        assert len(said) == int(inert), (kw, said)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_clamped_step_leaves_a_learned_prior_mean_alone_in_every_precision(precision):
    """Semi-supervised use: a step with h_0 free trains the mean, one with h_0 clamped has no prior term, so the
    mean neither moves nor keeps a gradient (bf16: the float32 master's, cast from the bfloat16 copy's)."""
    torch.manual_seed(0)
    net = pcdist.PCNetwork.from_dims([3, 6, 5], prior=Prior(1.0, "learned"))
    (mean,) = [p for n, p in net.named_parameters() if n.endswith("mean")]
    trainer = pcdist.PCTrainer(net, torch.optim.AdamW(net.parameters(), lr=0.1), T=5, x_lr=0.1, precision=precision)
    x, y = torch.randn(4, 3), torch.randn(4, 5)
    trainer.step(None, y)
    trained = mean.detach().clone()
    assert trained.abs().max() > 1e-3  # the free step moved it
    trainer.step(x, y)
    assert torch.equal(mean.detach(), trained)
    assert mean.grad is None


def test_value_noise_is_drawn_anew_at_every_step_and_every_sampling_call():
    """(review rv115) tests/reference.py takes noise_seed from pcdist, so a seed that ignored the call index (the
    same noise at every step: correlated, not Langevin noise; every infer(noise=) the same "sample") passed every
    reference test. Independent checks: distinct seeds, two sampling calls differ, two lr-0 steps on one batch
    log different energies."""
    from pcdist.engine.values import noise_seed

    assert len({noise_seed(0, c) for c in range(-50, 50)}) == 100
    torch.manual_seed(0)
    net = pcdist.PCNetwork.from_sequential(nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4)).to(DT))
    x, y = torch.randn(4, 6, dtype=DT), torch.randn(4, 4, dtype=DT)
    sampler = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=3, x_lr=0.1, noise_seed=5)
    assert not torch.equal(sampler.infer(x, None, noise=0.5)[1], sampler.infer(x, None, noise=0.5)[1])
    trainer = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=3, x_lr=0.1, value_noise=0.5,
                               noise_seed=5)
    assert trainer.step(x, y)["energy"] != trainer.step(x, y)["energy"]
