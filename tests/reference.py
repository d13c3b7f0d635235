"""Independent reference implementation of one predictive-coding training step.

This is the ground truth the engine is tested against.  It is deliberately
slow and simple: a Python loop over the layers of a plain ``nn.Sequential``
(Linear, act, Linear, act, ..., Linear), and EVERY gradient comes from
``torch.autograd`` applied to the energy -- nothing is derived by hand.

Maths (per sample; h_0 = x clamped, h_L = y clamped, hidden h_1..h_{L-1} free):
    u_l = f_l(W_l h_{l-1} + b_l) for l < L,   u_L = W_L h_{L-1} + b_L
    E   = sum_{l<L} 0.5 ||h_l - u_l||^2 + E_out
    E_out = 0.5 ||h_L - u_L||^2                  (energy="se")
    E_out = -sum_k h_L[k] log_softmax(u_L)[k]    (energy="ce")
    F   = mean over the batch of E
Value gradient  g_l = d(sum_batch E)/dh_l  (i.e. B * dF/dh_l, per-sample gradient);
weight gradient      d(mean_batch E)/dW    (= dF/dW).
Value optimizer: SGD with momentum reset every batch, v <- g + mu v, h <- h - x_lr v.
"""
import copy
import math

import torch
from torch import nn


def split_layers(seq):
    """``[(linear, activation), ..., (linear, None)]`` for Linear, act, ..., Linear."""
    mods = list(seq)
    assert len(mods) % 2 == 1, "expected Linear, act, Linear, act, ..., Linear"
    layers = []
    for i in range(0, len(mods), 2):
        assert isinstance(mods[i], nn.Linear), mods[i]
        layers.append((mods[i], mods[i + 1] if i + 1 < len(mods) else None))
    return layers


def sequential_predict(layers):
    """predict(l, h) = u_l of the Sequential's layer l (1-based): act(lin(h)), or lin(h) at the output."""
    def predict(l, h):
        lin, act = layers[l - 1]
        return lin(h) if act is None else act(lin(h))
    return predict


def layer_energies_from(predict, L, hs, energy):
    """Per-sample energy of each layer l = 1..L: a list of L tensors of shape [B]."""
    out = []
    for l in range(1, L + 1):
        u = predict(l, hs[l - 1])
        if l < L:  # hidden layer (a node of any shape: summed over all but the batch)
            out.append(0.5 * ((hs[l] - u) ** 2).flatten(1).sum(1))
        elif energy == "se":
            out.append(0.5 * ((hs[l] - u) ** 2).flatten(1).sum(1))
        elif energy == "ce":
            out.append(-(hs[l] * torch.log_softmax(u, dim=1)).sum(1))
        else:
            raise ValueError(energy)
    return out


def per_layer_energies(layers, hs, energy):
    """Per-sample energy of each layer of a Sequential's ``split_layers`` (a list of L [B] tensors)."""
    return layer_energies_from(sequential_predict(layers), len(layers), hs, energy)


def feed_forward_from(predict, L, x, y):
    """Init of the value nodes: h_0 = x, h_l = u_l (feed-forward) for hidden l, h_L = y."""
    hs = [x.detach().clone()]
    with torch.no_grad():
        for l in range(1, L):
            hs.append(predict(l, hs[-1]))
    hs.append(y.detach().clone())
    return hs


def feed_forward_values(seq, x, y):
    layers = split_layers(seq)
    return feed_forward_from(sequential_predict(layers), len(layers), x, y)


def reference_step(seq, opt, x, y, T, x_lr, x_momentum, algorithm, energy):
    """One training step of a Sequential (Linear, act, ..., Linear) on the batch (x, y); see ``pc_step``."""
    layers = split_layers(seq)
    return pc_step(sequential_predict(layers), len(layers), list(seq.parameters()), opt, x, y, T, x_lr,
                   x_momentum, algorithm, energy)


def pc_step(predict, L, params, opt, x, y, T, x_lr, x_momentum, algorithm, energy):
    """One training step on the batch (x, y) of the network u_l = predict(l, h_{l-1}), l = 1..L;
    updates ``params`` in place via ``opt`` (a torch.optim optimizer over them).

    Returns ``(stats, hs)``: stats = {"energy": float, "layer_energies": [L floats]} of the
    evaluation described in the API (pc: fresh evaluation at the final h, before the weight
    update; ipc: the evaluation of the last inference step), and hs = [x, h_1, ..., h_{L-1}, y]
    at the end of inference.
    """
    assert algorithm in ("pc", "ipc") and T >= 1
    hs = feed_forward_from(predict, L, x, y)
    vs = [torch.zeros_like(h) for h in hs[1:L]]  # value momentum, reset every batch

    def evaluate():
        """Energy at the current (h, W); autograd gradients w.r.t. hidden h and W."""
        hidden = [h.detach().requires_grad_(True) for h in hs[1:L]]
        energies = layer_energies_from(predict, L, [hs[0], *hidden, hs[L]], energy)
        E = torch.stack(energies).sum(0)  # [B] per-sample energy
        g_h = torch.autograd.grad(E.sum(), hidden, retain_graph=True) if hidden else []
        g_w = torch.autograd.grad(E.mean(), params)
        stats = {"energy": E.mean().item(), "layer_energies": [e.mean().item() for e in energies]}
        return list(g_h), list(g_w), stats

    def value_step(g_h):
        for i, g in enumerate(g_h):
            vs[i] = g + x_momentum * vs[i]
            hs[i + 1] = hs[i + 1] - x_lr * vs[i]

    def weight_step(g_w):
        opt.zero_grad()
        for p, g in zip(params, g_w):
            p.grad = g.detach().clone()
        opt.step()

    for _ in range(T):
        g_h, g_w, stats = evaluate()  # h-step and (ipc) W-step from the same state
        value_step(g_h)
        if algorithm == "ipc":
            weight_step(g_w)
    if algorithm == "pc":
        _, g_w, stats = evaluate()  # fresh evaluation at the final value nodes
        weight_step(g_w)
    return stats, [h.detach().clone() for h in hs]


class ReferenceTrainer:
    """Holds a deep copy of ``seq`` and its own optimizer ``make_opt(copy.parameters())``."""

    def __init__(self, seq, make_opt, T, x_lr, x_momentum=0.0, algorithm="pc", energy="se"):
        self.seq = copy.deepcopy(seq)
        self.opt = make_opt(self.seq.parameters())
        self.kw = dict(T=T, x_lr=x_lr, x_momentum=x_momentum, algorithm=algorithm, energy=energy)
        self.hs = None

    def step(self, x, y):
        stats, self.hs = reference_step(self.seq, self.opt, x, y, **self.kw)
        return stats

    def value_nodes(self):
        return self.hs

    def energy_at(self, hs):
        """Batch-mean energy F at value nodes ``hs`` with the current weights (no updates)."""
        with torch.no_grad():
            layers = split_layers(self.seq)
            return torch.stack(per_layer_energies(layers, hs, self.kw["energy"])).sum(0).mean().item()


# -- μPC (Innocenti et al., NeurIPS 2025), written from the paper's formula ------------------------
PHI = {
    "identity": lambda h: h,
    "relu": torch.relu,
    "tanh": torch.tanh,
    "gelu": torch.nn.functional.gelu,
    "sigmoid": torch.sigmoid,
    "leaky_relu": lambda h: torch.nn.functional.leaky_relu(h, 0.1),
}


class MuPCReference:
    """A μPC network of ``depth`` = L weight layers by its formula, trained by ``pc_step``.

        u_1 = a_1 W_1 x                          a_1 = 1/sqrt(d_in), no skip, no activation
        u_l = h_{l-1} + a_h W_l phi(h_{l-1})      a_h = 1/sqrt(width * L),  l = 2..L-1
        u_L = a_L W_L phi(h_{L-1})               a_L = 1/width, no skip
    (+ a_l b_l inside the scaled term with ``bias``). ``weights[l-1]`` is W_l [out, in], a plain
    tensor drawn N(0, 1) (float64) from ``seed``; nothing here comes from pcdist.
    """

    def __init__(self, d_in, width, depth, d_out, phi, make_opt, T, x_lr, x_momentum=0.0, algorithm="pc",
                 energy="se", bias=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        L = depth
        dims = [d_in] + [width] * (L - 1) + [d_out]
        self.L, self.phi = L, phi
        self.scales = [1 / math.sqrt(d_in)] + [1 / math.sqrt(width * L)] * (L - 2) + [1 / width]
        self.weights = [torch.randn(dims[l + 1], dims[l], generator=g, dtype=torch.float64).requires_grad_(True)
                        for l in range(L)]
        self.biases = [(0.1 * torch.randn(dims[l + 1], generator=g, dtype=torch.float64)).requires_grad_(True)
                       if bias else None for l in range(L)]
        self.params = [p for pair in zip(self.weights, self.biases) for p in pair if p is not None]
        self.opt = make_opt(self.params)
        self.kw = dict(T=T, x_lr=x_lr, x_momentum=x_momentum, algorithm=algorithm, energy=energy)
        self.hs = None

    def predict(self, l, h):
        W, b, a = self.weights[l - 1], self.biases[l - 1], self.scales[l - 1]
        z = (h if l == 1 else PHI[self.phi](h)) @ W.T
        if b is not None:
            z = z + b
        return h + a * z if 1 < l < self.L else a * z

    def step(self, x, y):
        stats, self.hs = pc_step(self.predict, self.L, self.params, self.opt, x, y, **self.kw)
        return stats

    def forward(self, x):
        with torch.no_grad():
            for l in range(1, self.L + 1):
                x = self.predict(l, x)
        return x


class Gate(nn.Module):
    """A residual block on an image node (the module kind in tests): h + 0.5 tanh(conv1x1(h))."""

    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)

    def forward(self, h):
        return h + 0.5 * torch.tanh(self.conv(h))
