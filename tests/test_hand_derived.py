"""Training steps on networks small enough to do on paper.

The expected numbers are worked out by hand from the closed-form PC formulas
(no autograd), and checked against BOTH the autograd reference (tests/reference.py,
so the reference itself is validated against a closed form) and pcdist.

Closed forms used (per sample, e_l = h_l - u_l, a_l = W_l h_{l-1} + b_l):
  value gradient  g_l     = e_l - W_{l+1}^T (e_{l+1} * f'(a_{l+1}))      for l+1 < L
                  g_{L-1} = e_{L-1} + W_L^T (u_L - y)            (se)
                  g_{L-1} = e_{L-1} + W_L^T (softmax(u_L) - y)   (ce)
  value update    v <- g + mu v  (v = 0 at the start of a batch),  h <- h - x_lr v
  weight grads    dF/dW_l = (1/B) sum_batch delta_l h_{l-1}^T,  dF/db_l = (1/B) sum_batch delta_l
                  delta_l = -e_l * f'(a_l) (l < L),  delta_L = dE_out/du_L (= u_L - y for se,
                  softmax(u_L) - y for ce)
  plain SGD:      W <- W - lr dF/dW
"""
import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from reference import ReferenceTrainer

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 1e-12
DT = torch.float64


def build(layers):
    """layers: list of (W, b, activation module or None) -> float64 nn.Sequential."""
    mods = []
    for W, b, act in layers:
        W = torch.tensor(W, dtype=DT)
        lin = nn.Linear(W.shape[1], W.shape[0]).to(DT)
        with torch.no_grad():
            lin.weight.copy_(W)
            lin.bias.copy_(torch.tensor(b, dtype=DT))
        mods.append(lin)
        if act is not None:
            mods.append(act)
    return nn.Sequential(*mods)


def run(impl, seq, x, y, T, x_lr, x_momentum, algorithm, energy, lr):
    """One step with plain SGD(lr); returns (stats, value nodes, [(W, b) per layer] after the step)."""

    def make_opt(params):
        return torch.optim.SGD(params, lr=lr)

    x, y = torch.tensor(x, dtype=DT), torch.tensor(y, dtype=DT)
    if impl == "reference":
        trainer = ReferenceTrainer(seq, make_opt, T=T, x_lr=x_lr, x_momentum=x_momentum,
                                   algorithm=algorithm, energy=energy)
        stats = trainer.step(x, y)
        new_seq = trainer.seq
    else:
        pcdist = pytest.importorskip("pcdist")
        net = pcdist.PCNetwork.from_sequential(seq, energy=energy)
        trainer = pcdist.PCTrainer(net, make_opt(net.parameters()), T=T, x_lr=x_lr,
                                   x_momentum=x_momentum, algorithm=algorithm)
        stats = trainer.step(x, y)
        new_seq = net.to_sequential()
    lins = [m for m in new_seq if isinstance(m, nn.Linear)]
    return stats, [h.detach() for h in trainer.value_nodes()], [(l.weight.detach(), l.bias.detach()) for l in lins]


def check(result, hidden, energy, layer_energies, params):
    stats, hs, got_params = result
    for l, h in enumerate(hidden, start=1):
        assert_close(hs[l], torch.tensor(h, dtype=DT), atol=TOL, rtol=0, msg=lambda m: f"h_{l}: {m}")
    assert stats["energy"] == pytest.approx(energy, abs=TOL, rel=0)
    assert [float(e) for e in stats["layer_energies"]] == pytest.approx(layer_energies, abs=TOL, rel=0)
    for l, ((W, b), (W_exp, b_exp)) in enumerate(zip(got_params, params), start=1):
        assert_close(W, torch.tensor(W_exp, dtype=DT), atol=TOL, rtol=0, msg=lambda m: f"W_{l}: {m}")
        assert_close(b, torch.tensor(b_exp, dtype=DT), atol=TOL, rtol=0, msg=lambda m: f"b_{l}: {m}")


IMPLS = ["reference", "pcdist"]


# ---------------------------------------------------------------------------------------------
# Case A: se, identity hidden activation, dims [1, 1, 2], batch of B = 2, T = 1, x_lr = 0.5,
# SGD lr = 0.1.  W1 = [[0.5]], b1 = [0.5], W2 = [[1], [-1]], b2 = [0, 0.5].
# x = [[2], [-1]], y = [[1, 0], [0, 1]].
#
# Init (feed-forward): a1 = 0.5 x + 0.5 -> sample 1: 1.5, sample 2: 0.   h1 = u1 = a1 = [1.5, 0].
#   u2 = W2 h1 + b2: s1 [1.5, -1.5 + 0.5] = [1.5, -1.0];  s2 [0, 0.5].   h2 = y.
#   e1 = 0;  e2 = y - u2: s1 [-0.5, 1.0];  s2 [0, 0.5].
#   E: s1 0.5 (0.25 + 1) = 0.625;  s2 0.5 * 0.25 = 0.125   -> F_init = 0.375 (all in layer 2).
# Inference step (T = 1): g1 = e1 + W2^T (u2 - y) = (u2 - y)[0] - (u2 - y)[1]
#   s1: 0.5 - (-1.0) = 1.5;  s2: 0 - (-0.5) = 0.5.
#   h1 <- h1 - 0.5 g1:  s1 1.5 - 0.75 = 0.75;  s2 0 - 0.25 = -0.25.
# ---------------------------------------------------------------------------------------------
CASE_A = dict(
    layers=[([[0.5]], [0.5], nn.Identity()), ([[1.0], [-1.0]], [0.0, 0.5], None)],
    x=[[2.0], [-1.0]], y=[[1.0, 0.0], [0.0, 1.0]], T=1, x_lr=0.5, x_momentum=0.0, energy="se", lr=0.1,
)


@pytest.mark.parametrize("impl", IMPLS)
def test_case_a_se_pc(impl):
    # pc: fresh evaluation at h1 = [0.75, -0.25] (weights unchanged, so u1 = [1.5, 0]):
    #   e1 = h1 - u1 = [-0.75, -0.25]              layer-1 energy: (0.28125 + 0.03125)/2 = 0.15625
    #   u2 = W2 h1 + b2: s1 [0.75, -0.25];  s2 [-0.25, 0.75]
    #   e2 = y - u2:     s1 [0.25, 0.25];   s2 [0.25, 0.25]  layer-2 energy: 0.0625   F = 0.21875 (< 0.375)
    # Weight gradients (mean over B = 2):
    #   delta1 = -e1 * 1 = [0.75, 0.25];  dW1 = (0.75*2 + 0.25*(-1))/2 = 0.625;  db1 = (0.75+0.25)/2 = 0.5
    #   delta2 = u2 - y = [-0.25, -0.25] for both samples
    #   dW2 = (delta2 * 0.75 + delta2 * (-0.25))/2 = [-0.0625, -0.0625];  db2 = [-0.25, -0.25]
    # SGD(lr = 0.1): W1 = 0.5 - 0.0625 = 0.4375;  b1 = 0.5 - 0.05 = 0.45
    #   W2 = [1 + 0.00625, -1 + 0.00625] = [1.00625, -0.99375];  b2 = [0.025, 0.525]
    c = CASE_A
    res = run(impl, build(c["layers"]), c["x"], c["y"], c["T"], c["x_lr"], c["x_momentum"], "pc", c["energy"], c["lr"])
    check(res, hidden=[[[0.75], [-0.25]]], energy=0.21875, layer_energies=[0.15625, 0.0625],
          params=[([[0.4375]], [0.45]), ([[1.00625], [-0.99375]], [0.025, 0.525])])


@pytest.mark.parametrize("impl", IMPLS)
def test_case_a_se_ipc(impl):
    # ipc, T = 1: the W-step is taken from the SAME evaluation as the h-step, i.e. the init state
    # (h1 = [1.5, 0], e1 = 0, e2 = s1 [-0.5, 1.0], s2 [0, 0.5]).  F = 0.375 = 0 + 0.375.
    #   delta1 = -e1 = 0  ->  dW1 = 0, db1 = 0: layer 1 unchanged (W1 = 0.5, b1 = 0.5)
    #   delta2 = u2 - y: s1 [0.5, -1.0];  s2 [0, -0.5]
    #   dW2 = (s1 [0.5, -1.0] * 1.5 + s2 [0, -0.5] * 0)/2 = [0.375, -0.75]
    #   db2 = ([0.5, -1.0] + [0, -0.5])/2 = [0.25, -0.75]
    # SGD(lr = 0.1): W2 = [1 - 0.0375, -1 + 0.075] = [0.9625, -0.925];  b2 = [-0.025, 0.575]
    # Value nodes after the h-step: as in pc, h1 = [0.75, -0.25]; no extra evaluation at the end.
    c = CASE_A
    res = run(impl, build(c["layers"]), c["x"], c["y"], c["T"], c["x_lr"], c["x_momentum"], "ipc", c["energy"], c["lr"])
    check(res, hidden=[[[0.75], [-0.25]]], energy=0.375, layer_energies=[0.0, 0.375],
          params=[([[0.5]], [0.5]), ([[0.9625], [-0.925]], [-0.025, 0.575])])


# ---------------------------------------------------------------------------------------------
# Case B: ce, tanh hidden activation, dims [1, 1, 2], B = 1, T = 1, x_lr = 0.2, SGD lr = 0.1.
# W1 = [[0.5]], b1 = [0], W2 = [[2], [-1]], b2 = [0.5, -0.5], x = [[1]], y = [[0, 1]].
# Irrational, so the arithmetic is written out scalar by scalar with math (values in comments).
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_case_b_ce_tanh_pc(impl):
    x, W1, b1, W2, b2, y, x_lr, lr = 1.0, 0.5, 0.0, [2.0, -1.0], [0.5, -0.5], [0.0, 1.0], 0.2, 0.1

    def softmax(u):
        z = [math.exp(v) for v in u]
        return [v / sum(z) for v in z]

    a1 = W1 * x + b1                                  # 0.5
    u1 = math.tanh(a1)                                # 0.46211715726000974
    h1 = u1                                           # init h1 = u1, e1 = 0
    u2 = [W2[k] * h1 + b2[k] for k in range(2)]       # [1.42423431452002, -0.96211715726001]
    p = softmax(u2)                                   # [0.91578059644878, 0.08421940355122]
    g1 = 0.0 + sum(W2[k] * (p[k] - y[k]) for k in range(2))  # e1 + W2^T (p - y) = 2.747341789346327
    h1 = h1 - x_lr * g1                               # -0.08735120060925566
    # pc: fresh evaluation at the new h1 with unchanged weights
    e1 = h1 - u1                                      # -0.5494683578692654
    u2 = [W2[k] * h1 + b2[k] for k in range(2)]       # [0.32529759878149, -0.41264879939074]
    p = softmax(u2)                                   # [0.67654662693332, 0.32345337306668]
    E1 = 0.5 * e1 ** 2                                # 0.15095773814977356
    E2 = -sum(y[k] * math.log(p[k]) for k in range(2))  # -log p[1] = 1.128700308144353
    # weight gradients (B = 1)
    delta1 = -e1 * (1.0 - math.tanh(a1) ** 2)         # 0.5494683578692654 * 0.7864477329659274 = 0.4321281443827947
    delta2 = [p[k] - y[k] for k in range(2)]          # [0.67654662693332, -0.67654662693332]
    W1_new = W1 - lr * delta1 * x                     # 0.45678718556172054
    b1_new = b1 - lr * delta1                         # -0.04321281443827947
    W2_new = [W2[k] - lr * delta2[k] * h1 for k in range(2)]  # [2.0059097160130768, -1.0059097160130768]
    b2_new = [b2[k] - lr * delta2[k] for k in range(2)]       # [0.432345337306668, -0.432345337306668]
    assert W1_new == pytest.approx(0.45678718556172054, abs=1e-15)  # the comments match the closed form

    seq = build([([[W1]], [b1], nn.Tanh()), ([[W2[0]], [W2[1]]], b2, None)])
    res = run(impl, seq, [[x]], [y], T=1, x_lr=x_lr, x_momentum=0.0, algorithm="pc", energy="ce", lr=lr)
    check(res, hidden=[[[h1]]], energy=E1 + E2, layer_energies=[E1, E2],
          params=[([[W1_new]], [b1_new]), ([[W2_new[0]], [W2_new[1]]], b2_new)])


# ---------------------------------------------------------------------------------------------
# Case C: se, LeakyReLU(0.1) hidden activations, dims [1, 1, 1, 1] (L = 3, so the hidden-to-hidden
# formula g_1 = e_1 - W_2^T (e_2 f'(a_2)) is used), B = 1, T = 2, x_lr = 0.5, value momentum
# mu = 0.5, SGD lr = 0.1.  W1 = 2, b1 = -1, W2 = -1, b2 = 0.5, W3 = 2, b3 = 0;  x = 1, y = 1.
#
# Init: a1 = 2 - 1 = 1 (f' = 1) -> h1 = u1 = 1;  a2 = -1 + 0.5 = -0.5 (f' = 0.1) -> h2 = u2 = -0.05;
#   u3 = 2 * (-0.05) = -0.1;  h3 = y = 1.
# Inference step 1 (h1 = 1, h2 = -0.05): e1 = 0, e2 = 0, e3 = 1 - (-0.1) = 1.1
#   g1 = e1 - W2 (e2 * 0.1) = 0;   g2 = e2 + W3 (u3 - y) = 2 * (-1.1) = -2.2
#   v1 = 0, v2 = -2.2;  h1 = 1,  h2 = -0.05 - 0.5 * (-2.2) = 1.05
# Inference step 2 (h1 = 1, h2 = 1.05): u1 = 1, e1 = 0;  a2 = -0.5, u2 = -0.05, e2 = 1.1;
#   u3 = 2.1, e3 = -1.1
#   g1 = 0 - (-1) (1.1 * 0.1) = 0.11;   g2 = 1.1 + 2 * (2.1 - 1) = 3.3
#   v1 = 0.11 + 0.5 * 0 = 0.11;  v2 = 3.3 + 0.5 * (-2.2) = 2.2
#   h1 = 1 - 0.5 * 0.11 = 0.945;  h2 = 1.05 - 0.5 * 2.2 = -0.05
#   (without momentum h2 would be 1.05 - 1.65 = -0.6: the momentum rule is checked)
# pc fresh evaluation (h1 = 0.945, h2 = -0.05, h3 = 1):
#   u1 = 1, e1 = -0.055                       E1 = 0.5 * 0.003025    = 0.0015125
#   a2 = -0.945 + 0.5 = -0.445, u2 = -0.0445, e2 = -0.05 + 0.0445 = -0.0055
#                                             E2 = 0.5 * 0.00003025  = 0.000015125
#   u3 = 2 * (-0.05) = -0.1, e3 = 1.1         E3 = 0.5 * 1.21        = 0.605
#   F = 0.606527625
# Weight gradients: delta1 = -e1 * 1 = 0.055:         dW1 = 0.055 * x = 0.055,  db1 = 0.055
#                   delta2 = -e2 * 0.1 = 0.00055:     dW2 = 0.00055 * 0.945 = 0.00051975, db2 = 0.00055
#                   delta3 = u3 - y = -1.1:           dW3 = -1.1 * (-0.05) = 0.055,  db3 = -1.1
# SGD(lr = 0.1): W1 = 1.9945, b1 = -1.0055, W2 = -1.000051975, b2 = 0.499945, W3 = 1.9945, b3 = 0.11
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_case_c_se_momentum_T2(impl):
    seq = build([([[2.0]], [-1.0], nn.LeakyReLU(0.1)), ([[-1.0]], [0.5], nn.LeakyReLU(0.1)),
                 ([[2.0]], [0.0], None)])
    res = run(impl, seq, [[1.0]], [[1.0]], T=2, x_lr=0.5, x_momentum=0.5, algorithm="pc", energy="se", lr=0.1)
    check(res, hidden=[[[0.945]], [[-0.05]]], energy=0.606527625,
          layer_energies=[0.0015125, 0.000015125, 0.605],
          params=[([[1.9945]], [-1.0055]), ([[-1.000051975]], [0.499945]), ([[1.9945]], [0.11])])


# ---------------------------------------------------------------------------------------------
# Case D: a μPC network (residual kind), relu, se.  d_in = 1, width N = 1, depth L = 4, d_out = 1,
# so the scalings are a_1 = 1/sqrt(d_in) = 1, a_h = 1/sqrt(N L) = 1/2 (layers 2, 3), a_L = 1/N = 1:
#   u1 = W1 x;  u2 = h1 + 1/2 W2 relu(h1);  u3 = h2 + 1/2 W3 relu(h2);  u4 = W4 relu(h3)
# W = [1, 1, -1, 2], x = 2, y = 1, B = 1, T = 2, x_lr = 0.25, SGD lr = 0.1.
#
# Init (feed-forward): h1 = u1 = 2;  h2 = u2 = 2 + 1 = 3;  h3 = u3 = 3 - 1.5 = 1.5;  u4 = 3, e4 = y - u4 = -2.
# Value gradient g_l = e_l - P_{l+1}, P_{l+1} = -dE_{l+1}/dh_l = a (W e_{l+1}) relu'(h_l) + skip * e_{l+1}
# (for the output, e4 is y - u4 = -dE_out/du4 and there is no skip).
# Step 1: e1 = e2 = e3 = 0;  P4 = 1 * 2 * (-2) * 1 = -4:  g1 = g2 = 0,  g3 = 0 - (-4) = 4
#   h3 <- 1.5 - 0.25 * 4 = 0.5
# Step 2 (h = 2, 3, 0.5):  e1 = e2 = 0;  e3 = 0.5 - 1.5 = -1;  u4 = 2 * 0.5 = 1, e4 = 0
#   g1 = 0 - (1/2 * 1 * e2 * 1 + e2) = 0
#   g2 = 0 - (1/2 * (-1) * (-1) * 1 + (-1)) = 0.5       (the skip passes e3 down in full)
#   g3 = -1 - (1 * 2 * 0 * 1) = -1
#   h2 <- 3 - 0.125 = 2.875;  h3 <- 0.5 + 0.25 = 0.75
# pc fresh evaluation (h = 2, 2.875, 0.75):
#   e1 = 0                                              E1 = 0
#   u2 = 3, e2 = -0.125                                 E2 = 0.0078125
#   u3 = 2.875 - 0.5 * 2.875 = 1.4375, e3 = -0.6875     E3 = 0.236328125
#   u4 = 1.5, e4 = 1 - 1.5 = -0.5                       E4 = 0.125          F = 0.369140625
# Weight gradients dF/dW_l = -a_l e_l phi(h_{l-1}) (phi = identity on layer 1):
#   dW1 = 0;  dW2 = -1/2 (-0.125) 2 = 0.125;  dW3 = -1/2 (-0.6875) 2.875 = 0.98828125;  dW4 = -(-0.5) 0.75 = 0.375
# SGD(lr = 0.1): W = [1, 0.9875, -1.098828125, 1.9625]
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_case_d_mupc_relu_T2(impl):
    from reference import MuPCReference

    W, x, y = [1.0, 1.0, -1.0, 2.0], torch.tensor([[2.0]], dtype=DT), torch.tensor([[1.0]], dtype=DT)
    kw = dict(T=2, x_lr=0.25, x_momentum=0.0, algorithm="pc")
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    if impl == "reference":
        ref = MuPCReference(1, 1, 4, 1, "relu", make_opt, energy="se", **kw)
        with torch.no_grad():
            for w_l, value in zip(ref.weights, W):
                w_l.fill_(value)
        stats = ref.step(x, y)
        hs, weights = ref.hs, [float(w_l.detach()) for w_l in ref.weights]
    else:
        pcdist = pytest.importorskip("pcdist")
        net = pcdist.PCNetwork(pcdist.mupc_specs(1, 1, 4, 1, "relu"), energy="se", dtype=DT, init=False)
        net.load_layer_state_dict({f"layers.{l}.weight": torch.tensor([[w]], dtype=DT) for l, w in enumerate(W, 1)})
        trainer = pcdist.PCTrainer(net, make_opt(net.parameters()), **kw)
        stats = trainer.step(x, y)
        hs = trainer.value_nodes()
        weights = [float(net.layer_state_dict()[f"layers.{l}.weight"]) for l in range(1, 5)]
    assert [float(h) for h in hs[1:4]] == pytest.approx([2.0, 2.875, 0.75], abs=TOL)
    assert stats["energy"] == pytest.approx(0.369140625, abs=TOL)
    assert stats["layer_energies"] == pytest.approx([0.0, 0.0078125, 0.236328125, 0.125], abs=TOL)
    assert weights == pytest.approx([1.0, 0.9875, -1.098828125, 1.9625], abs=TOL)


# ---------------------------------------------------------------------------------------------
# Case G: a generative step. h_0 = a label (clamped), h_L = data (clamped); identity hidden layer
# with precision pi_1 = 2. dims [2, 1, 2], B = 1, T = 1, x_lr = 0.25, SGD lr = 0.1.
# W1 = [[1, -1]], b1 = [0], W2 = [[2], [1]], b2 = [0, 0];  x = [1, 0] (the label), y = [3, 1] (the data).
#
# Energy: E = 0.5 pi_1 ||h_1 - u_1||^2 + 0.5 ||y - u_2||^2, u_1 = W1 h_0 + b1, u_2 = W2 h_1 + b2.
# Init (feed-forward): u1 = 1 - 0 = 1 -> h1 = 1;  u2 = [2, 1];  e2 = y - u2 = [1, 0].
#   E = 0 + 0.5 (1 + 0) = 0.5.
# Inference step: g1 = pi_1 e1 - W2^T e2 = 0 - (2 * 1 + 1 * 0) = -2;  h1 <- 1 - 0.25 (-2) = 1.5.
# pc, fresh evaluation at h1 = 1.5: e1 = 1.5 - 1 = 0.5, pi_1 e1 = 1;  layer-1 energy 0.5 * 2 * 0.25 = 0.25.
#   u2 = [3, 1.5], e2 = [0, -0.5];  layer-2 energy 0.125.   F = 0.375 (< 0.5).
# Weight gradients: dF/dW1 = -(pi_1 e1) h_0^T = [-1, 0];  dF/db1 = -1;
#   dF/dW2 = -e2 h1^T = [[0], [0.75]];  dF/db2 = -e2 = [0, 0.5].
# SGD(0.1): W1 = [1.1, -1], b1 = 0.1;  W2 = [[2], [0.925]], b2 = [0, -0.05].
# ---------------------------------------------------------------------------------------------
CASE_G = dict(layers=[([[1.0, -1.0]], [0.0], nn.Identity()), ([[2.0], [1.0]], [0.0, 0.0], None)],
              x=[[1.0, 0.0]], y=[[3.0, 1.0]])


def _generative_step(impl):
    seq = build(CASE_G["layers"])
    x, y = torch.tensor(CASE_G["x"], dtype=DT), torch.tensor(CASE_G["y"], dtype=DT)
    if impl == "reference":
        from reference import pc_step, split_layers, sequential_predict
        opt = torch.optim.SGD(seq.parameters(), lr=0.1)
        stats, hs = pc_step(sequential_predict(split_layers(seq)), 2, list(seq.parameters()), opt, x, y, 1, 0.25, 0.0,
                            "pc", "se", precision=[2.0, 1.0])
        new = seq
    else:
        import pcdist
        net = pcdist.PCNetwork.from_sequential(seq, precision=[2.0, 1.0])
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=1, x_lr=0.25)
        stats, hs, new = tr.step(x, y), tr.value_nodes(), net.to_sequential()
    lins = [m for m in new if isinstance(m, nn.Linear)]
    return stats, [h.detach() for h in hs], [(l.weight.detach(), l.bias.detach()) for l in lins]


@pytest.mark.parametrize("impl", IMPLS)
def test_case_g_generative_step_with_a_precision(impl):
    check(_generative_step(impl), hidden=[[[1.5]]], energy=0.375, layer_energies=[0.25, 0.125],
          params=[([[1.1, -1.0]], [0.1]), ([[2.0], [0.925]], [0.0, -0.05])])


# ---------------------------------------------------------------------------------------------
# Case G, at test time: classification by inference with Case G's initial weights. h_2 = y = [3, 1]
# clamped, h_0 free with the prior 0.5 pi_0 ||h_0 - m_0||^2, pi_0 = 1, m_0 = uniform [0.5, 0.5];
# T = 2, x_lr = 0.5.
# Init: h0 = m0 = [0.5, 0.5];  u1 = 0.5 - 0.5 = 0 -> h1 = 0;  u2 = [0, 0];  e2 = [3, 1].
# Step 1: g0 = pi_0 (h0 - m0) - W1^T (pi_1 e1) = 0 - 0 = [0, 0];  g1 = pi_1 * 0 - W2^T e2 = -(6 + 1) = -7.
#   h0 = [0.5, 0.5];  h1 = 0 + 0.5 * 7 = 3.5.
# Step 2: e1 = h1 - u1 = 3.5 (u1 = 0 still), pi_1 e1 = 7;  g0 = 0 - W1^T 7 = [-7, 7];
#   u2 = W2 h1 = [7, 3.5], e2 = [-4, -2.5], W2^T e2 = -8 - 2.5 = -10.5;  g1 = 7 + 10.5 = 17.5.
#   h0 = [0.5 + 3.5, 0.5 - 3.5] = [4, -3] (argmax: class 0);  h1 = 3.5 - 8.75 = -5.25.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_case_g_classification_by_inference(impl):
    seq = build(CASE_G["layers"])
    y = torch.tensor(CASE_G["y"], dtype=DT)
    m0 = torch.tensor([0.5, 0.5], dtype=DT)
    if impl == "reference":
        from reference import pc_step, split_layers, sequential_predict
        _, hs = pc_step(sequential_predict(split_layers(seq)), 2, list(seq.parameters()),
                        torch.optim.SGD(seq.parameters(), lr=0.0), None, y, 2, 0.5, 0.0, "pc", "se",
                        precision=[2.0, 1.0], prior_precision=1.0, prior_mean=m0)
    else:
        import pcdist
        net = pcdist.PCNetwork.from_sequential(seq, precision=[2.0, 1.0], prior=pcdist.Prior(1.0, "uniform"))
        hs = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=2, x_lr=0.5).infer(y=y)
    assert_close(hs[0], torch.tensor([[4.0, -3.0]], dtype=DT), atol=TOL, rtol=0)
    assert_close(hs[1], torch.tensor([[-5.25]], dtype=DT), atol=TOL, rtol=0)
    assert_close(hs[2], y, atol=0, rtol=0)
