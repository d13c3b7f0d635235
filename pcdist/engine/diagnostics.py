"""Diagnostics of PC against backprop on one batch: is inference converging, and does PC's weight
update point where backprop's gradient points? (docs/fidelity.md, "Diagnostics".)

``diagnose(trainer, x, y)`` runs, with the weights and the optimizer untouched:

1. the trainer's inference on the batch (feed-forward init, T Jacobi steps at its x_lr, momentum and
   precision schedule; no value noise), recording every layer's batch-mean energy at the init and
   after each step: ``energy_trace[t][l - 1]``;
2. PC's weight update from the errors where inference stopped: dF/dtheta_l, exactly what a ``pc``
   step hands the optimizer (for ``ipc``: the gradient at the last step with the weights held);
3. backprop's gradient on the same batch and weights: dF_bp/dtheta_l with
   F_bp = pi_L mean_batch E_out(u_L(x), y), PC's F at the feed-forward init, by autograd through
   each layer slice's own feed-forward pass and a sequential backward through the ranks (each rank
   receives dF_bp/d(its output node) from its downstream neighbour and sends dF_bp/d(its input node)
   upstream: point-to-point, as the inference exchange);
4. per layer l: cos(PC update, BP gradient) over all of the layer's parameters, and the norm ratio
   ||PC update|| / ||BP gradient|| (0 and 0 where PC's update is exactly 0: a layer inference has
   not reached, listed in ``unreached``; also 0 and 0 for a layer without parameters, or whose backprop
   gradient is 0: neither is ``compared``); per free node n: its value change over inference against its
   activation scale, rms(h_n(T) - h_n(0)) / rms(h_n(0)) (h_n(0): the feed-forward init).

Each rank computes the numbers of its own layers and nodes; one reduce brings them to the logging
rank, which alone gets the result (None elsewhere). Every rank must call it (it is collective).

Known values (tests): at the init (``T=0``) only the output layer's update is non-zero and it equals
backprop's, cos = 1 and norm ratio 1; with a small output precision pi_L = beta and inference run
to convergence, every layer's cos -> 1 and norm ratio -> 1 as beta -> 0 (the small-error limit).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .inference import relax
from .trainer import PCTrainer, check_batch

__all__ = ["diagnose", "classify_inference", "INFERENCE_STATES", "unstable_hint", "stable_x_lr"]

INFERENCE_STATES = ("converging", "oscillating", "diverging")


def classify_inference(energy: list[float], tol: float = 1e-3) -> str:
    """How the total energy moved over the inference steps (index 0: the feed-forward init):
    ``diverging`` if it ends above where it started (or is not finite), ``oscillating`` if it rose
    by more than ``tol`` (relative) at some step but ended lower, else ``converging``."""
    if not all(math.isfinite(e) for e in energy):
        return "diverging"
    if energy[-1] > energy[0] * (1 + 1e-9):
        return "diverging"
    if any(b > a + tol * abs(a) for a, b in zip(energy, energy[1:])):
        return "oscillating"
    return "converging"


def stable_x_lr(energy: list[float], x_lr: float) -> float:
    """A value step that the energy trace says is stable: near the end of a diverging inference the
    stiffest mode dominates, its error growing by r = sqrt(E_T / E_{T-1}) = |1 - x_lr lambda| per step, so
    lambda = (1 + r) / x_lr and x_lr' = 1 / lambda (the step that damps that mode fastest; stable up to
    2 / lambda) = x_lr / (1 + r); rounded down to 1, 2 or 5 times a power of ten."""
    a, b = energy[-2] if len(energy) > 1 else energy[0], energy[-1]
    r = math.sqrt(b / a) if math.isfinite(b) and a > 0 else 10.0
    want = x_lr / (1.0 + max(r, 1.0))
    p = 10 ** math.floor(math.log10(want))
    return max(m * p for m in (1, 2, 5) if m * p <= want * (1 + 1e-9))


def unstable_hint(energy: list[float], x_lr: float, T: int, where: str = "") -> str:
    """The one log line for an inference that diverged: what grew and the likely fix."""
    grew = "inf" if not math.isfinite(energy[-1]) else f"{energy[-1] / max(energy[0], 1e-30):.3g}x"
    return (f"warning: inference is unstable{where}: the energy grew over the {T} inference steps ({energy[0]:.4g} "
            f"-> {energy[-1]:.4g}, {grew}), so the weight updates follow the blow-up, not the errors, and accuracy "
            f"may stay near chance; likely fix: a smaller value step, pc.x_lr={stable_x_lr(energy, x_lr):g} (now "
            f"{x_lr:g}; docs/fidelity.md)")


def _layer_grads(g, grads: list[Tensor]) -> dict[int, Tensor]:
    """{global layer: its parameters' gradients flattened into one vector} from a group's stacked [K, ...]."""
    out = {}
    for k, l in enumerate(g.layers):
        out[l] = torch.cat([t[k].reshape(-1) for t in grads]) if grads else torch.zeros(0)
    return out


@torch.no_grad()
def diagnose(trainer: PCTrainer, x: Tensor, y: Tensor, T: int | None = None,
             global_batch: int | None = None) -> dict | None:
    """The diagnostics of one batch (see the module docstring) on the logging rank, None elsewhere:
    ``energy_trace`` [T + 1][L], ``energy`` (totals per step), ``inference`` (``classify_inference``),
    ``cosine`` [L], ``norm_ratio`` [L], ``compared`` [L] (both updates non-zero: the layer's cos means
    something), ``unreached`` (the layers, from 1, with a backprop gradient and no PC update: below the error
    front), ``value_change`` and ``activation_scale`` {node: value} of the free nodes. ``T``: inference steps
    (default the trainer's; 0: the update at the init).
    ``x`` and ``y`` clamp h_0 and h_L (supervised; backprop has nothing to compare with otherwise)."""
    if x is None or y is None:
        raise ValueError("diagnose compares PC with backprop on a supervised batch: give both x and y")
    T = trainer.T if T is None else int(T)
    if T < 0:
        raise ValueError(f"T must be >= 0, got {T}")
    net, par = trainer.net, trainer.parallel
    L, first = net.num_layers, net.first
    B = check_batch(net, x, y)
    st = trainer._begin(x, y, None)
    st.restart()
    par.feedforward(st)
    x_in = st.node(first - 1).clone()  # this slice's input at the init: x, or the upstream node
    free = [(lo + i, h[i]) for lo, h, _, _ in st.nodes.free for i in range(h.shape[0])]
    h0 = {n: h.clone() for n, h in free}
    rows = torch.zeros(T + 1, len(st.energy_log), dtype=st.energy_log.dtype, device=st.energy_log.device)
    relax(st, par, T, trainer.x_lr, fused=False, schedule=trainer.precision_schedule,
          record=lambda t: rows[t].copy_(st.layer_energies()), final=True, solver=trainer.solver)
    full = par.gather_layer_energies(rows, B, st.energy_index)
    trace = [] if full is None else [row[1:] for row in full.tolist()]
    par.weight_grads(st)
    par.reduce_grads()
    # Compare in the master network (float32 under precision="bf16", whose products run on a bfloat16 copy):
    # the copy's weight gradients go into the master's .grad, and backprop runs through the master's layers.
    trainer.mixed.grads(st.idle)
    master = dict(zip(map(id, trainer.mixed.compute.groups), net.groups))
    groups = [master.get(id(gr.g), gr.g) for gr in st.groups if gr.g.first > 0]
    pc = {l: v for g in groups for l, v in _layer_grads(g, [p.grad for p in g.parameters()]).items()}
    pi_L = float(st.precision[-1]) if st.precision is not None and par.is_last else 1.0
    bp = _backprop(trainer, x_in, y, groups, pi_L, B, global_batch)
    stats = torch.zeros(3 * L + 2 * (L + 1), dtype=torch.float64)
    if par.data_rank == 0:  # the gradients are the same on every data rank: count them once
        for l, g_pc in pc.items():
            g_bp = bp[l]
            stats[3 * (l - 1) : 3 * l] = torch.stack([(g_pc * g_bp).sum(), g_pc.square().sum(),
                                                      g_bp.square().sum()]).double().cpu()
    for n, h in free:  # the batch is split over data ranks: sum over all
        stats[3 * L + 2 * n] = float((h - h0[n]).double().square().sum())
        stats[3 * L + 2 * n + 1] = float(h0[n].double().square().sum())
    total = par.sum_to_logging(stats.tolist(), x_in.device)
    if total is None:
        return None
    cos, ratio, compared, unreached = [], [], [], []
    for l in range(L):
        dot, npc, nbp = total[3 * l : 3 * l + 3]
        ok = npc > 0 and nbp > 0
        cos.append(dot / math.sqrt(npc * nbp) if ok else 0.0)
        ratio.append(math.sqrt(npc / nbp) if ok else 0.0)
        compared.append(ok)
        if nbp > 0 and npc == 0:
            unreached.append(l + 1)
    nodes = sorted({n for n in range(L + 1) if total[3 * L + 2 * n + 1] > 0 or total[3 * L + 2 * n] > 0})
    change = {n: math.sqrt(total[3 * L + 2 * n] / total[3 * L + 2 * n + 1]) if total[3 * L + 2 * n + 1] > 0
              else math.inf for n in nodes}
    count = B * par.data_size if global_batch is None else global_batch
    scale = {n: math.sqrt(total[3 * L + 2 * n + 1] / (count * math.prod(net.node_shapes[n]))) for n in nodes}
    energy = [math.fsum(row) for row in trace]
    return {"T": T, "x_lr": trainer.x_lr, "energy_trace": trace, "energy": energy,
            "inference": classify_inference(energy), "cosine": cos, "norm_ratio": ratio, "compared": compared,
            "unreached": unreached, "value_change": change, "activation_scale": scale}


def _backprop(trainer: PCTrainer, x_in: Tensor, y: Tensor, groups, pi_L: float, B: int,
              global_batch: int | None) -> dict[int, Tensor]:
    """dF_bp/dtheta of this slice's layers, flattened per layer, by autograd through the slice's feed-forward
    pass from ``x_in`` and the gradient received from downstream (sent on upstream)."""
    net, par = trainer.net, trainer.parallel
    params = [p for g in groups for p in g.parameters()]
    with torch.enable_grad():
        h = x_in.detach().requires_grad_(not par.is_first)
        out = h
        for g in groups:
            out = g(out)
        if par.is_last:
            from .energies import OutputEnergy  # the loss of the backprop twin, scaled by pi_L

            total = B * par.data_size if global_batch is None else global_batch
            loss = pi_L * OutputEnergy(net.energy).value(out, y, y - out) / total
            seeds = None
        else:
            loss = out
            seeds = par.recv_from_next(torch.empty_like(out).contiguous())
        wrt = params + ([h] if not par.is_first else [])
        grads = list(torch.autograd.grad(loss, wrt, grad_outputs=seeds, allow_unused=True))
    grads = [torch.zeros_like(p) if gr is None else gr for p, gr in zip(wrt, grads)]
    if not par.is_first:
        par.send_to_prev(grads.pop())
    par.sum_over_data(grads)
    out, i = {}, 0
    for g in groups:
        n = len(list(g.parameters()))
        out.update(_layer_grads(g, grads[i : i + n]))
        i += n
    return out
