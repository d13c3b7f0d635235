"""On a CUDA device, the step replayed as CUDA graphs equals the eager step (docs/gpu.md).

These run wherever CUDA is present and skip elsewhere (tests/test_capture.py proves on a CPU what a
CPU can: no host reads, device-side schedules and skips equal to host ones). Here, in float64:

* for every layer kind and mode of tests/test_capture.py (pc and ipc, a learning-rate schedule whose
  rates keep changing after the captures, value noise, skip_above with an update skipped inside a
  replayed step, momentum, free ends), 10 steps alternating two batch sizes (two stages, two captured
  programs) with ``compile="graph"`` equal ``compile="none"``;
* the replayed step dispatches a handful of host ops whatever the depth (host work O(1) per step);
* through the service (``pcdist.train``), graph and none give the same metrics, and a run resumed
  under a captured step continues exactly;
* precision="bf16": its products written in float32 by cuBLAS equal float64 arithmetic on their bfloat16
  operands to float32 rounding; a float32 or bf16 step replayed equals the eager step; the batched GEMM is
  chosen once per shape (cuBLAS or Triton) and agrees with cuBLAS; so is a conv group's grouped convolution.

The learning rates are chosen exactly representable in float32 (the fused kernels read a captured
step's rate as a float32 tensor); a cosine schedule's rates are not, so there the runs agree to the
rounding of the rate (|dw| <= steps x lr x 2^-24 per weight, here below 1e-9).
"""

from __future__ import annotations

import math

import pytest
import torch

import pcdist
from pcdist.engine.capture import HostReads
from test_capture import CASES, batch, network

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DT = torch.float64
LR = 2.0 ** -7  # exactly representable in float32


STEPS = 8  # alternating two batch sizes: each stage's 4th call is captured (eager, checked, warm-up, captured)


def assert_captured(tr, compile: str) -> None:
    """A graph run's two stages were both captured (and replayed): nothing fell back to eager."""
    if compile == "graph":
        assert tr.runner.eager == {} and len(tr.runner.programs) == 2, (tr.runner.eager, len(tr.runner.programs))


def cuda_trainer(net, compile: str, opts: dict, steps: int, T: int = 4, schedule: str = "cycle"):
    opts = dict(opts)
    sched_on = opts.pop("lr_schedule", False)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=2.0 ** -6, fused=True)
    per = T if opts.get("algorithm") == "ipc" else 1
    sched = None
    if sched_on and schedule == "cycle":  # rates 2^-7, 2^-8, 2^-9, again and again: exact in float32, and changing
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 2.0 ** -(s % 3))  # after the captures too
    elif sched_on:
        sched = pcdist.warmup_cosine(opt, 2, steps * per)
    notes = []
    tr = pcdist.PCTrainer(net, opt, T=T, x_lr=0.1, scheduler=sched, compile=compile, noise_seed=4, say=notes.append,
                          **opts)
    return tr, notes


def trajectory(name: str, compile: str, steps: int = 10, schedule: str = "cycle"):
    """Every step's stats, weights and value nodes. With skip_above, step 8 (a replay) has a NaN in its input, so that
    its update is skipped on the device (a non-finite energy) inside a replayed step."""
    kind, net_kw, opts, ends = CASES[name]
    net = network(kind, **net_kw).cuda()
    tr, notes = cuda_trainer(net, compile, opts, steps, schedule=schedule)
    out = []
    for s in range(steps):
        x, y = batch(net, ends, 6 if s % 2 else 10, 100 + s)
        x = None if x is None else x.cuda()
        y = None if y is None else y.cuda()
        if s == 8 and opts.get("skip_above") is not None:
            x = x.clone()
            x.view(-1)[0] = math.nan
        stats = tr.step(x, y, log=s % 3 == 2)
        out.append((stats, [p.detach().clone() for p in net.parameters()], tr.value_nodes()))
    torch.cuda.synchronize()
    return tr, notes, out


@pytest.mark.parametrize("name", list(CASES))
def test_the_replayed_step_equals_the_eager_step(name):
    """Two batch sizes, so two stages each warmed up, captured and replayed; every step's weights, value
    nodes and logged energies equal the eager run's (conv: cuDNN's float64 kernels to 1e-10)."""
    tr_g, notes, graph = trajectory(name, "graph")
    tr_e, _, eager = trajectory(name, "none")
    assert notes == [] and tr_g.runner.eager == {}
    assert len(tr_g.runner.programs) == 2, "both stages were captured"
    if CASES[name][2].get("skip_above") is not None:  # step 8's update, skipped in a replay (ipc: each of its T)
        per = 4 if CASES[name][2].get("algorithm") == "ipc" else 1
        assert tr_g.skipped_updates == tr_e.skipped_updates == per
    atol = 1e-10 if name.startswith("conv") else 1e-12
    for s, ((st_g, w_g, h_g), (st_e, w_e, h_e)) in enumerate(zip(graph, eager)):
        for a, b in zip(w_g + h_g, w_e + h_e):
            torch.testing.assert_close(a, b, atol=atol, rtol=0, equal_nan=True, msg=lambda m: f"step {s}: {m}")
        if st_e:
            assert st_g["layer_energies"] == pytest.approx(st_e["layer_energies"], abs=atol, rel=0, nan_ok=True)


def test_a_cosine_schedule_agrees_to_the_float32_rounding_of_its_rates():
    name = "mlp-ipc-ce-momentum-schedule-skip"
    tr_g, _, graph = trajectory(name, "graph", schedule="cosine")
    assert_captured(tr_g, "graph")
    _, _, eager = trajectory(name, "none", schedule="cosine")
    bound = 10 * 4 * LR * 2.0 ** -24 * 4  # steps x updates per step x lr x float32 rounding, Adam's |m/sqrt(v)| <~ 4
    for (_, w_g, _), (_, w_e, _) in zip(graph, eager):
        assert max(float((a - b).abs().max()) for a, b in zip(w_g, w_e)) <= bound


@pytest.mark.parametrize("hidden", [2, 64])
def test_a_replayed_step_costs_the_host_the_same_whatever_the_depth(hidden):
    """Once captured, a step dispatches only its batch copies and the replay: the same handful of ops
    for 2 hidden layers as for 64, and none of them reads the device."""
    net = pcdist.PCNetwork.from_dims([32] + [64] * hidden + [10], "tanh", seed=0, device="cuda")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    tr = pcdist.PCTrainer(net, opt, T=20, x_lr=0.1, scheduler=pcdist.warmup_cosine(opt, 5, 100), compile="graph")
    x, y = torch.randn(64, 32, device="cuda"), torch.eye(10, device="cuda")[torch.arange(64) % 10]
    for _ in range(5):
        tr.step(x, y, log=False)
    with HostReads(strict=False) as reads:
        tr.step(x, y, log=False)
    torch.cuda.synchronize()
    assert reads.reads == [] and len(tr.runner.programs) == 1
    assert reads.ops <= 25, reads.by_op


@pytest.mark.parametrize("gemm", ["torch", "triton"])
def test_bf16_products_are_written_in_float32_by_the_gemm(gemm, monkeypatch):
    """precision="bf16" on a GPU: the products of bfloat16 operands are written in float32 by cuBLAS itself
    (base.f32_products, torch's out_dtype; PCDIST_GEMM=torch) or by the Triton GEMM, which rounds the float32
    operand as it reads it (gemm.low_product; PCDIST_GEMM=triton), so they equal float64 arithmetic on the same
    bfloat16 operands to float32 rounding, where a bfloat16 product copied into float32 is off by bfloat16's
    (2^-9); the in-place accumulation (the back-projection) too, beta 0 ignoring the target's old contents."""
    from pcdist.engine import gemm as products
    from pcdist.engine.layers.base import accumulate_product, f32_products, product_into

    monkeypatch.setenv("PCDIST_GEMM", gemm)
    products._CHOICE.clear()
    if gemm == "torch" and not hasattr(torch.ops.aten.baddbmm, "dtype_out"):
        pytest.skip(f"torch {torch.__version__} has no float32 output for bfloat16 products")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(3, 64, 128, generator=g, device="cuda")
    w = torch.randn(3, 128, 96, generator=g, device="cuda").bfloat16()
    bias = torch.randn(3, 1, 96, generator=g, device="cuda")
    exact = torch.bmm(a.bfloat16().double(), w.double())
    f32_ok = f32_products(a)
    assert f32_ok or gemm == "triton"

    def err(out, want):
        return float(((out.double() - want) / want.abs().max()).abs().max())

    for f32, bound in ((f32_ok, 1e-6), (False, 2.0 ** -8 if gemm == "torch" else 1e-6)):
        out = torch.full((3, 64, 96), float("nan"), device="cuda")
        product_into(out, a, w, f32, bias, 0.5)
        assert err(out, 0.5 * (exact + bias.double())) <= bound, f32
        t = torch.randn(3, 64, 96, generator=g, device="cuda")
        want = 0.75 * t.double() - 0.25 * exact
        accumulate_product(t, a, w, 0.75, -0.25, f32)
        assert err(t, want) <= bound, f32
    one = torch.full((64, 96), float("nan"), device="cuda")  # one layer (the feed-forward chain's [B, I] operands)
    product_into(one, a[0], w[0], f32_ok, bias[0, 0], 0.5)
    assert err(one, 0.5 * (exact[0] + bias[0].double())) <= (1e-6 if f32_ok else 2.0 ** -8)
    out = torch.full((3, 64, 96), float("nan"), device="cuda")
    accumulate_product(out, a, w, 0.0, 1.0, f32_ok)
    assert err(out, exact) <= 1e-6, "beta 0: the NaNs in the target are not read"
    if gemm == "torch":
        product_into(out, a, w, False)
        assert err(out, exact) > 1e-6, "the bfloat16 product is rounded: the test can tell the two apart"
    else:
        assert any(k[5] == torch.bfloat16 and c is not None for k, c in products._CHOICE.items()), "Triton ran"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["mlp", "mupc", "conv"])
def test_a_float32_or_bf16_step_replayed_equals_the_eager_step(kind, precision):
    """float32 nodes captured and replayed (two batch sizes), where pcdist's own kernels run (the Triton GEMM where
    it was timed faster, the elementwise kernels; bf16: the bfloat16 products, float32 outputs on a GPU): the
    nodes and master weights follow the eager run exactly (conv: cuDNN's kernels may sum in another order when
    captured, as in float64 above, so the energies to 1e-3), and bf16 stays near float32."""
    def run(compile: str, precision: str):
        net = network(kind, dtype=torch.float32).cuda()
        opt = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)
        tr = pcdist.PCTrainer(net, opt, T=4, x_lr=0.1, precision=precision, compile=compile)
        out = []
        for s in range(STEPS):
            x, y = batch(net, "xy", 6 if s % 2 else 10, 100 + s, dtype=torch.float32)
            out.append((tr.step(x.cuda(), y.cuda())["energy"], [p.detach().clone() for p in net.parameters()]))
        torch.cuda.synchronize()
        assert_captured(tr, compile)
        return out

    graph, eager, fp32 = run("graph", precision), run("none", precision), run("none", "fp32")
    for (e_g, w_g), (e_e, w_e), (e_f, _) in zip(graph, eager, fp32):
        if kind == "conv":
            assert e_g == pytest.approx(e_e, rel=1e-3)
        else:
            assert e_g == e_e and all(torch.equal(a, b) for a, b in zip(w_g, w_e))
        assert e_g == pytest.approx(e_f, rel=0.05)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_channels_last_conv_nodes_replay_as_eager_and_follow_the_row_major_run(precision, monkeypatch):
    """PCDIST_CHANNELS_LAST=1 on a GPU (cuDNN's NHWC convolutions, the conv kernels' channels-last variants): a
    float32 / TF32 / bf16 conv net's step replayed equals its eager step, and the run follows the row-major one
    to the convolutions' round-off (other cuDNN algorithms sum in another order)."""
    from pcdist.engine.models import conv_specs
    from pcdist.engine.nodes import is_channels_last

    def run(compile: str, channels_last: str):
        monkeypatch.setenv("PCDIST_CHANNELS_LAST", channels_last)  # nodes 0-2 channels-last, node 3 (a vector) not
        net = pcdist.PCNetwork(conv_specs((3, 8, 8), [(8, 3, 1, "max"), (8, 3, 1, "max")], [], 4, "relu"),
                               energy="ce", seed=1, device="cuda")
        opt = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)
        tr = pcdist.PCTrainer(net, opt, T=4, x_lr=0.1, precision=precision, compile=compile)
        out = []
        for s in range(STEPS):
            x, y = batch(net, "xy", 6 if s % 2 else 10, 100 + s, dtype=torch.float32)
            out.append(tr.step(x.cuda(), y.cuda())["energy"])
        torch.cuda.synchronize()
        assert_captured(tr, compile)
        return out, tr.stage(10)

    (graph, st), (eager, _), (rows, st_rows) = run("graph", "1"), run("none", "1"), run("graph", "0")
    assert [is_channels_last(st.node(n)) for n in range(4)] == [True, True, True, False]
    assert not any(is_channels_last(st_rows.node(n)) for n in range(4))
    assert graph == pytest.approx(eager, rel=1e-3)
    assert graph == pytest.approx(rows, rel=1e-3 if precision == "fp32" else 1e-2)


def test_the_gemm_is_chosen_once_per_shape_and_agrees_with_cublas(monkeypatch):
    """PCDIST_GEMM=auto on a GPU: the first product of a shape times cuBLAS against the Triton tiles and keeps the
    faster (pcdist/engine/gemm.py); the next product of that shape decides nothing again, and either way the
    result is cuBLAS's to round-off (a deep narrow group's shape: 128 layers of 64 x 128 by 128 x 128)."""
    from pcdist.engine import gemm

    monkeypatch.setenv("PCDIST_GEMM", "auto")
    h, w = torch.randn(128, 64, 128, device="cuda"), torch.randn(128, 128, 128, device="cuda") / 12
    out = torch.empty(128, 64, 128, device="cuda")
    _, bmm = gemm.functions(h)
    assert bmm is gemm.bmm
    bmm(h, w, out=out)
    decided = dict(gemm._CHOICE)
    bmm(h, w, out=out)
    assert gemm._CHOICE == decided and len(decided) >= 1
    torch.testing.assert_close(out, torch.bmm(h, w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_a_conv_groups_grouped_convolution_is_chosen_once_and_replays_as_the_layer_by_layer_step(precision,
                                                                                               monkeypatch):
    """PCDIST_CONV_GROUPED on a GPU: ``auto`` times a deep conv stack's group (15 equal 16-channel layers) grouped
    against layer by layer once per shape (two batch sizes: two) and keeps its choice; forced grouped (``1``), the
    step replayed equals its eager step and follows the layer-by-layer run to the convolutions' round-off."""
    from pcdist.engine.layers import conv
    from pcdist.engine.models import conv_specs

    def run(mode: str, compile: str):
        monkeypatch.setenv("PCDIST_CONV_GROUPED", mode)
        net = pcdist.PCNetwork(conv_specs((3, 12, 12), [(16, 3, 1, None)] * 16, [], 4, "relu"), energy="ce", seed=1,
                               device="cuda")
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=LR, fused=True), T=4, x_lr=0.05,
                              precision=precision, compile=compile)  # fused: a plain SGD reads its rate on the host
        out = []
        for s in range(STEPS):
            x, y = batch(net, "xy", 6 if s % 2 else 10, 100 + s, dtype=torch.float32)
            out.append(tr.step(x.cuda(), y.cuda())["energy"])
        torch.cuda.synchronize()
        assert_captured(tr, compile)
        return out, [g.grouped is not None for g in tr.stage(10).groups if g.K > 1]

    conv._GROUPED.clear()
    _, chosen = run("auto", "graph")
    decided = dict(conv._GROUPED)  # one choice per shape: batches of 6 and 10
    assert len(decided) == 2 and chosen[0] in decided.values(), (decided, chosen)
    run("auto", "none")
    assert conv._GROUPED == decided, "a shape seen before is not timed again"
    (graph, on), (eager, _), (layers, off) = run("1", "graph"), run("1", "none"), run("0", "graph")
    assert on == [True] and off == [False]
    assert graph == pytest.approx(eager, rel=1e-3)
    assert graph == pytest.approx(layers, rel=1e-3 if precision == "fp32" else 2e-2)


def test_a_value_step_or_noise_changed_after_the_capture_is_the_one_replayed():
    """trainer.x_lr set after the step was captured (pc.x_lr=auto sets it; a user may), then value_noise: the next
    steps replay a capture of the new step (one per x_lr and noise), equal to the eager trainer's to float64
    round-off (the noise turned off adds none)."""
    def run(compile: str):
        net = network("mlp").cuda()
        tr, _ = cuda_trainer(net, compile, {"value_noise": 0.1}, 14)
        out = []
        for s in range(14):
            if s == 6:
                tr.x_lr = 0.025
            if s == 10:
                tr.value_noise = 0.0
            x, y = batch(net, "xy", 8, 100 + s)
            out.append(tr.step(x.cuda(), y.cuda())["energy"])
        return out, tr

    (graph, tr), (eager, _) = run("graph"), run("none")
    assert graph == pytest.approx(eager, rel=1e-9, abs=1e-12)
    assert len(tr.runner.programs) == 3, "a capture per value step and noise"


def test_a_parameter_frozen_or_unfrozen_after_the_capture_is_so_in_the_replayed_steps():
    """A layer's weight frozen after the step was captured, then unfrozen: the steps between leave it alone, as eager
    steps do (the capture of the step with it trainable would update it), and the rest train it again. Its .grad,
    set to None while it was frozen (and every .grad, by a zero_grad() between steps), is the one the captured
    step writes again once replayed: it wrote the tensor it was captured with, freed by then (review)."""
    def run(compile: str):
        net = network("mlp").cuda()
        tr, _ = cuda_trainer(net, compile, {}, 18)
        weight = next(p for p in net.parameters() if p.dim() >= 2)
        out = []
        for s in range(18):
            if s in (6, 10):
                weight.requires_grad_(s == 10)
            if s == 14:
                tr.optimizer.zero_grad()
            x, y = batch(net, "xy", 8, 100 + s)
            out.append((tr.step(x.cuda(), y.cuda())["energy"], None if weight.grad is None else weight.grad.clone()))
            if s == 6:
                held = weight.detach().clone()
            if s == 9:
                assert torch.equal(weight, held), f"compile={compile}: a frozen weight changed"
        return out, tr

    (graph, tr), (eager, _) = run("graph"), run("none")
    assert [e for e, _ in graph] == pytest.approx([e for e, _ in eager], rel=1e-9, abs=1e-12)
    for s, ((_, g), (_, e)) in enumerate(zip(graph, eager)):
        assert (g is None) == (e is None) and (g is None or torch.allclose(g, e, rtol=1e-9, atol=1e-12)), s
    assert len(tr.runner.programs) == 2, "a capture with the weight trainable and one with it frozen"


class _HostTensor(torch.nn.Module):
    """A layer whose forward makes a tensor from host data (a pageable copy to the device): the step's check finds
    no host read, and its capture fails (CUDA refuses the copy inside a graph)."""

    def __init__(self, n: int):
        super().__init__()
        self.lin = torch.nn.Linear(n, n, dtype=DT)

    def forward(self, h):
        return torch.tanh(self.lin(h)) * torch.tensor([1.0], dtype=h.dtype, device=h.device)


def test_a_capture_that_fails_runs_the_step_eagerly_and_says_why():
    """The capture of a step CUDA refuses fails; the step runs eagerly from then on, said in one line, and trains as
    compile="none" (the failed capture was ended on another stream than its own: CUDA refused that too, leaving the
    runner's stream capturing, and every later step raised)."""
    def run(compile: str):
        torch.manual_seed(0)
        layers = [torch.nn.Sequential(torch.nn.Linear(6, 8, dtype=DT), torch.nn.Tanh()), _HostTensor(8),
                  torch.nn.Linear(8, 4, dtype=DT)]
        net = pcdist.PCNetwork.from_layers(layers).cuda()
        tr, notes = cuda_trainer(net, compile, {}, 6)
        return [tr.step(*(t.cuda() for t in batch(net, "xy", 8, 100 + s)))["energy"] for s in range(6)], notes, tr

    (graph, notes, tr), (eager, _, _) = run("graph"), run("none")
    assert graph == pytest.approx(eager, rel=1e-9, abs=1e-12)
    assert len(notes) == 1 and notes[0].startswith("compile=graph: the training step at batch size 8 runs eagerly: "
                                                   "capturing it failed: "), notes
    assert tr.runner.programs == {}


def test_inference_at_more_step_counts_than_a_runner_keeps_drops_the_oldest_and_captures_it_again():
    """infer at MAX_PROGRAMS + 3 step counts T, each called until captured: the runner keeps MAX_PROGRAMS captures
    (the least recently replayed go, their graphs and memory with them); the first T, dropped, is captured again
    at its first call back (its warm-up done before) and still equals eager inference."""
    from pcdist.engine.capture import MAX_PROGRAMS

    nets = [network("mlp").cuda(), network("mlp").cuda()]
    (tr, notes), (eager, _) = (cuda_trainer(net, compile, {}, 1) for net, compile in zip(nets, ("graph", "none")))
    x, _ = batch(nets[0], "xy", 8, 0)
    Ts = list(range(1, MAX_PROGRAMS + 4))
    for i, T in enumerate(Ts):
        for _ in range(4):  # eager, checked, warm-up, captured
            tr.infer(x.cuda(), None, T=T)
        assert len(tr.runner.programs) == min(i + 1, MAX_PROGRAMS)
    got = tr.infer(x.cuda(), None, T=1)
    assert notes == [] and tr.runner.eager == {}
    assert [k[2] for k in tr.runner.programs] == [*Ts[-(MAX_PROGRAMS - 1):], 1]
    want = eager.infer(x.cuda(), None, T=1)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(got, want))


@pytest.mark.parametrize("name", ["mlp-ipc-ce-momentum-schedule-skip", "generative-pc-noise-skip"])
def test_a_stage_evicted_and_made_again_is_captured_again_and_trains_as_eager(name):
    """max_stages = 1 and blocks of 5 steps at batch sizes 6, 10, 6: each block's stage is made anew (the other
    evicted with its captured step), captured at its 4th step and replayed at its 5th, and the run equals eager
    (the optimizer made capturable again, its learning-rate table, the skip, the noise generator registered with
    the new graphs)."""
    kind, net_kw, opts, ends = CASES[name]
    runs = {}
    for compile in ("graph", "none"):
        net = network(kind, **net_kw).cuda()
        tr, notes = cuda_trainer(net, compile, opts, 15)
        tr.max_stages = 1
        energies = []
        for s in range(15):
            x, y = (t.cuda() for t in batch(net, ends, 10 if s // 5 == 1 else 6, 100 + s))
            energies.append(tr.step(x, y)["energy"])
            if compile == "graph" and s % 5 == 4:
                assert len(tr._stages) == 1 and len(tr.runner.programs) == 1, "this block's step captured"
        runs[compile] = energies, [p.detach().clone() for p in net.parameters()], notes
    (eg, wg, notes), (ee, we, _) = runs["graph"], runs["none"]
    assert notes == [] and eg == pytest.approx(ee, rel=1e-9, abs=1e-12)
    assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(wg, we))


@pytest.mark.parametrize("stepped", [False, True])
@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam])
def test_a_default_adam_is_captured_and_replays_as_eager(optimizer, stepped):
    """A non-fused Adam / AdamW / NAdam (torch's default) is made capturable, before its state exists or after it
    stepped (its counters, NAdam's mu_product too, kept on the host then): both stages are captured (none falls
    back to eager) and replay the eager run to the float32 rounding of its bias corrections."""
    def run(compile: str):
        net = network("mlp").cuda()
        notes = []
        opt = optimizer(net.parameters(), lr=LR)
        if stepped:
            for p in net.parameters():
                p.grad = torch.zeros_like(p)
            opt.step()
        tr = pcdist.PCTrainer(net, opt, T=4, x_lr=0.1, compile=compile, say=notes.append, skip_above=1e6)
        out = []
        for s in range(8):
            x, y = batch(net, "xy", 6 if s % 2 else 10, 100 + s)
            out.append(tr.step(x.cuda(), y.cuda())["energy"])
        return out, tr, notes

    (graph, tr, notes), (eager, *_) = run("graph"), run("none")
    assert notes == [] and tr.runner.eager == {} and len(tr.runner.programs) == 2
    # the capturable update computes its bias corrections from a float32 step count (eager: Python floats)
    assert graph == pytest.approx(eager, rel=1e-6)
    # the optimizer keeps its own capturable=False: its state_dict loads into a CPU optimizer, which steps
    opt = tr.update.optimizer
    assert [g["capturable"] for g in opt.param_groups] == [False] * len(opt.param_groups)
    cpu = network("mlp")
    again = optimizer(cpu.parameters(), lr=LR)
    again.load_state_dict(opt.state_dict())
    for p in cpu.parameters():
        p.grad = torch.ones_like(p)
    again.step()
    assert all(torch.isfinite(p).all() for p in cpu.parameters())


def test_the_service_trains_alike_captured_and_eager(tmp_path, capsys):
    """pcdist.train on the GPU in float64 with a schedule, logging and skips: compile=graph and none log the
    same energies and reach the same accuracy (graph's logged steps replayed: a perf/replay_s, and no line of a
    stage run eagerly); a captured run stopped and resumed ends where it would have."""
    from pcdist.service.metrics import read_metrics

    common = {"logger": "none", "trainer": {"device": "cuda", "dtype": "float64", "max_steps": 24, "log_every": 4,
                                            "eval_every": 12, "ckpt_every": 12, "on_divergence": "skip",
                                            "max_energy": 1e6, "progress": "off"}}

    def train(compile: str, where: str, **trainer):
        cfg = {**common, "run_dir": str(tmp_path / where)}
        cfg["trainer"] = {**common["trainer"], "compile": compile, **trainer}
        return pcdist.train(cfg)

    g, e = train("graph", "graph"), train("none", "none")
    assert "compile=graph:" not in capsys.readouterr().out
    replayed = [row for row in read_metrics(tmp_path / "graph" / "metrics.jsonl") if "perf/replay_s" in row]
    assert replayed and not [row for row in read_metrics(tmp_path / "none" / "metrics.jsonl") if "perf/replay_s" in row]
    assert g["val/accuracy"] == pytest.approx(e["val/accuracy"], abs=1e-12)
    from pcdist.service.evaluate import evaluate  # the trained run back on the GPU: its logged accuracy

    assert evaluate(tmp_path / "graph", device="cuda", write=False)["accuracy"] == pytest.approx(g["val/accuracy"],
                                                                                                abs=1e-12)
    # the schedule's cosine rates reach the captured fused AdamW rounded to float32 (its rate is a float32
    # tensor): each weight moves by at most steps x lr x 2^-24 more, far below the step's own change
    assert g["train/energy"] == pytest.approx(e["train/energy"], rel=1e-6)
    train("graph", "stopped", stop_at=12)
    resumed = train("graph", "stopped")
    assert resumed["step"] == 24 and resumed["val/accuracy"] == pytest.approx(g["val/accuracy"], abs=1e-12)
    assert math.isfinite(resumed["train/energy"])
