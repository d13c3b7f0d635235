"""The fused feed-forward chain (pcdist/engine/chain.py) computes what the torch chain computes, and the fused
elementwise passes of the dense, residual and conv kinds (pcdist/engine/errorpass.py) what the torch ops compute.

On a GPU a group of K equal square layers runs its feed-forward init as one Triton kernel instead of
~2K small ones. The kernels run here on a CPU under Triton's interpreter, in a process started with
TRITON_INTERPRET=1 (each group of checks in a fork of it), and compiled where CUDA is present (a process per
group; tests/chain_checks.py; this file skips where Triton is not installed, and the interpreter's checks skip
where that Triton's interpreter cannot run a loop). They must
write exactly what the torch chain writes (the pre-activations a gelu-like f needs, u, phi(h) and the
input copies of μPC layers, the value nodes) for every activation and for a row range (the pipelined
init's micro-batches), in float32 (the interpreter's bfloat16 loads are wrong; on a GPU every group's
kernel, bfloat16 included, is checked against torch on first use); the error pass must write e, d and the
value step of the torch ops in each of its modes, for every activation, with and without precisions (the conv
kind's: without pooling, with max and with average pooling, against autograd through torch's pooling); a trainer
that uses them (MLP, μPC, CNN) must train as one that does not; and a kernel that disagrees with torch is not used.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from pcdist.engine import chain, errorpass  # noqa: E402

CHECKS = Path(__file__).with_name("chain_checks.py")
WHATS = ["kernels", "errors", "trainer"]


def launch(whats: list[str], interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PCDIST_TRITON")}
    env.update({"OMP_NUM_THREADS": "1", **({"TRITON_INTERPRET": "1"} if interpret else {})})
    return subprocess.run([sys.executable, str(CHECKS), *whats], env=env, capture_output=True, text=True,
                          timeout=900)


def assert_passed(out: subprocess.CompletedProcess, what: str) -> None:
    """The group ``what`` printed that all its checks passed (its failures, if any, are on stderr)."""
    if out.returncode == 77:
        pytest.skip(out.stdout.strip())
    assert out.returncode in (0, 1), out.stdout[-2000:] + out.stderr[-6000:]
    counts = [line.split() for line in out.stdout.splitlines() if line.endswith(f" {what} checks passed")]
    assert len(counts) == 1 and counts[0][0] == counts[0][2], out.stdout[-2000:] + out.stderr[-6000:]


def run_checks(what: str, interpret: bool) -> None:
    out = launch([what], interpret)
    assert_passed(out, what)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]


@pytest.fixture(scope="module")
def interpreted():
    """The three groups of checks, each in a fork of one process started with TRITON_INTERPRET=1 (its imports
    paid once)."""
    return launch(WHATS, interpret=True)


@pytest.mark.parametrize("what", WHATS)
def test_the_kernels_under_the_interpreter(what, interpreted):
    """kernels: every activation in float32, dense and μPC, a row range; errors: the dense, residual and conv
    passes, every activation and mode; trainer: an MLP, a μPC network and a CNN train with the kernels as without
    them (and their hidden groups did use them)."""
    assert_passed(interpreted, what)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("what", WHATS)
def test_the_compiled_kernels_on_the_gpu(what):
    """The same checks compiled for the GPU, bfloat16 kernels too."""
    run_checks(what, interpret=False)


def test_a_kernel_that_disagrees_is_not_used():
    """agree() is the guard a group passes before it uses the kernel: outputs off by more than round-off fail
    it with one warning (the group then keeps the torch chain)."""
    want = torch.ones(3, 4)
    assert chain.agree([want + 1e-7], [want], "a test")
    with pytest.warns(UserWarning, match="disagrees with torch on a test"):  # beyond even bfloat16's round-off
        assert not chain.agree([want + 1e-1], [want], "a test")


def test_a_kernel_that_fails_to_build_is_not_used():
    """checked() is the guard a group passes before it uses the kernel: a kernel that raises (a Triton whose
    compiler rejects it) leaves one warning naming the error, and the torch chain runs."""
    def broken():
        raise RuntimeError("PassManager::run failed")

    with pytest.warns(UserWarning, match=r"failed on a test \(RuntimeError: PassManager::run failed\)"):
        assert not chain.checked(broken, lambda: [], "a test")
    assert chain.checked(lambda: [torch.ones(2)], lambda: [torch.ones(2)], "a test")


def test_no_kernel_on_a_cpu_without_the_interpreter(monkeypatch):
    """On a CPU (no interpreter) the torch chain runs: the kernel is for CUDA devices."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from pcdist.engine.activations import Activation

    assert not chain.usable(torch.zeros(2, 2), Activation("tanh"), 4, 8, 8)
    assert not errorpass.usable(Activation("tanh"), torch.zeros(2, 2))
    assert not errorpass.conv_usable(Activation("relu"), "max", [2, 2], [2, 2], [0, 0], 64, torch.zeros(2, 2))
    from pcdist.engine import gemm
    assert gemm.functions(torch.zeros(2, 2)) == (torch.baddbmm, torch.bmm), "a CPU's products are torch's own"


SCALARS = {"slope": "fp32", "lo": "fp32", "hi": "fp32", "beta": "fp32", "thr": "fp32", "alpha": "fp32"}
TILES = {"BB": 16, "BN": 128, "BK": 32}


def ast_source():
    """Triton's ASTSource, as the tests below call it (``constexprs=``); an older Triton's takes ``constants=``
    keyed by argument index (torch 2.4's Triton 3.0): those tests skip there."""
    import inspect

    from triton.compiler import ASTSource

    if "constexprs" not in inspect.signature(ASTSource.__init__).parameters:
        pytest.skip(f"Triton {triton.__version__}'s ASTSource takes no constexprs= (an older compile API)")
    return ASTSource


@pytest.mark.parametrize("dt", ["fp32", "bf16"])
@pytest.mark.parametrize("kernel", ["dense", "residual"])
def test_the_kernels_compile_for_a_hopper_gpu(kernel, dt, tmp_path, monkeypatch):
    """Triton builds both kernels for an H100 / H200 (sm_90) on any machine, no GPU needed: the compiler
    passes a GPU runs (Triton 3.6 once rejected a helper's runtime branch there, caught on an H200)."""
    from triton.backends.compiler import GPUTarget
    ASTSource = ast_source()

    from pcdist.engine import _chain_kernels as kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile, do not reuse a cached build
    ptrs = ["x_ptr", "w_ptr", "b_ptr", "a_ptr", "u_ptr", "h_ptr"] if kernel == "dense" else \
        ["x_ptr", "w_ptr", "b_ptr", "s_ptr", "xs_ptr", "u_ptr", "h_ptr"]
    sig = {p: f"*{dt}" for p in ptrs} | {n: "i32" for n in ("row0", "nrows", "B", "D", "K")}
    flags = {"KEEP_A": True} if kernel == "dense" else \
        {"HAS_B": True, "STORE_S": True, "STORE_X": True, "SKIP": True}
    if kernel == "residual":
        sig["scale"] = "fp32"
    consts = {"ACT": chain.ACT_CODES["gelu"], **flags, "ACCURATE": True, "PREC": "ieee", **TILES}
    sig |= {"ACT": "constexpr"} | SCALARS | {k: "constexpr" for k in consts if k != "ACT"}
    fn = kernels.dense_chain if kernel == "dense" else kernels.residual_chain
    built = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                           options=chain.OPTIONS)
    assert ".entry " + fn.__name__ in built.asm["ptx"]


@pytest.mark.parametrize("fresh", [True, False])
def test_the_error_kernel_compiles_for_a_hopper_gpu(fresh, tmp_path, monkeypatch):
    """The dense error pass and the residual kind's passes build for sm_90 on any machine for every activation's f
    and f', with and without their optional parts: what the interpreter's checks cannot show of the GPU's
    compiler. Each activation is built in one of the two (half of them each: compiling is most of this test's
    time; every f and f' also builds in the conv kernels' test)."""
    from triton.backends.compiler import GPUTarget
    ASTSource = ast_source()

    from pcdist.engine import _chain_kernels as kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile, do not reuse a cached build
    sig = {p: "*fp32" for p in ("au_ptr", "u_ptr", "h_ptr", "e_ptr", "d_ptr", "b_ptr", "p_ptr")}
    sig |= {"n": "i32", "B": "i32", "O": "i32", "lr": "fp32"} | SCALARS
    codes = sorted(set(chain.ACT_CODES.values()) | {8})[int(fresh)::2]  # 8: gelu with approximate="tanh"
    for code in codes:
        consts = {"ACT": code, "FRESH": fresh, "HAS_D": True, "UPDATE": not fresh, "HAS_P": True, "ACCURATE": True,
                  "BLOCK": errorpass.BLOCK}
        built = triton.compile(ASTSource(fn=kernels.dense_errors, signature=sig | {k: "constexpr" for k in consts},
                                         constexprs=consts), target=GPUTarget("cuda", 90, 32),
                               options=chain.OPTIONS)
        assert ".entry dense_errors" in built.asm["ptx"], code
    # the residual kind's three passes (fresh: with the optional parts, else without)
    act = {"slope": "fp32", "lo": "fp32", "hi": "fp32", "thr": "fp32", "alpha": "fp32"}
    for name, ptrs, scalars, flags in (
            ("res_act", ("src_ptr", "s_ptr", "x_ptr"), {"n": "i32"} | SCALARS, {"STORE_X": fresh}),
            ("res_errors", ("u_ptr", "h_ptr", "e_ptr", "p_ptr"), {"n": "i32", "stepped": "i32", "per": "i32",
                                                                 "lr": "fp32"}, {"HAS_P": fresh, "UPDATE": fresh}),
            ("res_backproject", ("s_ptr", "x_ptr", "t_ptr", "e_ptr", "tgt_ptr"),
             {"n": "i32", "beta": "fp32", "alpha_a": "fp32", "alpha_e": "fp32", "bt": "fp32"} | act,
             {"HAS_X": fresh, "HAS_E": fresh, "HAS_BETA": fresh})):
        for code in (codes if name != "res_errors" else [None]):
            consts = {**({} if code is None else {"ACT": code}), **flags, "BLOCK": errorpass.BLOCK}
            consts |= {} if name == "res_errors" else {"ACCURATE": True}
            sig = {p: "*fp32" for p in ptrs} | scalars | {k: "constexpr" for k in consts}
            built = triton.compile(ASTSource(fn=getattr(kernels, name), signature=sig, constexprs=consts),
                                   target=GPUTarget("cuda", 90, 32), options=chain.OPTIONS)
            assert f".entry {name}" in built.asm["ptx"], (name, code)


def test_the_kernels_are_built_with_multiply_adds_fused(tmp_path, monkeypatch):
    """chain.OPTIONS, which every launch passes (and the builds above), fuses multiply-adds, as Triton did by default
    before 3.10 and as the kernels were checked on GPUs: a pass of products and sums builds into FMAs with them and
    into none with fusion off (Triton 3.9 warns that its default turns to off; said explicitly, it does not)."""
    from triton.backends.compiler import GPUTarget
    ASTSource = ast_source()

    from pcdist.engine import _chain_kernels as kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    consts = {"HAS_P": True, "UPDATE": True, "BLOCK": errorpass.BLOCK}
    sig = {p: "*fp32" for p in ("u_ptr", "h_ptr", "e_ptr", "p_ptr")} | {"n": "i32", "stepped": "i32", "per": "i32",
                                                                        "lr": "fp32"} | {k: "constexpr" for k in consts}
    fmas = [triton.compile(ASTSource(fn=kernels.res_errors, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"].count("fma.rn.f32")
            for options in (chain.OPTIONS, {"enable_fp_fusion": False})]
    assert fmas[0] > 0 and fmas[1] == 0, fmas


@pytest.mark.parametrize("pool", [0, 1, 2])
def test_the_conv_kernels_compile_for_a_hopper_gpu(pool, tmp_path, monkeypatch):
    """The conv kind's two passes (errorpass.ConvKernel) build for sm_90 without pooling, with max pooling (its
    int8 window offsets) and with average pooling over a 2 x 2 window, every activation's f and f' in one of
    the three (a third of them each: compiling is most of this test's time); with max pooling the convolution's
    output is bfloat16, as under precision="bf16"; the layouts (row-major or channels-last nodes and images,
    PCDIST_CHANNELS_LAST) in turn over the activations."""
    from triton.backends.compiler import GPUTarget
    ASTSource = ast_source()

    from pcdist.engine import _chain_kernels as kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    idx = "*i8" if pool == 1 else "*fp32"
    window = {"KH": 1, "KW": 1} if pool == 0 else {"KH": 2, "KW": 2}
    for name, ptrs, scalars, flags in (
            ("conv_act_pool", {"src_ptr": "*bf16" if pool == 1 else "*fp32", "b_ptr": "*fp32", "a_ptr": "*fp32",
                               "u_ptr": "*fp32", "idx_ptr": idx}, ("n", "C", "H", "W", "PH", "PW"),
             {"HAS_B": pool != 2}),
            ("conv_errors", {"a_ptr": "*fp32", "u_ptr": "*fp32", "h_ptr": "*fp32", "e_ptr": "*fp32",
                             "d_ptr": "*fp32", "idx_ptr": idx, "p_ptr": "*fp32"},
             ("n", "per", "stepped", "C", "H", "W", "PH", "PW"),
             {"HAS_D": True, "UPDATE": pool != 2, "HAS_P": pool != 0})):
        for i, code in enumerate(sorted(set(chain.ACT_CODES.values()) | {8})[pool::3]):
            layout = {"NODE_CL": (i + pool) % 4 >= 2, "SRC_CL": (i + pool) % 2 == 1}
            consts = {"ACT": code, "POOL": pool, **window, **layout, **flags, "ACCURATE": True,
                      "BLOCK": errorpass.BLOCK}
            sig = ptrs | {s: "i32" for s in scalars} | ({"lr": "fp32"} if name == "conv_errors" else {}) | SCALARS
            sig |= {k: "constexpr" for k in consts}
            built = triton.compile(ASTSource(fn=getattr(kernels, name), signature=sig, constexprs=consts),
                                   target=GPUTarget("cuda", 90, 32), options=chain.OPTIONS)
            assert f".entry {name}" in built.asm["ptx"], (name, code)


@pytest.mark.parametrize("prec", ["ieee", "tf32", "bf16"])
def test_the_gemm_kernel_compiles_for_a_hopper_gpu(prec, tmp_path, monkeypatch):
    """The batched GEMM of pcdist/engine/gemm.py builds for sm_90 with each of its tile candidates (in float32, in
    TF32, or on float32 nodes times bfloat16 weights rounded as read, precision="bf16"; a third of them each:
    compiling is this test's time), reading the target or not."""
    from triton.backends.compiler import GPUTarget
    ASTSource = ast_source()

    from pcdist.engine import _chain_kernels as kernels
    from pcdist.engine import gemm

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    sig = {p: "*fp32" for p in ("a_ptr", "b_ptr", "c_ptr", "o_ptr")} | {"M": "i32", "N": "i32", "R": "i32"}
    sig |= {f"s_{o}{d}": "i32" for o in "abco" for d in ("k", "m" if o in "aco" else "r", "r" if o == "a" else "n")}
    sig |= {"alpha": "fp32", "beta": "fp32"}
    if prec == "bf16":
        sig["b_ptr"] = "*bf16"
    for i, (BM, BN, BK, warps) in enumerate(gemm.CONFIGS[["ieee", "tf32", "bf16"].index(prec)::3]):
        consts = {"HAS_C": i % 2 == 0, "PREC": "ieee" if prec == "bf16" else prec, "LOW": prec == "bf16",
                  "EMULATE": False, "BM": BM, "BN": BN, "BK": BK}
        built = triton.compile(ASTSource(fn=kernels.bmm, signature=sig | {k: "constexpr" for k in consts},
                                         constexprs=consts), target=GPUTarget("cuda", 90, 32),
                               options={**chain.OPTIONS, "num_warps": warps})
        assert ".entry bmm" in built.asm["ptx"], (BM, BN, BK)
        assert prec != "bf16" or ".bf16.bf16" in built.asm["ptx"], "bfloat16 tensor-core products"


def test_a_bad_gemm_setting_is_refused_naming_the_allowed_ones(monkeypatch):
    """PCDIST_GEMM picks the products' kernel (pcdist/engine/gemm.py): a value it does not know is an error naming
    the variable and its values, not a silent default."""
    from pcdist.engine import gemm

    monkeypatch.setenv("PCDIST_GEMM", "fast")
    with pytest.raises(ValueError, match=r"PCDIST_GEMM='fast': allowed auto, torch, triton"):
        gemm.functions(torch.zeros(2, 2))


def test_buffers_past_int32_offsets_keep_the_torch_ops(monkeypatch):
    """The Triton kernels index with int32 offsets: a group whose buffers hold more than chain.MAX_ELEMENTS elements
    (width 256, 129 layers, batch 65536: 2^31 + 2^25) keeps the torch ops (a kernel would write outside them),
    one just below runs them. Meta tensors: nothing is allocated."""
    from pcdist.engine.activations import Activation

    if torch.cuda.is_available():  # this worker's kernels made compiled first: Triton reads TRITON_INTERPRET as it
        chain._triton()  # decorates them, so set below at their first import it would leave them interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels' own conditions, as on a GPU
    tanh = Activation("tanh")
    big = torch.empty(129, 65536, 256, device="meta")
    small = torch.empty(chain.MAX_ELEMENTS // (65536 * 256), 65536, 256, device="meta")
    assert big.numel() > chain.MAX_ELEMENTS >= small.numel()
    assert not chain.usable(big, tanh, 129, 256, 256) and chain.usable(small, tanh, small.shape[0], 256, 256)
    assert not errorpass.usable(tanh, big) and errorpass.usable(tanh, small)
