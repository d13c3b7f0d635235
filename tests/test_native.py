"""The fused CPU error kernel (pcdist/engine/_native.c) against the torch ops it replaces, and
training with it against training without it."""

from __future__ import annotations

import os
import pty
import re
import shutil
import subprocess
import sys

import pytest
import torch

import pcdist
from pcdist.engine import native
from pcdist.engine.activations import Activation

from test_reference import make_batch, make_seq

ACTS = [Activation("tanh"), Activation("sigmoid"), Activation("relu"), Activation("leaky_relu", negative_slope=0.2),
        Activation("hard_tanh", min_val=-0.5, max_val=0.75), Activation("identity"), Activation("gelu"),
        Activation("gelu", approximate="tanh"), Activation("silu"), Activation("softplus"),
        Activation("softplus", beta=2.0, threshold=5.0), Activation("elu"), Activation("elu", alpha=0.5),
        Activation("mish")]
HAVE_CC = shutil.which(os.environ.get("CC") or "cc") is not None


def test_kernel_builds_where_a_compiler_exists():
    """The fast path must not silently fall back on a machine that can build it."""
    if not HAVE_CC:
        pytest.skip("no C compiler on this machine: the engine uses torch ops (tested everywhere else)")
    assert native.library() is not None


def torch_ops(act, a, bias, h, lr, stepped, prec=None):
    """What the kernel computes, as separate torch ops: u = f(a + b); e = pi (h - u); d = e f'(a);
    h[:stepped] -= lr e."""
    pre = a + bias.unsqueeze(1)
    u = act.forward(pre.clone())
    e = h - u if prec is None else (h - u) * prec.view(-1, 1, 1)
    d = torch.empty_like(e)
    act.grad(e, pre, u, out=d)
    h = h.clone()
    if lr is not None:
        h[:stepped] -= lr * e[:stepped]
    return u, e, d, h


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("act", ACTS, ids=lambda a: a.name + ("_tanh" if a.approximate == "tanh" else "")
                         + (f"_beta{a.beta:g}" if a.beta != 1 else "") + (f"_alpha{a.alpha:g}" if a.alpha != 1 else ""))
def test_kernel_equals_torch_ops(act, dtype):
    gen = torch.Generator().manual_seed(0)
    K, B, O = 5, 7, 33  # odd sizes: vector remainders and rows that straddle OpenMP chunks
    a0 = torch.randn(K, B, O, generator=gen, dtype=dtype) * 2
    a0[0, 0, :6] = torch.tensor([0.0, -0.5, 0.75, 1e-30, -1e-30, 3.0], dtype=dtype)  # at the kinks
    a0[0, 1, :6] = torch.tensor([-200.0, -30.0, -2.5, 2.5, 30.0, 200.0], dtype=dtype)  # thresholds, caps, overflow
    bias = torch.randn(K, O, generator=gen, dtype=dtype) * 0.1
    bias[0, :6] = 0
    h0 = torch.randn(K, B, O, generator=gen, dtype=dtype)
    ulp = torch.finfo(dtype).eps
    pis = torch.tensor([0.5, 2.0, 0.0, 1.0, 3.0], dtype=dtype)  # a zero precision switches a layer off
    for fresh, with_d, (lr, stepped), prec in [(f, w, ls, p) for f in (True, False) for w in (True, False)
                                               for ls in ((None, None), (0.3, K), (0.3, K - 2)) for p in (None, pis)]:
        ref_u, ref_e, ref_d, ref_h = torch_ops(act, a0, bias, h0, lr, stepped if lr else K, prec)
        # Not fresh: au holds u, or for gelu (f' needs a) the pre-activation a + b.
        held = (a0 + bias.unsqueeze(1)) if act.needs_input else ref_u
        au = a0.clone() if fresh else held.clone()
        h, e, d = h0.clone(), torch.full_like(h0, 7.0), torch.full_like(h0, 7.0)
        native.Kernel(act, au, h, e, d, bias, u=ref_u.clone(), prec=prec).run(fresh, with_d, lr, stepped)
        tol = dict(atol=16 * ulp, rtol=8 * ulp)  # libm/libmvec vs Sleef tanh, exp: a few ulp
        if act.name == "gelu":  # f' sums nearly cancelling terms: torch and the kernel are each
            tol = dict(atol=128 * ulp, rtol=128 * ulp)  # ~25 ulp from exact, up to ~70 apart
        assert torch.equal(au, a0 if fresh else held), "au is read, never written"
        n = stepped if lr is not None else 0  # the stepped layers do not store e
        assert bool((e[:n] == 7.0).all())
        torch.testing.assert_close(e[n:], ref_e[n:], **tol)
        if not fresh and prec is None:  # e = h - u from the u it is given, exactly: zero errors stay zero
            assert torch.equal(e[n:], (h0 - ref_u)[n:])
        torch.testing.assert_close(h, ref_h, **tol)
        if with_d and act.name == "silu":  # torch's f' = s (1 + x (1 - s)) loses 1 - s to cancellation, up to |x|
            # ulp (x reaches 200 here); the kernel takes 1 - s as sigmoid(-x): held to f' worked in float64
            wide = torch_ops(act, a0.double(), bias.double(), h0.double(), None, K, prec if prec is None else
                             prec.double())[2]
            torch.testing.assert_close(d.double(), wide, atol=16 * ulp, rtol=8 * ulp if dtype == torch.float32
                                       else 256 * ulp)
        elif with_d:
            torch.testing.assert_close(d, ref_d, **tol)
        else:
            assert bool((d == 7.0).all()), "d must be left alone when not asked for"


def test_kernel_rejects_mismatched_buffers():
    if not HAVE_CC:
        pytest.skip("no C compiler")
    a = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="buffer h must be contiguous"):
        native.Kernel(Activation("tanh"), a, torch.zeros(2, 4, 3).transpose(1, 2), a.clone(), a.clone(),
                      torch.zeros(2, 4))
    with pytest.raises(ValueError, match="bias must be contiguous"):
        native.Kernel(Activation("tanh"), a, a.clone(), a.clone(), a.clone(), torch.zeros(2, 5))


def group_acts(acts):
    """The activation of each non-output group: the input layer (6 -> 9, a shape of its own),
    then one group per run of equal activations among the 9 -> 9 layers."""
    runs = [acts[0], acts[1]]
    for a in acts[2:]:
        if a != runs[-1]:
            runs.append(a)
    return runs


def run_training(make_net, algorithm, x_momentum, native_on, monkeypatch, steps=3, free_bottom=False, **kw):
    """3 steps of the net ``make_net()`` builds, with the kernel on or off: energies, value nodes,
    weights, and for each bound group whether it runs the kernel. ``free_bottom``: h_0 inferred
    (unsupervised); ``kw`` goes to the trainer (a precision schedule)."""
    monkeypatch.setenv("PCDIST_NATIVE", "1" if native_on else "0")
    net = make_net()
    trainer = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), T=6, x_lr=0.2,
                               x_momentum=x_momentum, algorithm=algorithm, **kw)
    gen = torch.Generator().manual_seed(5)
    energies = []
    for _ in range(steps):
        x, y = make_batch(8, 6, 4, gen)
        energies.append(trainer.step(None if free_bottom else x, y)["energy"])
    st = trainer.stage(8, free_bottom)
    used = {gr: getattr(gr, "kernel", None) is not None for gr in st.groups if gr.first > 0}
    return energies, trainer.value_nodes(), [p.detach().clone() for p in net.parameters()], used, st


def assert_same_training(on, off):
    assert on[0] == pytest.approx(off[0], abs=1e-12, rel=1e-12)
    for a, b in zip(on[1] + on[2], off[1] + off[2]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("algorithm,x_momentum,energy", [("pc", 0.0, "se"), ("pc", 0.5, "ce"), ("ipc", 0.0, "ce")])
@pytest.mark.parametrize("acts", [["tanh"] * 4, ["relu"] * 4, ["sigmoid"] * 4, ["leaky_relu"] * 4, ["hardtanh"] * 4,
                                  ["identity"] * 4, ["tanh", "gelu", "gelu", "relu"], ["silu", "mish", "mish", "elu"],
                                  ["softplus"] * 4], ids="-".join)
def test_training_with_kernel_equals_torch_ops(acts, algorithm, x_momentum, energy, monkeypatch):
    """float64: the fused kernel (and pc's fused value step) changes nothing beyond round-off,
    also for gelu, whose f' the kernel computes from the pre-activation, beside other groups."""
    make_net = lambda: pcdist.PCNetwork.from_sequential(make_seq([6, 9, 9, 9, 9, 4], acts, seed=3),  # noqa: E731
                                                        energy=energy)
    on, off = (run_training(make_net, algorithm, x_momentum, native, monkeypatch) for native in (True, False))
    hidden = lambda run: [used for gr, used in run[3].items() if gr is not run[4].output]  # noqa: E731
    assert not any(hidden(off)), "PCDIST_NATIVE=0 must select the torch ops"
    assert len(hidden(on)) == len(group_acts(acts)) and all(hidden(on)), "the kernel runs every hidden group"
    assert_same_training(on, off)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("kind", ["dense", "mupc"])
@pytest.mark.parametrize("algorithm,x_momentum", [("pc", 0.0), ("pc", 0.5), ("ipc", 0.0)])
def test_precisions_and_a_free_bottom_with_kernel_equal_torch_ops(kind, algorithm, x_momentum, monkeypatch):
    """float64: per-layer precisions (fused into the kernels), a top-down schedule changing them per step
    and a free h_0 with a learned prior train alike with the kernels and with torch ops."""
    prior, precision = pcdist.Prior(0.5, "learned"), [0.5, 2.0, 1.5, 0.0, 1.0, 1.2]
    if kind == "dense":
        make_net = lambda: pcdist.PCNetwork.from_sequential(  # noqa: E731
            make_seq([6, 9, 9, 9, 9, 9, 4], ["tanh", "gelu", "gelu", "relu", "relu"], seed=4), precision=precision,
            prior=prior)
    else:
        make_net = lambda: pcdist.PCNetwork(pcdist.mupc_specs(6, 9, 6, 4, "tanh"), dtype=torch.float64,  # noqa: E731
                                            seed=2, precision=precision, prior=prior)
    runs = [run_training(make_net, algorithm, x_momentum, native, monkeypatch, free_bottom=True,
                         precision_schedule=pcdist.top_down(0.4)) for native in (True, False)]
    assert any(runs[0][3].values()) and not any(runs[1][3].values())
    assert_same_training(*runs)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("act", ACTS, ids=lambda a: a.name + ("_tanh" if a.approximate == "tanh" else "")
                         + (f"_beta{a.beta:g}" if a.beta != 1 else "") + (f"_alpha{a.alpha:g}" if a.alpha != 1 else ""))
def test_residual_kernel_equals_torch_ops(act, dtype):
    """The residual kind's passes: s = phi(h) (x = h where phi' needs it), e = h_out - u with the
    value step on the first layers, and target = beta target + alpha_a t phi'(h) (+ alpha_e e)."""
    if act.name == "leaky_relu":
        act = Activation("leaky_relu", negative_slope=0.2)
    gen = torch.Generator().manual_seed(1)
    K, B, N = 4, 7, 33
    rand = lambda: torch.randn(K, B, N, generator=gen, dtype=dtype)  # noqa: E731
    h_in, u, h0, t = rand() * 2, rand(), rand(), rand()
    h_in[0, 0, :4] = torch.tensor([0.0, -0.5, 0.75, 1e-30], dtype=dtype)  # at the kinks
    s, x, e = torch.full_like(h_in, 7.0), torch.full_like(h_in, 7.0) if act.needs_input else None, rand()
    h_out = h0.clone()
    k = native.ResidualKernel(act, h_in, s, x, u, h_out, e, t)
    ulp = torch.finfo(dtype).eps
    tol = dict(atol=128 * ulp, rtol=128 * ulp) if act.name == "gelu" else dict(atol=16 * ulp, rtol=8 * ulp)
    k.activate()
    torch.testing.assert_close(s, act.forward(h_in.clone()), **tol)
    if x is not None:
        assert torch.equal(x, h_in)
    for lr, stepped in ((None, K), (0.3, K), (0.3, K - 2)):
        h_out.copy_(h0)
        k.errors(lr, stepped)
        assert torch.equal(e, h0 - u), "e = h - u exactly: zero errors stay zero"
        want = h0.clone()
        if lr is not None:
            want[:stepped] -= lr * (h0 - u)[:stepped]
        torch.testing.assert_close(h_out, want, **tol)
    # With per-layer precisions (one of them 0): e = pi (h - u), and the step takes the weighted error.
    pis = torch.tensor([0.5, 0.0, 2.0, 1.5], dtype=dtype)
    kp = native.ResidualKernel(act, h_in, s, x, u, h_out, e, t, pis)
    for lr, stepped in ((None, K), (0.3, K), (0.3, K - 2)):
        h_out.copy_(h0)
        kp.errors(lr, stepped)
        weighted = (h0 - u) * pis.view(-1, 1, 1)
        torch.testing.assert_close(e, weighted, **tol)
        want = h0.clone()
        if lr is not None:
            want[:stepped] -= lr * weighted[:stepped]
        torch.testing.assert_close(h_out, want, **tol)
    phi_t = act.grad(t, h_in, act.forward(h_in.clone()), out=torch.empty_like(t))  # t * phi'(h_in)
    for beta in (0.0, 1.0, 0.5):
        for skip in (None, e):
            target0 = torch.full_like(t, float("nan")) if beta == 0.0 else rand()
            target = target0.clone()
            k.backproject(target, skip, beta, -0.7, 0.4)
            want = -0.7 * phi_t + (0.0 if skip is None else 0.4 * e) + (0.0 if beta == 0.0 else beta * target0)
            torch.testing.assert_close(target, want, **tol)
    with pytest.raises(ValueError, match="must have the back-projection's shape"):
        k.backproject(torch.zeros(K, B, N + 1, dtype=dtype), None, 0.0, 1.0, 1.0)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("algorithm,x_momentum,energy", [("pc", 0.0, "se"), ("pc", 0.5, "ce"), ("ipc", 0.0, "ce")])
@pytest.mark.parametrize("act", ["relu", "tanh", "gelu"])
def test_mupc_training_with_kernel_equals_torch_ops(act, algorithm, x_momentum, energy, monkeypatch):
    """float64: the residual kind's kernels change nothing beyond round-off."""
    make_net = lambda: pcdist.PCNetwork(pcdist.mupc_specs(6, 9, 6, 4, act), energy=energy,  # noqa: E731
                                        dtype=torch.float64, seed=2)
    on, off = (run_training(make_net, algorithm, x_momentum, native, monkeypatch) for native in (True, False))
    assert all(on[3].values()) and not any(off[3].values()), \
        "the kernel runs every group; PCDIST_NATIVE=0 selects torch ops"
    assert_same_training(on, off)


def test_no_compiler_falls_back_with_a_warning(tmp_path):
    """Without a compiler the engine warns once and trains with torch ops."""
    code = (
        "import warnings, torch, pcdist\n"
        "from pcdist.engine import native\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    assert native.library() is None\n"
        "assert any('no C compiler' in str(x.message) for x in w), [str(x.message) for x in w]\n"
        "seq = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))\n"
        "net = pcdist.PCNetwork.from_sequential(seq)\n"
        "tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=3)\n"
        "s = tr.step(torch.randn(4, 3), torch.eye(2)[[0, 1, 0, 1]])\n"
        "assert all(g.kernel is None for g in tr.stage(4).groups)\n"
        "print('energy', s['energy'])\n"
    )
    env = {**os.environ, "CC": "no-such-compiler-pcdist", "PCDIST_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "energy" in proc.stdout
    assert not list(tmp_path.iterdir()), "nothing is built without a compiler"


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_unusable_cache_folder_builds_in_the_temp_folder_once_for_processes_started_together(tmp_path):
    """A cache folder that cannot be created or written (a read-only home in a container;
    here a path under a plain file, which even root cannot create) must not cost the fast path:
    the kernel is built in the temp folder. Two processes that need it at once (the ranks of a first
    launch) compile it once: the compiler (a wrapper that logs each call) runs once per flag set tried, and both
    load that build. On a terminal the wait is said in a line (compiling, or waiting for the other process);
    in a log, nothing."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    (tmp_path / "tmp").mkdir()
    calls = tmp_path / "cc-calls"
    cc = tmp_path / "cc"
    # The wrapper compiles at -O0 (2 s, not 17): this test is about where and how often the kernel is built, and
    # every other test of the kernel runs the -O3 build of the cache folder.
    cc.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                  f'for a in "$@"; do shift; [ "$a" = -O3 ] && a=-O0; set -- "$@" "$a"; done\n'
                  f'exec {shutil.which(os.environ.get("CC") or "cc")} "$@"\n')
    cc.chmod(0o755)
    code = "from pcdist.engine import native; lib = native.library(); assert lib is not None; print(lib._name)"
    env = {**os.environ, "PCDIST_CACHE_DIR": str(blocker / "cache"), "TMPDIR": str(tmp_path / "tmp"), "CC": str(cc)}
    terminal, its_end = pty.openpty()  # the first process's stderr is a terminal, the second's a pipe (a log)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=err, text=True)
             for err in (its_end, subprocess.PIPE)]
    os.close(its_end)
    outs = [p.communicate(timeout=300) for p in procs]
    shown = b""
    while True:  # what the terminal showed, until the process closed it
        try:
            chunk = os.read(terminal, 4096)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    os.close(terminal)
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    loaded = {out.strip() for out, _ in outs}
    assert len(loaded) == 1 and loaded.pop().startswith(str(tmp_path / "tmp")), outs
    said = shown.decode().strip()  # the compiler's wait, said on the terminal: compiling it, or waiting for the other
    assert said == f"pcdist: compiling the fused CPU kernel for this CPU, once (about 20 s; kept in " \
                   f"{tmp_path / 'tmp' / f'pcdist-{os.getuid()}'})" or \
        said == "pcdist: waiting for another process to compile the fused CPU kernel (once for this CPU)", said
    assert outs[1][1] == "", "nothing in a log"
    tried = [re.sub(r" -o \S+", "", line) for line in calls.read_text().splitlines()]  # one per flag set it tried
    assert tried and len(tried) == len(set(tried)), f"each build compiled once, not once per process: {tried}"


def test_a_first_layer_parallel_launch_compiles_the_kernel_before_the_ranks_meet(tmp_path):
    """The kernel was compiled in the first step, where a layer neighbour waits for it only parallel.timeout_s:
    a launch on a new machine (or after an upgrade) with a short timeout failed ("feed-forward receive with rank 0
    ... timed out"), and so did every torchrun restart (each killed the compile). Every rank builds it (or waits
    for the one that does) before the process group is made. The compiler here takes 8 s more than the timeout
    (a wrapper that waits, then compiles at -O0), whatever the machine's speed."""
    from test_service import ROOT

    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\nsleep 8\nfor a in "$@"; do shift; [ "$a" = -O3 ] && a=-O0; set -- "$@" "$a"; done\n'
                  f'exec {shutil.which(os.environ.get("CC") or "cc")} "$@"\n')
    cc.chmod(0o755)
    env = {**os.environ, "PCDIST_CACHE_DIR": str(tmp_path / "cache"), "CC": str(cc), "OMP_NUM_THREADS": "1",
           "PCDIST_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(ROOT / "train.py"), "parallel.layer=2", "parallel.timeout_s=4", "trainer.max_steps=2",
                          "logger=none", "logger.plots=false", "trainer.progress=off",
                          f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step-00000002" / "manifest.json").is_file()
    assert list((tmp_path / "cache").glob("pcdist_native_*.so")), "the kernel was built (and used)"
