"""The feed-forward init of a group of K equal square layers as ONE kernel (Triton, on CUDA devices).

Shape letters: K layers, B batch, D width (every layer D -> D).

The init is a chain: layer k reads what layer k - 1 just wrote, so run with torch it is one GEMM and
one activation kernel per layer, and at 512 layers those ~1,000 small kernels dominate a step even
replayed as a CUDA graph (docs/gpu.md). Here each program owns BB rows of the batch and walks the K
layers itself, keeping its rows' chain on the device between layers (a barrier between layers; no
other program reads its rows), so a group's whole init is one launch:

    dense      a_k = h_{k-1} @ w_k + b_k;  u_k = f(a_k);  h_k <- u_k
    residual   s_k = phi(h_{k-1});  u_k = skip * h_{k-1} + scale * (s_k @ w_k + b_k);  h_k <- u_k   (μPC)

It writes what the torch chain writes (a, u, s, the copy of the input a gelu-like phi needs, and the
value nodes), so the inference steps that follow are unchanged. Before a group uses it, it is checked
once against the torch chain on the group's own weights (``agree``): a kernel that disagrees is not
used (one warning), so the worst case is the torch chain's speed. ``PCDIST_TRITON=0`` turns it off.
Under ``TRITON_INTERPRET=1`` the same kernels run on a CPU (tests/test_chain.py), with the activations
written from exp/log where a GPU uses libdevice's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch
from torch import Tensor

from .arguments import env_choice

__all__ = ["usable", "ACT_CODES", "dense_chain", "residual_chain"]

ACT_CODES = {"identity": 0, "relu": 1, "leaky_relu": 2, "tanh": 3, "sigmoid": 4, "hard_tanh": 5, "silu": 6,
             "gelu": 7, "softplus": 9, "elu": 10, "mish": 11}  # gelu with approximate="tanh": 8


@functools.lru_cache(maxsize=1)
def _triton():
    try:
        import triton  # noqa: F401

        from . import _chain_kernels
    except Exception:  # no Triton (a CPU build), or one this code cannot use: the torch chain
        return None
    return _chain_kernels


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_TAKES: dict[str, frozenset] = {}  # kernel name: its argument names

OPTIONS = {"enable_fp_fusion": True}
"""Compiler options of every pcdist kernel. Multiply-adds fused (FMA), as every Triton before 3.10 does by default
and as the kernels were checked on GPUs; said explicitly, since Triton 3.9 warns that its default turns to unfused
in 3.10, which would change the kernels' round-off. TRITON_FORCE_DISABLE_FP_FUSION=1 still turns it off."""


def launch(name: str, grid: tuple, *args, **consts) -> None:
    """Triton kernel ``name`` (pcdist/engine/_chain_kernels.py) over ``grid``; ACCURATE (libdevice's tanh and
    exp, which the interpreter lacks) is passed where the kernel takes it. A keyword the kernel does not take
    raises TypeError here, on every device: Triton's interpreter, which the CPU tests run, drops it silently,
    while a compiled launch fails with it."""
    kernel = getattr(_triton(), name)
    takes = _TAKES.get(name) or _TAKES.setdefault(name, frozenset(kernel.arg_names))
    if "ACCURATE" in takes:
        consts["ACCURATE"] = not interpreted()
    if unknown := [k for k in consts if k not in takes and k not in ("num_warps", "num_stages")]:
        raise TypeError(f"Triton kernel {name} takes no argument {', '.join(unknown)}")
    options = {} if interpreted() else OPTIONS  # (compiler options: the interpreter compiles nothing)
    with on_device(next((a.device for a in args if isinstance(a, Tensor)), None)):
        kernel[grid](*args, **consts, **options)  # Triton launches on the current device: made the tensors' own


def on_device(device: torch.device | None):
    """A context in which ``device`` (a CUDA device) is the current one; nothing for another device or None."""
    return torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()


def triton_allowed(like: Tensor) -> bool:
    """Triton kernels for tensors like ``like``: on a CUDA device (or any device under the Triton interpreter),
    Triton importable, PCDIST_TRITON not 0 (this chain and the error pass, pcdist/engine/errorpass.py)."""
    return (env_choice("PCDIST_TRITON") == "1" and (like.device.type == "cuda" or interpreted())
            and _triton() is not None)


MAX_WIDTH = 256  # the widest layers the chain kernel runs on a GPU (see usable)
MAX_ELEMENTS = 2**31 - 2**16  # the largest buffers the Triton kernels index (int32 offsets; a last block's room)


def usable(like: Tensor, act, K: int, I: int, O: int) -> bool:
    """True if the chain kernel can run this group: K >= 2 square layers, float32 or bfloat16, on a CUDA
    device (or any device under the Triton interpreter), an activation it knows, PCDIST_TRITON not 0, buffers
    of at most MAX_ELEMENTS (its int32 offsets), and layers at most MAX_WIDTH wide on a GPU. Its programs own 16
    rows of the batch each and run every layer's product in turn, so a program's work grows as K D^2 while the
    torch chain spreads each product over the whole GPU: on an H200 the kernel made MLP A's replayed step (width
    128) faster and MLP B's (width 512) slower than the torch chain (docs/gpu.md)."""
    return (K >= 2 and I == O and act is not None and act.name in ACT_CODES
            and like.dtype in (torch.float32, torch.bfloat16) and triton_allowed(like)
            and like.numel() <= MAX_ELEMENTS and (I <= MAX_WIDTH or interpreted()))


def act_args(act) -> dict:
    code = ACT_CODES[act.name] + (1 if act.name == "gelu" and act.approximate == "tanh" else 0)
    return dict(ACT=code, slope=float(act.negative_slope), lo=float(act.min_val), hi=float(act.max_val),
                beta=float(act.beta), thr=float(act.threshold), alpha=float(act.alpha))


def _precision(like: Tensor) -> str:
    """The dot's precision: IEEE float32 unless TF32 is on for float32 matmuls (trainer.precision=tf32)."""
    if like.dtype != torch.float32:
        return "ieee"
    m = torch.backends.cuda.matmul
    tf32 = m.fp32_precision == "tf32" if hasattr(m, "fp32_precision") else m.allow_tf32
    return "tf32" if tf32 and not interpreted() else "ieee"


def _blocks(D: int) -> tuple[int, int, int]:
    n = max(16, 1 << (D - 1).bit_length())
    return 16, min(n, 128), min(n, 32)  # rows per program, output columns per tile, reduction chunk


def dense_chain(h0: Tensor, w_KIO: Tensor, b_KO: Tensor, a: Tensor, u: Tensor, h_out: Tensor, act,
                rows: slice | None = None) -> None:
    """The dense chain from h0 [B, D] (rows ``rows`` of the batch): a [K, B, D] (the pre-activations,
    unless u is a), u and h_out [K, B, D]."""
    K, B, D = u.shape
    lo, hi = (0, B) if rows is None else (rows.start or 0, B if rows.stop is None else rows.stop)
    BB, BN, BK = _blocks(D)
    launch("dense_chain", (-(-(hi - lo) // BB),), h0, w_KIO, b_KO, a, u, h_out, lo, hi - lo, B, D, K,
           **act_args(act), KEEP_A=a.data_ptr() != u.data_ptr(), PREC=_precision(u), BB=BB, BN=BN, BK=BK)


def residual_chain(h0: Tensor, w_KIO: Tensor, b_KO: Tensor | None, s: Tensor | None, x: Tensor | None, u: Tensor,
                   h_out: Tensor, act, scale: float, skip: bool, rows: slice | None = None) -> None:
    """The μPC chain from h0 [B, D]: s [K, B, D] = phi of each layer's input (None: phi is the identity),
    x [K, B, D] a copy of each input (or None), u and h_out [K, B, D]."""
    K, B, D = u.shape
    lo, hi = (0, B) if rows is None else (rows.start or 0, B if rows.stop is None else rows.stop)
    BB, BN, BK = _blocks(D)
    launch("residual_chain", (-(-(hi - lo) // BB),), h0, w_KIO, u if b_KO is None else b_KO, u if s is None else s,
           u if x is None else x, u, h_out, lo, hi - lo, B, D, K, float(scale), **act_args(act),
           HAS_B=b_KO is not None, STORE_S=s is not None, STORE_X=x is not None, SKIP=skip, PREC=_precision(u),
           BB=BB, BN=BN, BK=BK)


CHAIN = ("feed-forward kernel", "the torch chain")


def checked(run, reference, what: str, kernel: tuple[str, str] = CHAIN) -> bool:
    """The kernel on a probe (``run()`` returns its outputs) against torch (``reference()``): a kernel that
    fails to build or run (a Triton this code does not suit), or disagrees, is not used (one warning), and
    torch runs instead. ``kernel``: its name and what runs instead, for the warning."""
    try:
        got = run()
    except Exception as e:  # Triton's compiler errors are plain RuntimeErrors
        first = (str(e).strip().splitlines() or [""])[0][:200]
        warnings.warn(f"pcdist: the fused {kernel[0]} failed on {what} ({type(e).__name__}: {first}); "
                      f"using {kernel[1]} (PCDIST_TRITON=0 turns the kernel off)", stacklevel=3)
        return False
    return agree(got, reference(), what, kernel)


def agree(got: list[Tensor], want: list[Tensor], what: str, kernel: tuple[str, str] = CHAIN) -> bool:
    """The kernel's outputs equal torch's to round-off (relative 1e-4 in float32, 1e-2 with TF32
    products, 3e-2 in bfloat16, of the largest value); otherwise warn once and say torch is used."""
    for g, w in zip(got, want):
        scale = float(w.abs().max()) if w.numel() else 0.0
        rel = 3e-2 if w.dtype == torch.bfloat16 else 1e-2 if _precision(w) == "tf32" else 1e-4
        tol = rel * max(scale, 1.0)
        if not float((g.float() - w.float()).abs().max()) <= tol:
            warnings.warn(f"pcdist: the fused {kernel[0]} disagrees with torch on {what}; using {kernel[1]} "
                          "(PCDIST_TRITON=0 turns the kernel off)", stacklevel=3)
            return False
    return True
