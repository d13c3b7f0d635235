"""Pre-emption: SIGTERM / SIGUSR1 make every rank finish its step, checkpoint and exit (status 3
for a single process, PREEMPTED in the run directory for the launcher); a rerun resumes."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import pcdist
from pcdist.service.checkpoint import latest_checkpoint
from pcdist.service.metrics import read_metrics
from test_elastic import children
from test_service import ROOT

LONG = ["trainer.max_steps=5000", "trainer.ckpt_every=4000", "trainer.log_every=20", "trainer.eval_every=4000",
        "logger=none", "logger.plots=false", "trainer.progress=off", "parallel.timeout_s=60"]


def start(cmd, run_dir, session=False):
    """Start ``cmd`` (in a session of its own, as a terminal's foreground job: ``session``) and wait until it logs."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=session)
    deadline = time.monotonic() + 120
    while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size > 0):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "training did not start logging within 120 s"
        time.sleep(0.05)
    return proc


def finish(proc, timeout=120):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"no exit within {timeout} s after the signal:\n{proc.communicate()[0][-4000:]}")
    return out


def test_sigterm_checkpoints_exits_3_and_the_rerun_resumes(tmp_path, capsys):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), *LONG, f"hydra.run.dir={run_dir}"]
    proc = start(cmd, run_dir)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 3, out[-3000:]
    step = int((run_dir / "PREEMPTED").read_text())
    assert 0 < step < 4000 and f"pre-empted: stopped by a signal after step {step}" in out
    assert f"  pre-empted: stopped by a signal after step {step}" in (run_dir / "train.log").read_text(), \
        "the run's record says so too (a requeued job's reader has train.log)"
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / f"step-{step:08d}"
    capsys.readouterr()
    pcdist.train([*LONG, f"trainer.stop_at={step + 5}", f"run_dir={run_dir}"])  # the rerun, as train.py runs it
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{step:08d}'} at step {step}" in capsys.readouterr().out
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / f"step-{step + 5:08d}"
    assert not (run_dir / "PREEMPTED").exists(), "the resumed run removed the stop's record"


def test_sigterm_to_the_process_group_of_a_streamed_run_checkpoints(tmp_path):
    """SIGTERM to the whole process group (GNU timeout, kill -- -PGID, a bare torchrun's agent, a SLURM step) of a
    run streaming its data with a DataLoader worker: the worker died of it, and torch's SIGCHLD handler raised in
    the training process mid-step (three tracebacks, no pre-emption checkpoint, no PREEMPTED). The workers now
    ignore the stop signals; the run checkpoints and exits 3 as with no workers."""
    import numpy as np

    arrays = tmp_path / "arrays"
    arrays.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 320), ("val", 40)):
        np.save(arrays / f"x_{split}.npy", rng.standard_normal((n, 12)).astype("float32"))
        np.save(arrays / f"y_{split}.npy", rng.integers(0, 4, n))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), *LONG, "data=arrays", f"data.path={arrays}/", "data.num_workers=1",
           "model.dims=[12,8,8,4]", "pc.x_lr=0.1", f"hydra.run.dir={run_dir}"]
    proc = start(cmd, run_dir, session=True)
    os.killpg(proc.pid, signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 3 and "Traceback" not in out, out[-3000:]
    step = int((run_dir / "PREEMPTED").read_text())
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / f"step-{step:08d}"


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """SIGUSR1 (SLURM's warning) to one torchrun worker only: both ranks checkpoint the same step and stop."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), "parallel.layer=2", *LONG, f"hydra.run.dir={run_dir}"]
    proc = start(cmd, run_dir)
    workers = children(proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGUSR1)
    out = finish(proc)
    assert proc.returncode != 0, "torchrun reports the stopped workers as failed; PREEMPTED tells why"
    step = int((run_dir / "PREEMPTED").read_text())
    ckpt = latest_checkpoint(run_dir)
    assert ckpt == run_dir / "checkpoints" / f"step-{step:08d}"
    assert len(list(ckpt.glob("layers-*.pt"))) == 2, "both layer slices wrote their part of the same step"
    assert "stopped by a signal after step" in out


def interrupted_step(out: str, run_dir) -> int:
    """The step of the one 'interrupted:' line, which names the checkpoint and how to resume."""
    lines = [line for line in out.splitlines() if line.startswith("interrupted: ")]
    assert len(lines) == 1, out[-3000:]
    step = int(re.search(r"after step (\d+);", lines[0]).group(1))
    assert lines[0] == (f"interrupted: stopped by Ctrl-C (SIGINT) after step {step}; checkpoint "
                        f"{run_dir / 'checkpoints' / f'step-{step:08d}'}; to resume: python train.py "
                        f"hydra.run.dir={run_dir}")
    assert f"  {lines[0]}\n" in (run_dir / "train.log").read_text(), "train.log holds the line too"
    return step


def test_ctrl_c_checkpoints_says_how_to_resume_and_no_step_repeats(tmp_path, capsys):
    """Ctrl-C is handled like SIGTERM: the step finishes, a checkpoint of it is written, one line says how to
    resume, no traceback. Exit status 130 and no PREEMPTED (the user stopped it: no launcher requeues it). The
    rerun resumes from that step, and metrics.jsonl never holds a step twice."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), *LONG, f"hydra.run.dir={run_dir}"]
    proc = start(cmd, run_dir)
    proc.send_signal(signal.SIGINT)
    out = finish(proc)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    step = interrupted_step(out, run_dir)
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / f"step-{step:08d}"
    assert not (run_dir / "PREEMPTED").exists()
    capsys.readouterr()
    pcdist.train([*LONG, f"trainer.stop_at={step + 30}", f"run_dir={run_dir}"])  # the rerun, as train.py runs it
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{step:08d}'} at step {step}" in capsys.readouterr().out
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/energy" in r]
    assert steps == sorted(set(steps)) and steps[-1] == step + 30, steps


def test_ctrl_c_to_torchrun_stops_every_rank_after_the_same_step(tmp_path):
    """Ctrl-C at the terminal reaches torchrun's agent (the workers run in sessions of their own), which passes
    SIGINT on to every worker: both layer ranks finish the same step and write their part of its checkpoint; one
    line says so, and no worker prints a traceback (torchrun's agent reports the signal itself)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), "parallel.layer=2", *LONG, f"hydra.run.dir={run_dir}"]
    proc = start(cmd, run_dir, session=True)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the foreground process group
    out = finish(proc)
    step = interrupted_step(out, run_dir)
    ckpt = latest_checkpoint(run_dir)
    assert ckpt == run_dir / "checkpoints" / f"step-{step:08d}"
    assert len(list(ckpt.glob("layers-*.pt"))) == 2, "both layer slices wrote their part of the same step"
    assert "KeyboardInterrupt" not in out and "pcdist/" not in out, out[-3000:]
    assert not (run_dir / "PREEMPTED").exists()


SECOND_CTRL_C = textwrap.dedent("""
    import os, signal, sys, torch, pcdist
    from pcdist.data import StreamedData

    class Pressed(torch.utils.data.Dataset):
        '''The digits, read one sample at a time; Ctrl-C is pressed while sample `at` is read, and again at the next.'''
        def __init__(self, x, y, at):
            self.x, self.y, self.at, self.reads = x, y, at, 0
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            self.reads += 1
            if self.reads in (self.at, self.at + 1):
                os.kill(os.getpid(), signal.SIGINT)
            return self.x[i], int(self.y[i])

    d = pcdist.data.load_digits()
    at = int(sys.argv[2])
    data = StreamedData(Pressed(d.x_train, d.y_train, at), torch.utils.data.TensorDataset(d.x_val, d.y_val), 10)
    pcdist.train({"run_dir": sys.argv[1], "logger": "none", "data": {"num_workers": 0},
                  "trainer": {"max_steps": 40, "ckpt_every": 4, "log_every": 1, "eval_every": 40, "batch_size": 16,
                              "progress": "off"}}, data=data)
    print("finished")
""")


def test_a_second_ctrl_c_exits_at_once_without_a_checkpoint(tmp_path):
    """Ctrl-C, then Ctrl-C again before the stop is done (both pressed while step 7's batch is read): the process
    stops at once, exit status 130, with one line saying how to resume and no traceback; the newest checkpoint is
    the one before the first Ctrl-C (step 4), intact, and the run resumes from it."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", SECOND_CTRL_C, str(run_dir), str(6 * 16 + 3)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 130, out.stdout[-2000:] + out.stderr[-3000:]
    assert "finished" not in out.stdout and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (  # (and how to resume: it said none)
        f"second Ctrl-C: stopped at once, before the checkpoint of this step (the run directory keeps its newest "
        f"checkpoint); to resume: pcdist.train({{'run_dir': '{run_dir}'}}, data=...) with the same data"), \
        out.stderr[-3000:]
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step-00000004"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000004"]
    last = (run_dir / "train.log").read_text().splitlines()[-1]  # the run's record says how it ended (it did not)
    assert last.endswith("  " + out.stderr.strip().splitlines()[-1]), last
    import torch
    from pcdist.data import StreamedData

    d = pcdist.data.load_digits()
    data = StreamedData(*(torch.utils.data.TensorDataset(x, y) for x, y in ((d.x_train, d.y_train),
                                                                             (d.x_val, d.y_val))), 10)
    resumed = pcdist.train({"run_dir": str(run_dir), "logger": "none", "data": {"num_workers": 0}}, data=data)
    assert resumed["step"] == 40 and [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")
                                      if "train/energy" in r] == list(range(1, 41)), "resumed from step 4"


SIGNAL_AT_START = textwrap.dedent("""
    import os, signal, sys, torch, pcdist
    from pcdist.data import StreamedData, load_digits
    from pcdist.service.preemption import Preempted

    class Digits(torch.utils.data.Dataset):  # sends the signal as the run reads its first batch (pc.x_lr=auto)
        def __init__(self, x, y, sig=None):
            self.x, self.y, self.sig = x, y, sig
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            if self.sig is not None:
                os.kill(os.getpid(), self.sig)
                self.sig = None
            return self.x[i], int(self.y[i])

    d, sig, run_dir, steps = load_digits(), getattr(signal, sys.argv[1]), sys.argv[2], int(sys.argv[3])
    mine = lambda signum, frame: print("the caller's own handler", flush=True)
    signal.signal(signal.SIGTERM, mine)
    train = Digits(d.x_train, d.y_train)
    data = StreamedData(train, Digits(d.x_val, d.y_val), 10)  # (it reads sample 0 to know the shape)
    train.sig = sig
    cfg = {"run_dir": run_dir, "logger": "none", "logger.plots": False, "data.num_workers": 0,
           "trainer": {"max_steps": steps, "ckpt_every": 400, "progress": "off"}}
    try:
        print("finished at step", pcdist.train(cfg, data=data)["step"], flush=True)
    except Preempted as e:
        print("stopped:", e.signal == sig, isinstance(e, Exception), isinstance(e, KeyboardInterrupt), flush=True)
    print("handlers:", signal.getsignal(signal.SIGTERM) is mine, signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL,
          signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the caller's handler again, not a recorded stop
""")


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM", "SIGINT"])
def test_a_stop_signal_during_the_start_stops_after_its_second_step_and_handlers_come_back(tmp_path, sig):
    """SIGUSR1, SIGTERM or Ctrl-C while the run starts (reading its first batches for pc.x_lr=auto, after it made
    its files): recorded, so the run stops after its second step (each step reads the stop vote of the step
    before), with its checkpoint (SIGUSR1 killed the process outright, without a line or PREEMPTED); pre-empted
    (PREEMPTED written), or interrupted by the user (none). pcdist.train raises a Preempted that is no Exception
    (a caller's `except Exception` around each run had caught a Ctrl-C and gone on to its next run), for Ctrl-C
    a KeyboardInterrupt too. When pcdist.train returns or raises, the caller's handlers of SIGTERM, SIGUSR1 and
    SIGINT are back (a script ignored SIGTERM and SIGUSR1 after its first pcdist.train)."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", SIGNAL_AT_START, sig, str(run_dir), "500"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    ctrl_c = sig == "SIGINT"
    assert lines[-3:] == [f"stopped: True False {ctrl_c}", "handlers: True True True", "the caller's own handler"], \
        out.stdout
    said = "interrupted: stopped by Ctrl-C (SIGINT)" if ctrl_c else "pre-empted: stopped by a signal"
    assert any(line.startswith(f"{said} after step 2;") for line in lines), out.stdout
    if ctrl_c:
        assert not (run_dir / "PREEMPTED").exists()
    else:
        assert (run_dir / "PREEMPTED").read_text() == "2\n"
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step-00000002"


def test_a_stop_voted_at_the_last_step_ends_the_run_as_finished(tmp_path):
    """A stop signal whose vote lands on the run's last step (here: sent during the start of a 2-step run): the
    run ends as it would have, finished, with its last line and no PREEMPTED (it was left in the finished run,
    which no rerun trains again, so none removed it, and a launcher requeued the job)."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", SIGNAL_AT_START, "SIGUSR1", str(run_dir), "2"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[-3:] == ["finished at step 2", "handlers: True True True", "the caller's own handler"], out.stdout
    assert lines[-4].startswith("step 2: val/accuracy ") and not (run_dir / "PREEMPTED").exists()


CTRL_C_AT_IMPORT = textwrap.dedent("""
    import os, runpy, signal, sys
    module, entry, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    stop = getattr(signal, os.environ.get("STOP_SIGNAL", "SIGINT"))
    class CtrlC:  # Ctrl-C (or STOP_SIGNAL) as `module` starts importing, the first time
        def find_spec(self, name, path=None, target=None):
            if name == module:
                sys.meta_path.remove(self)
                os.kill(os.getpid(), stop)
    sys.meta_path.insert(0, CtrlC())
    if entry == "-m":  # as python -m pcdist: argv[0] is "-m" while the package imports
        sys.argv = ["-m", *args]
        runpy.run_module("pcdist", run_name="__main__", alter_sys=True)
    else:
        sys.argv = [entry, *args]
        runpy.run_path(entry, run_name="__main__")
""")


@pytest.mark.parametrize("entry,module,said", [
    ("train.py", "numpy", "interrupted (Ctrl-C) while starting: nothing was run"),  # inside torch's own import
    ("-m", "numpy", "interrupted (Ctrl-C) while starting: nothing was run"),
    ("train.py", "torch.nn", "interrupted (Ctrl-C) while starting: nothing was run"),
    ("train.py", "pcdist.service.commands", "interrupted (Ctrl-C) while starting: nothing was run"),  # the checks
])
def test_ctrl_c_while_the_command_line_starts_is_one_line_and_leaves_nothing(tmp_path, entry, module, said):
    """Ctrl-C while train.py or python -m pcdist imports torch and pcdist, or checks its command line: status
    130, one line, no traceback, no run directory. Inside torch's import of numpy the KeyboardInterrupt was
    swallowed (torch's C++ clears that import's error): the run went on with numpy half-imported."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", CTRL_C_AT_IMPORT, module, str(ROOT / entry) if entry != "-m" else entry,
                          "trainer.max_steps=5", "logger=none", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert (out.returncode, out.stderr) == (130, said + "\n"), out.stdout[-2000:] + out.stderr[-3000:]
    assert not run_dir.exists() and "new run in" not in out.stdout


def test_sigterm_while_the_data_loads_is_one_line_and_leaves_nothing(tmp_path):
    """(review rv117) SIGTERM before the first training step (here as the digits are split: a data set that takes
    minutes to load, a SLURM pre-emption there) ended the process by the signal without a word; Ctrl-C said so."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", CTRL_C_AT_IMPORT, "numpy.random", str(ROOT / "train.py"),
                          "trainer.max_steps=5", "logger=none", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1", STOP_SIGNAL="SIGTERM"))
    assert (out.returncode, out.stderr) == (-signal.SIGTERM, "stopped by SIGTERM while starting (before the first "
                                            "training step): nothing was trained\n"), out.stdout + out.stderr[-3000:]
    assert not run_dir.exists()


def test_a_ctrl_c_while_the_finished_run_draws_its_pictures_names_the_checkpoint_kept(tmp_path):
    """(review rv117) The line said "without a checkpoint of its own", as if the finished run's were lost."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", CTRL_C_AT_IMPORT, "matplotlib", str(ROOT / "train.py"),
                          "trainer.max_steps=3", "pc.T=2", "logger=none", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert (out.returncode, out.stderr) == (130, f"interrupted (Ctrl-C) outside the training steps: stopped at once; "
                                                 f"the run's newest checkpoint is kept: {run_dir}/checkpoints/"
                                                 f"step-00000003\n"), out.stdout + out.stderr[-3000:]


def test_a_ctrl_c_after_the_last_step_stops_the_end_of_run_trace_at_once(tmp_path, monkeypatch):
    """Once the last step is checkpointed, what is left (the trace of the inference, the pictures, the last line)
    can stop at once: a Ctrl-C there was caught as in training, then ignored (the next one stopped the process).
    Here it comes as the trace starts: KeyboardInterrupt, the run finished and checkpointed."""
    from pcdist.engine.trainer import PCTrainer

    trace = PCTrainer.trace

    def interrupted(self, x, y):
        os.kill(os.getpid(), signal.SIGINT)
        return trace(self, x, y)

    monkeypatch.setattr(PCTrainer, "trace", interrupted)
    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        pcdist.train({"run_dir": str(run_dir), "logger": {"name": "none", "plots": False},
                      "trainer": {"max_steps": 3, "progress": "off"}, "pc": {"T": 2}})
    assert latest_checkpoint(run_dir).name == "step-00000003"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
