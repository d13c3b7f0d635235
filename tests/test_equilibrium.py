"""Inits near the equilibrium of inference (pcdist/engine/equilibrium.py), against what they are defined to be.

``newton`` is Newton's step on the energy from the feed-forward state, computed through the low-rank form of
the linearised equilibrium; the test computes the same step the plain way, with torch.autograd's Hessian of the
reference energy (tests/reference.py) in all hidden nodes at once, and compares the errors the init leaves at
every layer to 1e-10 in float64. ``newton_cr`` is the same step by block cyclic reduction (equal to newton).
On a linear network the energy is quadratic, so Newton's step lands on the equilibrium itself: the energy's
gradient in every hidden node is zero after the init. ``backward`` minimises the linearised energy along one
direction, so it lowers the energy from the feed-forward state but not below Newton's. Every init leaves
errors at every layer, which is what lets the lowest layers of a deep network learn at T < L.
"""

import pytest
import torch
from torch import nn
from torch.func import jvp

import pcdist
from pcdist.engine.equilibrium import block_tridiagonal_solve
from reference import feed_forward_values, layer_energies_from, sequential_predict, split_layers

pytestmark = pytest.mark.usefixtures("single_thread")

DT = torch.float64


def mlp(dims, act, seed):
    torch.manual_seed(seed)
    mods = []
    for l in range(len(dims) - 1):
        mods.append(nn.Linear(dims[l], dims[l + 1]))
        if l < len(dims) - 2:
            mods.append(act())
    return nn.Sequential(*mods).to(DT)


def batch(B, d_in, d_out, energy, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, d_in, generator=g, dtype=DT)
    if energy == "ce":
        return x, torch.eye(d_out, dtype=DT)[torch.randint(0, d_out, (B,), generator=g)]
    return x, torch.randn(B, d_out, generator=g, dtype=DT)


def init_nodes(seq, x, y, init, energy, precision=None):
    net = pcdist.PCNetwork.from_sequential(seq, energy=energy, precision=precision)
    tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=1, x_lr=0.1, init=init)
    with torch.no_grad():  # the init as a step runs it
        st = tr._begin(x, y, None)
        st.restart()  # as a step's core starts
        tr.parallel.feedforward(st)
    return [st.node(n).clone() for n in range(net.num_layers + 1)]


def reference_newton_errors(seq, x, y, energy, pis):
    """Newton's step on the reference energy in the hidden nodes from the feed-forward state (autograd Hessian),
    then each layer's error pi_l (delta_l - J_l delta_{l-1}) of the linearised step."""
    layers = split_layers(seq)
    L, predict = len(layers), sequential_predict(layers)
    hs = feed_forward_values(seq, x, y)
    shapes = [h.shape for h in hs[1:L]]
    sizes = [h.numel() for h in hs[1:L]]

    def energy_of(flat):
        hidden = [t.view(s) for t, s in zip(flat.split(sizes), shapes)]
        nodes = [hs[0], *hidden, hs[L]]
        return torch.stack(layer_energies_from(predict, L, nodes, energy, pis)).sum()

    flat0 = torch.cat([h.flatten() for h in hs[1:L]])
    g = torch.autograd.functional.jacobian(energy_of, flat0)
    H = torch.autograd.functional.hessian(energy_of, flat0)
    delta = [d.view(s) for d, s in zip(torch.linalg.solve(H, -g).split(sizes), shapes)]
    errors, prev = [], torch.zeros_like(hs[0])
    for l in range(1, L):
        J_prev = jvp(lambda h: predict(l, h), (hs[l - 1],), (prev,))[1]
        errors.append(pis[l - 1] * (delta[l - 1] - J_prev))
        prev = delta[l - 1]
    return errors


def injected_errors(seq, nodes, pis):
    """pi_l (h_l - u_l(h_{l-1})) at the init's nodes, by the reference's own predictions."""
    layers = split_layers(seq)
    predict = sequential_predict(layers)
    with torch.no_grad():
        return [pis[l - 1] * (nodes[l] - predict(l, nodes[l - 1])) for l in range(1, len(layers))]


CASES = {"tanh-se": ([5, 8, 8, 8, 3], nn.Tanh, "se", None), "gelu-ce": ([6, 9, 7, 9, 4], nn.GELU, "ce", None),
         "sigmoid-se-precisions": ([4, 6, 6, 6, 6, 3], nn.Sigmoid, "se", [0.5, 2.0, 1.5, 0.8, 1.2]),
         "relu-ce-two-layers": ([5, 7, 4], nn.ReLU, "ce", None)}


@pytest.mark.parametrize("name", list(CASES))
def test_newton_is_newtons_step_on_the_energy(name):
    dims, act, energy, precision = CASES[name]
    seq = mlp(dims, act, seed=len(name))
    x, y = batch(6, dims[0], dims[-1], energy, seed=3)
    L = len(dims) - 1
    pis = precision or [1.0] * L
    want = reference_newton_errors(seq, x, y, energy, pis)
    for init in ("newton", "newton_cr"):
        got = injected_errors(seq, init_nodes(seq, x, y, init, energy, precision), pis)
        for l, (a, b) in enumerate(zip(got, want), 1):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=lambda m: f"{name} {init}: e_{l}: {m}")
            assert b.abs().max() > 1e-4, "the step puts an error at every hidden layer"


def test_on_a_linear_network_newton_lands_on_the_equilibrium():
    """Identity activations and the se energy: the energy is quadratic in the hidden nodes, so one Newton step
    from anywhere is its minimum: every hidden node's gradient vanishes, and inference has nothing left to do."""
    seq = mlp([5, 7, 7, 7, 7, 3], nn.Identity, seed=2)
    x, y = batch(6, 5, 3, "se", seed=2)
    layers = split_layers(seq)
    predict = sequential_predict(layers)
    for init in ("newton", "newton_cr"):
        nodes = [h.detach().requires_grad_(0 < n < len(layers)) for n, h in enumerate(init_nodes(seq, x, y, init,
                                                                                                   "se"))]
        E = torch.stack(layer_energies_from(predict, len(layers), nodes, "se")).sum()
        grads = torch.autograd.grad(E, nodes[1:-1])
        assert max(g.abs().max().item() for g in grads) < 1e-12, init
        ff = feed_forward_values(seq, x, y)
        assert min((a - b).abs().max().item() for a, b in zip(nodes[1:-1], ff[1:-1])) > 1e-3


@pytest.mark.parametrize("energy", ["se", "ce"])
def test_backward_lowers_the_energy_but_not_below_newton(energy):
    seq = mlp([6, 10, 10, 10, 4], nn.Tanh, seed=9)
    x, y = batch(8, 6, 4, energy, seed=9)
    layers = split_layers(seq)
    predict = sequential_predict(layers)

    def F(nodes):
        with torch.no_grad():
            return torch.stack(layer_energies_from(predict, len(layers), nodes, energy)).sum(0)  # per sample

    ff = F(feed_forward_values(seq, x, y))
    back, newton = F(init_nodes(seq, x, y, "backward", energy)), F(init_nodes(seq, x, y, "newton", energy))
    assert (back < ff).all() and (newton < ff).all()
    assert newton.sum() <= back.sum() + 1e-9


@pytest.mark.parametrize("init", ["newton", "backward", "newton_cr"])
def test_under_a_precision_schedule_the_init_reads_the_networks_own_precisions(init):
    """The inits near equilibrium read the hidden layers' precisions from the network and the output layer's from
    the step's precision tensor, which a schedule leaves at its last row: the same infer call gave other nodes
    after another call (0.36 apart), a training step with lr 0 another energy on the same batch. Every call now
    starts from the network's own precisions: identical calls agree to the bit, and equal a trainer's first."""
    x, y = torch.randn(6, 5, dtype=DT), torch.randn(6, 3, dtype=DT)

    def output_ramp(layer, t, L):  # the output layer's precision grows over the steps
        return 1.0 + t if layer == L else 1.0

    def fresh():
        net = pcdist.PCNetwork.from_dims([5, 8, 8, 8, 3], activation="tanh", seed=0, dtype=DT)
        return pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=3, x_lr=0.1, init=init,
                                precision_schedule=output_ramp)

    tr = fresh()
    first = tr.infer(x, y)
    tr.trace(x, y)
    for again in (tr.infer(x, y), tr.infer(x, y), fresh().infer(x, y)):
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    tr = fresh()
    energies = [tr.step(x, y)["energy"] for _ in range(3)]
    assert energies[1] == energies[0] and energies[2] == energies[0], energies
    tr = fresh()  # a schedule set anew on the live trainer: its first call, as a trainer made with it
    tr.infer(x, y)
    tr.precision_schedule = lambda layer, t, L: 1.0  # (it read the old schedule's last output precision: 0.49 off)
    net = pcdist.PCNetwork.from_dims([5, 8, 8, 8, 3], activation="tanh", seed=0, dtype=DT)
    new = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=3, x_lr=0.1, init=init,
                           precision_schedule=lambda layer, t, L: 1.0).infer(x, y)
    assert all(torch.equal(a, b) for a, b in zip(tr.infer(x, y), new))


def test_block_tridiagonal_solve_equals_a_dense_solve():
    """Cyclic reduction on random diagonally dominant blocks, for 1 to 9 blocks (odd and even counts)."""
    g = torch.Generator().manual_seed(0)
    for n in range(1, 10):
        B, D = 3, 4
        lower, upper = torch.randn(n, B, D, D, generator=g, dtype=DT), torch.randn(n, B, D, D, generator=g, dtype=DT)
        diag = torch.randn(n, B, D, D, generator=g, dtype=DT) + 8 * torch.eye(D, dtype=DT)
        rhs = torch.randn(n, B, D, generator=g, dtype=DT)
        dense = torch.zeros(B, n * D, n * D, dtype=DT)
        for i in range(n):
            dense[:, i * D:(i + 1) * D, i * D:(i + 1) * D] = diag[i]
            if i > 0:
                dense[:, i * D:(i + 1) * D, (i - 1) * D:i * D] = lower[i]
            if i < n - 1:
                dense[:, i * D:(i + 1) * D, (i + 1) * D:(i + 2) * D] = upper[i]
        want = torch.linalg.solve(dense, rhs.permute(1, 0, 2).reshape(B, n * D)).view(B, n, D).permute(1, 0, 2)
        torch.testing.assert_close(block_tridiagonal_solve(lower, diag, upper, rhs), want, atol=1e-12, rtol=0)


def test_deep_network_learns_in_every_layer_at_small_T():
    """From the feed-forward init an error moves one layer per step: at T = 2 on a 12-layer network the lowest
    nine layers get no weight gradient (exactly: the engine leaves the layers below the error front out of the
    weight step, Stage.front, as the physics has it). From any init near equilibrium every layer gets one."""
    specs = pcdist.mupc_specs(6, 16, 12, 4, "tanh")
    x, y = batch(8, 6, 4, "se", seed=1)
    for init, reach in (("ff", "top"), ("newton", "all"), ("backward", "all")):
        net = pcdist.PCNetwork(specs, dtype=DT, seed=0)
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=2, x_lr=0.1, init=init)
        tr.step(x, y)
        norms = [g.weight.grad[k].norm().item() for g in net.groups for k in range(g.K)]
        if reach == "top":
            assert norms[:9] == [0.0] * 9 and norms[-1] > 1e-6, (init, norms)
        else:
            assert all(n > 1e-6 for n in norms), (init, norms)


def test_the_inits_refuse_what_they_cannot_do():
    net = pcdist.PCNetwork.from_dims([5, 6, 6, 3], "tanh", dtype=DT, seed=0)
    tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=2, init="newton")
    x, y = batch(4, 5, 3, "se", seed=0)
    with pytest.raises(ValueError, match="clamped"):
        tr.step(None, y)
    with pytest.raises(ValueError, match="init"):
        pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), init="newtonish")


@pytest.mark.parametrize("kind", ["mupc-tanh", "mupc-relu-ce", "conv"])
def test_every_kind_takes_the_same_newton_step_both_ways(kind):
    """The residual kind's closed-form products and the conv kind's torch.func ones give the step that cyclic
    reduction computes from torch.func's per-sample Jacobians of the same layers (an independent route)."""
    g = torch.Generator().manual_seed(5)
    if kind.startswith("mupc"):
        act, energy = kind.split("-")[1], "ce" if kind.endswith("ce") else "se"

        def net_of(init):
            return pcdist.PCNetwork(pcdist.mupc_specs(5, 6, 5, 3, act), dtype=DT, seed=2, energy=energy)

        x = torch.randn(4, 5, generator=g, dtype=DT)
    else:
        energy = "se"
        seq = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Conv2d(2, 2, 3, padding=1),
                            nn.Tanh(), nn.Flatten(), nn.Linear(8, 3)).to(DT)

        def net_of(init):
            return pcdist.PCNetwork.from_sequential(seq, input_shape=(1, 4, 4), energy=energy)

        x = torch.randn(4, 1, 4, 4, generator=g, dtype=DT)
    y = torch.eye(3, dtype=DT)[torch.tensor([0, 2, 1, 2])] if energy == "ce" else torch.randn(4, 3, generator=g,
                                                                                                dtype=DT)
    nodes = {}
    for init in ("ff", "newton", "newton_cr"):
        net = net_of(init)
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=1, init=init)
        with torch.no_grad():
            st = tr._begin(x, y, None)
            st.restart()  # as a step's core starts
            tr.parallel.feedforward(st)
        nodes[init] = [st.node(n).clone() for n in range(net.num_layers + 1)]
    for n, (a, b) in enumerate(zip(nodes["newton"], nodes["newton_cr"])):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=lambda m: f"{kind}: h_{n}: {m}")
    assert max((a - b).abs().max() for a, b in zip(nodes["newton"][1:-1], nodes["ff"][1:-1])) > 1e-4


@pytest.mark.parametrize("init", ["newton", "backward"])
@pytest.mark.parametrize("kind", ["mlp-gelu-ce", "mupc-tanh-se", "mupc-relu-ce"])
def test_closed_form_products_equal_torch_func(kind, init, monkeypatch):
    """Dense and residual layers take their Jacobian products in closed form (one GEMM each); through torch.func
    (as every other kind) the inits are the same to 1e-12."""
    import pcdist.engine.equilibrium as eq

    name, act, energy = kind.split("-")
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 6, generator=g, dtype=DT)
    y = torch.eye(4, dtype=DT)[torch.tensor([0, 3, 1, 2, 3])] if energy == "ce" else torch.randn(5, 4, generator=g,
                                                                                                   dtype=DT)
    specs = pcdist.mlp_specs([6, 7, 7, 7, 4], act) if name == "mlp" else pcdist.mupc_specs(6, 7, 6, 4, act)
    got = {}
    for closed in (True, False):
        monkeypatch.setattr(eq, "CLOSED_FORM", closed)
        net = pcdist.PCNetwork(specs, dtype=DT, seed=3, energy=energy)
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=1, init=init)
        with torch.no_grad():
            st = tr._begin(x, y, None)
            st.restart()  # as a step's core starts
            tr.parallel.feedforward(st)
        got[closed] = [st.node(n).clone() for n in range(net.num_layers + 1)]
    for n, (a, b) in enumerate(zip(got[True], got[False])):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=lambda m: f"{kind} {init}: h_{n}: {m}")


@pytest.mark.parametrize("init", ["newton", "backward", "newton_cr"])
def test_the_inits_take_a_callable_output_energy_as_its_built_in_twin(init):
    """A callable energy (its curvature by autograd) equal to se gives the steps se gives (it raised: the init
    called the energy's wrapper, not the user's function)."""
    x, y = torch.randn(6, 5, dtype=DT), torch.randn(6, 3, dtype=DT)

    def se(u, target):
        return 0.5 * ((u - target) ** 2).sum(1)

    got = []
    for energy in ("se", se):
        net = pcdist.PCNetwork.from_dims([5, 8, 8, 3], activation="tanh", seed=0, dtype=DT, energy=energy)
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=3, x_lr=0.1, init=init)
        got.append((tr.step(x, y)["energy"], [p.detach().clone() for p in net.parameters()]))
    assert got[1][0] == pytest.approx(got[0][0], abs=1e-12)
    for a, b in zip(got[0][1], got[1][1]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
