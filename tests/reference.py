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


def per_layer_energies(layers, hs, energy):
    """Per-sample energy of each layer l = 1..L: a list of L tensors of shape [B]."""
    out = []
    for l, (lin, act) in enumerate(layers, start=1):
        a = lin(hs[l - 1])
        if act is not None:  # hidden layer
            out.append(0.5 * ((hs[l] - act(a)) ** 2).sum(1))
        elif energy == "se":
            out.append(0.5 * ((hs[l] - a) ** 2).sum(1))
        elif energy == "ce":
            out.append(-(hs[l] * torch.log_softmax(a, dim=1)).sum(1))
        else:
            raise ValueError(energy)
    return out


def feed_forward_values(seq, x, y):
    """Init of the value nodes: h_0 = x, h_l = u_l (feed-forward) for hidden l, h_L = y."""
    hs = [x.detach().clone()]
    with torch.no_grad():
        for lin, act in split_layers(seq)[:-1]:
            hs.append(act(lin(hs[-1])))
    hs.append(y.detach().clone())
    return hs


def reference_step(seq, opt, x, y, T, x_lr, x_momentum, algorithm, energy):
    """One training step on the batch (x, y); updates ``seq``'s weights in place via ``opt``.

    ``opt`` must be a torch.optim optimizer over ``seq.parameters()``.
    Returns ``(stats, hs)``: stats = {"energy": float, "layer_energies": [L floats]} of the
    evaluation described in the API (pc: fresh evaluation at the final h, before the weight
    update; ipc: the evaluation of the last inference step), and hs = [x, h_1, ..., h_{L-1}, y]
    at the end of inference.
    """
    assert algorithm in ("pc", "ipc") and T >= 1
    layers = split_layers(seq)
    L = len(layers)
    params = list(seq.parameters())
    hs = feed_forward_values(seq, x, y)
    vs = [torch.zeros_like(h) for h in hs[1:L]]  # value momentum, reset every batch

    def evaluate():
        """Energy at the current (h, W); autograd gradients w.r.t. hidden h and W."""
        hidden = [h.detach().requires_grad_(True) for h in hs[1:L]]
        energies = per_layer_energies(layers, [hs[0], *hidden, hs[L]], energy)
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
