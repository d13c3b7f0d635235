"""Generative and unsupervised PC learn on the bundled digits: thresholds from closed forms and baselines.

* unsupervised, linear decoder, latent k = 10: PCA with 10 components is the optimum of a linear
  decoder, so PC's held-out reconstruction must come within 5% of PCA's; a decoder with hidden
  layers must beat it;
* generative, linear decoder: with the label node free under its Gaussian prior, inference solves a
  ridge least-squares problem in closed form; the inferred h_0 must equal that solution, and its
  argmax classifies; a decoder with a hidden layer must reach 0.91 by inference.

The figures of the longer runs are in benchmarks/modes.py and docs/modes.md.
"""

import pytest
import torch
from torch import nn

import pcdist
from pcdist.data import load_digits
from pcdist.engine.modes import classify, reconstruct

pytestmark = pytest.mark.usefixtures("single_thread")

K = 10


@pytest.fixture(scope="module")
def digits():
    d = load_digits().flat()  # [N, 64] pixels in [0, 1]
    return d.x_train, d.y_train, d.x_val, d.y_val


def pca_error(x_train, x_val, k):
    """Held-out reconstruction error per pixel of PCA with k components fitted on the training set."""
    mean = x_train.mean(0)
    _, _, vt = torch.linalg.svd(x_train - mean, full_matrices=False)
    p = vt[:k]
    return float((((x_val - mean) @ p.T @ p + mean - x_val) ** 2).mean())


def fit(net, x_train, labels_train, mode, steps, T, x_lr, lr, x_momentum=0.0, seed=0):
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    tr = pcdist.PCTrainer(net, opt, T=T, x_lr=x_lr, x_momentum=x_momentum,
                          scheduler=pcdist.warmup_cosine(opt, 20, steps))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(x_train), (64,), generator=g)
        bottom = torch.eye(10, dtype=x_train.dtype)[labels_train[idx]] if mode == "generative" else None
        tr.step(bottom, x_train[idx], log=False)
    return tr


def test_unsupervised_linear_decoder_comes_within_5_percent_of_pca(digits):
    x_tr, _, x_va, _ = digits
    torch.manual_seed(0)
    net = pcdist.PCNetwork(pcdist.mlp_specs([K, 64], "identity"), energy="se", prior=pcdist.Prior(0.1), seed=0)
    tr = fit(net, x_tr, None, "unsupervised", steps=1000, T=20, x_lr=0.1, lr=1e-2)
    err = float(((reconstruct(tr, x_va, T=200) - x_va) ** 2).mean())
    pca = pca_error(x_tr, x_va, K)
    assert err <= 1.05 * pca, f"PC {err:.5f} vs PCA {pca:.5f}"
    assert err >= 0.99 * pca, f"a linear decoder cannot beat PCA on the data it fits: {err:.5f} < {pca:.5f}"


def test_unsupervised_decoder_with_hidden_layers_beats_pca(digits):
    """One PC layer holding an MLP decoder (the module kind): the energy 0.5 pi_0 |h_0|^2 + 0.5 |x - g(h_0)|^2
    with the latent inferred by the decoder's VJP (a decoder whose hidden layers are value nodes needs
    their precision far above the output's and many more inference steps: benchmarks/modes.py)."""
    x_tr, _, x_va, _ = digits
    torch.manual_seed(0)
    decoder = pcdist.AnyModule(nn.Sequential(nn.Linear(K, 128), nn.Tanh(), nn.Linear(128, 64)))
    net = pcdist.PCNetwork.from_layers([decoder], input_shape=(K,), prior=pcdist.Prior(0.01))
    tr = fit(net, x_tr, None, "unsupervised", steps=1200, T=15, x_lr=0.2, lr=3e-3, x_momentum=0.5)
    err = float(((reconstruct(tr, x_va, T=400) - x_va) ** 2).mean())
    pca = pca_error(x_tr, x_va, K)
    assert err < 0.95 * pca, f"PC {err:.5f} vs PCA {pca:.5f}"


def test_generative_linear_decoder_infers_the_ridge_solution(digits):
    """h_0 free, h_L = x: E = 0.5 pi_0 ||h_0 - m_0||^2 + 0.5 ||x - W h_0 - b||^2 is minimised by
    h_0* = m_0 + (W^T W + pi_0 I)^-1 W^T (x - b - W m_0); converged inference must land there."""
    x_tr, l_tr, x_va, l_va = digits
    torch.manual_seed(0)
    net = pcdist.PCNetwork(pcdist.mlp_specs([10, 64], "identity"), energy="se", prior=pcdist.Prior(1.0, "uniform"),
                           seed=0, dtype=torch.float64)
    tr = fit(net, x_tr.double(), l_tr, "generative", steps=1000, T=1, x_lr=0.1, lr=1e-2)
    tr.x_lr = 0.01  # below 2 / the largest eigenvalue of W^T W + pi_0 I: the inference converges
    h0 = tr.infer(None, x_va.double(), T=3000)[0]
    W, b = net.layer_params(1)["weight"].detach(), net.layer_params(1)["bias"].detach()
    m0 = torch.full((10,), 0.1, dtype=torch.float64)
    want = m0 + torch.linalg.solve(W.T @ W + torch.eye(10, dtype=torch.float64),
                                   W.T @ (x_va.double() - b - W @ m0).T).T
    torch.testing.assert_close(h0, want, atol=1e-6, rtol=0)
    acc = float((h0.argmax(1) == l_va).double().mean())
    assert acc >= 0.85, acc  # ridge least squares of the class means (the nearest class mean: 0.90)


def test_generative_decoder_with_a_hidden_layer_classifies_by_inference(digits):
    x_tr, l_tr, x_va, l_va = digits
    torch.manual_seed(0)
    net = pcdist.PCNetwork(pcdist.mlp_specs([10, 128, 64], "tanh"), energy="se", prior=pcdist.Prior(1.0, "uniform"),
                           seed=0)
    tr = fit(net, x_tr, l_tr, "generative", steps=1500, T=20, x_lr=0.05, lr=3e-3)
    acc = float((classify(tr, x_va, T=200) == l_va).float().mean())
    assert acc >= 0.91, acc
