"""trainer.precision through the service: recorded in the run, kept by a resume and by pcdist.load, refused
where it cannot hold (docs/gpu.md).

A bf16 run's network is its float32 master weights (the bfloat16 copy only computes the products), so
what a run writes and what comes back from it are float32, and a bf16 run stopped and resumed ends where an
uninterrupted bf16 run ends (the same products, from the same master weights, in the same order).
"""

import warnings

import pytest
import torch
import yaml

import pcdist
from pcdist.service.metrics import read_metrics

COMMON = {"logger": "none", "trainer": {"max_steps": 20, "eval_every": 10, "ckpt_every": 10, "log_every": 5,
                                        "precision": "bf16", "progress": "off"}}


def train(run_dir, **trainer):
    return pcdist.train({**COMMON, "run_dir": str(run_dir), "trainer": {**COMMON["trainer"], **trainer}})


def test_a_bf16_run_is_recorded_resumed_and_loaded_as_bf16(tmp_path):
    straight = train(tmp_path / "straight")
    train(tmp_path / "split", stop_at=10)
    resumed = train(tmp_path / "split")
    assert resumed["step"] == 20 and resumed["val/accuracy"] == straight["val/accuracy"]
    assert resumed["train/energy"] == pytest.approx(straight["train/energy"], rel=1e-6)
    saved = yaml.safe_load((tmp_path / "split" / "config.yaml").read_text())
    assert saved["trainer"]["precision"] == "bf16"
    run = pcdist.load(tmp_path / "split")
    assert run.config.trainer.precision == "bf16"
    assert all(p.dtype == torch.float32 for p in run.network.parameters()), "the master weights come back"
    torch.testing.assert_close(run.network.layer_state_dict()["layers.1.weight"],
                               straight.network.layer_state_dict()["layers.1.weight"], atol=1e-6, rtol=0)


def test_a_bf16_run_on_a_data_axis_equals_one_process(tmp_path):
    """bf16 keeps a layer's weights in bfloat16 and its bias in float32: the data axis's gradient bucket, of one
    dtype per group, raised at the first step ("grad_dtype 'Float'"). Two gloo data ranks train as one process:
    the same energies (the bfloat16 sums of two halves, within bfloat16's rounding) and the same accuracy."""
    from spawn import run
    from test_service import _train_worker

    def energies(name):
        return [r["train/energy"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if "train/energy" in r]

    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        run(_train_worker, 2, {**COMMON, "run_dir": str(tmp_path / "data2"), "parallel.data": 2,
                               "trainer": {**COMMON["trainer"], "max_steps": 10}}, timeout=240)
    one = train(tmp_path / "one", max_steps=10)
    assert energies("data2") == pytest.approx(energies("one"), rel=1e-2) and len(energies("one")) == 2
    assert pcdist.load(tmp_path / "data2").step == 10 and abs(one["val/accuracy"] - read_metrics(
        tmp_path / "data2" / "metrics.jsonl")[-1]["val/accuracy"]) <= 0.02


def test_bf16_with_float64_master_weights_is_one_line(tmp_path):
    with pytest.raises(pcdist.ConfigError, match="trainer.dtype.*float32 under trainer.precision=bf16"):
        train(tmp_path / "run", dtype="float64")
    assert not (tmp_path / "run").exists()


def test_backprop_under_bf16_runs_its_products_in_bfloat16(tmp_path):
    """pc.algorithm=bp (PC's twin of the same settings) honours trainer.precision: bf16 runs its forward pass under
    autocast (bfloat16 products, float32 weights and loss), so its energy moves off float32's by bfloat16's
    rounding and no further; and a run leaves the caller's TF32 switches and torch threads as it found them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # not what a run on this machine sets (its cores, or OMP_NUM_THREADS)
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32, torch.get_num_threads()
    bf16 = train(tmp_path / "bf16", max_steps=30, eval_every=30, ckpt_every=30)
    fp32 = pcdist.train({**COMMON, "pc": {"algorithm": "bp"}, "run_dir": str(tmp_path / "fp32"),
                         "trainer": {**COMMON["trainer"], "precision": "fp32", "max_steps": 30, "eval_every": 30,
                                     "ckpt_every": 30}})
    bp16 = pcdist.train({**COMMON, "pc": {"algorithm": "bp"}, "run_dir": str(tmp_path / "bp16"),
                         "trainer": {**COMMON["trainer"], "max_steps": 30, "eval_every": 30, "ckpt_every": 30}})
    assert bp16["train/energy"] != fp32["train/energy"], "the products ran in bfloat16"
    assert bp16["train/energy"] == pytest.approx(fp32["train/energy"], rel=0.02)
    assert abs(bp16["val/accuracy"] - fp32["val/accuracy"]) <= 0.02 and bf16["step"] == 30
    after = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32, torch.get_num_threads()
    torch.set_num_threads(threads)
    assert after == before


def test_the_switches_the_caller_set_through_torchs_per_backend_api_are_put_back():
    """torch >= 2.9 has per-backend float32 precision switches beside the older two, and refuses to read the older
    ones once only the newer were written: a caller's TF32 choice so set could not be read, so a run (whose trainer
    sets the switches at each step on a GPU: set_tf32) put nothing back."""
    from pcdist.engine.precision import restore_tf32, set_tf32, tf32_state

    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip("this torch has no per-backend float32 precision switches (torch < 2.9)")
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = tf32_state()
    try:
        for chosen in ("high", "highest"):  # set through the older API: still readable so after (review)
            torch.set_float32_matmul_precision(chosen)
            state = tf32_state()
            set_tf32(chosen == "highest")  # what a trainer of the other choice does
            restore_tf32(state)
            assert torch.get_float32_matmul_precision() == chosen
        for chosen in ("tf32", "ieee"):
            matmul.fp32_precision, conv.fp32_precision = chosen, chosen
            state = tf32_state()
            set_tf32(chosen == "ieee")
            restore_tf32(state)
            assert (matmul.fp32_precision, conv.fp32_precision) == (chosen, chosen)
    finally:
        restore_tf32(before)


def test_fp32_turns_tf32_convolutions_off_also_where_a_caller_set_tf32_for_every_backend():
    """torch >= 2.9 stores the older ``cudnn.allow_tf32 = False`` as "none", which inherits a backend-wide or global
    "tf32": an fp32 trainer's convolutions ran in TF32 under ``torch.backends.fp32_precision = "tf32"``."""
    from pcdist.engine.precision import restore_tf32, set_tf32, tf32_convolutions, tf32_state

    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip("this torch has no per-backend float32 precision switches (torch < 2.9)")
    before = tf32_state()
    try:
        for parent in (torch.backends, torch.backends.cudnn):
            restore_tf32(("highest", True))
            parent.fp32_precision = "tf32"
            set_tf32(False)
            assert not tf32_convolutions() and torch.backends.cudnn.rnn.fp32_precision != "tf32", parent
            set_tf32(True)
            assert tf32_convolutions()
            parent.fp32_precision = "none"
    finally:
        torch.backends.fp32_precision = torch.backends.cudnn.fp32_precision = "none"  # (torch's defaults)
        restore_tf32(before)


def test_float32_matmuls_on_a_cpu_are_ieee_whatever_the_process_set():
    """A process-wide set_float32_matmul_precision("medium") has oneDNN compute float32 matmuls in bfloat16 (2e-3
    off): a trainer's fp32 (or tf32, which a CPU does not have) step computes in float32 all the same, equal to the
    step under "highest"; so does backprop's. The process's own setting is as it was after each step (it rules the
    user's other work, CUDA's TF32 too)."""
    from pcdist.service.backprop import BackpropTrainer

    def energies(precision):
        out = []
        for algorithm in ("pc", "bp"):
            torch.manual_seed(0)
            net = pcdist.PCNetwork.from_dims([64, 128, 10], seed=0)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            tr = pcdist.PCTrainer(net, opt, T=3, precision=precision) if algorithm == "pc" else BackpropTrainer(
                net, opt)
            x, y = torch.randn(32, 64), torch.eye(10)[torch.arange(32) % 10]
            out.append([tr.step(x, y)["energy"] for _ in range(2)])
        return out

    before = torch.get_float32_matmul_precision()
    try:
        reference = energies("fp32")
        for precision in ("fp32", "tf32"):
            torch.set_float32_matmul_precision("medium")
            assert energies(precision) == reference, precision
            assert torch.get_float32_matmul_precision() == "medium", "the process's setting is put back"
    finally:
        torch.set_float32_matmul_precision(before)


def test_cpu_convolutions_are_ieee_whatever_the_process_set_and_every_switch_reads_as_before():
    """oneDNN's own ``fp32_precision = "bf16"`` (torch >= 2.9) had an fp32 trainer's CPU convolutions run in
    bfloat16 (matmuls were guarded, convolutions not); and a caller's ``cuda.matmul.allow_tf32 = True`` left oneDNN's
    matmul switch at TF32 after any CPU step (the guard put back through torch's older switch, which writes both).
    Every switch reads as it did before after each step, the older ones included."""
    from torch import nn

    from pcdist.engine.precision import restore_tf32, tf32_state

    if not hasattr(torch.backends.mkldnn, "conv") or not hasattr(torch.backends.mkldnn.conv, "fp32_precision"):
        pytest.skip("this torch has no oneDNN float32 precision switches (torch < 2.9)")

    def step():
        torch.manual_seed(0)
        seq = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(128, 4))
        net = pcdist.PCNetwork.from_sequential(seq, input_shape=(1, 8, 8))
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=4, x_lr=0.1)
        g = torch.Generator().manual_seed(1)
        tr.step(torch.randn(32, 1, 8, 8, generator=g), torch.randn(32, 4, generator=g))
        return [p.detach().clone() for p in net.parameters()]

    def switches():
        out = {}
        for name, read in (("matmul", torch.get_float32_matmul_precision),
                           ("cuda", lambda: torch.backends.cuda.matmul.allow_tf32),
                           ("cudnn", lambda: torch.backends.cudnn.allow_tf32)):
            try:
                out[name] = read()
            except RuntimeError:
                out[name] = "unreadable"
        out.update((n, getattr(torch.backends.mkldnn, n).fp32_precision) for n in ("matmul", "conv"))
        return out

    before = tf32_state()
    try:
        reference = step()
        for setup in (lambda: setattr(torch.backends.mkldnn.conv, "fp32_precision", "bf16"),
                      lambda: setattr(torch.backends, "fp32_precision", "bf16"),
                      lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True)):
            restore_tf32(before)
            setup()
            caller = switches()
            assert all(torch.equal(a, b) for a, b in zip(step(), reference))
            assert switches() == caller
    finally:
        torch.backends.fp32_precision = "none"
        restore_tf32(before)


def test_a_bf16_trainer_uses_its_networks_buffers_and_refuses_a_cast_network():
    """bf16 computes on a copy of the network: a buffer loaded into the network after the trainer was made (a
    BatchNorm's statistics) was ignored (energy 0.59 against a fresh trainer's 2.60), and a network cast to float64
    or bfloat16 afterwards trained on silently in the precision bf16 exists to avoid."""
    def made(seed):
        torch.manual_seed(seed)
        layers = [torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh()),
                  torch.nn.Linear(8, 3)]
        for m in layers[0]:
            m.eval()
        return pcdist.PCNetwork.from_layers(layers, input_shape=(6,))

    x, y = torch.randn(5, 6), torch.eye(3)[[0, 1, 2, 0, 1]]
    net = made(0)
    live = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=2, precision="bf16")
    live.step(x, y)
    stats = {k: v for k, v in made(1).state_dict().items() if "running" in k}
    assert stats and net.load_state_dict({**net.state_dict(), **{k: v * 3 + 1 for k, v in stats.items()}})
    fresh = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=2, precision="bf16")
    assert live.step(x, y)["energy"] == fresh.step(x, y)["energy"]
    net2 = pcdist.PCNetwork.from_dims([6, 8, 3], seed=0)
    tr = pcdist.PCTrainer(net2, torch.optim.SGD(net2.parameters(), lr=0.1), T=2, precision="bf16")
    tr.step(x, y)
    net2.double()
    with pytest.raises(ValueError, match=r"^precision='bf16' keeps float32 master weights .* the network is now "
                                         r"torch.float64 on cpu"):
        tr.step(x.double(), y.double())
    bare = pcdist.PCNetwork.from_layers([torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False), torch.nn.Tanh()),
                                         torch.nn.Linear(8, 3, bias=False)], input_shape=(6,))
    tr = pcdist.PCTrainer(bare, torch.optim.SGD(bare.parameters(), lr=0.1), T=2, precision="bf16")
    tr.step(x, y)  # its compute copy shares no parameter with it: the cast is seen by the master's own storage
    bare.double()
    with pytest.raises(ValueError, match=r"^precision='bf16' keeps float32 master weights .* the network is now "
                                         r"torch.float64 on cpu"):
        tr.step(x.double(), y.double())


def test_backprop_steps_its_schedule_on_a_skipped_update_as_pc_does(tmp_path):
    """The schedule counts training steps, skipped or not (engine/update.py; a resume positions it so): backprop
    under skip_above did not step it on a skipped update."""
    from pcdist.service.backprop import BackpropTrainer

    counts = {}
    for algorithm in ("pc", "bp"):
        net = pcdist.PCNetwork.from_dims([4, 8, 3], seed=0)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        sched = pcdist.warmup_cosine(opt, 1, 10)
        kw = dict(scheduler=sched, skip_above=0.0)
        tr = pcdist.PCTrainer(net, opt, T=2, **kw) if algorithm == "pc" else BackpropTrainer(net, opt, **kw)
        for s in range(4):
            tr.step(torch.randn(5, 4), torch.eye(3)[[0, 1, 2, 0, 1]])
        counts[algorithm] = sched.last_epoch, tr.skipped_updates
    assert counts == {"pc": (4, 4), "bp": (4, 4)}


@pytest.mark.parametrize("energy", ["se", "ce"])
def test_the_float64_backprop_twin_computes_in_float64(energy):
    """pc.algorithm=bp on a float64 network: its update is float64 autograd's on the network's own forward pass and
    the output energy (it cast the output to float32, a cast meant for bf16 autocast: gradients 5e-8 off)."""
    from pcdist.service.backprop import BackpropTrainer

    torch.manual_seed(0)
    net = pcdist.PCNetwork.from_dims([6, 9, 9, 4], energy=energy, seed=0, dtype=torch.float64)
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.eye(4, dtype=torch.float64)[[0, 1, 2, 3, 1]]
    u = net(x)
    loss = (0.5 * (y - u).square().sum() if energy == "se" else
            -(y * torch.log_softmax(u, dim=1)).sum()) / len(x)
    want = torch.autograd.grad(loss, list(net.parameters()))
    BackpropTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0)).step(x, y)
    for p, g in zip(net.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-13, atol=1e-15)


def test_bf16_on_a_network_without_bfloat16_products_says_it_runs_in_float32():
    """Every layer of the module kind (any nn.Module computes in float32): precision='bf16' ran bitwise as fp32 with
    no word, and a run's config said bf16; now a warning says so (the service's note line: "changes nothing here").
    A network with a dense layer has bfloat16 products and gets none."""
    from torch import nn

    def made(net):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), precision="bf16")
        return [str(w.message) for w in caught]

    modules = [nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6)), nn.Sequential(nn.Linear(6, 3), nn.LayerNorm(3))]
    assert made(pcdist.PCNetwork.from_layers(modules, input_shape=(4,))) == [
        "precision='bf16' changes nothing here: no layer has bfloat16 products (the module kind computes in "
        "float32), so this network runs in float32"]
    assert made(pcdist.PCNetwork.from_dims([4, 6, 3])) == []


def test_every_float32_switch_reads_as_before_after_a_trainer_set_tf32_whatever_api_the_caller_used():
    """(reviews rv111, rv118) A GPU trainer sets TF32 at each step (set_tf32) and a run puts the caller's switches
    back (restore_tf32). With torch's older and newer switches mixed by the caller (cudnn.conv.fp32_precision =
    "ieee", mkldnn.matmul = "bf16", cuda.matmul.allow_tf32 = True), 7 of 24 round trips changed a switch or made a
    read raise. Each switch now reads as before; one that could not be read (torch refuses to mix) may read after."""
    from pcdist.engine.precision import restore_tf32, set_tf32, tf32_state

    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip("this torch has no per-backend float32 precision switches (torch < 2.9)")
    ops = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")

    def switch(name):
        backend, op = name.split(".")
        return getattr(getattr(torch.backends, backend), op)

    def reads():
        out = {n: switch(n).fp32_precision for n in ops}
        out.update(("backend " + b, getattr(torch.backends, b).fp32_precision) for b in ("cudnn", "mkldnn"))
        out["global"] = torch.backends.fp32_precision
        for name, read in (("matmul", torch.get_float32_matmul_precision),
                           ("cuda", lambda: torch.backends.cuda.matmul.allow_tf32),
                           ("cudnn", lambda: torch.backends.cudnn.allow_tf32)):
            try:
                out[name] = read()
            except RuntimeError:
                out[name] = "unreadable"
        return out

    def default():
        torch.backends.fp32_precision = torch.backends.cudnn.fp32_precision = "none"
        torch.backends.mkldnn.fp32_precision = "none"
        for n in ops:
            switch(n).fp32_precision = "none"
        restore_tf32(("highest", True))

    callers = [lambda: None, lambda: torch.set_float32_matmul_precision("high"),
               lambda: torch.set_float32_matmul_precision("medium"),
               lambda: setattr(torch.backends.cudnn, "allow_tf32", False),
               lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
               lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "tf32"),
               lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
               lambda: setattr(torch.backends, "fp32_precision", "tf32"),
               lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"),
               lambda: setattr(torch.backends.mkldnn.conv, "fp32_precision", "bf16")]
    before = tf32_state()
    try:
        for i, caller in enumerate(callers):
            for on in (True, False):
                default()
                caller()
                want = reads()
                state = tf32_state()
                set_tf32(on)
                restore_tf32(state)
                got = reads()
                assert {k: v for k, v in got.items() if want[k] != "unreadable"} == \
                    {k: v for k, v in want.items() if v != "unreadable"}, (i, on)
    finally:
        default()
        restore_tf32(before)
