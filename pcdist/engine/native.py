"""The fused error kernel of a layer group on CPUs: one pass instead of four torch ops.

Per inference step each hidden group runs f(a), e = h - u, d = e * f'(a) and (pc
without momentum) h -= x_lr * e. As separate torch ops these are four passes over
a K x B x O block that no longer fits in L2, and they cost as much as a third of
the step on a CPU. ``_native.c`` does them in one vectorised pass.

It is compiled on first use with the system C compiler (``$CC``, else ``cc``) into
a cache folder (``$PCDIST_CACHE_DIR``, else ``$XDG_CACHE_HOME/pcdist`` or
``~/.cache/pcdist``; the temp folder if that cannot be written), keyed by the source,
the flags and this CPU's feature flags, so a shared home folder on a mixed cluster never
loads a binary built for another CPU; processes that need it at once (the ranks of a first launch) compile it
once, the others waiting for that build. Without a compiler, or with ``PCDIST_NATIVE=0``, the engine keeps the torch
ops (a warning says why), and GPUs always use them. Both give the same numbers to
round-off (tests/test_native.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

from .arguments import env_choice

__all__ = ["ACT_CODES", "act_code", "library", "usable", "ErrorPass", "Kernel", "ResidualKernel"]

ACT_CODES = {"tanh": 0, "sigmoid": 1, "relu": 2, "leaky_relu": 3, "hard_tanh": 4, "identity": 5, "gelu": 6,
             "gelu_tanh": 7, "silu": 8, "softplus": 9, "elu": 10, "mish": 11}
_SOURCE = Path(__file__).with_name("_native.c")
# Tried in order: the fast build (x86 with glibc's vector maths), then ever more portable ones.
_FLAG_SETS = (
    ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-lmvec", "-lm"],
    ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-lm"],
    ["-O3", "-ffast-math", "-lm"],
)
_UNSET = object()
_lib = _UNSET


def _cache_dir() -> Path:
    if os.environ.get("PCDIST_CACHE_DIR"):
        return Path(os.environ["PCDIST_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pcdist"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build(cc: str) -> Path:
    """Compile the kernel (or find it in the cache); raises RuntimeError with the compiler's output."""
    src = _SOURCE.read_bytes()
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(b"\0".join([src, " ".join([cc, *flags]).encode(), _cpu_flags().encode(),
                                         platform.machine().encode()])).hexdigest()[:16]
        out = _cache_dir() / f"pcdist_native_{key}.so"
        if out.exists():
            return out
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(out.parent, os.W_OK):
                raise PermissionError(out.parent)
        except OSError:  # a read-only home (some containers): build in the temp folder instead
            out = Path(tempfile.gettempdir()) / f"pcdist-{os.getuid() if hasattr(os, 'getuid') else 0}" / out.name
            if out.exists():
                return out
            out.parent.mkdir(parents=True, exist_ok=True)
        with _only_one_builds(out):
            if out.exists():  # another process built it while this one waited
                return out
            if not errors:
                _tell(f"compiling the fused CPU kernel for this CPU, once (about 20 s; kept in {out.parent})")
            error = _compile(cc, flags, out)
        if error is None:
            return out
        errors.append(error)
    raise RuntimeError("could not compile pcdist/engine/_native.c:\n" + "\n".join(errors))


@contextlib.contextmanager
def _only_one_builds(out: Path):
    """Held while ``out`` is built: the ranks of a first launch on a machine (or a node of a cluster sharing a home
    folder) start at once, and one of them compiles (~17 CPU-s) while the others wait and load its build, instead
    of each compiling the same file. A lock file beside it (flock: released if its holder dies); where flock does
    not exist, every process builds, as each renames its own complete build into place."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(out.with_suffix(".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _tell("waiting for another process to compile the fused CPU kernel (once for this CPU)")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _tell(what: str) -> None:
    """A line on a terminal (a first run waits for the compiler, and should say why); nothing in a log."""
    if sys.stderr.isatty():
        print(f"pcdist: {what}", file=sys.stderr, flush=True)


def _compile(cc: str, flags: list[str], out: Path) -> str | None:
    """Compile to ``out`` with ``flags``: None, or the compiler's command and output."""
    # Build beside the target and rename: a process never loads a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    libs = [f for f in flags if f.startswith("-l")]
    cmd = [cc, *[f for f in flags if not f.startswith("-l")], "-shared", "-fPIC", str(_SOURCE), "-o", tmp, *libs]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        os.unlink(tmp)
        raise RuntimeError(f"the C compiler did not finish within 300 s: {' '.join(cmd)}") from None
    if proc.returncode == 0:
        os.replace(tmp, out)
        return None
    os.unlink(tmp)
    return f"$ {' '.join(cmd)}\n{proc.stderr.strip()[-800:]}"


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None if disabled or unbuildable (warned once)."""
    global _lib
    if _lib is not _UNSET:
        return _lib
    _lib = None
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        warnings.warn(f"pcdist: no C compiler ({cc!r} not found); the CPU engine uses separate torch ops "
                      "for the error pass (correct, slower). Set CC or install gcc to enable the fused kernel.",
                      RuntimeWarning, stacklevel=2)
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"pcdist: the fused CPU kernel is unavailable, using torch ops instead: {e}",
                      RuntimeWarning, stacklevel=2)
        return None
    i, d, p, n = ctypes.c_int, ctypes.c_double, ctypes.c_void_p, ctypes.c_long
    for suffix in ("f32", "f64"):
        for name, args in ((f"pcd_errors_{suffix}", [i, i, i, d, d, *[p] * 7, n, n, n, d]),
                           (f"pcd_res_act_{suffix}", [i, i, i, d, d, *[p] * 6, n, d, d, d]),
                           (f"pcd_res_errors_{suffix}", [i, p, p, p, n, n, d, p, n])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, None
    _lib = lib
    return lib


def act_code(act) -> int | None:
    """The kernel's code for an Activation, or None where it has none (leaky_relu with a
    negative slope, elu with a negative alpha: their f' is not a function of u, and they are rare
    enough to leave to torch ops)."""
    if act is None or (act.name == "leaky_relu" and act.negative_slope < 0) or (act.name == "elu" and act.alpha < 0):
        return None
    return ACT_CODES.get("gelu_tanh" if act.name == "gelu" and act.approximate == "tanh" else act.name)


def _bounds(act) -> tuple[float, float]:
    """The kernel's two activation parameters (lo, hi): leaky_relu's slope, elu's alpha, softplus's
    beta and threshold, hard_tanh's bounds."""
    return {"leaky_relu": (act.negative_slope, 0.0), "elu": (act.alpha, 0.0),
            "softplus": (act.beta, act.threshold)}.get(act.name, (act.min_val, act.max_val))


def usable(act, like: Tensor) -> bool:
    """True if the kernel can run this activation on tensors like ``like`` (CPU, float32/64) and
    PCDIST_NATIVE is not 0 (read when a trainer builds its buffers)."""
    return (env_choice("PCDIST_NATIVE") == "1" and act_code(act) is not None and like.device.type == "cpu"
            and like.dtype in (torch.float32, torch.float64) and library() is not None)


class ErrorPass:
    """The buffers and ``run`` of a dense group's fused error pass, whatever runs it: the C kernel here (``Kernel``)
    or Triton on GPUs (pcdist/engine/errorpass.py); a subclass brings ``_call(fresh, with_d, lr, k0, k1)``.

    ``au`` [K, B, O] holds a = h_in @ w without the bias (``fresh``: u = f(a + bias) is
    computed on the fly and not stored), or else u is read from ``u`` (default: ``au``
    itself) and ``au`` holds what f' is computed from: u, or for gelu a + bias. ``h``
    holds the predicted nodes; ``e`` receives pi (h - u) (``prec``: the K layers' precisions pi, a
    tensor the caller may change between calls; None: pi = 1 with no extra multiply); ``d`` e * f'(a)
    if wanted. ``run(fresh, with_d, lr)`` instead takes the step h -= lr * e when ``lr`` is given (e
    is then not stored: nothing reads it), on all K layers or, with ``stepped=K'``, on the first K'
    only (the rest store e). The buffers are checked here (``who`` names the kernel in the error).
    """

    who = "native kernel"

    def __init__(self, act, au: Tensor, h: Tensor, e: Tensor, d: Tensor, bias: Tensor, u: Tensor | None = None,
                 prec: Tensor | None = None):
        u = au if u is None else u
        for name, t in (("a", au), ("u", u), ("h", h), ("e", e), ("d", d)):
            if not t.is_contiguous() or t.shape != au.shape or t.dtype != au.dtype:
                raise ValueError(f"{self.who}: buffer {name} must be contiguous with shape {list(au.shape)}")
        K, B, O = au.shape
        if not bias.is_contiguous() or bias.shape != (K, O) or bias.dtype != au.dtype:
            raise ValueError(f"{self.who}: bias must be contiguous with shape {[K, O]}")
        if prec is not None and (not prec.is_contiguous() or prec.shape != (K,) or prec.dtype != au.dtype):
            raise ValueError(f"{self.who}: prec must be contiguous with shape {[K]}")
        self.act, self.au, self.u, self.h, self.e, self.d, self.bias, self.prec = act, au, u, h, e, d, bias, prec
        self.K, self.B, self.O = K, B, O

    def run(self, fresh: bool, with_d: bool, lr: float | None = None, stepped: int | None = None) -> None:
        if lr is not None and stepped is not None and stepped < self.K:
            self._call(fresh, with_d, lr, 0, stepped)
            self._call(fresh, with_d, None, stepped, self.K)
        else:
            self._call(fresh, with_d, lr, 0, self.K)

    def _call(self, fresh: bool, with_d: bool, lr: float | None, k0: int, k1: int) -> None:
        raise NotImplementedError


class Kernel(ErrorPass):
    """The fused pass of ``ErrorPass`` as the C kernel, bound to the group's buffers (pointers taken once)."""

    def __init__(self, act, au: Tensor, h: Tensor, e: Tensor, d: Tensor, bias: Tensor, u: Tensor | None = None,
                 prec: Tensor | None = None):
        super().__init__(act, au, h, e, d, bias, u, prec)
        u = self.u
        lib = library()
        self._fn = lib.pcd_errors_f32 if au.dtype == torch.float32 else lib.pcd_errors_f64
        self._code, self._bounds = act_code(act), _bounds(act)
        self._ptrs = [t.data_ptr() for t in (au, u, h, e, d)]
        self._bias = bias.data_ptr()
        self._prec = None if prec is None else prec.data_ptr()
        self._size = au.element_size()
        self._args: dict[tuple, tuple] = {}

    def _call(self, fresh: bool, with_d: bool, lr: float | None, k0: int, k1: int) -> None:
        """The pass over layers [k0, k1) of the group."""
        if k1 <= k0:
            return
        mode = int(fresh) + 2 * int(with_d) + 4 * int(lr is not None) + 8 * int(self._prec is not None)
        key = (mode, k0, k1, lr, torch.get_num_threads())
        args = self._args.get(key)
        if args is None:  # converted to ctypes once: a call then costs ~2 us instead of ~6
            if len(self._args) > 64:  # e.g. a changing lr: keep the cache bounded
                self._args.clear()
            B, O = self.B, self.O
            au, u, h, e, d = (p + k0 * B * O * self._size for p in self._ptrs)
            prec = None if self._prec is None else self._prec + k0 * self._size
            vals = (self._code, mode, key[-1], *self._bounds, au, u, h, e, d, self._bias + k0 * O * self._size,
                    prec, (k1 - k0) * B * O, B, O, 0.0 if lr is None else lr)
            args = self._args[key] = tuple(t(v) for t, v in zip(self._fn.argtypes, vals))
        self._fn(*args)


class ResidualKernel:
    """The residual kind's elementwise passes over one group's buffers (pcdist/engine/layers/residual.py).

    ``activate``: s = phi(h_in) (and x = h_in where phi' needs its input); ``errors``: e = pi (h_out - u)
    (``prec``: the K layers' precisions, None for 1) and the value step's own-error term h_out -= lr * e;
    ``backproject``: target = beta * target + alpha_a * t * phi'(h_in) + alpha_e * e, phi' read from s
    (or x). One pass each, where torch ops take two or three.
    """

    def __init__(self, act, h_in: Tensor, s: Tensor, x: Tensor | None, u: Tensor, h_out: Tensor, e: Tensor,
                 t: Tensor | None, prec: Tensor | None = None):
        like = [b for b in (h_in, s, x, u, h_out, e, t, prec) if b is not None]
        if any(not b.is_contiguous() or b.dtype != u.dtype for b in like):
            raise ValueError("native residual kernel: every buffer must be contiguous and of one dtype")
        lib = library()
        f64 = u.dtype == torch.float64
        self._act_fn = lib.pcd_res_act_f64 if f64 else lib.pcd_res_act_f32
        self._err_fn = lib.pcd_res_errors_f64 if f64 else lib.pcd_res_errors_f32
        self._head = (act_code(act), *_bounds(act))
        self._keep = like  # the buffers outlive the pointers
        self._h_in, self._s, self._x = h_in, s, x
        self._u, self._h_out, self._e, self._t, self._prec = u, h_out, e, t, prec
        self._per_layer = u[0].numel()
        self._cache: dict[tuple, tuple] = {}

    def _call(self, fn, key, make):
        args = self._cache.get(key)
        if args is None:
            if len(self._cache) > 64:
                self._cache.clear()
            args = self._cache[key] = tuple(t(v) for t, v in zip(fn.argtypes, make()))
        fn(*args)

    def activate(self) -> None:
        src, s, x = self._h_in, self._s, self._x
        threads = torch.get_num_threads()
        self._call(self._act_fn, ("act", threads), lambda: (self._head[0], 0, threads, *self._head[1:], src.data_ptr(),
                   s.data_ptr(), x.data_ptr() if x is not None else None, None, None, None, src.numel(), 0.0, 0.0, 0.0))

    def errors(self, lr: float | None, stepped: int) -> None:
        u, h, e = self._u, self._h_out, self._e
        n_step = 0 if lr is None else stepped * self._per_layer
        threads = torch.get_num_threads()
        prec = None if self._prec is None else self._prec.data_ptr()
        self._call(self._err_fn, ("err", threads, lr, n_step), lambda: (threads, u.data_ptr(), h.data_ptr(),
                   e.data_ptr(), u.numel(), n_step, 0.0 if lr is None else lr, prec, self._per_layer))

    def backproject(self, target: Tensor, skip: Tensor | None, beta: float, alpha_a: float, alpha_e: float) -> None:
        """target = beta * target + alpha_a * t * phi'(h_in) (+ alpha_e * skip, the skip term's errors)."""
        t, s, x = self._t, self._s, self._x
        if target.numel() != t.numel() or (skip is not None and skip.numel() != t.numel()):
            raise ValueError("native residual kernel: target and skip must have the back-projection's shape")
        threads = torch.get_num_threads()
        e = None if skip is None else skip.data_ptr()
        key = ("bp", threads, target.data_ptr(), e, beta, alpha_a, alpha_e)
        self._call(self._act_fn, key, lambda: (self._head[0], 1, threads, *self._head[1:], None, s.data_ptr(),
                   x.data_ptr() if x is not None else None, t.data_ptr(), e, target.data_ptr(), t.numel(), beta,
                   alpha_a, alpha_e))
