"""Triton kernels of pcdist/engine/chain.py and pcdist/engine/errorpass.py (imported only where Triton is installed)."""

import triton
import triton.language as tl

try:  # libdevice's accurate transcendentals on a GPU
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    from triton.language.extra.cuda import libdevice


@triton.jit
def _tanh(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.tanh(x)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _softplus(x, beta, thr, ACCURATE: tl.constexpr):
    bx = beta * x
    if ACCURATE:
        sp = libdevice.log1p(tl.exp(tl.minimum(bx, thr))) / beta
    else:
        sp = tl.log(1.0 + tl.exp(tl.minimum(bx, thr))) / beta
    return tl.where(bx > thr, x, sp)


@triton.jit
def _act(a, ACT: tl.constexpr, slope, lo, hi, beta, thr, alpha, ACCURATE: tl.constexpr):
    """f(a) for the activation code ACT (chain.ACT_CODES), in float32."""
    if ACT == 1:
        return tl.maximum(a, 0.0)
    elif ACT == 2:
        return tl.where(a > 0, a, a * slope)
    elif ACT == 3:
        return _tanh(a, ACCURATE)
    elif ACT == 4:
        return tl.sigmoid(a)
    elif ACT == 5:
        return tl.minimum(tl.maximum(a, lo), hi)
    elif ACT == 6:
        return a * tl.sigmoid(a)
    elif ACT == 7:
        return 0.5 * a * (1.0 + tl.erf(a * 0.7071067811865476))
    elif ACT == 8:
        return 0.5 * a * (1.0 + _tanh(0.7978845608028654 * (a + 0.044715 * a * a * a), ACCURATE))
    elif ACT == 9:
        return _softplus(a, beta, thr, ACCURATE)
    elif ACT == 10:
        if ACCURATE:
            neg = alpha * libdevice.expm1(tl.minimum(a, 0.0))
        else:
            neg = alpha * (tl.exp(tl.minimum(a, 0.0)) - 1.0)
        return tl.where(a > 0, a, neg)
    elif ACT == 11:
        return a * _tanh(_softplus(a, 1.0, 20.0, ACCURATE), ACCURATE)
    else:
        return a


@triton.jit
def _input_tile(x_ptr, u_ptr, k, B, D, r, cols, mask):
    """Rows r, columns cols of layer k's input: the chain's input x for k = 0, else layer k - 1's output u.
    Two masked loads, one of them empty, rather than a branch on k (a loop variable): Triton 3.6 neither
    compiles nor interprets a runtime branch that returns from a helper."""
    off = r[:, None] * D + cols[None, :]
    hx = tl.load(x_ptr + off, mask=mask & (k == 0), other=0.0)
    hu = tl.load(u_ptr + (k - 1) * B * D + off, mask=mask & (k > 0), other=0.0)
    return hx + hu


@triton.jit
def dense_chain(x_ptr, w_ptr, b_ptr, a_ptr, u_ptr, h_ptr, row0, nrows, B, D, K,
                ACT: tl.constexpr, slope, lo, hi, beta, thr, alpha,
                KEEP_A: tl.constexpr, ACCURATE: tl.constexpr, PREC: tl.constexpr,
                BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Rows [row0 + pid * BB, ...) of a_k = h_{k-1} @ w_k + b_k, u_k = f(a_k), h_k = u_k for k = 0..K-1."""
    r = row0 + tl.program_id(0) * BB + tl.arange(0, BB)
    rmask = r < row0 + nrows
    cn = tl.arange(0, BN)
    ck = tl.arange(0, BK)
    for k in range(K):
        for n0 in range(0, D, BN):
            n = n0 + cn
            nmask = n < D
            acc = tl.zeros([BB, BN], dtype=tl.float32)
            for k0 in range(0, D, BK):
                kk = k0 + ck
                kmask = kk < D
                hx = _input_tile(x_ptr, u_ptr, k, B, D, r, kk, rmask[:, None] & kmask[None, :])
                w = tl.load(w_ptr + k * D * D + kk[:, None] * D + n[None, :], mask=kmask[:, None] & nmask[None, :],
                            other=0.0)
                acc += tl.dot(hx, w, input_precision=PREC)
            b = tl.load(b_ptr + k * D + n, mask=nmask, other=0.0).to(tl.float32)
            a = acc + b[None, :]
            m = rmask[:, None] & nmask[None, :]
            off = k * B * D + r[:, None] * D + n[None, :]
            if KEEP_A:
                tl.store(a_ptr + off, a.to(a_ptr.dtype.element_ty), mask=m)
            u = _act(a, ACT, slope, lo, hi, beta, thr, alpha, ACCURATE).to(u_ptr.dtype.element_ty)
            tl.store(u_ptr + off, u, mask=m)
            tl.store(h_ptr + off, u, mask=m)
        tl.debug_barrier()  # layer k + 1 reads what every thread of this program wrote of layer k


@triton.jit
def residual_chain(x_ptr, w_ptr, b_ptr, s_ptr, xs_ptr, u_ptr, h_ptr, row0, nrows, B, D, K, scale,
                   ACT: tl.constexpr, slope, lo, hi, beta, thr, alpha,
                   HAS_B: tl.constexpr, STORE_S: tl.constexpr, STORE_X: tl.constexpr, SKIP: tl.constexpr,
                   ACCURATE: tl.constexpr, PREC: tl.constexpr,
                   BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Rows [row0 + pid * BB, ...) of s_k = phi(h_{k-1}), u_k = skip h_{k-1} + scale (s_k @ w_k + b_k), h_k = u_k."""
    r = row0 + tl.program_id(0) * BB + tl.arange(0, BB)
    rmask = r < row0 + nrows
    cn = tl.arange(0, BN)
    ck = tl.arange(0, BK)
    for k in range(K):
        for n0 in range(0, D, BN):
            n = n0 + cn
            nmask = n < D
            acc = tl.zeros([BB, BN], dtype=tl.float32)
            for k0 in range(0, D, BK):
                kk = k0 + ck
                kmask = kk < D
                mk = rmask[:, None] & kmask[None, :]
                hx = _input_tile(x_ptr, u_ptr, k, B, D, r, kk, mk)
                s = _act(hx.to(tl.float32), ACT, slope, lo, hi, beta, thr, alpha, ACCURATE).to(hx.dtype)
                if n0 == 0:  # each input column once: phi(h) and the copy of h the back-projection reads
                    off_in = k * B * D + r[:, None] * D + kk[None, :]
                    if STORE_S:
                        tl.store(s_ptr + off_in, s, mask=mk)
                    if STORE_X:
                        tl.store(xs_ptr + off_in, hx, mask=mk)
                w = tl.load(w_ptr + k * D * D + kk[:, None] * D + n[None, :], mask=kmask[:, None] & nmask[None, :],
                            other=0.0)
                acc += tl.dot(s, w, input_precision=PREC)
            if HAS_B:
                acc += tl.load(b_ptr + k * D + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
            out = scale * acc
            m = rmask[:, None] & nmask[None, :]
            if SKIP:
                out += _input_tile(x_ptr, u_ptr, k, B, D, r, n, m).to(tl.float32)
            off = k * B * D + r[:, None] * D + n[None, :]
            tl.store(u_ptr + off, out.to(u_ptr.dtype.element_ty), mask=m)
            tl.store(h_ptr + off, out.to(u_ptr.dtype.element_ty), mask=m)
        tl.debug_barrier()


@triton.jit
def _sig(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _dact(x, u, ACT: tl.constexpr, slope, lo, hi, beta, thr, alpha, ACCURATE: tl.constexpr):
    """f'(a) for the activation code ACT from u = f(a), or from a itself (x) where u does not determine it
    (silu, gelu, softplus, mish: ``Activation.needs_input``): the formulas of the CPU kernel (_native.c)."""
    if ACT == 1:
        return tl.where(u > 0, 1.0, 0.0)
    elif ACT == 2:
        return tl.where(u > 0, 1.0, slope)
    elif ACT == 3:
        return 1.0 - u * u
    elif ACT == 4:
        return (1.0 - u) * u
    elif ACT == 5:
        return tl.where((u > lo) & (u < hi), 1.0, 0.0)
    elif ACT == 6:
        s = _sig(x)
        return s * (1.0 + x * (1.0 - s))
    elif ACT == 7:
        return 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACT == 8:
        t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x), ACCURATE)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
    elif ACT == 9:
        ex = tl.exp(tl.minimum(beta * x, thr))
        return tl.where(beta * x > thr, 1.0, ex / (ex + 1.0))
    elif ACT == 10:
        return tl.where(u > 0, 1.0, u + alpha)
    elif ACT == 11:
        t = _tanh(_softplus(x, 1.0, 20.0, ACCURATE), ACCURATE)
        return t + x * _sig(x) * (1.0 - t * t)
    else:
        return 1.0 + 0.0 * x


@triton.jit
def dense_errors(au_ptr, u_ptr, h_ptr, e_ptr, d_ptr, b_ptr, p_ptr, n, B, O, lr,
                 ACT: tl.constexpr, slope, lo, hi, beta, thr, alpha, FRESH: tl.constexpr, HAS_D: tl.constexpr,
                 UPDATE: tl.constexpr, HAS_P: tl.constexpr, ACCURATE: tl.constexpr, BLOCK: tl.constexpr):
    """The dense kind's error pass over n elements of [K', B, O] (the CPU kernel's, pcdist/engine/native.py):
    x = a + bias and u = f(x) (FRESH: au holds a = h_in @ w) or u read from u_ptr (au holding u, or the
    pre-activation where f' needs it); e = pi (h - u); d = e f'(x) (HAS_D); h -= lr e (UPDATE, e not stored)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    layer = i // (B * O)
    x = tl.load(au_ptr + i, mask=m, other=0.0)
    if FRESH:
        x = x + tl.load(b_ptr + layer * O + i % O, mask=m, other=0.0)
        u = _act(x, ACT, slope, lo, hi, beta, thr, alpha, ACCURATE)
    else:
        u = tl.load(u_ptr + i, mask=m, other=0.0)
    h = tl.load(h_ptr + i, mask=m, other=0.0)
    e = h - u
    if HAS_P:
        e = e * tl.load(p_ptr + layer, mask=m, other=1.0)
    if HAS_D:
        tl.store(d_ptr + i, e * _dact(x, u, ACT, slope, lo, hi, beta, thr, alpha, ACCURATE), mask=m)
    if UPDATE:
        tl.store(h_ptr + i, h - lr * e, mask=m)
    else:
        tl.store(e_ptr + i, e, mask=m)


@triton.jit
def res_act(src_ptr, s_ptr, x_ptr, n, ACT: tl.constexpr, slope, lo, hi, beta, thr, alpha, STORE_X: tl.constexpr,
            ACCURATE: tl.constexpr, BLOCK: tl.constexpr):
    """The residual kind's s = phi(h_in) (and x = h_in where phi' needs its input) over n elements."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(src_ptr + i, mask=m, other=0.0)
    tl.store(s_ptr + i, _act(v, ACT, slope, lo, hi, beta, thr, alpha, ACCURATE), mask=m)
    if STORE_X:
        tl.store(x_ptr + i, v, mask=m)


@triton.jit
def res_errors(u_ptr, h_ptr, e_ptr, p_ptr, n, stepped, per, lr, HAS_P: tl.constexpr, UPDATE: tl.constexpr,
               BLOCK: tl.constexpr):
    """e = pi (h - u) over n elements (pi of layer i // per), and h -= lr e on the first ``stepped`` (UPDATE)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _node_errors(u_ptr, h_ptr, e_ptr, p_ptr, i, i < n, stepped, per, lr, HAS_P, UPDATE)


@triton.jit
def _node_errors(u_ptr, h_ptr, e_ptr, p_ptr, i, m, stepped, per, lr, HAS_P: tl.constexpr, UPDATE: tl.constexpr):
    """Elements i (mask m) of e = pi (h - u) (pi of layer i // per), stored, and h -= lr e on the first
    ``stepped`` (UPDATE); returns e (the residual and conv kinds' error pass)."""
    h = tl.load(h_ptr + i, mask=m, other=0.0)
    e = h - tl.load(u_ptr + i, mask=m, other=0.0)
    if HAS_P:
        e = e * tl.load(p_ptr + i // per, mask=m, other=1.0)
    tl.store(e_ptr + i, e, mask=m)
    if UPDATE:
        tl.store(h_ptr + i, h - lr * e, mask=m & (i < stepped))
    return e


@triton.jit
def res_backproject(s_ptr, x_ptr, t_ptr, e_ptr, tgt_ptr, n, beta, alpha_a, alpha_e,
                    ACT: tl.constexpr, slope, lo, hi, bt, thr, alpha, HAS_X: tl.constexpr, HAS_E: tl.constexpr,
                    HAS_BETA: tl.constexpr, ACCURATE: tl.constexpr, BLOCK: tl.constexpr):
    """target = beta target + alpha_a t phi'(h_in) (+ alpha_e e: the skip's errors), phi' from s = phi(h_in) or
    from the copy x of h_in (HAS_X); HAS_BETA False ignores the target's old contents."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    u = tl.load(s_ptr + i, mask=m, other=0.0)
    if HAS_X:
        x = tl.load(x_ptr + i, mask=m, other=0.0)
    else:
        x = u
    v = alpha_a * tl.load(t_ptr + i, mask=m, other=0.0) * _dact(x, u, ACT, slope, lo, hi, bt, thr, alpha, ACCURATE)
    if HAS_E:
        v += alpha_e * tl.load(e_ptr + i, mask=m, other=0.0)
    if HAS_BETA:
        v += beta * tl.load(tgt_ptr + i, mask=m, other=0.0)
    tl.store(tgt_ptr + i, v, mask=m)


@triton.jit
def _window(i, C, PH, PW, H, W, KH: tl.constexpr, KW: tl.constexpr, NODE_CL: tl.constexpr, SRC_CL: tl.constexpr):
    """For element i of the pooled images [N, C, PH, PW] (in their storage order: channels-last where NODE_CL):
    the offset of its pooling window's first element in the convolution's output [N, C, H, W] (channels-last
    where SRC_CL), the stride of that output's W axis, and the element's channel."""
    if NODE_CL:
        c = i % C
        t = i // C
        pw = t % PW
        t = t // PW
        ph = t % PH
        nb = t // PH
    else:
        pw = i % PW
        t = i // PW
        ph = t % PH
        t = t // PH
        c = t % C
        nb = t // C
    if SRC_CL:
        base = ((nb * H + ph * KH) * W + pw * KW) * C + c
        sw = C
    else:
        base = ((nb * C + c) * H + ph * KH) * W + pw * KW
        sw = 1
    return base, sw, c


@triton.jit
def conv_act_pool(src_ptr, b_ptr, a_ptr, u_ptr, idx_ptr, n, C, H, W, PH, PW,
                  ACT: tl.constexpr, slope, lo, hi, beta, thr, alpha, HAS_B: tl.constexpr, POOL: tl.constexpr,
                  KH: tl.constexpr, KW: tl.constexpr, NODE_CL: tl.constexpr, SRC_CL: tl.constexpr,
                  ACCURATE: tl.constexpr, BLOCK: tl.constexpr):
    """One conv layer's bias, activation and pooling over n elements of its output u [N, C, PH, PW]: from the
    convolution's output src [N, C, H, W] (without its bias), x = src + bias[c] is written to a (what f' is
    computed from), z = f(x), and u = z (POOL 0, a 1 x 1 window), the window's max (POOL 1; idx: the window
    offset of its first largest element, as torch's max pooling picks) or its mean (POOL 2). Windows of KH x KW
    with stride KH x KW and no padding (what the conv layers' pooling is; an element of src in no window, at the
    border in floor mode, is not written). u and idx channels-last where NODE_CL, src and a where SRC_CL."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    base, sw, c = _window(i, C, PH, PW, H, W, KH, KW, NODE_CL, SRC_CL)
    if HAS_B:
        b = tl.load(b_ptr + c, mask=m, other=0.0).to(tl.float32)
    else:
        b = 0.0
    best = tl.zeros([BLOCK], dtype=tl.float32)
    j = tl.zeros([BLOCK], dtype=tl.int32)
    for di in tl.static_range(KH):
        for dj in tl.static_range(KW):
            off = base + (di * W + dj) * sw
            x = tl.load(src_ptr + off, mask=m, other=0.0).to(tl.float32) + b
            tl.store(a_ptr + off, x, mask=m)
            z = _act(x, ACT, slope, lo, hi, beta, thr, alpha, ACCURATE)
            if di == 0 and dj == 0:
                best = z
            elif POOL == 1:
                take = (z > best) | (z != z)
                best = tl.where(take, z, best)
                j = tl.where(take, di * KW + dj, j)
            else:
                best += z
    if POOL == 2:
        best = best / (KH * KW)
    tl.store(u_ptr + i, best, mask=m)
    if POOL == 1:
        tl.store(idx_ptr + i, j.to(tl.int8), mask=m)


@triton.jit
def conv_errors(a_ptr, u_ptr, h_ptr, e_ptr, d_ptr, idx_ptr, p_ptr, n, per, stepped, C, H, W, PH, PW, lr,
                ACT: tl.constexpr, slope, lo, hi, beta, thr, alpha, POOL: tl.constexpr, KH: tl.constexpr,
                KW: tl.constexpr, NODE_CL: tl.constexpr, SRC_CL: tl.constexpr, HAS_D: tl.constexpr,
                UPDATE: tl.constexpr, HAS_P: tl.constexpr, ACCURATE: tl.constexpr, BLOCK: tl.constexpr):
    """A conv group's error pass over n elements of its nodes [K, B, C, PH, PW]: e = pi (h - u) (pi of layer
    i // per), h -= lr e on the first ``stepped`` elements (UPDATE), and (HAS_D) the signal at the convolution's
    output d = pool'(e) f'(x) over each element's window of x = a (conv_act_pool's): e at the window's max (POOL
    1, its offset in idx) or e / (KH KW) everywhere in it (POOL 2), e itself without pooling (POOL 0). The nodes
    channels-last where NODE_CL, a and d where SRC_CL."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    e = _node_errors(u_ptr, h_ptr, e_ptr, p_ptr, i, m, stepped, per, lr, HAS_P, UPDATE)
    if HAS_D:
        base, sw, c = _window(i, C, PH, PW, H, W, KH, KW, NODE_CL, SRC_CL)
        if POOL == 1:
            j = tl.load(idx_ptr + i, mask=m, other=0).to(tl.int32)
        for di in tl.static_range(KH):
            for dj in tl.static_range(KW):
                off = base + (di * W + dj) * sw
                x = tl.load(a_ptr + off, mask=m, other=0.0)
                g = _dact(x, _act(x, ACT, slope, lo, hi, beta, thr, alpha, ACCURATE), ACT, slope, lo, hi, beta, thr,
                          alpha, ACCURATE)
                if POOL == 1:
                    dz = tl.where(j == di * KW + dj, e, 0.0)
                elif POOL == 2:
                    dz = e / (KH * KW)
                else:
                    dz = e
                tl.store(d_ptr + off, dz * g, mask=m)


@triton.jit
def _low(x, EMULATE: tl.constexpr):
    """x rounded to bfloat16 (to nearest even), a bfloat16 dot's operand; EMULATE (under the interpreter, whose
    bfloat16 is broken): the same rounding kept in float32, whose dot of such values is then exact per product."""
    if EMULATE:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.bfloat16)
    return y


@triton.jit
def bmm(a_ptr, b_ptr, c_ptr, o_ptr, M, N, R, s_ak, s_am, s_ar, s_bk, s_br, s_bn, s_ck, s_cm, s_cn, s_ok, s_om, s_on,
        alpha, beta, HAS_C: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr, EMULATE: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One [BM, BN] tile of batch k of o = beta c + alpha (a @ b) (torch.baddbmm; HAS_C False: c not read, as a
    beta of 0), every operand through its strides (a transposed operand, a broadcast bias: stride 0). LOW: both
    operands rounded to bfloat16 as they are read (a float32 node batch times bfloat16 weights, under
    precision="bf16"), the products summed in float32."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    k = tl.program_id(2).to(tl.int64)
    mm, mn = rm < M, rn < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for r0 in range(0, R, BK):
        r = r0 + tl.arange(0, BK)
        mr = r < R
        a = tl.load(a_ptr + k * s_ak + rm[:, None] * s_am + r[None, :] * s_ar, mask=mm[:, None] & mr[None, :],
                    other=0.0)
        b = tl.load(b_ptr + k * s_bk + r[:, None] * s_br + rn[None, :] * s_bn, mask=mr[:, None] & mn[None, :],
                    other=0.0)
        if LOW:
            a = _low(a, EMULATE)
            b = _low(b, EMULATE)
        acc += tl.dot(a, b, input_precision=PREC)
    acc = alpha * acc
    m = mm[:, None] & mn[None, :]
    if HAS_C:
        acc += beta * tl.load(c_ptr + k * s_ck + rm[:, None] * s_cm + rn[None, :] * s_cn, mask=m, other=0.0)
    tl.store(o_ptr + k * s_ok + rm[:, None] * s_om + rn[None, :] * s_on, acc.to(o_ptr.dtype.element_ty), mask=m)
