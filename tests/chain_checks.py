"""The checks of tests/test_chain.py, run in a process of their own: on a CPU under Triton's interpreter
(started with TRITON_INTERPRET=1: the interpreter must be on before triton is first imported), or compiled on
a CUDA device (started without it). ``python tests/chain_checks.py kernels|errors|trainer [...]``; exits 1 with
the failures on stderr, 77 where this Triton's interpreter cannot run a loop at all (a Triton / numpy mismatch).
Several groups named: each runs in a fork of this process once it has imported torch, Triton and pcdist (the state
of a process of its own, without its imports' CPU seconds), and each prints its own count."""

import os
import sys

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import torch  # noqa: E402

import pcdist  # noqa: E402
from pcdist.engine import chain, errorpass  # noqa: E402
from pcdist.engine.activations import ACTIVATIONS, Activation  # noqa: E402

DEV = "cpu" if INTERPRETED else "cuda"
ACTS = [Activation(n) for n in ACTIVATIONS] + [Activation("gelu", approximate="tanh"),
                                               Activation("leaky_relu", negative_slope=0.2)]


def torch_chain(act, h0, w, b, residual=None):
    """The chain written with torch: dense a = h w + b, u = f(a); μPC u = h + scale (phi(h) w + b)."""
    x, a_s, u_s, s_s, x_s = h0, [], [], [], []
    for k in range(w.shape[0]):
        if residual is None:
            a = x @ w[k] + b[k]
            u = act(a)
            a_s.append(a)
        else:
            s = act(x)
            s_s.append(s)
            x_s.append(x)
            u = x + residual * (s @ w[k] + b[k])
        u_s.append(u)
        x = u
    stack = lambda ts: torch.stack(ts) if ts else None  # noqa: E731
    return stack(a_s), stack(u_s), stack(s_s), stack(x_s)


def kernels(act, dtype):
    """Every activation, odd widths (masked tiles), rows 3..19 of a batch of 20 (the rest untouched)."""
    g = torch.Generator().manual_seed(1)
    K, B, D, rows = 3, 20, 24, slice(3, 20)
    w = (torch.randn(K, D, D, generator=g) / D ** 0.5).to(DEV, dtype)
    b = (0.1 * torch.randn(K, D, generator=g)).to(DEV, dtype)
    h0 = torch.randn(B, D, generator=g).to(DEV, dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    a_w, u_w, _, _ = torch_chain(act, h0.float(), w.float(), b.float())
    a, h = (torch.full((K, B, D), 7.0, dtype=dtype, device=DEV) for _ in range(2))
    u = a if not act.needs_input else torch.full((K, B, D), 7.0, dtype=dtype, device=DEV)
    chain.dense_chain(h0, w, b, a, u, h, act, rows)
    torch.testing.assert_close(u[:, rows].float(), u_w[:, rows], **tol)
    torch.testing.assert_close(h[:, rows].float(), u_w[:, rows], **tol)
    if act.needs_input:
        torch.testing.assert_close(a[:, rows].float(), a_w[:, rows], **tol)
    assert (h[:, :3] == 7.0).all(), "rows outside the range are not written"
    _, u_w, s_w, x_w = torch_chain(act, h0.float(), w.float(), b.float(), residual=0.3)
    s, x, u, h = (torch.empty(K, B, D, dtype=dtype, device=DEV) for _ in range(4))
    chain.residual_chain(h0, w, b, s, x, u, h, act, 0.3, True)
    for got, want in ((u, u_w), (h, u_w), (s, s_w), (x, x_w)):
        torch.testing.assert_close(got.float(), want, **tol)


def errors(act, prec: bool):
    """The dense error pass (pcdist/engine/errorpass.py) against torch ops, in every mode: fresh (u = f(a + b)
    from a = h w) or from the stored u (and the pre-activation where f' needs it), with and without d, the value
    step on the first K' layers only (the rest keep e), with and without the layers' precisions."""
    g = torch.Generator().manual_seed(3)
    K, B, O = 3, 5, 37  # 555 elements: a masked block

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEV)

    a, h, bias = rand(K, B, O), rand(K, B, O), 0.1 * rand(K, O)
    pi = 0.5 + rand(K).abs() if prec else None
    x = a + bias.unsqueeze(1)
    u = act(x)
    e = (1.0 if pi is None else pi.view(-1, 1, 1)) * (h - u)
    d = act.grad(e, x, u, out=torch.empty_like(x))
    for fresh in (True, False):
        for lr, stepped in ((None, None), (0.3, K), (0.3, 2)):
            au = a.clone() if fresh else (x if act.needs_input else u).clone()
            bufs = dict(h=h.clone(), e=torch.full_like(a, 7.0), d=torch.full_like(a, 7.0))
            kernel = errorpass.Kernel(act, au, bufs["h"], bufs["e"], bufs["d"], bias, u=u.clone(), prec=pi)
            kernel.run(fresh, True, lr, stepped)
            n = 0 if lr is None else stepped  # layers that took the value step (their e is not stored)
            torch.testing.assert_close(bufs["d"], d, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(bufs["h"][:n], h[:n] - 0.3 * e[:n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(bufs["h"][n:], h[n:])
            torch.testing.assert_close(bufs["e"][n:], e[n:], atol=1e-5, rtol=1e-5)
            assert (bufs["e"][:n] == 7.0).all(), "e is not stored where the value step was taken"
    d_kept = torch.full_like(a, 7.0)
    errorpass.Kernel(act, a.clone(), h.clone(), torch.empty_like(a), d_kept, bias, prec=pi).run(True, False)
    assert (d_kept == 7.0).all(), "d is not written without with_d"


def residual(act, prec: bool):
    """The residual kind's three passes (errorpass.ResidualKernel) against torch ops: s = phi(h_in) (and the copy
    of h_in where phi' needs it), e = pi (h - u) with the value step on the first K' layers, the back-projection
    target = beta target + alpha_a t phi'(h_in) (+ alpha_e e of the skip) for beta 0 and not, with and without it."""
    g = torch.Generator().manual_seed(4)
    K, B, D = 3, 5, 37

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEV)

    h_in, u, h, t, tgt, e_skip = (rand(K, B, D) for _ in range(6))
    pi = 0.5 + rand(K).abs() if prec else None
    s, e = torch.empty_like(h_in), torch.empty_like(u)
    x = torch.empty_like(h_in) if act.needs_input else None
    kernel = errorpass.ResidualKernel(act, h_in, s, x, u, h.clone(), e, t, pi)
    kernel.activate()
    torch.testing.assert_close(s, act(h_in), atol=1e-5, rtol=1e-5)
    if x is not None:
        assert torch.equal(x, h_in)
    e_want = (1.0 if pi is None else pi.view(-1, 1, 1)) * (h - u)
    kernel.errors(0.3, 2)
    torch.testing.assert_close(e, e_want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel.h_out[:2], h[:2] - 0.3 * e_want[:2], atol=1e-5, rtol=1e-5)
    assert torch.equal(kernel.h_out[2:], h[2:]), "no value step on the held layer"
    kernel.errors(None, 0)  # e of the stepped nodes, no step
    torch.testing.assert_close(e, (1.0 if pi is None else pi.view(-1, 1, 1)) * (kernel.h_out - u), atol=1e-5,
                               rtol=1e-5)
    bp = act.grad(t, h_in, act(h_in), out=torch.empty_like(t))
    for beta, skip in ((0.0, None), (0.5, None), (0.0, e_skip), (0.5, e_skip)):
        out = tgt.clone()
        kernel.backproject(out, skip, beta, 0.3, 0.7)
        want = beta * tgt + 0.3 * bp + (0.0 if skip is None else 0.7 * skip)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def conv(act, pool, prec: bool, node_cl: bool = False, src_cl: bool = False):
    """The conv kind's passes (errorpass.ConvKernel) against autograd through torch's own bias add, f and
    pooling: u = pool(f(conv + bias)), e = pi (h - u), the value step on the first layer only, and d the
    gradient of <e, u> by the convolution's output (the signal: e routed back through the pooling, times f');
    odd sizes (a border no window reaches, whose d stays 0), bias or none; a row range of a layer written
    alone (the pipelined init's micro-batches) leaves the other rows as they were. ``node_cl`` / ``src_cl``: the
    nodes / the convolution-sized images channels-last (PCDIST_CHANNELS_LAST), in any combination."""
    from pcdist.engine.layers.conv import pooled
    from pcdist.engine.nodes import stacked_zeros

    g = torch.Generator().manual_seed(5)
    K, B, C, H, W = 2, 3, 4, 7, 5
    window = [2, 2] if pool else None
    PH, PW = (H // 2, W // 2) if pool else (H, W)
    big, small = (K, B, C, H, W), (K, B, C, PH, PW)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEV)

    def full(shape, cl, value, dtype=torch.float32):
        return stacked_zeros(shape, cl, dtype=dtype, device=DEV).fill_(value)

    kernel = errorpass.ConvKernel(act, pool, window, node_cl, src_cl)
    for bias in (True, False):
        src, h = full(big, src_cl, 0.0).copy_(rand(*big)), full(small, node_cl, 0.0).copy_(rand(*small))
        b = 0.1 * rand(K, C) if bias else None
        pi = 0.5 + rand(K).abs() if prec else None
        a, u = full(big, src_cl, 7.0), full(small, node_cl, 7.0)
        e, d = full(small, node_cl, 0.0), full(big, src_cl, 0.0)
        idx = full(small, node_cl, 0, torch.int8) if pool == "max" else None
        for k in range(K):
            kernel.activate(src[k], None if b is None else b[k], a[k], u[k], None if idx is None else idx[k])
        h1 = h.clone()
        kernel.errors(a, u, h1, e, d, idx, pi, 0.3, 1, True)
        x = (src if b is None else src + b.view(K, 1, C, 1, 1)).reshape(K * B, C, H, W).requires_grad_(True)
        u_w = pooled(act(x), pool, window).reshape(K, B, C, PH, PW)
        e_w = (1.0 if pi is None else pi.view(-1, 1, 1, 1, 1)) * (h - u_w.detach())
        (d_w,) = torch.autograd.grad(u_w, x, e_w)
        torch.testing.assert_close(u, u_w.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(e, e_w, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d, d_w.reshape(d.shape), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h1[:1], h[:1] - 0.3 * e_w[:1], atol=1e-5, rtol=1e-5)
        assert torch.equal(h1[1:], h[1:]), "no value step on the held layer"
        d2 = torch.full_like(d, 7.0)
        kernel.errors(a, u, h1, e, d2, idx, pi, None, 0, False)
        assert (d2 == 7.0).all(), "d is not written without with_d"
        rows = slice(1, 3)
        a2, u2 = torch.full_like(a[0], 7.0), torch.full_like(u[0], 7.0)
        i2 = None if idx is None else torch.zeros_like(idx[0])
        kernel.activate(src[0][rows], None if b is None else b[0], a2[rows], u2[rows], None if i2 is None else i2[rows])
        torch.testing.assert_close(u2[rows], u[0][rows])
        assert (u2[:1] == 7.0).all() and (a2[:1] == 7.0).all(), "rows outside the range are not written"


def gemm_products(case: str):
    """pcdist/engine/gemm.py's Triton GEMM (PCDIST_GEMM=triton) against torch's own, in each form a group calls:
    a bias broadcast over the batch (predict), alpha and beta, an in-place accumulation into the target
    (back-projection), a transposed operand (the weight gradients), beta 0 ignoring NaNs in the target, odd
    sizes (masked tiles)."""
    from pcdist.engine import gemm

    os.environ["PCDIST_GEMM"] = "triton"
    g = torch.Generator().manual_seed(6)
    K, B, I, O = 3, 21, 37, 19

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEV)

    baddbmm, bmm = gemm.functions(rand(1))
    assert baddbmm is gemm.baddbmm and bmm is gemm.bmm
    h, w, d, bias = rand(K, B, I), rand(K, I, O), rand(K, B, O), rand(K, 1, O)
    tol = dict(atol=1e-4, rtol=1e-4)
    if case == "predict":
        torch.testing.assert_close(baddbmm(bias, h, w, out=torch.empty(K, B, O, device=DEV)),
                                   torch.baddbmm(bias, h, w), **tol)
        torch.testing.assert_close(baddbmm(bias, h, w, beta=0.5, alpha=0.3, out=torch.empty(K, B, O, device=DEV)),
                                   torch.baddbmm(bias, h, w, beta=0.5, alpha=0.3), **tol)
        torch.testing.assert_close(bmm(h, w, out=torch.empty(K, B, O, device=DEV)), torch.bmm(h, w), **tol)
    elif case == "backproject":
        target = rand(K, B, I)
        want = torch.baddbmm(target, d, w.transpose(1, 2), beta=0.7, alpha=-0.2)
        baddbmm(target, d, w.transpose(1, 2), beta=0.7, alpha=-0.2, out=target)
        torch.testing.assert_close(target, want, **tol)
        nan = torch.full((K, B, I), float("nan"), device=DEV)
        baddbmm(nan, d, w.transpose(1, 2), beta=0.0, alpha=1.0, out=nan)
        torch.testing.assert_close(nan, torch.bmm(d, w.transpose(1, 2)), **tol)
    elif case == "weights":  # the weight gradients: a transposed node batch times the signal
        grad = torch.full((K, I, O), float("nan"), device=DEV)
        baddbmm(grad, h.transpose(1, 2), d, beta=0.0, alpha=0.25, out=grad)
        torch.testing.assert_close(grad, 0.25 * torch.bmm(h.transpose(1, 2), d), **tol)
    else:  # precision="bf16": float32 nodes times bfloat16 weights, the nodes rounded to bfloat16 as they are read
        from pcdist.engine.layers.base import accumulate_product, product_into

        w16 = w.to(torch.bfloat16)
        exact = torch.bmm(h.to(torch.bfloat16).float(), w16.float())  # float32 sums of exact products
        out = torch.empty(K, B, O, device=DEV)
        product_into(out, h, w16, False, bias, 0.5)
        torch.testing.assert_close(out, 0.5 * (bias + exact), **tol)
        product_into(out, h, w16, False)
        torch.testing.assert_close(out, exact, **tol)
        target = rand(K, B, I)
        want = 0.7 * target - 0.2 * torch.bmm(d.to(torch.bfloat16).float(), w16.float().transpose(1, 2))
        accumulate_product(target, d, w16.transpose(1, 2), 0.7, -0.2, False)
        torch.testing.assert_close(target, want, **tol)
        assert any(key[2] == torch.float32 and key[5] == torch.bfloat16 and c is not None
                   for key, c in gemm._CHOICE.items()), "the bfloat16 products ran through the Triton GEMM"
    assert any(c is not None for c in gemm._CHOICE.values()), "the Triton kernel ran"


def trainer(model):
    """The hidden group's init runs through the kernel (checked against torch on first use); two training
    steps then give the energies and weights of the torch chain to float32 round-off (SGD: a step linear in
    the gradients, so round-off stays round-off; AdamW's sign-like step would amplify it where v is tiny)."""
    def trained(fused: bool):
        # cnn_cl: the kernels on channels-last nodes and images (PCDIST_CHANNELS_LAST), against the torch ops on
        # row-major ones; cnn_grouped: so too, with the group of two's convolutions as one (PCDIST_CONV_GROUPED)
        os.environ["PCDIST_CHANNELS_LAST"] = "1" if fused and model in ("cnn_cl", "cnn_grouped") else "0"
        os.environ["PCDIST_CONV_GROUPED"] = "1" if fused and model == "cnn_grouped" else "0"
        os.environ["PCDIST_TRITON"] = "1" if fused else "0"
        os.environ["PCDIST_NATIVE"] = "0"  # the CPU's own error kernel off: the Triton one, or torch ops
        os.environ["PCDIST_GEMM"] = "triton" if fused and "cnn" not in model else "torch"  # the Triton products too
        if model == "mlp":
            net = pcdist.PCNetwork.from_dims([12, 16, 16, 16, 4], "tanh", seed=0, device=DEV)
        elif "cnn" in model:  # max and average pooling, a group of two, an odd size and no pooling
            from pcdist.engine.models import conv_specs
            net = pcdist.PCNetwork(conv_specs((1, 7, 7), [(4, 3, 1, "max"), (4, 3, 1, None), (4, 3, 1, None),
                                                          (6, 3, 1, "avg")], [], 4, "gelu"), seed=0, device=DEV)
        else:
            net = pcdist.PCNetwork(pcdist.mupc_specs(12, 16, 5, 4, "gelu"), seed=0, device=DEV)
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.05), T=4, x_lr=0.1)
        g = torch.Generator().manual_seed(2)
        shape = (1, 7, 7) if "cnn" in model else (12,)
        y = torch.eye(4, device=DEV)[torch.arange(10) % 4]
        energies = [tr.step(torch.randn(10, *shape, generator=g).to(DEV), y)["energy"] for _ in range(2)]
        groups = tr._stage.groups
        return energies, [p.detach().clone() for p in net.parameters()], \
            [gr for gr in groups if gr.K > 1 or ("cnn" in model and not gr.is_output)]

    e_f, w_f, hidden = trained(True)
    e_t, w_t, _ = trained(False)
    if "cnn" in model:
        assert len(hidden) == 3 and all(isinstance(gr.kernel, errorpass.ConvKernel) for gr in hidden), \
            [gr.kernel for gr in hidden]
        # channels-last: the convolutions' images but the first's, whose input has one channel, and the output nodes
        # but the last, whose images are 1 x 1 (row-major and channels-last at once, both taken as row-major)
        layouts = [(gr.kernel.src_cl, gr.kernel.node_cl) for gr in hidden]
        want = [(False, True), (True, True), (True, False)] if model != "cnn" else [(False, False)] * 3
        assert layouts == want, layouts
        grouped = [gr.K for gr in hidden if gr.grouped is not None]
        assert grouped == ([2] if model == "cnn_grouped" else []), grouped
    else:
        from pcdist.engine import gemm
        assert all(gr.baddbmm is gemm.baddbmm for gr in hidden), "the products ran through the Triton GEMM"
        assert gemm._CHOICE and None not in gemm._CHOICE.values(), "every product's Triton tiles agreed with torch"
        assert hidden and all(gr.fused_chain == "yes" for gr in hidden), [gr.fused_chain for gr in hidden]
        kind = errorpass.Kernel if model == "mlp" else errorpass.ResidualKernel  # the elementwise passes: Triton
        assert all(isinstance(gr.kernel, kind) for gr in hidden), [gr.kernel for gr in hidden]
    assert e_f == pytest.approx(e_t, rel=1e-5), (e_f, e_t)
    for a, b in zip(w_f, w_t):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def bf16_trainer(model):
    """precision="bf16" (bfloat16 weights, float32 nodes) with its per-step products through the Triton GEMM (the
    nodes rounded as it reads them, float32 sums): two steps follow the torch ops' bfloat16 products (which round
    each product to bfloat16 on a CPU) to bfloat16's precision, and the products ran through the kernel."""
    from pcdist.engine import gemm

    def trained(fused: bool):
        os.environ["PCDIST_TRITON"] = "1" if fused else "0"
        os.environ["PCDIST_NATIVE"] = "0"
        os.environ["PCDIST_GEMM"] = "triton" if fused else "torch"
        gemm._CHOICE.clear()
        net = pcdist.PCNetwork(pcdist.mupc_specs(12, 16, 5, 4, "gelu"), seed=0, device=DEV) if model == "mupc" \
            else pcdist.PCNetwork.from_dims([12, 16, 16, 16, 4], "tanh", seed=0, device=DEV)
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.05), T=4, x_lr=0.1, precision="bf16")
        g = torch.Generator().manual_seed(2)
        y = torch.eye(4, device=DEV)[torch.arange(10) % 4]
        energies = [tr.step(torch.randn(10, 12, generator=g).to(DEV), y)["energy"] for _ in range(2)]
        low = [c for key, c in gemm._CHOICE.items() if key[2] == torch.float32 and key[5] == torch.bfloat16]
        return energies, low

    (e_f, low), (e_t, _) = trained(True), trained(False)
    assert low and None not in low, "the hidden groups' bfloat16 products ran through the Triton GEMM"
    assert e_f == pytest.approx(e_t, rel=2e-2), (e_f, e_t)


def interpreter_runs() -> str:
    """'' where the interpreter runs a loop over a kernel argument; else why not (Triton 3.6's interpreter
    with numpy 2.4 or later cannot: it converts a one-element array to an int)."""
    global tl  # an older Triton's interpreter (3.0) finds triton.language only among the kernel's module globals
    import triton
    import triton.language as tl

    @triton.jit
    def count(o, n):
        acc = 0.0
        for _ in range(n):
            acc += 1.0
        tl.store(o, acc)

    o = torch.zeros(1)
    try:
        count[(1,)](o, 3)
    except Exception as e:
        import numpy
        return f"Triton {triton.__version__}'s interpreter cannot run a loop with numpy {numpy.__version__}: {e}"
    return "" if o.item() == 3.0 else f"Triton {triton.__version__}'s interpreter counts a loop of 3 as {o.item()}"


def main(whats: list[str]) -> int:
    if INTERPRETED and (why := interpreter_runs()):
        print(why, flush=True)
        return 77
    if len(whats) == 1:
        return check(whats[0])
    failed = False
    for what in whats:  # a fork each: every group starts from the state of a fresh process
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = check(what)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        failed |= os.waitpid(pid, 0)[1] != 0
    return 1 if failed else 0


def check(what: str) -> int:
    """Runs one group of checks; prints how many passed, and each failure on stderr (naming the group)."""
    failed = []
    # The interpreter in float32 only: its bfloat16 loads and stores are wrong (a copy doubles garbage). On a GPU,
    # bfloat16 too (and every group's kernel is checked against torch on first use, chain.checked).
    dtypes = [torch.float32] + ([] if INTERPRETED else [torch.bfloat16])
    cases = {"kernels": [(kernels, (act, dt)) for act in ACTS for dt in dtypes],
             "errors": [(f, (act, p)) for f in (errors, residual) for act in ACTS for p in (False, True)]
             # the conv pass: every activation and pooling, the precisions (read only by e) on every other one
             # and the four layouts (row-major or channels-last nodes and convolution outputs) in turn
             + [(conv, (act, pool, (i + j) % 2 == 1, (i // 2 + j) % 4 >= 2, (i // 2 + j) % 2 == 1))
                for i, act in enumerate(ACTS) for j, pool in enumerate((None, "max", "avg"))]
             + [(gemm_products, (case,)) for case in ("predict", "backproject", "weights", "bf16")],
             "trainer": [(trainer, (m,)) for m in ("mlp", "mupc", "cnn", "cnn_cl", "cnn_grouped")]
             + [(bf16_trainer, (m,)) for m in ("mlp", "mupc")]}[what]
    for fn, args in cases:
        try:
            fn(*args)
        except Exception as e:  # report every failing case, not only the first
            failed.append(f"{what}: {fn.__name__}{args}: {type(e).__name__}: {e}")
    print(f"{len(cases) - len(failed)} of {len(cases)} {what} checks passed", flush=True)
    sys.stderr.write("".join(f + "\n" for f in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
