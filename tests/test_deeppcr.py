"""DeepPCR: the chain's states and its backward pass equal the sequential loop / autograd."""

import warnings

import pytest
import torch
from torch import nn

from pcdist import deeppcr
from pcdist.engine.activations import Activation


def chain(L, D, act, dtype=torch.float64, seed=0, gain=1.2):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(L, D, D, generator=g, dtype=dtype) * gain / D**0.5
    b = torch.randn(L, D, generator=g, dtype=dtype) * 0.1
    return w, b, Activation(act)


def loop_states(w, b, act, x0):
    """The obviously-right sequential pass."""
    xs = [x0]
    for l in range(w.shape[0]):
        xs.append(act(xs[-1] @ w[l] + b[l]))
    return torch.stack(xs)


@pytest.mark.parametrize("act", ["tanh", "relu"])
@pytest.mark.parametrize("L", [1, 2, 3, 7, 64, 257])
@pytest.mark.parametrize("D", [4, 16])
def test_states_match_the_sequential_loop_float64(act, L, D):
    w, b, A = chain(L, D, act, seed=L * 31 + D)
    x0 = torch.randn(5, D, dtype=torch.float64)
    res = deeppcr.solve((w, b, A), x0)
    torch.testing.assert_close(res.states, loop_states(w, b, A, x0), atol=1e-10, rtol=0)
    assert res.converged and res.residual <= 16 * torch.finfo(torch.float64).eps * (1 + x0.abs().max().item())
    assert 1 <= res.iterations <= L + 1


@pytest.mark.parametrize("act", ["tanh", "relu"])
@pytest.mark.parametrize("L", [7, 64])
def test_states_match_in_float32(act, L):
    w, b, A = chain(L, 8, act, dtype=torch.float32, seed=L)
    x0 = torch.randn(4, 8, generator=torch.Generator().manual_seed(L))  # seeded: the global RNG depends on the order
    res = deeppcr.solve((w, b, A), x0)
    torch.testing.assert_close(res.states, loop_states(w, b, A, x0), atol=1e-5, rtol=0)


def test_sequential_module_input():
    torch.manual_seed(0)
    seq = nn.Sequential(*[m for _ in range(9) for m in (nn.Linear(6, 6), nn.Tanh())]).double()
    x0 = torch.randn(3, 6, dtype=torch.float64)
    res = deeppcr.solve(seq, x0)
    torch.testing.assert_close(res.states[-1], seq(x0), atol=1e-10, rtol=0)


@pytest.mark.parametrize("act", ["tanh", "relu"])
@pytest.mark.parametrize("L", [1, 5, 33])
def test_backward_pass_matches_autograd(act, L):
    """chain_vjp: dLoss/dx_l for every l in one reduction equals autograd through the loop."""
    w, b, A = chain(L, 8, act, seed=L + 100)
    x0 = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    xs = [x0]
    for l in range(L):
        xs.append(A(xs[-1] @ w[l] + b[l]))
        xs[-1].retain_grad()
    v = torch.randn(4, 8, dtype=torch.float64)
    (xs[-1] * v).sum().backward()
    grads = deeppcr.chain_vjp((w, b, A), torch.stack([x.detach() for x in xs]), v)
    for l in range(L):
        torch.testing.assert_close(grads[l], xs[l].grad, atol=1e-10, rtol=0, msg=f"dLoss/dx_{l}")
    torch.testing.assert_close(grads[L], v)


@pytest.mark.parametrize("L", [1, 2, 6, 17])
def test_solve_linear_matches_the_recurrence(L):
    g = torch.Generator().manual_seed(L)
    M = torch.randn(L, 3, 5, 5, generator=g, dtype=torch.float64) * 0.4
    r = torch.randn(L, 3, 5, generator=g, dtype=torch.float64)
    y, want = torch.zeros(3, 5, dtype=torch.float64), []
    for l in range(L):
        y = (y.unsqueeze(-2) @ M[l]).squeeze(-2) + r[l]
        want.append(y)
    torch.testing.assert_close(deeppcr.solve_linear(M, r), torch.stack(want), atol=1e-12, rtol=0)


def test_non_convergence_is_reported_not_hidden():
    w, b, A = chain(64, 16, "tanh", seed=3)
    x0 = torch.randn(5, 16, dtype=torch.float64)
    with pytest.raises(deeppcr.NotConverged, match=r"residual .* > tol .* after 2 Newton iterations \(L=64\)"):
        deeppcr.solve((w, b, A), x0, max_iters=2)
    res = deeppcr.solve((w, b, A), x0, max_iters=2, raise_on_failure=False)
    assert not res.converged and res.iterations == 2 and res.residual > 1e-6


def test_bad_chains_are_rejected():
    """Chains DeepPCR does not solve are refused in one line: widths that change, and Linears and activations out of
    order (Tanh, Linear or Linear, Linear, Tanh, Tanh were solved as Linear, Tanh, ...: converged, and 0.1-0.5 off
    the chain's own output)."""
    with pytest.raises(ValueError, match="must map 4 -> 4 features"):
        deeppcr.solve(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 5), nn.Tanh()), torch.randn(2, 4))
    for mods in ((nn.Tanh(), nn.Linear(4, 4)), (nn.Linear(4, 4), nn.Linear(4, 4), nn.Tanh(), nn.Tanh()),
                 (nn.Linear(4, 4), nn.Tanh(), nn.Tanh(), nn.Linear(4, 4))):
        with pytest.raises(ValueError, match="Linear, activation, Linear, activation, ... with one activation, in "
                                             "that order"):
            deeppcr.solve(nn.Sequential(*mods), torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"expected M \[L, B, I, O\] and r \[L, B, O\]"):
        deeppcr.solve_linear(torch.randn(3, 4, 4), torch.randn(3, 2, 4))


@pytest.mark.parametrize("algorithm", ["pc", "ipc"])
def test_pc_init_deeppcr_trains_like_the_feedforward_init(algorithm):
    """pc.init=deeppcr only changes how the init is computed: the training is the same to round-off.

    SGD: right after the init the hidden errors are 0 (ff) or ~1e-16 (deeppcr); the layers below the error
    front are left out of the weight step under both, but the others' gradients differ by that round-off, which
    Adam's normalisation would turn into steps of lr * 1e-8 where a gradient is itself that small."""
    import pcdist

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), *[m for _ in range(12) for m in (nn.Linear(12, 12), nn.Tanh())],
                        nn.Linear(12, 3)).double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.eye(3, dtype=torch.float64)[torch.randint(0, 3, (8,))]
    out = {}
    for init in ("ff", "deeppcr"):
        net = pcdist.PCNetwork.from_sequential(seq, energy="ce")
        assert any(g.K > 1 for g in net.groups)
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), T=5, x_lr=0.1,
                              algorithm=algorithm, init=init)
        for _ in range(3):
            stats = tr.step(x, y)
        out[init] = (stats["energy"], tr.value_nodes(), net.layer_state_dict())
    assert out["ff"][0] == pytest.approx(out["deeppcr"][0], abs=1e-10)
    for a, b in zip(out["ff"][1], out["deeppcr"][1]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    for k in out["ff"][2]:
        torch.testing.assert_close(out["ff"][2][k], out["deeppcr"][2][k], atol=1e-10, rtol=0)


def test_pc_init_deeppcr_where_no_group_is_a_chain_says_it_changes_nothing(tmp_path):
    """init="deeppcr" solves groups of several equal dense or residual hidden layers; a network with none (the
    service's default MLP: 64-128-128-10, three groups of one layer; a conv net) runs the feed-forward pass, which
    was silent. The engine warns, the service says it as a note line; a network with a chain says nothing."""
    import pcdist

    def warned(net) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), init="deeppcr")
        return [str(w.message) for w in caught if "changes nothing here" in str(w.message)]

    assert len(warned(pcdist.PCNetwork.from_dims([64, 128, 128, 10], "relu"))) == 1
    conv = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3))
    assert len(warned(pcdist.PCNetwork.from_sequential(conv, input_shape=(1, 4, 4)))) == 1
    assert warned(pcdist.PCNetwork.from_dims([6, 8, 8, 8, 4], "tanh")) == []
    assert warned(pcdist.PCNetwork(pcdist.mupc_specs(6, 8, 4, 4, "relu"))) == []
    pcdist.train({"run_dir": str(tmp_path / "run"), "pc": {"init": "deeppcr"}, "logger": "none",
                  "trainer": {"max_steps": 1, "eval_every": 1, "progress": "off"}})
    log = (tmp_path / "run" / "train.log").read_text()
    assert "note: init='deeppcr' changes nothing here: it solves groups of several equal dense or residual" in log


def test_generic_blocks_through_torch_func():
    """Any identical D -> D blocks (here Linear + LayerNorm + GELU): Jacobians by torch.func, same states."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.GELU()) for _ in range(9)).double()
    x0 = torch.randn(4, 6, dtype=torch.float64)
    res = deeppcr.solve(blocks, x0)
    xs = [x0]
    for blk in blocks:
        xs.append(blk(xs[-1]))
    torch.testing.assert_close(res.states, torch.stack(xs).detach(), atol=1e-10, rtol=0)
    assert res.converged


def test_generic_path_equals_the_analytic_one():
    w, b, A = chain(17, 5, "tanh", seed=9)
    blocks = []
    for l in range(17):
        lin = nn.Linear(5, 5).double()
        with torch.no_grad():
            lin.weight.copy_(w[l].T)
            lin.bias.copy_(b[l])
        blocks.append(nn.Sequential(lin, nn.Tanh()))
    x0 = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(deeppcr.solve(blocks, x0).states, deeppcr.solve((w, b, A), x0).states,
                               atol=1e-12, rtol=0)
