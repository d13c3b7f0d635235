"""The diagnostics (pcdist.diagnose): where theory says PC's weight update is backprop's gradient, the
cosine between them is 1; the numbers of a layer-parallel run (real gloo processes) equal one process;
an inference that blows up is seen and named with its fix (docs/fidelity.md).

Why it matters: the diagnostics are what a user reads to decide whether PC lags backprop because
inference has not converged or is unstable. A cosine that is not exactly 1 where it must be, or that
changes with the layer split, would send them after the wrong setting.
"""

import math

import pytest
import torch

import pcdist
from pcdist.engine.inference import relax
from pcdist.distributed.parallel import Parallel, ParallelDims, init_distributed
from pcdist.engine.diagnostics import classify_inference, stable_x_lr
from spawn import run

DT = torch.float64
DIMS = (5, 7, 6, 7, 3)


def network(precision=None, activation="identity", energy="se", layers=None):
    return pcdist.PCNetwork.from_dims(DIMS, activation=activation, energy=energy, dtype=DT, seed=3,
                                      precision=precision, layers=layers)


def batch(B=8):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, DIMS[0], generator=g, dtype=DT)
    y = torch.eye(DIMS[-1], dtype=DT)[torch.randint(0, DIMS[-1], (B,), generator=g)]
    return x, y


def trainer(net, T, x_lr=0.2, parallel=None):
    return pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=T, x_lr=x_lr, parallel=parallel)


def autograd_backprop(net, x, y, pi_L=1.0):
    """Backprop's gradient of pi_L * mean E_out(u_L(x), y), per layer, by plain autograd on the whole network."""
    from pcdist.service.backprop import bp_loss

    net.zero_grad()
    with torch.enable_grad():
        (pi_L * bp_loss(net.energy, net(x), y)).backward()
    return [torch.cat([p.grad[k].reshape(-1) for p in g.parameters()]) for g in net.groups for k in range(g.K)]


@pytest.mark.parametrize("solver", ["heun", "rk4"])
def test_diagnose_relaxes_with_the_trainers_solver(solver):
    """diagnose (and so the service's x_lr=auto, which chooses a step from it) ran Euler whatever the trainer's
    solver: at a step Euler overshoots it called a run diverging whose own inference settles. Its energy trace is
    the trainer's own (``trainer.trace``), and its cosines are those of the weight update after the trainer's own
    inference (a step of the same solver with the same T, lr 0: its weight gradients)."""
    net = network(activation="tanh")
    x, y = batch()
    tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=4, x_lr=0.9, solver=solver)
    d = pcdist.diagnose(tr, x, y)
    assert d["energy"] == pytest.approx([sum(row) for row in tr.trace(x, y)], rel=1e-12, abs=0)
    bp = autograd_backprop(net, x, y)
    tr.step(x, y)
    pc = [torch.cat([p.grad[k].reshape(-1) for p in g.parameters()]) for g in net.groups for k in range(g.K)]
    assert d["cosine"] == pytest.approx([float(a @ b / (a.norm() * b.norm())) for a, b in zip(pc, bp)], abs=1e-9)


@pytest.mark.parametrize("energy", ["se", "ce"])
def test_at_the_init_only_the_output_layer_moves_and_it_is_backprops(energy):
    """T=0: every hidden error is 0 after the feed-forward init, so PC's update of the output layer is
    backprop's gradient exactly (cos 1, norm ratio 1) and every other layer's is 0."""
    net = network(activation="tanh", energy=energy)
    d = pcdist.diagnose(trainer(net, T=5), *batch(), T=0)
    assert abs(d["cosine"][-1] - 1) < 1e-12 and abs(d["norm_ratio"][-1] - 1) < 1e-12
    assert d["cosine"][:-1] == [0.0] * 3 and d["norm_ratio"][:-1] == [0.0] * 3


def test_a_diagnosis_at_another_t_than_the_trainers_takes_its_own_error_front():
    """pc zeroes the weight gradients of the layers its error front has not reached (L - T, Stage.front); a
    diagnosis after a training step at T = 1 runs its own T = 3, whose front reaches every layer: its numbers
    equal those of a trainer that never stepped (the weights held by a learning rate of 0)."""
    x, y = batch()

    def held(T):
        net = network(activation="tanh")
        return pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=T, x_lr=0.2)

    stepped = held(1)
    stepped.step(x, y)  # its front: layer 3 of 4
    d, fresh = pcdist.diagnose(stepped, x, y, T=3), pcdist.diagnose(held(1), x, y, T=3)
    assert all(c != 0.0 for c in d["cosine"]), d["cosine"]
    assert d["cosine"] == fresh["cosine"] and d["norm_ratio"] == fresh["norm_ratio"]


def test_small_output_precision_and_converged_inference_give_backprops_gradient_in_every_layer():
    """Nudged limit on a linear network: with the output's precision beta -> 0 and inference run to its
    fixed point, e_l / beta -> backprop's delta_l, so cos(PC update, BP gradient) -> 1 and the norm ratio
    -> 1 in every layer (the deviation is O(beta)). beta = 1e-5: cos within 1e-6 of 1."""
    beta = 1e-5
    net = network(precision=[1.0, 1.0, 1.0, beta])
    x, y = batch()
    d = pcdist.diagnose(trainer(net, T=300, x_lr=0.3), x, y)
    for l, (c, r) in enumerate(zip(d["cosine"], d["norm_ratio"]), 1):
        assert abs(c - 1) < 1e-6, f"layer {l}: cos {c}"
        assert abs(r - 1) < 1e-3, f"layer {l}: norm ratio {r}"
    assert d["inference"] == "converging"


def test_the_diagnostics_backprop_is_autograds():
    """cos and norm ratio per layer equal those of two independent references: PC's update from the
    trainer's own fused inference (as a training step hands it to the optimizer) and backprop's gradient
    by plain autograd on the whole network."""
    net = network(activation="gelu", energy="ce")
    x, y = batch()
    tr = trainer(net, T=4)
    d = pcdist.diagnose(tr, x, y)
    bp = autograd_backprop(net, x, y)
    tr2 = trainer(net, T=4)  # PC's update as the trainer hands it to the optimizer, from a real step's inference
    with torch.no_grad():
        st = tr2.stage(len(x))
        st.begin(x, y)
        tr2.parallel.feedforward(st)
        relax(st, tr2.parallel, 4, tr2.x_lr, fused=True, final=True, solver=tr2.solver)
        tr2.parallel.weight_grads(st)
    pc = [torch.cat([p.grad[k].reshape(-1) for p in g.parameters()]) for g in net.groups for k in range(g.K)]
    for l, (a, b) in enumerate(zip(pc, bp)):
        cos = float(a @ b / (a.norm() * b.norm())) if a.norm() > 0 else 0.0
        assert abs(d["cosine"][l] - cos) < 1e-9, l
        assert abs(d["norm_ratio"][l] - (float(a.norm() / b.norm()) if a.norm() > 0 else 0.0)) < 1e-9, l


def _worker(rank, world, layer, T, out):
    init_distributed(timeout_s=60)
    specs = network().specs
    par = Parallel.from_mesh(ParallelDims(world // layer, layer), specs, timeout_s=60)
    net = network(precision=[1.0, 1.0, 1.0, 1e-5], activation="tanh", layers=par.layers)
    x, y = batch()
    rows = torch.tensor_split(torch.arange(len(x)), world // layer)[par.data_rank]
    d = pcdist.diagnose(trainer(net, T=T, parallel=par), x[rows], y[rows], global_batch=len(x))
    if d is not None:
        torch.save(d, out)


@pytest.mark.parametrize("layer,world", [(2, 2)])
def test_any_layer_split_gives_the_numbers_of_one_process(layer, world, tmp_path):
    """Two layer ranks on real gloo processes (the sequential backward crosses the boundary): the energy
    trace, cos, norm ratios and value changes equal one process's to 1e-9 (float64). (A data axis, (2, 4),
    passes too; left out to keep the suite short.)"""
    out = tmp_path / "d.pt"
    run(_worker, world, layer, 6, str(out), timeout=120)
    got = torch.load(out, weights_only=False)
    want = pcdist.diagnose(trainer(network(precision=[1.0, 1.0, 1.0, 1e-5], activation="tanh"), T=6), *batch())
    for key in ("cosine", "norm_ratio", "energy"):
        assert got[key] == pytest.approx(want[key], abs=1e-9, rel=1e-9), key
    for t, (a, b) in enumerate(zip(got["energy_trace"], want["energy_trace"], strict=True)):
        assert a == pytest.approx(b, abs=1e-12, rel=1e-9), f"inference step {t}"
    assert got["value_change"] == pytest.approx(want["value_change"], rel=1e-9)
    assert got["activation_scale"] == pytest.approx(want["activation_scale"], rel=1e-9)


def _choose_worker(rank, world, out):
    from pcdist.service.autostep import choose_x_lr

    init_distributed(timeout_s=60)
    par = Parallel.from_mesh(ParallelDims(world, 1), network().specs, timeout_s=60)
    net = network(activation="tanh", layers=par.layers)
    x, y = batch(7)
    rows = torch.tensor_split(torch.arange(len(x)), world)[par.data_rank]  # 4 and 3 samples
    got = choose_x_lr(trainer(net, T=6, parallel=par), [(x[rows], y[rows])], global_batch=len(x))
    if par.is_logging:
        torch.save(got, out)


def test_pc_x_lr_auto_chooses_on_a_data_axis_with_uneven_shares_as_one_process(tmp_path):
    """pc.x_lr=auto's trials (diagnose per candidate step) on two data ranks holding 4 and 3 of a batch of 7: the
    same cosines to 1e-9 and the same step as one process (backprop's gradient weighed by each rank's own share;
    weighed by the local batch times the ranks, a run chose a step 10 times smaller)."""
    from pcdist.service.autostep import choose_x_lr

    run(_choose_worker, 2, str(tmp_path / "c.pt"), timeout=120)
    chosen, rows = torch.load(tmp_path / "c.pt", weights_only=False)
    want, want_rows = choose_x_lr(trainer(network(activation="tanh"), T=6), [batch(7)])
    assert chosen == want and [r["x_lr"] for r in rows] == [r["x_lr"] for r in want_rows]
    for r, w in zip(rows, want_rows):
        assert r["min_cos"] == pytest.approx(w["min_cos"], abs=1e-9), r["x_lr"]


def test_a_too_large_value_step_makes_the_energy_grow_and_the_fix_is_stable():
    """Gradient descent on the energy with step x_lr diverges once x_lr exceeds 2 / (the largest curvature):
    the trace grows and is called diverging; the suggested x_lr (from the growth rate) is below 2 / lambda
    and, run again, the energy falls."""
    net = network(activation="tanh")
    x, y = batch()
    d = pcdist.diagnose(trainer(net, T=20, x_lr=3.0), x, y)
    e = d["energy"]
    assert d["inference"] == "diverging" and e[-1] > 10 * e[0]
    fix = stable_x_lr(e, 3.0)
    d2 = pcdist.diagnose(trainer(net, T=20, x_lr=fix), x, y)
    assert d2["inference"] != "diverging" and d2["energy"][-1] < d2["energy"][0]


def test_classify_inference():
    """The three states, from their definitions."""
    assert classify_inference([3.0, 2.0, 1.0]) == "converging"
    assert classify_inference([3.0, 4.0, 1.0]) == "oscillating"
    assert classify_inference([3.0, 2.0, 5.0]) == "diverging"
    assert classify_inference([3.0, math.inf]) == "diverging"


def test_the_unstable_warning_needs_the_energy_to_grow_beyond_round_off(tmp_path):
    """At convergence the inference energy stays where it is, up to float32 round-off (9.623e-05 -> 9.623e-05
    was called 'grew, 1x'). A warning then sends the user to change a setting that is fine: only a growth beyond
    round-off (and a non-finite energy) is unstable. Checked on the end-of-run trace, as a run checks it, with the
    run's own logger (its train.log)."""
    from types import SimpleNamespace

    from pcdist.service.diagnostics import check_trace
    from pcdist.service.metrics import RunLogger

    log = RunLogger(tmp_path, {}, SimpleNamespace(name="none", mode="disabled", plots=True), 1, "off")
    flat = [[9.623e-05 * 0.5, 9.623e-05 * 0.5]] * 5 + [[9.623e-05 * 0.5 * (1 + 3e-7), 9.623e-05 * 0.5]]
    assert not check_trace(flat, 0.1, 5, log)
    grows = [[1.0, 1.0], [1.1, 1.0], [1.5, 1.2], [2.5, 1.5]]
    assert check_trace(grows, 0.1, 3, log)
    assert check_trace([[1.0, 1.0], [float("nan"), 1.0]], 0.1, 1, log)
    fits = [[0.0, 0.0], [3e-21, 0.0], [1e-20, 2e-21]]  # a batch fit exactly: round-off, no blow-up (was "grew, 1e+10x")
    assert not check_trace(fits, 0.1, 2, log) and not check_trace([[1e-12, 0.0], [4e-12, 1e-12]], 0.1, 1, log)
    log.close()
    said = [line for line in (tmp_path / "train.log").read_text().splitlines() if "inference is unstable" in line]
    assert len(said) == 2 and "(2 -> 4, 2x)" in said[0] and "nan" in said[1], said


def test_a_resumed_run_logs_each_diagnosis_once(tmp_path):
    """A run resumed from a checkpoint it had trained past (its newest lost: a crash) diagnoses again at the resumed
    step, before its first update: metrics.jsonl held that step's diag/* row twice (diagnostics.jsonl once), and
    wandb with it. Every diagnosed step once, in both files alike."""
    import json
    import shutil

    from pcdist.service.metrics import read_metrics

    run_dir = tmp_path / "run"
    cfg = {"run_dir": str(run_dir), "logger": "none", "logger.plots": False,
           "pc": {"diagnostics": True, "diagnostics_every": 4},
           "trainer": {"max_steps": 8, "ckpt_every": 4, "log_every": 2, "eval_every": 8, "progress": "off"}}
    pcdist.train(cfg)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000008")
    assert pcdist.train(cfg)["step"] == 8  # resumed at step 4
    logged = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if any(k.startswith("diag/") for k in r)]
    recorded = [json.loads(line)["step"] for line in (run_dir / "diagnostics.jsonl").read_text().splitlines()]
    assert 4 in logged and logged == sorted(set(logged)) == recorded, (logged, recorded)
