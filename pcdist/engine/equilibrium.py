"""Inits near the equilibrium of inference: errors at every layer from the start.

Shape letters: B batch, O output width (the output node read flattened), S a node's shape,
D a hidden node's size (its entries).

From the feed-forward init an error moves one layer per inference step, so at T < L the lowest
L - T - 1 layers never see one. With both ends clamped (supervised PC) the only source of error is
the output, and the equilibrium of the energy linearised at the feed-forward state is low-rank.
With J_l = du_l/dh_{l-1} at that state, A_l = J_L ... J_{l+1} [O x D_l] (A_{L-1} = J_L), the
output signal d = -pi_L dE_out/du_L (r = d at the feed-forward state) and H = pi_L d^2E_out/du_L^2:

    stationarity      e_l = J_{l+1}^T e_{l+1}  ->  e_l = A_l^T d       (e_l = pi_l (h_l - u_l))
    linearised flow   h_l - ff_l = e_l / pi_l + J_l (h_{l-1} - ff_{l-1}),  so  u_L - u_L^ff = S d
                      with S = sum_{l<L} A_l A_l^T / pi_l  [O x O] per sample
    output            d = r - H S d   ->   (I + H S) d = r                   (one small solve)

``newton`` takes that step: one backward chain of O-wide vector-Jacobian products (A_l for every
layer: for dense and residual layers one GEMM of O x B rows each, for other kinds torch.func.vjp
vmapped over the O rows), the [O x O] solve per sample, then a feed-forward pass with the errors
injected, h_l = u_l(h_{l-1}) + e_l / pi_l. It is exactly Newton's step on the energy from the
feed-forward state (there every hidden error is zero, so the Hessian is the Gauss-Newton one; the
output energy's own curvature is H), where u_L is linear in h_{L-1}; an output layer with an activation
of its own adds r . d2u_L/dh2, which the step leaves out (Gauss-Newton in that layer).

``newton_cr`` takes the same step the way DeepPCR solves a chain (pcdist/engine/deeppcr.py): the
Hessian in the hidden nodes is block-tridiagonal (diagonal pi_l I + pi_{l+1} J_{l+1}^T J_{l+1},
the last J_L^T H J_L; off-diagonal -pi_l J_l), solved by cyclic reduction in ceil(log2 L) rounds
of batched [D x D] solves (blocks padded to the largest node). It needs the per-sample Jacobians
(O(L B D^2) numbers, O(L B D^3) work), so it is the comparison, not the fast path.

``backward`` is the cheap guess: one backward chain of the output signal alone (b_l = A_l^T r, a
backprop pass), scaled per sample by the step alpha that minimises the linearised energy along it,
alpha = q / (q + s^T H s) with s = S r from one forward chain of Jacobian-vector products and
q = r . s; then the same injected feed-forward pass.

None of them reads a value on the host (``torch.linalg.solve_ex``: no check), so they stay in a
step's capturable core. They need both end nodes clamped and the whole network on one layer slice.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.func import jacrev, jvp, vjp, vmap

__all__ = ["near_equilibrium", "output_hessian", "block_tridiagonal_solve"]

CLOSED_FORM = True
"""Dense and residual layers' Jacobian products in closed form (False: through torch.func, as other kinds)."""


def _layers(st) -> list[Callable[[Tensor], Tensor]]:
    """u_l = f_l(h_{l-1}) for l = 1 .. L (index 0 unused), from each group's per-layer prediction."""
    fns: list = [None]
    for gr in st.groups:
        if gr.first == 0:
            continue
        for k in range(gr.K):
            fns.append(lambda h, g=gr.g, k=k: g.layer(k, h))
    return fns


class Linearised:
    """Layer l at the input h_{l-1}: its prediction ``u`` and the products with its Jacobian J there,
    ``vjp(R)`` = R J for rows R [N, B, *S_out] and ``jvp(v)`` = J v for v [B, *S_in]. Dense and residual layers
    in closed form (one GEMM each); any other kind through torch.func (vjp vmapped over the rows)."""

    def __init__(self, g, k: int, h: Tensor):
        self.in_shape = h.shape
        kind = getattr(g.kind, "kind", None) if CLOSED_FORM else None
        act = getattr(g.kind, "activation", None)
        if kind == "dense":
            x = h.flatten(1) if g.kind.input_shape is not None else h
            w = g.weight[k].to(h.dtype)  # bf16's bfloat16 weights: float32 products here
            a = torch.addmm(g.b_KO[k], x, w)
            self.u = a if act is None else act(a)
            self.fp = None if act is None else act.grad(torch.ones_like(a), a, self.u, out=torch.empty_like(a))
            self.w, self.mode = w, "dense"
        elif kind == "residual":
            s = act(h)
            self.fp = act.grad(torch.ones_like(h), h, s, out=torch.empty_like(h))
            self.w, self.scale, self.skip = g.weight[k].to(h.dtype), float(g.kind.scale), g.kind.skip
            self.mode = "residual"
            self._fn, self._h = (lambda x: g.layer(k, x)), h
        else:
            with torch.enable_grad():  # torch.func's own transforms; nothing is recorded on the parameters
                self.u, self._pull = vjp(lambda x: g.layer(k, x), h)
            self._fn, self._h, self.mode = (lambda x: g.layer(k, x)), h, "func"

    @property
    def u(self) -> Tensor:
        """The prediction at h (computed on first use where the products do not need it)."""
        if "_u" not in self.__dict__:
            self._u = self._fn(self._h)
        return self._u

    @u.setter
    def u(self, value: Tensor) -> None:
        self._u = value

    def vjp(self, R: Tensor) -> Tensor:
        """R J for rows R [N, B, *S_out] (N = 1 for a single cotangent)."""
        if self.mode == "dense":
            t = R if self.fp is None else R * self.fp
            return torch.matmul(t, self.w.T).reshape(*R.shape[:-1], *self.in_shape[1:])
        if self.mode == "residual":
            out = torch.matmul(R, self.w.T).mul_(self.fp).mul_(self.scale)
            return out.add_(R) if self.skip else out
        return _vjp_rows(self._pull, R)

    def jvp(self, v: Tensor) -> Tensor:
        """J v for v [B, *S_in]."""
        if self.mode == "dense":
            t = v.flatten(1) @ self.w
            return t if self.fp is None else t.mul_(self.fp)
        if self.mode == "residual":
            out = torch.matmul(v * self.fp, self.w).mul_(self.scale)
            return out.add_(v) if self.skip else out
        return jvp(self._fn, (self._h,), (v,))[1]


def _linearised(st, l: int, h: Tensor) -> Linearised:
    """Layer l of the Stage ``st`` linearised at its input h."""
    for gr in st.groups:
        if gr.first > 0 and gr.first <= l < gr.first + gr.K:
            return Linearised(gr.g, l - gr.first, h)
    raise IndexError(l)


def output_hessian(energy, u_BO: Tensor, y_BO: Tensor) -> Tensor:
    """H = pi_L d^2 E_out / du^2 per sample [B, O, O] at (u, y) of an OutputEnergy."""
    B, O = u_BO.shape
    n = energy.name
    if n == "se":
        H = torch.eye(O, dtype=u_BO.dtype, device=u_BO.device).expand(B, O, O).clone()
    elif n == "ce":
        p = torch.softmax(u_BO, dim=-1)
        H = (torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)) * y_BO.sum(-1).view(B, 1, 1)
    elif n == "bce":
        s = torch.sigmoid(u_BO)
        H = torch.diag_embed(s * (1 - s))
    elif n == "zero":
        H = u_BO.new_zeros(B, O, O)
    else:
        def one(u_O, y_O):
            return energy.energy.fn(u_O.unsqueeze(0), y_O.unsqueeze(0))[0]  # (a FromCallable: the user's)
        H = vmap(jacrev(jacrev(one)))(u_BO, y_BO)
    return H if energy.prec is None else H * energy.prec.view(1, 1, 1)


def _vjp_rows(pullback, rows: Tensor) -> Tensor:
    """Each of the rows [N, B, *S_out] times J (vmapped; a loop where vmap has no rule)."""
    try:
        return vmap(pullback)(rows)[0]
    except (RuntimeError, NotImplementedError):
        return torch.stack([pullback(r)[0] for r in rows])


def _setup(st):
    if st.free_bottom or st.free_top:
        raise ValueError(f"init={st.init!r} needs both end nodes clamped (supervised PC: step(x, y)); for inference "
                         f"with a free end, set trainer.init = 'ff' first")
    net = st.net
    if (net.first, net.stop) != (1, net.num_layers + 1):
        raise ValueError(f"init={st.init!r} needs the whole network on one layer slice")
    L = net.num_layers
    pis = net.precision or (1.0,) * L
    if any(p <= 0 for p in pis[:-1]):
        raise ValueError(f"init={st.init!r} needs every hidden layer's precision > 0, got {pis}")
    if st.precision is not None:  # a precision schedule (this one's or one set before) left its last step's row:
        if -1 not in st.precision_rows:  # the init reads the network's own pi_l (the output layer's too: pis)
            st.precision_rows[-1] = torch.tensor(pis, dtype=st.precision.dtype).to(st.precision.device)
        st.precision.copy_(st.precision_rows[-1])
    hs = [st.node(n) for n in range(L + 1)]
    return L, pis, hs, _layers(st), st.output.energy


def near_equilibrium(st, how: str) -> None:
    """Move the hidden nodes of the Stage ``st`` (at the feed-forward state, h_L = y) to the init ``how``:
    "newton", "newton_cr" or "backward" (see the module docstring)."""
    L, pis, hs, fns, energy = _setup(st)
    B = hs[0].shape[0]
    if L < 2:
        return
    top = _linearised(st, L, hs[L - 1])
    y = hs[L].reshape(B, -1)
    u = top.u.reshape(B, -1)
    r = energy.signal(u, y, torch.empty_like(u))  # d at the feed-forward state (pi_L included)
    H = output_hessian(energy, u, y)
    if how == "newton":
        errors = _newton(st, L, pis, hs, top, r, H)
    elif how == "newton_cr":
        errors = _newton_cr(L, pis, hs, fns, r, H)
    else:
        errors = _backward(st, L, pis, hs, top, r, H)
    h = hs[0]
    for l in range(1, L):  # the feed-forward pass with the errors injected: h_l = u_l + e_l / pi_l
        out = fns[l](h)
        hs[l].copy_(out.add_(errors[l], alpha=1.0 / pis[l - 1]))
        h = hs[l]
    for gr in st.groups:
        if gr.free_input:
            gr.cached = False


def _newton(st, L, pis, hs, top, r_BO, H_BOO) -> dict[int, Tensor]:
    """e_l = A_l^T d with (I + H S) d = r (the O-wide backward chain and one small solve)."""
    B, O = r_BO.shape
    eye = torch.eye(O, dtype=r_BO.dtype, device=r_BO.device)
    rows = eye.unsqueeze(1).expand(O, B, O).reshape(O, *top.u.shape)  # row o: the unit vector o per sample
    A = {}
    S = torch.zeros(B, O, O, dtype=r_BO.dtype, device=r_BO.device)
    layer = top
    for l in range(L - 1, 0, -1):
        A[l] = rows = layer.vjp(rows)  # [O, B, *S_l]: the rows of A_l
        flat = rows.reshape(O, B, -1)
        S.add_(torch.einsum("obd,pbd->bop", flat, flat), alpha=1.0 / pis[l - 1])
        if l > 1:
            layer = _linearised(st, l, hs[l - 1])
    M = torch.baddbmm(eye.expand(B, O, O), H_BOO, S)
    d = torch.linalg.solve_ex(M, r_BO.unsqueeze(-1))[0].squeeze(-1)  # [B, O]
    return {l: torch.einsum("ob...,bo->b...", A[l], d) for l in A}


def _backward(st, L, pis, hs, top, r_BO, H_BOO) -> dict[int, Tensor]:
    """e_l = alpha A_l^T r, alpha minimising the linearised energy along it (one backward, one forward chain)."""
    B = r_BO.shape[0]
    b, layers = {}, {L: top}
    g = r_BO.reshape(1, *top.u.shape)
    for l in range(L - 1, 0, -1):
        g = layers[l + 1].vjp(g)
        b[l] = g[0]
        if l > 1:
            layers[l] = _linearised(st, l, hs[l - 1])
    delta = b[1] / pis[0]
    for l in range(2, L):  # delta_l = b_l / pi_l + J_l delta_{l-1}
        delta = layers[l].jvp(delta).add_(b[l], alpha=1.0 / pis[l - 1])
    s = top.jvp(delta).reshape(B, -1)  # S r
    q = (r_BO * s).sum(-1)
    curv = torch.einsum("bo,bop,bp->b", s, H_BOO, s)
    alpha = q / (q + curv).clamp_min(torch.finfo(q.dtype).tiny)
    return {l: b[l] * alpha.view(B, *[1] * (b[l].dim() - 1)) for l in b}


def _newton_cr(L, pis, hs, fns, r_BO, H_BOO) -> dict[int, Tensor]:
    """The Newton step from the block-tridiagonal Hessian in the hidden nodes, by cyclic reduction."""
    B = r_BO.shape[0]
    J = {}
    for l in range(2, L + 1):  # J_l = du_l/dh_{l-1} per sample, flattened: [B, D_l, D_{l-1}]
        h = hs[l - 1]
        shape = h.shape[1:]

        def one(x, l=l, shape=shape):
            return fns[l](x.view(1, *shape)).reshape(-1)
        J[l] = vmap(jacrev(one))(h.reshape(B, -1))
    n = L - 1  # hidden nodes 1 .. L-1, each block padded to the largest (identity there, zero on the right)
    sizes = [hs[l][0].numel() for l in range(1, L)]
    D = max(sizes)
    eye = torch.eye(D, dtype=r_BO.dtype, device=r_BO.device)
    diag = eye.expand(n, B, D, D).clone()
    lower = torch.zeros_like(diag)  # block (l, l-1): -pi_l J_l
    rhs = torch.zeros(n, B, D, dtype=r_BO.dtype, device=r_BO.device)
    for l in range(1, L):
        i, d = l - 1, sizes[l - 1]
        block = pis[l - 1] * eye[:d, :d] + (pis[l] * J[l + 1].transpose(1, 2) @ J[l + 1] if l + 1 < L
                                            else J[L].transpose(1, 2) @ H_BOO @ J[L])
        diag[i, :, :d, :d] = block
        if l > 1:
            lower[i, :, :d, : sizes[l - 2]] = -pis[l - 1] * J[l]
    rhs[n - 1, :, : sizes[-1]] = (J[L].transpose(1, 2) @ r_BO.unsqueeze(-1)).squeeze(-1)
    upper = torch.zeros_like(diag)
    upper[:-1] = lower[1:].transpose(-1, -2)  # block (l, l+1) = (l+1, l)^T
    delta = [x[:, :d] for x, d in zip(block_tridiagonal_solve(lower, diag, upper, rhs), sizes)]  # h_l - ff_l
    errors, prev = {}, None
    for l in range(1, L):  # e_l = pi_l (delta_l - J_l delta_{l-1})
        e = delta[l - 1] if prev is None else delta[l - 1] - (J[l] @ prev.unsqueeze(-1)).squeeze(-1)
        errors[l] = (e * pis[l - 1]).view_as(hs[l])
        prev = delta[l - 1]
    return errors


def block_tridiagonal_solve(lower: Tensor, diag: Tensor, upper: Tensor, rhs: Tensor) -> Tensor:
    """x of lower_i x_{i-1} + diag_i x_i + upper_i x_{i+1} = rhs_i, i = 0 .. n-1 ([n, B, D, D] blocks, rhs
    [n, B, D]; lower_0 and upper_{n-1} ignored), by cyclic reduction: eliminate the odd rows from the even
    ones (all at once), solve the half-size system, then the odd rows from their neighbours."""
    n = diag.shape[0]
    if n == 1:
        return torch.linalg.solve_ex(diag[0], rhs[0].unsqueeze(-1))[0].squeeze(-1).unsqueeze(0)
    lower, upper = lower.clone(), upper.clone()
    lower[0].zero_()
    upper[-1].zero_()
    # rows as slices of Python ints: index tensors made here would live on the host (a copy to the device per
    # use, which a CUDA graph cannot capture). Even rows 0, 2, ...; odd rows 1, 3, ...; m_up even rows have a
    # row above (2, 4, ...), m_down = n_odd a row below (0, 2, ...); the odd rows likewise for the solve back.
    n_odd = n // 2
    m_up = (n + 1) // 2 - 1
    inv_odd = torch.linalg.inv_ex(diag[1::2])[0]  # [n_odd, B, D, D]
    # even row i: subtract lower_i D_{i-1}^{-1} (row i-1) and upper_i D_{i+1}^{-1} (row i+1)
    new_diag, new_lower, new_upper, new_rhs = diag[0::2].clone(), torch.zeros_like(diag[0::2]), \
        torch.zeros_like(diag[0::2]), rhs[0::2].clone()
    coef = lower[2::2] @ inv_odd[:m_up]  # even rows 2, 4, ... from the odd row above
    new_diag[1:] -= coef @ upper[1::2][:m_up]
    new_rhs[1:] -= (coef @ rhs[1::2][:m_up].unsqueeze(-1)).squeeze(-1)
    new_lower[1:] = -(coef @ lower[1::2][:m_up])
    coef = upper[0::2][:n_odd] @ inv_odd  # even rows 0, 2, ... from the odd row below
    new_diag[:n_odd] -= coef @ lower[1::2]
    new_rhs[:n_odd] -= (coef @ rhs[1::2].unsqueeze(-1)).squeeze(-1)
    new_upper[:n_odd] = -(coef @ upper[1::2])
    x_even = block_tridiagonal_solve(new_lower, new_diag, new_upper, new_rhs)
    x = torch.empty_like(rhs)
    x[0::2] = x_even
    b = rhs[1::2].clone()
    b -= (lower[1::2] @ x[0::2][:n_odd].unsqueeze(-1)).squeeze(-1)
    b[:m_up] -= (upper[1::2][:m_up] @ x[2::2].unsqueeze(-1)).squeeze(-1)  # odd rows with a row below
    x[1::2] = (inv_odd @ b.unsqueeze(-1)).squeeze(-1)
    return x
