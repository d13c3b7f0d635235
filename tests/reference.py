"""Independent reference implementation of one predictive-coding training step.

This is the ground truth the engine is tested against.  It is deliberately
slow and simple: a Python loop over the layers of a plain ``nn.Sequential``
(Linear, act, Linear, act, ..., Linear), and EVERY gradient comes from
``torch.autograd`` applied to the energy -- nothing is derived by hand.

Maths (per sample; hidden h_1..h_{L-1} free; h_0 = x and h_L = y clamped, or free when None):
    u_l = f_l(W_l h_{l-1} + b_l) for l < L,   u_L = W_L h_{L-1} + b_L
    E   = [h_0 free] 0.5 pi_0 ||h_0 - m_0||^2 + sum_{l<L} 0.5 pi_l ||h_l - u_l||^2 + pi_L E_out
    E_out = 0.5 ||h_L - u_L||^2                  (energy="se")
    E_out = -sum_k h_L[k] log_softmax(u_L)[k]    (energy="ce")
    E_out = sum_k softplus(u_L[k]) - h_L[k] u_L[k]   (energy="bce")
    E_out = 0                                    (energy="zero");  or energy(u_L, h_L) for a callable
    F   = mean over the batch of E
pi_l(t) = precision[l] * schedule(l, t, L) at inference step t (t = T for the final evaluation).
Value gradient  g_l = d(sum_batch E)/dh_l  (i.e. B * dF/dh_l, per-sample gradient) of every free node;
weight gradient      d(mean_batch E)/dW    (= dF/dW), a learned m_0 included.
Value optimizer: SGD with momentum reset every batch, v <- g + mu v, h <- h - x_lr v, then
value noise h <- h + sqrt(2 x_lr tau) xi (xi from the documented per-node generator seed); or, state
reset every batch, t = 1..T: Nesterov (m <- mu m + g, h <- h - x_lr (g + mu m)), Adam (m <- b1 m +
(1 - b1) g, s <- b2 s + (1 - b2) g^2, h <- h - x_lr m_hat / (sqrt(s_hat) + eps), hats divided by
1 - b^t) and AdamW (Adam after h <- (1 - x_lr decay) h).
Solvers of dh/dt = -g(h) with dt = x_lr, from their Butcher tableaux: Euler (the value optimizer),
Heun (k1 = g(h), k2 = g(h - dt k1), h <- h - dt (k1 + k2) / 2) and classic RK4; T counts solver
steps; pi(t) holds through step t's stages; iPC's weight step uses the gradient at the step's start.
Init: h_0 = x or m_0; hidden (and a free h_L) by the feed-forward pass; h_L = y if clamped.
"""
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from pcdist.engine.values import noise_seed  # the documented seed of each node's noise (the only engine import)


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


def output_energy(energy, u, h):
    """Per-sample E_out [B] of a named or callable energy."""
    if callable(energy):
        return energy(u, h)
    if energy == "se":
        return 0.5 * ((h - u) ** 2).flatten(1).sum(1)
    if energy == "ce":
        return -(h * torch.log_softmax(u, dim=1)).sum(1)
    if energy == "bce":
        return (F.softplus(u) - h * u).flatten(1).sum(1)
    if energy == "zero":
        return torch.zeros(u.shape[0], dtype=u.dtype)
    raise ValueError(energy)


def layer_energies_from(predict, L, hs, energy, pis=None):
    """Per-sample energy of each layer l = 1..L: a list of L tensors of shape [B] (``pis``: pi_1..pi_L)."""
    out = []
    for l in range(1, L + 1):
        u = predict(l, hs[l - 1])
        pi = 1.0 if pis is None else pis[l - 1]
        if l < L:  # hidden layer (a node of any shape: summed over all but the batch)
            out.append(pi * 0.5 * ((hs[l] - u) ** 2).flatten(1).sum(1))
        else:
            out.append(pi * output_energy(energy, u, hs[l]))
    return out


def per_layer_energies(layers, hs, energy):
    """Per-sample energy of each layer of a Sequential's ``split_layers`` (a list of L [B] tensors)."""
    return layer_energies_from(sequential_predict(layers), len(layers), hs, energy)


def feed_forward_from(predict, L, x, y, m0=None, batch_size=None):
    """Init of the value nodes: h_0 = x (or the prior mean m0), h_l = u_l (feed-forward) for hidden l,
    h_L = y (or u_L when y is None); ``batch_size`` where both are None."""
    B = x.shape[0] if x is not None else y.shape[0] if y is not None else batch_size
    hs = [x.detach().clone() if x is not None else m0.detach().expand(B, *m0.shape).clone()]
    with torch.no_grad():
        for l in range(1, L if y is not None else L + 1):
            hs.append(predict(l, hs[-1]))
    if y is not None:
        hs.append(y.detach().clone())
    return hs


def feed_forward_values(seq, x, y):
    layers = split_layers(seq)
    return feed_forward_from(sequential_predict(layers), len(layers), x, y)


def reference_step(seq, opt, x, y, T, x_lr, x_momentum, algorithm, energy, **method):
    """One training step of a Sequential (Linear, act, ..., Linear) on the batch (x, y); see ``pc_step``
    (``method``: its value_optimizer, betas, eps, decay, solver)."""
    layers = split_layers(seq)
    return pc_step(sequential_predict(layers), len(layers), list(seq.parameters()), opt, x, y, T, x_lr,
                   x_momentum, algorithm, energy, **method)


def pc_step(predict, L, params, opt, x, y, T, x_lr, x_momentum, algorithm, energy, precision=None, schedule=None,
            prior_precision=1.0, prior_mean=None, noise=0.0, noise_seed_=0, call=0, rows=None, total=None,
            batch_size=None, value_optimizer="sgd", betas=(0.9, 0.999), eps=1e-8, decay=0.0, solver="euler",
            init_nodes=None):
    """One training step on the batch (x, y) of the network u_l = predict(l, h_{l-1}), l = 1..L;
    updates ``params`` in place via ``opt`` (a torch.optim optimizer over them).

    ``x`` / ``y`` None: h_0 / h_L free. A free h_0 has the prior 0.5 pi_0 ||h_0 - m_0||^2
    (``prior_precision``, ``prior_mean`` [*S]: a tensor; put it in ``params`` if learned).
    ``precision``: pi_1..pi_L (None: 1); ``schedule(l, t, L)`` scales them at step t.
    ``noise``: tau; at every step t one randn over the whole global batch (``total`` rows) of every
    node h_0 .. h_L in order, from a generator seeded ``noise_seed(noise_seed_, call)`` at the start
    of the call; node n's xi is its block [total, *S_n], cut to ``rows`` (default the whole batch).
    ``batch_size``: the batch when both ends are free. ``value_optimizer`` (sgd, nesterov, adam, adamw with
    ``betas``, ``eps``, ``decay``) and ``solver`` (euler, heun, rk4): see the module docstring.
    ``init_nodes``: value nodes to start from instead of the feed-forward pass.

    Returns ``(stats, hs)``: stats = {"energy": float, "layer_energies": [L floats], "prior_energy"}
    of the evaluation described in the API (pc: fresh evaluation at the final h, before the weight
    update; ipc: the evaluation of the last inference step), and hs = [h_0, h_1, ..., h_L] at the
    end of inference.
    """
    assert algorithm in ("pc", "ipc") and T >= 1
    assert x is not None or prior_mean is not None, "a free h_0 needs prior_mean (its shape)"
    hs = feed_forward_from(predict, L, x, y, prior_mean, batch_size) if init_nodes is None \
        else [h.detach().clone() for h in init_nodes]
    free = [n for n in range(L + 1) if (n > 0 or x is None) and (n < L or y is None)]
    vs = {n: torch.zeros_like(hs[n]) for n in free}  # value momentum, reset every batch
    ss = {n: torch.zeros_like(hs[n]) for n in free}  # adam's second moments
    B = hs[0].shape[0]
    total = B if total is None else total
    rows = slice(0, B) if rows is None else rows

    def pis(t):
        base = [1.0] * L if precision is None else list(precision)
        return [base[l - 1] * (1.0 if schedule is None else schedule(l, t, L)) for l in range(1, L + 1)]

    def evaluate(t, at=None):
        """Energy at the current (h, W) (or the nodes ``at``) with pi(t); autograd gradients w.r.t. the free h
        and W."""
        nodes = [h.detach().requires_grad_(n in free) for n, h in enumerate(hs if at is None else at)]
        energies = layer_energies_from(predict, L, nodes, energy, pis(t))
        prior = 0.5 * prior_precision * ((nodes[0] - prior_mean) ** 2).flatten(1).sum(1) if x is None \
            else torch.zeros(B, dtype=nodes[0].dtype)
        E = torch.stack(energies).sum(0) + prior  # [B] per-sample energy
        g_h = dict(zip(free, torch.autograd.grad(E.sum(), [nodes[n] for n in free], retain_graph=True,
                                                 allow_unused=True))) if free else {}
        g_h = {n: torch.zeros_like(hs[n]) if g is None else g for n, g in g_h.items()}
        g_w = torch.autograd.grad(E.mean(), params, allow_unused=True)
        # a clamped h_0 has no prior term: a learned mean gets no gradient (None: no update, as PyTorch leaves a
        # parameter the loss does not use); a layer whose energy is zero gets a zero gradient
        g_w = [None if p is prior_mean and x is not None else torch.zeros_like(p) if g is None else g
               for p, g in zip(params, g_w)]
        stats = {"energy": E.mean().item(), "layer_energies": [e.mean().item() for e in energies],
                 "prior_energy": prior.mean().item()}
        return g_h, list(g_w), stats

    gen = torch.Generator().manual_seed(noise_seed(noise_seed_, call))
    sizes = [total * math.prod(h.shape[1:]) for h in hs]

    def value_step(g_h, t):
        xis = torch.randn(sum(sizes), generator=gen, dtype=hs[0].dtype).split(sizes) if noise else None
        for n in free:
            g = g_h[n]
            if value_optimizer == "sgd":
                vs[n] = g + x_momentum * vs[n]
                hs[n] = hs[n] - x_lr * vs[n]
            elif value_optimizer == "nesterov":
                vs[n] = x_momentum * vs[n] + g
                hs[n] = hs[n] - x_lr * (g + x_momentum * vs[n])
            else:
                b1, b2 = betas
                vs[n] = b1 * vs[n] + (1 - b1) * g
                ss[n] = b2 * ss[n] + (1 - b2) * g * g
                m_hat, s_hat = vs[n] / (1 - b1 ** (t + 1)), ss[n] / (1 - b2 ** (t + 1))
                if value_optimizer == "adamw":
                    hs[n] = hs[n] * (1 - x_lr * decay)
                hs[n] = hs[n] - x_lr * m_hat / (torch.sqrt(s_hat) + eps)
            if noise:
                xi = xis[n].view(total, *hs[n].shape[1:])[rows]
                hs[n] = hs[n] + math.sqrt(2 * x_lr * noise) * xi

    def weight_step(g_w):
        opt.zero_grad()
        for p, g in zip(params, g_w):
            p.grad = None if g is None else g.detach().clone()
        opt.step()

    tableau = {"heun": ([[1.0]], [0.5, 0.5]),
               "rk4": ([[0.5], [0.0, 0.5], [0.0, 0.0, 1.0]], [1 / 6, 1 / 3, 1 / 3, 1 / 6])}

    def solver_step(g_h, t):
        """One step of an explicit Runge-Kutta method (Butcher tableau a, b) on dh/dt = -g(h), dt = x_lr."""
        a, b = tableau[solver]
        ks = [g_h]
        for row in a:
            at = list(hs)
            for n in free:
                at[n] = hs[n] - x_lr * sum(c * k[n] for c, k in zip(row, ks))
            ks.append(evaluate(t, at)[0])
        for n in free:
            hs[n] = hs[n] - x_lr * sum(c * k[n] for c, k in zip(b, ks))

    for t in range(T):
        g_h, g_w, stats = evaluate(t)  # h-step and (ipc) W-step from the same state
        if solver == "euler":
            value_step(g_h, t)
        else:
            solver_step(g_h, t)
        if algorithm == "ipc":
            weight_step(g_w)
    if algorithm == "pc":
        _, g_w, stats = evaluate(T)  # fresh evaluation at the final value nodes
        weight_step(g_w)
    return stats, [h.detach().clone() for h in hs]


class ReferenceTrainer:
    """Holds a deep copy of ``seq`` and its own optimizer ``make_opt(copy.parameters())``."""

    def __init__(self, seq, make_opt, T, x_lr, x_momentum=0.0, algorithm="pc", energy="se", **method):
        self.seq = copy.deepcopy(seq)
        self.opt = make_opt(self.seq.parameters())
        self.kw = dict(T=T, x_lr=x_lr, x_momentum=x_momentum, algorithm=algorithm, energy=energy, **method)
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
