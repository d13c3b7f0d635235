"""The step's core is capturable, proven on a CPU (docs/gpu.md).

A step captured as a CUDA graph replays exactly what its capture recorded: any value the host reads
in it, any branch on a device value, any learning rate or seed held in a Python number would be
frozen. So the core must read nothing on the host between log points, and every decision a real
run takes inside a step (the learning rate schedule, skipping a diverged update, value noise,
precision schedules) must happen on the device with the same result as on the host:

* every layer kind and mode, pc and ipc, with a schedule, skips, noise and momentum, every value optimizer,
  solver and init near equilibrium: a step with
  ``log=False`` reads nothing on the host (counted with pcdist.engine.capture.HostReads, which
  treats every tensor as a device tensor), and ``compile="graph"`` finds nothing to fall back on;
* ``compile="graph"`` (the capturable core: learning rates read from a device table, the skip
  decided on the device) equals ``compile="none"`` bit for bit, and its learning rates equal the
  float schedule's to 1e-15;
* the device-side skip equals a host decision made in the test from the step's logged energy, for
  an optimizer that skips by itself (fused AdamW / SGD) and one restored by mask (SGD with momentum);
* a module that branches on a value of its input falls back to eager with one line naming why;
* bfloat16 steps stay within bfloat16's rounding of float32 steps, with float32 master weights.
"""

from __future__ import annotations

import copy
import gc
import math
import weakref

import pytest
import torch
from torch import nn

import pcdist
from pcdist.engine.capture import HostReads
from pcdist.engine.layers.prior import Prior
from pcdist.engine.schedules import top_down

DT = torch.float64


class Gated(nn.Module):
    """A LayerNorm + Linear block: the module kind (autograd VJPs, vmapped over the stack)."""

    def __init__(self, n):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(n), nn.Linear(n, n)

    def forward(self, h):
        return torch.tanh(self.lin(self.norm(h)))


class Branchy(nn.Module):
    """A layer with data-dependent control flow: it reads a value of its input on the host."""

    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, h):
        return torch.tanh(self.lin(h)) if h.sum() > 0 else torch.relu(self.lin(h))


def network(kind: str, dtype=DT, **kw):
    torch.manual_seed(3)
    if kind == "mlp":
        return pcdist.PCNetwork.from_dims([6, 8, 8, 8, 4], "tanh", dtype=dtype, seed=1, **kw)
    if kind == "mupc":
        return pcdist.PCNetwork(pcdist.mupc_specs(6, 8, 6, 4, "relu"), dtype=dtype, seed=1, **kw)
    if kind == "conv":
        seq = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(3, 3, 3, padding=1),
                            nn.Tanh(), nn.Flatten(), nn.Linear(48, 4)).to(dtype)
        return pcdist.PCNetwork.from_sequential(seq, input_shape=(1, 8, 8), **kw)
    if kind == "module":
        layers = [nn.Sequential(nn.Linear(6, 8), nn.Tanh()), Gated(8), Gated(8), nn.Linear(8, 4)]
        return pcdist.PCNetwork.from_layers([m.to(dtype) for m in layers], **kw)
    if kind == "branchy":
        layers = [nn.Sequential(nn.Linear(6, 8), nn.Tanh()), Branchy(8), nn.Linear(8, 4)]
        return pcdist.PCNetwork.from_layers([m.to(dtype) for m in layers], **kw)
    raise ValueError(kind)


# name: (network, its options, trainer options, which ends are clamped: "xy" supervised, "y" free h_0,
#        "x" free h_L, "onehot-y" generative)
CASES = {
    "mlp-pc-se": ("mlp", {}, {}, "xy"),
    "mlp-ipc-ce-momentum-schedule-skip": ("mlp", dict(energy="ce"), dict(algorithm="ipc", x_momentum=0.5,
                                                                         skip_above=1e6, lr_schedule=True), "xy"),
    "mupc-pc-top-down-precisions": ("mupc", dict(precision=0.5), dict(precision_schedule=top_down(0.3)), "xy"),
    "conv-pc-ce-momentum": ("conv", dict(energy="ce"), dict(x_momentum=0.3), "xy"),
    "module-ipc-se": ("module", {}, dict(algorithm="ipc"), "xy"),
    "generative-pc-noise-skip": ("mlp", dict(energy="bce"), dict(value_noise=0.05, skip_above=1e6), "onehot-y"),
    "unsupervised-learned-prior-noise-schedule": ("mlp", dict(prior=Prior(0.5, "learned")),
                                                  dict(value_noise=0.05, lr_schedule=True), "y"),
    "free-top-ipc-noise": ("mlp", dict(precision=(0.5, 2.0, 1.5, 1.0)), dict(algorithm="ipc", value_noise=0.02), "x"),
    # Issue 30: value optimizers, solvers and the inits near equilibrium in the capturable core.
    "mlp-pc-nesterov": ("mlp", {}, dict(value_optimizer="nesterov", x_momentum=0.5), "xy"),
    "conv-pc-ce-adam": ("conv", dict(energy="ce"), dict(value_optimizer="adam"), "xy"),
    "unsupervised-adamw-ipc": ("mlp", dict(prior=Prior(0.5, "learned")), dict(value_optimizer="adamw",
                                                                              algorithm="ipc"), "y"),
    "mupc-pc-heun-schedule": ("mupc", {}, dict(solver="heun", precision_schedule=top_down(0.3)), "xy"),
    "module-ipc-rk4": ("module", {}, dict(algorithm="ipc", solver="rk4"), "xy"),
    "mlp-pc-ce-newton-init": ("mlp", dict(energy="ce"), dict(init="newton"), "xy"),
    "mupc-pc-backward-init-adam": ("mupc", {}, dict(init="backward", value_optimizer="adam"), "xy"),
    "conv-pc-newton-init-heun": ("conv", {}, dict(init="newton", solver="heun"), "xy"),
    "mupc-ipc-newton-cr-init": ("mupc", {}, dict(init="newton_cr", algorithm="ipc"), "xy"),
}


def batch(net, ends: str, B: int, seed: int, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    shape_in, d_out = net.node_shapes[0], net.node_shapes[-1][0]
    x = torch.randn(B, *shape_in, generator=g, dtype=dtype)
    y = torch.eye(d_out, dtype=dtype)[torch.randint(0, d_out, (B,), generator=g)]
    if ends == "onehot-y":
        x = torch.eye(shape_in[0], dtype=dtype)[torch.randint(0, shape_in[0], (B,), generator=g)]
        y = torch.rand(B, d_out, generator=g, dtype=dtype)
    if ends == "y":
        x, y = None, torch.rand(B, d_out, generator=g, dtype=dtype)
    if ends == "x":
        y = None
    return x, y


def trainer_for(net, compile: str, opts: dict, optimizer: str = "adamw", steps: int = 8, T: int = 4):
    opts = dict(opts)
    sched_on = opts.pop("lr_schedule", False)
    tensor = opts.pop("tensor_lr", False)  # a tensor rate: the scheduler writes it in place

    def rate(lr: float):
        return torch.tensor(lr, dtype=torch.float64) if tensor else lr

    if optimizer == "adamw":
        opt = torch.optim.AdamW(net.parameters(), lr=rate(0.01), weight_decay=0.01, fused=True)
    elif optimizer == "sgd-fused":
        opt = torch.optim.SGD(net.parameters(), lr=rate(0.05), momentum=0.9, fused=True)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=rate(0.05), momentum=0.9)
    sched = pcdist.warmup_cosine(opt, 2, steps * (T if opts.get("algorithm") == "ipc" else 1)) if sched_on else None
    notes = []
    tr = pcdist.PCTrainer(net, opt, T=T, x_lr=0.1, scheduler=sched, compile=compile, noise_seed=4, say=notes.append,
                          **opts)
    return tr, notes


def run(name: str, compile: str, steps: int = 6, log_every: int = 3):
    kind, net_kw, opts, ends = CASES[name]
    net = network(kind, **net_kw)
    tr, notes = trainer_for(net, compile, opts, steps=steps)
    trail = []
    for s in range(steps):
        x, y = batch(net, ends, 6, 100 + s)
        stats = tr.step(x, y, log=(s + 1) % log_every == 0)
        trail.append((stats, [p.detach().clone() for p in net.parameters()], tr.value_nodes()))
    return net, tr, notes, trail


@pytest.mark.parametrize("compile", ["none", "graph"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_step_reads_nothing_on_the_host_between_log_points(name, compile):
    """Steps with log=False read no value on the host (a captured step could not); the graph core's own
    check (run on each stage's first step, logging included) finds nothing to fall back on."""
    kind, net_kw, opts, ends = CASES[name]
    net = network(kind, **net_kw)
    tr, notes = trainer_for(net, compile, opts)
    x, y = batch(net, ends, 6, 0)
    tr.step(x, y, log=True)  # the first step of a stage builds what the stage keeps (bookkeeping)
    with HostReads() as reads:
        for s in range(3):
            tr.step(*batch(net, ends, 6, 1 + s), log=False)
    assert reads.reads == [], reads.reads
    assert reads.kernels > 0
    assert notes == [] and tr.runner.eager == {}
    stats = tr.step(x, y, log=True)  # a log point: the energies come back
    assert math.isfinite(stats["energy"]) and len(stats["layer_energies"]) == net.num_layers


@pytest.mark.parametrize("name", list(CASES))
def test_the_capturable_core_equals_the_eager_step(name):
    """compile="graph" (learning rates from a device table, skips decided on the device, energies always
    recorded) trains bit for bit as compile="none": weights, value nodes and logged energies."""
    *_, eager = run(name, "none")
    *_, graph = run(name, "graph")
    for s, ((st_e, w_e, h_e), (st_g, w_g, h_g)) in enumerate(zip(eager, graph)):
        assert all(torch.equal(a, b) for a, b in zip(w_e, w_g)), f"step {s}: weights"
        assert all(torch.equal(a, b) for a, b in zip(h_e, h_g)), f"step {s}: value nodes"
        assert st_e.keys() == st_g.keys() and st_e.get("layer_energies") == st_g.get("layer_energies"), s


class _FailedCapture:
    """What a capture that fails does, then the eager fallback (pcdist.engine.capture.Runner._capture): the core's
    Python runs twice and its kernels once. A capture executes no kernel, so the first run's tensor writes (and its
    draws from the noise generator) are undone here before the second."""
    mode = "graph"

    def __init__(self, generator: torch.Generator):
        self.generator, self.seen = generator, set()

    def __call__(self, key, fn) -> None:
        import gc

        if key not in self.seen:  # a stage's first call runs as it is (it makes the optimizer's state)
            self.seen.add(key)
            fn()
            return
        saved = {}
        for t in gc.get_objects():
            if type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" and t.numel():  # not fake or meta
                s = t.untyped_storage()
                saved.setdefault(s.data_ptr(), (s, s.clone()))
        state = self.generator.get_state()
        fn()
        for s, before in saved.values():
            s.copy_(before)
        self.generator.set_state(state)
        fn()


@pytest.mark.parametrize("name", ["mlp-pc-se", "mlp-ipc-ce-momentum-schedule-skip", "mlp-pc-nesterov",
                                  "conv-pc-ce-adam", "unsupervised-adamw-ipc", "generative-pc-noise-skip"])
def test_a_core_run_again_after_a_failed_capture_steps_as_one_eager_step(name):
    """Where a capture fails the core runs again eagerly: it starts its Python state afresh (the value step's count,
    which momentum and the adam rules read; the weight copies), so the step equals one eager step bit for bit."""
    *_, eager = run(name, "none")
    kind, net_kw, opts, ends = CASES[name]
    net = network(kind, **net_kw)
    tr, notes = trainer_for(net, "graph", opts, steps=len(eager))  # rates planned on the host, as where it captures
    tr.runner = _FailedCapture(tr._generator)
    for s, (st_e, w_e, h_e) in enumerate(eager):
        stats = tr.step(*batch(net, ends, 6, 100 + s), log=(s + 1) % 3 == 0)
        assert all(torch.equal(a, b) for a, b in zip(w_e, net.parameters())), f"step {s}: weights"
        assert all(torch.equal(a, b) for a, b in zip(h_e, tr.value_nodes())), f"step {s}: value nodes"
        assert stats.get("layer_energies") == st_e.get("layer_energies"), s


@pytest.mark.parametrize("grouped", ["0", "1"])
@pytest.mark.parametrize("algorithm", ["pc", "ipc"])
def test_channels_last_conv_steps_read_nothing_on_the_host_and_capture_as_eager(algorithm, grouped, monkeypatch):
    """PCDIST_CHANNELS_LAST=1 (channels-last image nodes, weight copies refreshed at every weight change: iPC's
    at each inference step), with a group of two's convolutions layer by layer or as one (PCDIST_CONV_GROUPED):
    steps with log=False read nothing on the host, and compile="graph" trains bit for bit as compile="none"."""
    from pcdist.engine.models import conv_specs
    from pcdist.engine.nodes import is_channels_last

    monkeypatch.setenv("PCDIST_CHANNELS_LAST", "1")
    monkeypatch.setenv("PCDIST_CONV_GROUPED", grouped)

    def trained(compile: str):
        net = pcdist.PCNetwork(conv_specs((3, 8, 8), [(4, 3, 1, "max"), (4, 3, 1, None), (4, 3, 1, None)], [], 4,
                                          "relu"), energy="ce", seed=1, dtype=DT)
        tr, notes = trainer_for(net, compile, dict(algorithm=algorithm, value_noise=0.02, lr_schedule=True))
        tr.step(*batch(net, "xy", 6, 0), log=True)
        with HostReads() as reads:
            for s in range(3):
                tr.step(*batch(net, "xy", 6, 1 + s), log=False)
        assert reads.reads == [] and notes == [], (reads.reads, notes)
        assert [is_channels_last(tr.stage(6).node(n)) for n in range(5)] == [True, True, True, True, False]
        assert [g.grouped is not None for g in tr.stage(6).groups if g.K == 2] == [grouped == "1"]
        return [p.detach().clone() for p in net.parameters()], tr.value_nodes()

    (w_e, h_e), (w_g, h_g) = trained("none"), trained("graph")
    assert all(torch.equal(a, b) for a, b in zip(w_e + h_e, w_g + h_g))


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
@pytest.mark.parametrize("algorithm", ["pc", "ipc"])
def test_the_tensor_learning_rate_schedule_equals_the_float_one(algorithm, tensor_lr):
    """Under a plan the optimizer reads each step's rate from a device tensor: the rates it read equal the
    float schedule's (warm-up then cosine) to 1e-15, for every optimizer step (T per training step in ipc),
    also where the optimizer was given its rate as a tensor (which the scheduler writes in place)."""
    steps, T = 7, 3
    net_g, net_e = network("mlp"), network("mlp")
    opts = dict(algorithm=algorithm, lr_schedule=True)
    tr_g, _ = trainer_for(net_g, "graph", dict(opts, tensor_lr=tensor_lr), steps=steps, T=T)
    tr_e, _ = trainer_for(net_e, "none", opts, steps=steps, T=T)
    per = T if algorithm == "ipc" else 1
    seen = []
    tr_e.optimizer.register_step_pre_hook(lambda opt, *a: seen.append(opt.param_groups[0]["lr"]))
    planned = []
    for s in range(steps):
        x, y = batch(net_g, "xy", 6, s)
        tr_g.step(x, y, log=False)
        planned += tr_g.update.plan[:per, 0].tolist()
        tr_e.step(x, y, log=False)
    assert len(planned) == len(seen) == steps * per
    assert max(abs(a - b) for a, b in zip(planned, seen)) <= 1e-15
    assert seen[0] < seen[2] and seen[-1] < max(seen), "the schedule warms up and decays"
    assert all(torch.equal(a, b) for a, b in zip(net_g.parameters(), net_e.parameters()))
    assert float(tr_g.optimizer.param_groups[0]["lr"]) == tr_e.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-fused", "sgd"])
@pytest.mark.parametrize("compile", ["none", "graph"])
def test_the_device_side_skip_equals_the_host_decision(optimizer, compile):
    """Skipping a diverged update on the device does exactly what a host decision does: the reference
    steps a copy without a limit and, where the step's logged energy F is above it (or not finite),
    puts the weights and optimizer state back as they were. Same skips, same weights, bit for bit; the first
    update is skipped too, so the state an optimizer makes in it must be as if never made (fused SGD's momentum
    buffers come uninitialised from empty_like: zeroed)."""
    if compile == "graph" and optimizer == "sgd":  # the tensor rate needs the fused kernel (the core would read it)
        optimizer = "sgd-fused"
    net = network("mlp", energy="ce")
    ref_net = copy.deepcopy(net)
    energies = []
    probe = copy.deepcopy(net)
    tr_probe, _ = trainer_for(probe, "none", {})
    for s in range(8):
        energies.append(tr_probe.step(*batch(net, "xy", 6, s))["energy"])
    limit = sorted(energies)[len(energies) // 2]  # about half the batches of a run from these weights diverge
    tr, _ = trainer_for(net, compile, dict(skip_above=limit), optimizer)
    ref, _ = trainer_for(ref_net, "none", {}, optimizer)
    skipped = 0
    batches = [batch(net, "xy", 6, s) for s in range(8)]
    for s in (0, 5):  # not finite: always skipped (the first: state the optimizer makes in a skipped step)
        batches[s] = (torch.full_like(batches[s][0], float("nan")), batches[s][1])
    for s, (x, y) in enumerate(batches):
        if s == 0:  # freed memory of the parameters' sizes holds NaN: what an uninitialised new state would read
            junk = [torch.full_like(p, float("nan")) for p in net.parameters() for _ in range(4)]
            del junk
        before = (copy.deepcopy(ref_net.state_dict()), copy.deepcopy(ref.optimizer.state_dict()))
        e = ref.step(x, y)["energy"]
        if not math.isfinite(e) or e > limit:
            skipped += 1
            ref_net.load_state_dict(before[0])
            ref.optimizer.load_state_dict(before[1])
        tr.step(x, y, log=False)
        assert tr.skipped_updates == skipped
        assert all(torch.equal(a, b) for a, b in zip(net.parameters(), ref_net.parameters()))
    assert 0 < skipped < len(batches)
    for p in net.parameters():
        state, ref_state = tr.optimizer.state[p], ref.optimizer.state[dict(zip(net.parameters(),
                                                                               ref_net.parameters()))[p]]
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v.to(ref_state[k].dtype), ref_state[k]), k


def test_ops_whose_output_size_depends_on_the_values_are_host_reads():
    """On a GPU the host waits for a boolean mask's positions or a nonzero's count before it can size the output,
    which a capture cannot do: HostReads counted none of them (a user's module using one passed the CPU check).
    Ops of a fixed output size (where, an integer index) are not reads."""
    h = torch.randn(7)
    reads = {}
    for name, op in (("mask", lambda: h[h > 0]), ("masked write", lambda: h.clone().masked_fill_(h < 0, 0)),
                     ("mask write", lambda: h.clone().__setitem__(h < 0, 0)), ("nonzero", lambda: h.nonzero()),
                     ("masked_select", lambda: h.masked_select(h > 0)), ("unique", lambda: h.unique()),
                     ("where", lambda: torch.where(h > 0, h, 0.0)), ("index", lambda: h[torch.tensor([0, 2])]),
                     ("repeats", lambda: h.repeat_interleave(torch.arange(7))), ("histc", lambda: h.histc(bins=4)),
                     ("sized repeats", lambda: h.repeat_interleave(torch.arange(7), output_size=21))):
        with HostReads() as r:
            op()
        reads[name] = len(r.reads)
    assert reads == {"mask": 1, "masked write": 0, "mask write": 1, "nonzero": 1, "masked_select": 1, "unique": 1,
                     "where": 0, "index": 0, "repeats": 1, "histc": 0, "sized repeats": 0}


def test_copies_from_the_host_to_the_device_are_found_as_on_a_gpu():
    """HostReads(strict=False), as on a GPU (here "meta" tensors stand for device tensors: any device not the CPU):
    a host array copied to the device in the core (``t.to(device)``, ``d.copy_(host)``, a 0-d one too) is what a
    capture refuses or replays stale, and was not found; copies between device tensors, a device tensor times a
    Python number or a host 0-d scalar (a value, no copy), and a host tensor made on the device are not."""
    d, host = torch.zeros(3, device="meta"), torch.ones(3)
    found = {}
    for name, op in (("to", lambda: host.to("meta")), ("to device=", lambda: host.to(device=d.device)),
                     ("copy_", lambda: d.clone().copy_(host)),
                     ("0-d copy_", lambda: d[0].clone().copy_(torch.tensor(2.0))),
                     ("device copy", lambda: d.clone().copy_(d)), ("device to", lambda: d.to(torch.float64)),
                     ("scalars", lambda: d * 2.0 + torch.tensor(3.0)),
                     ("made there", lambda: torch.ones(3, device="meta")),
                     ("host only", lambda: host.clone().copy_(host))):
        with HostReads(strict=False) as r:
            op()
        found[name] = [what.split(" (")[0] for what in r.reads]
    copied = ["a copy from the host"]
    assert found == {"to": copied, "to device=": copied, "copy_": copied, "0-d copy_": copied, "device copy": [],
                     "device to": [], "scalars": [], "made there": [], "host only": []}


def test_the_rates_copied_in_before_the_core_and_a_cpu_optimizers_own_read_are_not_host_reads():
    """The learning rates that a captured step's update copies in before its core runs (WeightUpdate.prepare) are
    host work, not a read: HostReads(strict=False) around a whole replayed step (as tests/test_cuda.py wraps one;
    "meta" stands for the device) counted it as a copy from the host. And on a CPU, compile="graph" with a foreach
    Adam (whose planned rate the update reads on the host on purpose: a CPU runs eagerly) said that the step reads a
    device value and runs eagerly."""
    from pcdist.engine.update import WeightUpdate

    p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    opt = torch.optim.AdamW([p], lr=1e-3)
    update = WeightUpdate(opt, pcdist.warmup_cosine(opt, 5, 100), None, None, planned=True, steps=3,
                          device=torch.device("meta"))
    with HostReads(strict=False) as reads:
        update.prepare()
    assert reads.reads == [] and reads.by_op["copy_"] >= 1, (reads.reads, reads.by_op)

    net = network("mlp")
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, foreach=True)
    notes = []
    tr = pcdist.PCTrainer(net, opt, T=4, x_lr=0.1, scheduler=pcdist.warmup_cosine(opt, 2, 8), compile="graph",
                          say=notes.append)
    for s in range(4):
        tr.step(*batch(net, "xy", 6, s), log=False)
    assert notes == [] and tr.runner.eager == {}


def test_a_module_that_branches_on_its_input_runs_eagerly_with_one_line():
    """A layer that reads a value of its input on the host cannot be captured: the stage says so once, in one
    line that names the stage and the read, and then trains exactly as compile="none"."""
    nets = [network("branchy"), network("branchy")]
    (tr_g, notes), (tr_e, _) = trainer_for(nets[0], "graph", {}), trainer_for(nets[1], "none", {})
    for s in range(3):
        x, y = batch(nets[0], "xy", 6, s)
        tr_g.step(x, y)
        tr_e.step(x, y)
    assert len(notes) == 1, notes
    assert notes[0].startswith("compile=graph: the training step at batch size 6 runs eagerly: the step reads a "
                               "device value on the host (Tensor.__bool__"), notes[0]
    line = Branchy.forward.__code__.co_firstlineno + 1  # the user's line that reads it, named (not pcdist's caller)
    assert f"Tensor.__bool__ in {__file__}:{line} (forward), from " in notes[0], notes[0]
    assert all(torch.equal(a, b) for a, b in zip(*(n.parameters() for n in nets)))


def test_a_value_step_changed_between_steps_is_the_one_a_step_uses_noise_included():
    """trainer.x_lr set between steps (what pc.x_lr=auto does): the next steps and infer calls, value noise of std
    sqrt(2 x_lr tau) included, equal a trainer built with that step from the same state (the replayed step and
    the stage's noise are kept per x_lr; they kept the first one's)."""
    def trainer(x_lr):
        net = network("mlp", dtype=DT)
        return pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.05), T=4, x_lr=x_lr, value_noise=0.5,
                                noise_seed=3, compile="graph")

    changed, fresh = trainer(0.5), trainer(0.01)
    changed.step(*batch(changed.net, "xy", 6, 0))  # its stage and noise made at x_lr 0.5
    changed.x_lr = 0.01
    fresh.net.load_state_dict(changed.net.state_dict())  # SGD without momentum: nothing else to carry
    fresh.steps_done = changed.steps_done  # the noise of step n is drawn for n
    for _ in range(3):
        x, y = batch(changed.net, "xy", 6, 1)
        assert changed.step(x, y)["energy"] == fresh.step(x, y)["energy"]
    a, b = changed.infer(x, y, noise=0.5), fresh.infer(x, y, noise=0.5)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_a_value_step_changed_at_every_step_is_said_once_and_its_counts_stay_bounded():
    """x_lr changed before every step: no constants are kept long enough to be captured, which the runner says in
    one line (once) after CHURN such calls, keeping no count for the values gone by (one per step otherwise); an
    x_lr then kept counts on towards its capture, with no other line."""
    from pcdist.engine.capture import CHURN

    net = network("mlp", dtype=DT)
    notes = []
    tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.05), T=4, compile="graph", say=notes.append)
    x, y = batch(net, "xy", 6, 0)
    for s in range(3 * CHURN):
        tr.x_lr = 0.1 + 0.01 * s
        tr.step(x, y, log=False)
        said = [n for n in notes if "changes at every call" in n]
        assert len(said) == (s + 1 >= CHURN), (s, notes)
    assert notes == said and "the training step at batch size 6" in said[0]
    assert len([k for k in tr.runner.calls if k[0] == "step"]) <= CHURN
    for _ in range(3):
        tr.step(x, y, log=False)
    assert tr.runner.calls[("step", tr._stage, tr.x_lr, None, 4, tr.solver, tr.update.settings(), ())] == 4
    assert len(notes) == 1


def test_a_parameter_frozen_between_steps_is_a_captured_step_of_its_own():
    """A captured step leaves alone the parameters frozen when it was captured: one frozen (or unfrozen) later is
    in the step's key, so its steps are a capture of their own (tests/test_cuda.py replays them), not the old one
    replayed; here the frozen weight stays as it was and the unfrozen one trains on under the first key."""
    net = network("mlp", dtype=DT)
    tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.05), T=4, compile="graph")
    weight = next(p for p in net.parameters() if p.dim() >= 2)
    x, y = batch(net, "xy", 6, 0)
    for _ in range(2):
        tr.step(x, y, log=False)
    weight.requires_grad_(False)
    held = weight.detach().clone()
    for _ in range(2):
        tr.step(x, y, log=False)
    assert torch.equal(weight, held)
    weight.requires_grad_(True)
    tr.step(x, y, log=False)
    assert not torch.equal(weight, held)
    at = [p is weight for p in net.parameters()].index(True)  # (the optimizer's order)
    steps = sorted((k[-1], n) for k, n in tr.runner.calls.items() if k[0] == "step")
    assert steps == [((), 3), ((at,), 2)], steps


def test_optimizer_settings_written_between_steps_are_a_captured_step_of_their_own():
    """weight_decay, betas (any key of the optimizer's defaults but lr) written on a live trainer: a captured step
    replays them as they were at its capture (they reach the fused kernel as numbers), so each new value is in the
    step's key, a capture of its own (it kept the first one's, silently); the rate is not (the plan carries it)."""
    net = network("mlp", dtype=DT)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    tr = pcdist.PCTrainer(net, opt, T=4, compile="graph")
    x, y = batch(net, "xy", 6, 0)
    for s in range(6):
        opt.param_groups[0]["weight_decay"] = 0.01 if s < 2 else 0.02
        opt.param_groups[0]["betas"] = (0.9, 0.999) if s < 4 else (0.8, 0.999)
        opt.param_groups[0]["lr"] = 0.01 / (s + 1)
        tr.step(x, y, log=False)
    keys = sorted(((g := dict(k[-2][0]))["betas"], g["weight_decay"], n) for k, n in tr.runner.calls.items()
                  if k[0] == "step")
    assert keys == [((0.8, 0.999), 0.02, 2), ((0.9, 0.999), 0.01, 2), ((0.9, 0.999), 0.02, 2)], keys


def test_optimizer_state_dropped_on_a_live_trainer_drops_the_captured_steps():
    """optimizer.state.clear() (or a del of one parameter's): the captured steps update the old state tensors by
    address (on a GPU freed, a replay would write into other tensors' memory), so the trainer takes the optimizer
    anew, as after load_state_dict: the stage's captures and counts go, the next step makes fresh state, as an
    eager step does."""
    net = network("mlp", dtype=DT)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    tr = pcdist.PCTrainer(net, opt, T=4, compile="graph")
    x, y = batch(net, "xy", 6, 0)
    for _ in range(3):
        tr.step(x, y, log=False)
    update = tr.update
    assert sum(n for k, n in tr.runner.calls.items() if k[0] == "step") == 3
    opt.state.clear()
    tr.step(x, y, log=False)
    assert tr.update is not update and len(opt.state) == len(list(net.parameters()))
    assert sum(n for k, n in tr.runner.calls.items() if k[0] == "step") == 1, "counted afresh"
    assert all(int(st["step"]) == 1 for st in opt.state.values())


def test_an_optimizer_is_capturable_only_while_pcdist_steps_it_and_keeps_its_own_setting():
    """On a CUDA device every call of a captured mode that runs in Python does so inside ``update.capturable()``
    (tests/test_cuda.py runs it there): within it the groups that have the option are capturable, and after it,
    raised or not, each has its own setting again (a state_dict saved from the optimizer must step on a CPU)."""
    net = network("mlp", dtype=DT)
    opt = torch.optim.Adam([{"params": list(net.parameters())[:2]},
                            {"params": list(net.parameters())[2:], "capturable": True}], lr=0.01)
    tr = pcdist.PCTrainer(net, opt, T=4, compile="graph")
    with tr.update.capturable():
        assert [g["capturable"] for g in opt.param_groups] == [True, True]
    assert [g["capturable"] for g in opt.param_groups] == [False, True]
    with pytest.raises(KeyboardInterrupt), tr.update.capturable():
        raise KeyboardInterrupt
    assert [g["capturable"] for g in opt.param_groups] == [False, True]


def test_inference_over_ever_new_batch_sizes_keeps_a_bounded_number_of_stages_and_frees_the_rest():
    """infer over 20 batch sizes, a training step at one size between each: the trainer keeps its max_stages most
    recently used stages (the training one never leaves), and the others, with all the runner counted or captured
    for them, are freed. A stage made again computes what it computed the first time."""
    net = network("mlp")
    tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=4, compile="graph")
    x6, y6 = batch(net, "xy", 6, 0)
    tr.step(x6, y6)
    training = tr._stage
    first, made = {}, []
    for B in range(7, 27):
        first[B] = tr.infer(batch(net, "xy", B, B)[0], None)
        made.append(weakref.ref(tr._stage))
        tr.step(x6, y6)
    gc.collect()
    kept = [st for _, st in tr._stages.values()]
    assert len(kept) == tr.max_stages and training in kept and tr._stage is training
    assert [B for B, ref in zip(range(7, 27), made) if ref() is not None] == list(range(27 - tr.max_stages + 1, 27))
    assert {k[1] for k in (*tr.runner.calls, *tr.runner.programs, *tr.runner.eager)} <= set(kept)
    again = tr.infer(batch(net, "xy", 7, 7)[0], None)
    assert all(torch.equal(a, b) for a, b in zip(first[7], again))


@pytest.mark.parametrize("name", ["mlp-ipc-ce-momentum-schedule-skip", "generative-pc-noise-skip", "conv-pc-ce-adam"])
def test_a_trainer_that_keeps_one_stage_trains_exactly_as_one_that_keeps_them_all(name):
    """Batch sizes alternating 6 and 10 with max_stages = 1: each step's stage is made anew (the other evicted),
    and the run equals one whose stages all stay, bit for bit (a stage holds nothing a step carries over)."""
    kind, net_kw, opts, ends = CASES[name]
    runs = []
    for keep in (1, pcdist.PCTrainer.max_stages):
        net = network(kind, **net_kw)
        tr, _ = trainer_for(net, "graph", opts)
        tr.max_stages = keep
        energies = [tr.step(*batch(net, ends, 10 if s % 2 else 6, 100 + s))["energy"] for s in range(6)]
        runs.append((energies, [p.detach().clone() for p in net.parameters()], len(tr._stages)))
    (e1, w1, n1), (e8, w8, n8) = runs
    assert (n1, n8) == (1, 2) and e1 == e8
    assert all(torch.equal(a, b) for a, b in zip(w1, w8))


def test_bfloat16_products_on_a_cpu_are_rounded_to_bfloat16_then_summed_in_float32():
    """Where the GEMM cannot write float32 from bfloat16 operands (a CPU: base.f32_products is False; a GPU's
    float32 products are tests/test_cuda.py's), a product is rounded to bfloat16 and then added in float32:
    the closed form below, bit for bit, for the prediction (with a bias and a scale) and the back-projection."""
    from pcdist.engine.layers.base import accumulate_product, f32_products, product_into

    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(3, 5, 8, generator=g), torch.randn(3, 8, 4, generator=g).bfloat16()
    bias, t = torch.randn(3, 1, 4, generator=g), torch.randn(3, 5, 4, generator=g)
    p = torch.bmm(a.bfloat16(), w).float()  # the product in bfloat16, then read as float32
    assert not f32_products(a)
    out = torch.empty(3, 5, 4)
    product_into(out, a, w, False, bias, 0.5)
    assert torch.equal(out, (bias + p) * 0.5)
    want = (t * 0.75).add_(p, alpha=-0.25)  # torch's own beta x + alpha y (a fused multiply-add on some CPUs)
    accumulate_product(t, a, w, 0.75, -0.25, False)
    assert torch.equal(t, want)


@pytest.mark.parametrize("kind, algorithm, init", [("mlp", "pc", "ff"), ("mlp", "ipc", "ff"), ("mupc", "pc", "ff"),
                                                   ("conv", "pc", "ff"), ("mlp", "pc", "newton"),
                                                   ("mupc", "pc", "backward"), ("conv", "pc", "newton_cr")])
def test_bfloat16_steps_track_float32_steps_with_float32_master_weights(kind, algorithm, init):
    """precision="bf16": the matmuls on bfloat16 operands, value nodes and errors in float32, the optimizer on
    float32 master weights. From the same weights, the energies of each step agree with float32's to
    bfloat16's rounding (relative 2^-8 per operand; 5% over a step), SGD moves the weights the same way (its
    step is linear in the gradients, so their direction and size agree to that rounding), the products did
    run in bfloat16 (the compute copy's weights), the step reads nothing on the host, and the master weights
    and optimizer state stay float32. The inits near equilibrium compute in float32 with the bfloat16 weights."""
    nets = {p: network(kind, dtype=torch.float32) for p in ("fp32", "bf16")}
    trs = {p: pcdist.PCTrainer(n, torch.optim.SGD(n.parameters(), lr=0.05, momentum=0.5, fused=True), T=8,
                               x_lr=0.1, algorithm=algorithm, precision=p, compile="graph", init=init)
           for p, n in nets.items()}
    w0 = [p.detach().clone() for p in nets["fp32"].parameters()]
    for s in range(5):
        x, y = batch(nets["fp32"], "xy", 32, s, torch.float32)
        with HostReads() as reads:
            e = {p: tr.step(x, y, log=False) for p, tr in trs.items()}
        assert reads.reads == [] or s < 2, reads.reads  # the first steps build the stage (and are checked)
        e = {p: float(tr._stage.energy_log.sum()) for p, tr in trs.items()}
        assert e["bf16"] == pytest.approx(e["fp32"], rel=0.05), s
        if s == 0:
            st = trs["bf16"]._stage
            assert st.node(1).dtype == torch.float32
            assert all(gr.g.weight.dtype == torch.bfloat16 for gr in st.groups if gr.g.lowp_params)
            assert e["bf16"] != e["fp32"], "the products ran in bfloat16"
    assert trs["bf16"].runner.eager == {}
    moved = {p: torch.cat([(a.detach() - b).flatten() for a, b in zip(n.parameters(), w0)]) for p, n in nets.items()}
    cos = torch.nn.functional.cosine_similarity(moved["fp32"], moved["bf16"], dim=0)
    assert cos > 0.99 and moved["bf16"].norm() == pytest.approx(float(moved["fp32"].norm()), rel=0.05)
    assert all(p.dtype == torch.float32 for p in nets["bf16"].parameters())
    assert all(v.dtype == torch.float32 for st in trs["bf16"].optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def test_a_stage_beyond_the_plan_runs_eagerly_in_one_line_whatever_changes_between_steps():
    """(review rv115) compile="graph" with a momentum-cycling scheduler and x_lr annealed at every step: each step's
    new key printed the "runs eagerly" line again and kept an entry of its own (30 and 30 after 30 steps); the
    stage now runs eagerly as a whole, said once, and letting the trainer go forgets it. Also: torch.equal is a
    host read (a blocking read on a GPU), and compile="auto" is none on a CPU."""
    from pcdist.engine.capture import compile_mode

    torch.manual_seed(0)
    net = pcdist.PCNetwork.from_sequential(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)
    notes = []
    trainer = pcdist.PCTrainer(net, opt, T=3, x_lr=0.1, scheduler=sched, compile="graph", say=notes.append)
    for s in range(12):
        trainer.x_lr = 0.1 * (1 - s / 100)
        trainer.step(torch.randn(8, 4), torch.randn(8, 3))
    assert len(trainer.runner.eager) == 1 and len(notes) == 1 and "cycles momentum" in notes[0], notes
    for stage in [st for _, st in trainer._stages.values()]:
        trainer.runner.forget(stage)
    assert not trainer.runner.eager and not trainer.runner.calls
    with HostReads(strict=True) as reads:
        torch.equal(torch.zeros(3), torch.zeros(3))
    assert reads.reads, "torch.equal was not counted"
    assert compile_mode("auto", torch.device("cpu")) == "none"
