"""The batched products of dense and μPC groups on CUDA devices: cuBLAS, or a Triton kernel where it is faster.

A group of K equal layers multiplies K small matrices at once (``baddbmm``: a [K, B, I] batch of nodes by [K, I, O]
weights, per inference step twice, plus the weight gradients). Narrow and deep, these are many tiny GEMMs
(64 x 128 by 128 x 128 at width 128), a shape cuBLAS's batched kernels run far below the GPU's arithmetic
rate: on an H200 the float32 products of 512 such layers took 4.7 ms per step where their arithmetic is about
1.6 ms (docs/gpu.md), so a deep narrow step's time grows with depth. ``bmm`` in pcdist/engine/_chain_kernels.py
is a plain tiled Triton GEMM whose tile sizes are chosen per shape; which of the two runs a product is decided
the first time a shape is seen, by timing both on the operands themselves (as cuDNN's benchmark mode picks a
convolution algorithm), and kept for the process, so every trainer of a process makes the same choice:

    auto      (default) on CUDA devices, the Triton kernel where its best tiles are at least 10% faster than
              cuBLAS and agree with it to round-off; cuBLAS otherwise
    torch     cuBLAS (torch.baddbmm) always
    triton    the Triton kernel wherever it can run (the tests' setting under Triton's interpreter)

set by the environment variable PCDIST_GEMM; PCDIST_TRITON=0 turns it off with the other kernels. float32
operands (trainer.precision fp32 or tf32: the kernel's dot is TF32 where torch's float32 matmuls are) through
``functions``; under precision="bf16", float32 nodes times bfloat16 weights through ``low_product`` (the kernel
rounds the nodes to bfloat16 as it reads them, where torch first casts them in a pass of its own, and sums in
float32), timed against what runs otherwise (layers/base.py ``product_into``); float64 products stay torch's.
On a CPU, ``functions`` hands back torch's own functions and ``low_product`` declines: nothing changes.
A choice is made outside CUDA-graph capture (a step's first call is eager); a shape first seen while capturing
runs cuBLAS. As with cuDNN's benchmark mode, two runs may time a shape differently and so differ by float32
round-off; PCDIST_GEMM=torch (or triton) makes the choice fixed.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from . import chain
from .arguments import env_choice

__all__ = ["functions", "baddbmm", "bmm", "low_product", "timed", "CONFIGS"]

CONFIGS = ((16, 64, 32, 4), (32, 64, 32, 4), (64, 64, 32, 4), (64, 128, 32, 4), (128, 128, 32, 8))
"""Tile candidates (rows BM, columns BN, reduction chunk BK, warps): narrow tiles for a batch of small GEMMs."""

INTERPRETED_CONFIG = (16, 16, 16, 4)  # small tiles under the interpreter: every masked edge is exercised
_CHOICE: dict[tuple, tuple | None] = {}


def _mode() -> str:
    return env_choice("PCDIST_GEMM")


def functions(like: Tensor):
    """(baddbmm, bmm) for a group whose products are like ``like``: this module's where the Triton kernel may run
    (float32 on a CUDA device, or under the interpreter with PCDIST_GEMM=triton), else torch's own."""
    return (baddbmm, bmm) if _allowed(like) else (torch.baddbmm, torch.bmm)


def _allowed(out: Tensor) -> bool:
    """The Triton kernel may write products like ``out``: float32 on a CUDA device (or under the interpreter with
    PCDIST_GEMM=triton), PCDIST_GEMM not torch, Triton allowed (chain.triton_allowed)."""
    mode = _mode()
    return out.dtype == torch.float32 and mode != "torch" and chain.triton_allowed(out) \
        and (out.device.type == "cuda" or mode == "triton")


def _launch(cfg, inp: Tensor | None, a: Tensor, b: Tensor, beta: float, alpha: float, out: Tensor) -> None:
    BM, BN, BK, warps = cfg
    K, M, N = out.shape
    c = out if inp is None else inp.expand(out.shape)
    grid = (-(-M // BM), -(-N // BN), K)
    low = _low(a, b)
    if low and chain.interpreted():  # its bfloat16 loads are broken: the values in float32 (exact), rounded as read
        a, b = a.float(), b.float()
    chain.launch("bmm", grid, a, b, c, out, M, N, a.shape[2], *a.stride(), *b.stride(), *c.stride(), *out.stride(),
                 float(alpha), float(beta), HAS_C=inp is not None and beta != 0.0,
                 PREC="ieee" if low else chain._precision(out), LOW=low, EMULATE=low and chain.interpreted(),
                 BM=BM, BN=BN, BK=BK, num_warps=warps)


def _low(a: Tensor, b: Tensor) -> bool:
    """A product on bfloat16 operands (precision="bf16": bfloat16 weights, float32 nodes)."""
    return torch.bfloat16 in (a.dtype, b.dtype)


def reference(inp: Tensor | None, a: Tensor, b: Tensor, beta: float, alpha: float) -> Tensor:
    """What the kernel computes, in torch ops: float32 sums of the operands' products (bfloat16-rounded operands
    where either is bfloat16), times ``alpha``, plus ``beta * inp``."""
    if _low(a, b):
        a, b = a.to(torch.bfloat16).float(), b.to(torch.bfloat16).float()
    exact = torch.bmm(a, b)
    return alpha * exact if inp is None or beta == 0.0 else beta * inp + alpha * exact


def timed(fn, reps: int = 20, device: torch.device | None = None) -> float:
    """Milliseconds per call of ``fn`` on ``device``'s current CUDA stream (None: the current device's; 3 calls'
    warm-up, then ``reps`` timed); on the host clock for a CPU device."""
    with chain.on_device(device):  # events and launches on the tensors' device, not the current one
        for _ in range(3):
            fn()
        if device is not None and device.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) * 1e3 / reps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps


def _choose(inp: Tensor | None, a: Tensor, b: Tensor, beta: float, alpha: float, out: Tensor, baseline=None):
    """The Triton tiles for this product's shapes, strides and dtypes (decided once, see the module docstring), or
    None. ``baseline(inp, out)``: what runs instead (default: torch.baddbmm / torch.bmm)."""
    key = (a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype, out.shape, out.stride(), out.device,
           None if inp is None else inp.expand(out.shape).stride(), beta != 0.0, chain._precision(out))
    if key in _CHOICE:
        return _CHOICE[key]
    if out.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None  # no timing inside a capture: cuBLAS, decided on the next eager call
    scratch = out.clone()
    in_place = inp is not None and inp.data_ptr() == out.data_ptr()
    src = None if inp is None else (inp.clone() if in_place else inp)

    def torch_run():  # what baddbmm / bmm would run instead (inp None: bmm, whose alpha is 1)
        if baseline is not None:
            baseline(scratch if in_place else src, scratch)  # in place, as the caller's
        elif src is None:
            torch.bmm(a, b, out=scratch)
        else:
            torch.baddbmm(src, a, b, beta=beta, alpha=alpha, out=scratch)

    def tiles(cfg):
        _launch(cfg, src, a, b, beta, alpha, scratch)
        return [scratch]

    if _low(a, b):  # the arithmetic the kernel does: float32 sums of the bfloat16-rounded operands' products
        want = [reference(src, a, b, beta, alpha)]
    else:
        torch_run()
        want = [scratch.clone()]
    timing = _mode() == "auto"
    base = timed(torch_run, device=out.device) if timing else None
    best, choice = None, None
    for cfg in [INTERPRETED_CONFIG] if chain.interpreted() else CONFIGS:
        # each candidate builds, runs and agrees with torch (else one warning and torch), then is timed
        if not chain.checked(lambda: tiles(cfg), lambda: want, "a batched product", ("Triton GEMM", "cuBLAS")):
            best, choice = None, None
            break
        t = timed(lambda: tiles(cfg), device=out.device) if timing else 0.0
        if best is None or t < best:
            best, choice = t, cfg
    if timing and choice is not None and not best < 0.9 * base:
        choice = None
    _CHOICE[key] = choice
    return choice


def low_product(inp: Tensor | None, a: Tensor, w: Tensor, beta: float, alpha: float, out: Tensor, fallback) -> bool:
    """out = beta inp + alpha (a @ w) on bfloat16 operands (precision="bf16": a float32 node batch rounded to w's
    bfloat16 as the kernel reads it, no cast of its own), summed and written in float32 by the Triton GEMM, where
    it may run (``functions``' conditions) and was timed faster than ``fallback(inp, out)``, the torch ops that
    otherwise compute it (given ``out`` itself as ``inp`` for an in-place product); False where it does not run,
    and the caller runs ``fallback``."""
    if not _allowed(out) or a.dim() != 3:  # one layer's product (the feed-forward chain): the fallback's
        return False
    cfg = _choose(inp, a, w, beta, alpha, out, fallback)
    if cfg is None:
        return False
    _launch(cfg, inp, a, w, beta, alpha, out)
    return True


def baddbmm(input: Tensor, batch1: Tensor, batch2: Tensor, *, beta: float = 1.0, alpha: float = 1.0,
            out: Tensor) -> Tensor:
    """torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha, out=out), by cuBLAS or the Triton kernel."""
    cfg = _choose(input, batch1, batch2, beta, alpha, out)
    if cfg is None:
        return torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha, out=out)
    _launch(cfg, input, batch1, batch2, beta, alpha, out)
    return out


def bmm(batch1: Tensor, batch2: Tensor, *, out: Tensor) -> Tensor:
    """torch.bmm(batch1, batch2, out=out), by cuBLAS or the Triton kernel."""
    cfg = _choose(None, batch1, batch2, 0.0, 1.0, out)
    if cfg is None:
        return torch.bmm(batch1, batch2, out=out)
    _launch(cfg, None, batch1, batch2, 0.0, 1.0, out)
    return out
