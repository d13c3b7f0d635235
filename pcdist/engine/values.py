"""The value optimizer of a Stage: SGD with momentum on the free value nodes, the other value
rules (Nesterov, Adam, AdamW), the stages of the multi-stage ODE solvers, and value noise.

Shape letters: N nodes of a block, B batch, S a node's shape.

Per inference step, with g the per-sample energy gradient of a free node (its own error
pi e plus the back-projection of the layer above: g = pi e - P), the value step is

    v <- g + mu v;   h <- h - x_lr v                       (v reset every batch)
    h <- h + sqrt(2 x_lr tau) xi,   xi ~ N(0, 1)           (value noise, MCPC; ``ValueNoise``)

The other rules (``ValueRule``; state per node, started afresh every batch, t = 1, 2, ...
the inference step):

    nesterov   m <- mu m + g;   h <- h - x_lr (g + mu m)
    adam       m <- b1 m + (1 - b1) g;   s <- b2 s + (1 - b2) g^2
               h <- h - x_lr (m / (1 - b1^t)) / (sqrt(s / (1 - b2^t)) + eps)
    adamw      adam after h <- h (1 - x_lr decay)        (decoupled decay of the values)

and the stages of a multi-stage solver (``Tableau``; pcdist/engine/inference.py): stage s
evaluates k_s = g at the point the stage before it set, then

    s = 0          h0 <- h;  acc <- k_0;          h <- h0 - x_lr c_0 k_0
    0 < s < S - 1  acc <- acc + w_s k_s;          h <- h0 - x_lr c_s k_s
    s = S - 1      acc <- acc + w_s k_s;          h <- h0 - x_lr q acc

(Heun: c = (1,), w = (1, 1), q = 1/2; RK4: c = (1/2, 1/2, 1), w = (1, 2, 2, 1), q = 1/6).
For these, v holds g itself at the update (the back-projection starts it afresh each
evaluation) and the rule's own state lives beside it (``state``).

The back-projections accumulate into v during ``Stage.backproject`` with the weight ``beta``
on the old v (every free node but h_L gets exactly one back-projection, so momentum is
applied there exactly once; a free h_L, which none projects into, is scaled here). Without
momentum and with the errors written straight into v (``aliased``), v is g already.

For pc without momentum the Stage fuses the step into its passes (``begin_step``): each
group's error pass takes h -= x_lr e, the back-projection adds x_lr P into h, and only the
steps that had to wait (a node read by a group that ran later: ``deferred``) and the slice's
boundary nodes are left to ``update``.

A layer slice's boundary: v of its last node gets the downstream back-projection
``recv_backproj``, and the replica of the upstream neighbour's last node takes the update its
owner takes, from ``recv_error`` and ``send_backproj``, in the same floating-point order. The
rules and solver stages step the owner's boundary node as a node of its own (not inside its
block), so that it and its replica run the very same kernels on tensors of one shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .nodes import ValueNodes

__all__ = ["ValueOptimizer", "ValueNoise", "ValueRule", "Tableau", "VALUE_OPTIMIZERS", "TABLEAUS", "noise_seed",
           "scale_", "stage_noise", "value_rule"]

VALUE_OPTIMIZERS = ("sgd", "nesterov", "adam", "adamw")


@dataclass(frozen=True)
class ValueRule:
    """How the value nodes step (see the module docstring): ``name`` one of VALUE_OPTIMIZERS; ``momentum``
    mu (sgd: heavy ball, nesterov); ``betas``, ``eps`` (adam, adamw); ``decay``: adamw's decoupled decay (None:
    0.01 for adamw, torch's default, as ``value_optimizer="adamw"``; others have none). A setting the rule does not
    read is refused (it would change nothing)."""

    name: str = "sgd"
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    decay: float | None = None

    def __post_init__(self):
        if self.name not in VALUE_OPTIMIZERS:
            raise ValueError(f"unknown value optimizer {self.name!r}; allowed: {', '.join(VALUE_OPTIMIZERS)}")
        if self.decay is None:
            object.__setattr__(self, "decay", 0.01 if self.name == "adamw" else 0.0)
        if not (0.0 <= self.momentum < 1.0):
            raise ValueError(f"the value momentum must be in [0, 1), got {self.momentum!r}")
        if self.name == "nesterov" and self.momentum == 0.0:
            raise ValueError("value_optimizer='nesterov' needs a momentum > 0 (x_momentum)")
        if self.name in ("adam", "adamw") and self.momentum:
            raise ValueError("adam and adamw on the values keep their own averages: leave x_momentum at 0")
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise ValueError(f"adam's betas must be a pair (beta1, beta2), got {self.betas!r}")
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0 and 0 < self.eps < math.inf and 0 <= self.decay < math.inf):
            raise ValueError(f"adam's betas must be in [0, 1), eps > 0 and decay >= 0 (finite), got {self}")
        unread = ["decay"] if self.name != "adamw" and self.decay else []
        if self.name in ("sgd", "nesterov"):
            unread += ["betas"] * (tuple(self.betas) != (0.9, 0.999)) + ["eps"] * (self.eps != 1e-8)
        if unread:
            raise ValueError(f"ValueRule({self.name!r}) does not read {', '.join(unread)} (decay is adamw's, betas "
                             f"and eps adam's and adamw's): it would change nothing")

    @property
    def plain(self) -> bool:
        """SGD (with heavy-ball momentum or none): the step needs no state beside v."""
        return self.name == "sgd"


def value_rule(spec: "str | ValueRule", momentum: float = 0.0) -> ValueRule:
    """The ValueRule of a name (with the trainer's x_momentum; adamw: decay 0.01, torch's default) or
    the rule itself."""
    if isinstance(spec, ValueRule):
        if momentum and float(momentum) != spec.momentum:
            raise ValueError(f"x_momentum={momentum!r} beside value_optimizer={spec} would be ignored: the rule "
                             f"carries its own momentum; set ValueRule(..., momentum={momentum!r}) or leave "
                             f"x_momentum at 0")
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"value_optimizer must be a name ({', '.join(VALUE_OPTIMIZERS)}) or a ValueRule, "
                         f"got {spec!r}")
    return ValueRule(spec, float(momentum))


@dataclass(frozen=True)
class Tableau:
    """An explicit Runge-Kutta method whose stage s is evaluated at h0 - dt c_{s-1} k_{s-1} (see the
    module docstring): ``c`` the S - 1 stage offsets, ``w`` the S weights of acc, ``q`` acc's factor."""

    name: str
    c: tuple[float, ...]
    w: tuple[float, ...]
    q: float

    @property
    def stages(self) -> int:
        return len(self.w)


TABLEAUS = {"heun": Tableau("heun", (1.0,), (1.0, 1.0), 0.5),
            "rk4": Tableau("rk4", (0.5, 0.5, 1.0), (1.0, 2.0, 2.0, 1.0), 1.0 / 6.0)}


def noise_seed(seed: int, call: int) -> int:
    """The seed of the value noise of training step (or infer call) ``call`` (see ``ValueNoise``)."""
    return (seed * 0x9E3779B1 + call * 0x85EBCA77 + 0x27D4EB2F) % 2**63


def scale_(v: Tensor, beta: float) -> Tensor:
    """v *= beta in place; beta 0 clears v (as a GEMM with beta 0 ignores its old contents)."""
    if beta == 0.0:
        return v.zero_()
    return v if beta == 1.0 else v.mul_(beta)


class ValueOptimizer:
    """The value step over a Stage's nodes: ``rule`` (a ValueRule; its heavy-ball momentum is ``mu``);
    ``aliased``: v and e are one tensor. A multi-stage solver sets ``tableau`` and, before each
    update, ``stage``."""

    def __init__(self, nodes: ValueNodes, rule: ValueRule | float, aliased: bool):
        rule = rule if isinstance(rule, ValueRule) else ValueRule("sgd", float(rule))
        self.nodes, self.rule, self.aliased = nodes, rule, aliased
        self.mu = rule.momentum if rule.plain else 0.0
        self.tableau: Tableau | None = None
        self.stage = 0
        self.state: dict = {}  # (rule or tableau name) -> per-target buffers, made on first use
        self.estimate: list | None = None  # adaptive solver: [tol, sum of squares]
        self.front: int | None = None  # adam: the top node of the error front (see ``_stateful``)
        self.reset()

    def reset(self) -> None:
        """A new batch: momentum starts again from zero."""
        self.step = 0
        self.step_lr, self.done, self.deferred = None, [], []

    @property
    def plain(self) -> bool:
        """The SGD step of one stage: v accumulates the momentum itself and h <- h - x_lr v."""
        return self.rule.plain and self.tableau is None

    def begin_step(self, step_lr: float | None) -> bool:
        """Start an error pass; True if the value step is fused into it (pc without momentum)."""
        self.step_lr = step_lr if step_lr is not None and self.mu == 0.0 and self.plain else None
        return self.step_lr is not None

    @property
    def beta(self) -> float:
        """Weight of the old v in the back-projection: 1 when v holds e (no momentum), mu with
        momentum, 0 on the first step of a batch (and always for the stateful rules and solvers,
        whose v is g afresh at every evaluation)."""
        return 1.0 if self.aliased else (self.mu if self.step > 0 else 0.0)

    def update(self, x_lr: float, boundary: bool, top: bool) -> None:
        """v += e (unless v is e); h -= x_lr * v on the free nodes (``boundary``: this slice sends its last
        node downstream; ``top``: it holds a free h_L) and on the replica (see the module docstring); the
        other rules and the solvers' stages take their own step from v = g."""
        nd, beta, blocks = self.nodes, self.beta, self.nodes.blocks
        plain = self.plain
        if self.step_lr is not None:  # errors and backproject took the rest of the step
            for gr in self.deferred:
                gr.h_out.add_(gr.e_out, alpha=-x_lr)
            if boundary:  # the boundary node, stepped as its replica downstream is
                blocks[-1].h[-1].add_(blocks[-1].e[-1], alpha=-x_lr).add_(nd.recv_backproj, alpha=-x_lr)
        else:
            if nd.recv_backproj is not None:
                scale_(blocks[-1].v[-1], beta).add_(nd.recv_backproj)
            if top and not self.aliased:  # no layer projects into h_L: its momentum is applied here
                scale_(blocks[-1].v[-1], beta)
            for _, h, v, e in nd.free:
                if not self.aliased:
                    v.add_(e)
                if plain:
                    h.add_(v, alpha=-x_lr)
        if nd.has_replica:
            h, v, e = blocks[0].h[0], blocks[0].v[0], blocks[0].e[0]
            if self.step_lr is not None:
                h.add_(e, alpha=-x_lr).add_(nd.send_backproj, alpha=-x_lr)
            else:
                scale_(v, beta).add_(nd.send_backproj)
                if not self.aliased:
                    v.add_(e)
                if plain:
                    h.add_(v, alpha=-x_lr)
        if not plain:
            self._stateful(x_lr, boundary)
        self.step += 1
        self.step_lr, self.done, self.deferred = None, [], []

    # -- the stateful rules and the solvers' stages -----------------------------------------
    def targets(self, boundary: bool) -> list[tuple[int, Tensor, Tensor, bool]]:
        """(first node, h, v = g, owned) of every run of nodes this rank steps: the free runs, the boundary
        node sent downstream as a node of its own, and the replica of the upstream node (``owned`` False)."""
        nd = self.nodes
        out = [(lo, h, v, True) for lo, h, v, _ in nd.free]
        if boundary and out:
            lo, h, v, _ = out.pop()
            if h.shape[0] > 1:
                out.append((lo, h[:-1], v[:-1], True))
            out.append((lo + h.shape[0] - 1, h[-1:], v[-1:], True))
        if nd.has_replica:
            out.append((nd.blocks[0].lo, nd.blocks[0].h[:1], nd.blocks[0].v[:1], False))
        return out

    def _buffers(self, key: str, n: int, boundary: bool) -> list[tuple]:
        bufs = self.state.get(key)
        if bufs is None:
            bufs = self.state[key] = [tuple(torch.empty_like(h) for _ in range(n)) + (lo, h, v, owned)
                                      for lo, h, v, owned in self.targets(boundary)]
        return bufs

    def _stateful(self, x_lr: float, boundary: bool) -> None:
        if self.tableau is not None:
            self._stage(self.tableau, x_lr, boundary)
            return
        r, t = self.rule, self.step + 1
        if r.name == "nesterov":
            for m, _, h, g, _ in self._buffers("nesterov", 1, boundary):
                if t == 1:
                    m.copy_(g)
                else:
                    m.mul_(r.momentum).add_(g)
                h.add_(g, alpha=-x_lr).add_(m, alpha=-x_lr * r.momentum)
            return
        b1, b2 = r.betas
        c1, c2 = 1.0 - b1 ** t, math.sqrt(1.0 - b2 ** t)
        for m, s, d, lo, h, g, _ in self._buffers("adam", 3, boundary):
            if self.front is not None and lo < self.front - self.step:
                # Below the error front (pc from the feed-forward init: node n's gradient is exactly zero
                # before step top - n) g is round-off of recomputed predictions, which Adam's division by
                # its own scale would turn into full steps: it is zero there, as in exact arithmetic.
                g[: min(g.shape[0], self.front - self.step - lo)].zero_()
            if t == 1:
                torch.mul(g, 1.0 - b1, out=m)
                torch.mul(g, g, out=s).mul_(1.0 - b2)
            else:
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                s.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            torch.sqrt(s, out=d).div_(c2).add_(r.eps)
            if r.decay:
                h.mul_(1.0 - x_lr * r.decay)
            h.addcdiv_(m, d, value=-x_lr / c1)

    def _stage(self, tab: Tableau, x_lr: float, boundary: bool) -> None:
        s, last = self.stage, tab.stages - 1
        est = self.estimate
        for h0, acc, _, h, k, owned in self._buffers(tab.name, 2, boundary):
            if s == 0:
                h0.copy_(h)
                acc.copy_(k)
                h.add_(k, alpha=-x_lr * tab.c[0])
                continue
            if s == last and est is not None and owned:  # Heun against Euler: dt/2 (k_1 - k_0), scaled
                err = torch.sub(k, acc).mul_(0.5 * x_lr).div_(h0.abs().add_(1.0).mul_(est[0]))
                est[1] = est[1] + err.square().sum()
            acc.add_(k) if tab.w[s] == 1.0 else acc.add_(k, alpha=tab.w[s])
            if s < last:
                h.copy_(h0).add_(k, alpha=-x_lr * tab.c[s])
            else:
                h.copy_(h0).add_(acc, alpha=-x_lr * tab.q)

    def restore(self) -> None:
        """Put every node back where the solver's step began (an adaptive step that was rejected)."""
        for h0, _, _, h, _, _ in self.state[self.tableau.name]:
            h.copy_(h0)

    def owned_count(self, boundary: bool) -> int:
        """Entries of the nodes this rank owns and steps (the replica not counted)."""
        return sum(h.numel() for _, h, _, owned in self.targets(boundary) if owned)


class ValueNoise:
    """MCPC's Langevin term on a Stage: h += std xi after the value step of every inference step, on every node
    this rank updates (the replica of the upstream node included), std = sqrt(2 x_lr tau).

    The draw is graph-safe and the same whatever the split: at the start of training step (or infer call)
    ``call`` a generator is seeded with ``noise_seed(seed, call)`` (``seed_call``, on the host); at each
    inference step one ``randn(n)`` draws the noise of the whole global batch of every node h_0 .. h_L, in
    that order, each node's block [global batch, *shape] (n = global batch x the sum of the node sizes).
    Node h_n's xi is its block, cut to this data rank's rows. Every rank draws the whole vector, so it does
    not matter which nodes or rows it owns; a captured step reads the generator's seed at each replay.
    """

    def __init__(self, st, par, std: float, global_batch: int | None, generator: torch.Generator):
        B = st.B
        total = B if par.data_size == 1 else global_batch
        if total is None:
            raise ValueError("value noise on a data axis needs the global batch size: pass global_batch=")
        rows = torch.tensor_split(torch.arange(total), par.data_size)[par.data_rank]
        if len(rows) != B:
            raise ValueError(f"global_batch={total} over {par.data_size} data ranks gives this rank {len(rows)} rows, "
                             f"but its batch has {B}")
        lo = int(rows[0]) if len(rows) else 0
        shapes = st.net.node_shapes
        offsets = [0]
        for shape in shapes:
            offsets.append(offsets[-1] + total * math.prod(shape))
        like = st.node(st.net.stop - 1)
        self.flat = st.noise_buffers.get(total)  # one per global batch, whatever x_lr and tau: each call fills it
        if self.flat is None:
            self.flat = st.noise_buffers[total] = torch.empty(offsets[-1], dtype=like.dtype, device=like.device)
        self.std, self.generator = std, generator

        def block(n: int, N: int) -> Tensor:  # xi of nodes n .. n + N - 1, this rank's rows
            xi = self.flat[offsets[n] : offsets[n + N]].view(N, total, *shapes[n])
            return xi[:, lo : lo + B]

        nd = st.values.nodes
        self.pairs = [(h, block(n, h.shape[0])) for n, h, _, _ in nd.free]
        if nd.has_replica:
            self.pairs.append((nd.blocks[0].h[:1], block(nd.blocks[0].lo, 1)))

    def seed_call(self, seed: int, call: int) -> None:
        """Seed this call's draws (host work, before the step's core runs)."""
        self.generator.manual_seed(noise_seed(seed, call))

    def __call__(self, t: int) -> None:
        """Inference step t's noise on every node this rank updates."""
        torch.randn(self.flat.shape, generator=self.generator, out=self.flat)
        for h, xi in self.pairs:
            h.add_(xi, alpha=self.std)


NOISE_KEPT = 8
"""The ValueNoise objects a Stage keeps (the most recently used): an x_lr annealed at every step makes one each."""


def stage_noise(st, par, x_lr: float, tau: float, global_batch: int | None, generator: torch.Generator,
                seed: int, call: int) -> ValueNoise | None:
    """The Stage's value noise at temperature ``tau`` (made once per stage, tau and x_lr, NOISE_KEPT at most: its
    std is sqrt(2 x_lr tau)), seeded for ``call``; None without noise."""
    if not tau:
        return None
    key = (tau, global_batch, x_lr)
    noise = st.noise.pop(key, None)
    if noise is None:
        noise = ValueNoise(st, par, math.sqrt(2.0 * x_lr * tau), global_batch, generator)
    st.noise[key] = noise  # (the most recent last)
    while len(st.noise) > NOISE_KEPT:
        del st.noise[next(iter(st.noise))]
    noise.seed_call(seed, call)
    return noise
