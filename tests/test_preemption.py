"""Pre-emption: SIGTERM / SIGUSR1 make every rank finish its step, checkpoint and exit (status 3
for a single process, PREEMPTED in the run directory for the launcher); a rerun resumes."""

import os
import signal
import subprocess
import sys
import time

from pcdist.service.checkpoint import latest_checkpoint
from test_elastic import children
from test_service import ROOT

LONG = ["trainer.max_steps=5000", "trainer.ckpt_every=4000", "trainer.log_every=20", "trainer.eval_every=4000",
        "logger=none", "trainer.progress=off", "parallel.timeout_s=60"]


def start(cmd, run_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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


def test_sigterm_checkpoints_exits_3_and_the_rerun_resumes(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), *LONG, f"hydra.run.dir={run_dir}"]
    proc = start(cmd, run_dir)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 3, out[-3000:]
    step = int((run_dir / "PREEMPTED").read_text())
    assert 0 < step < 4000 and f"pre-empted: stopped by a signal after step {step}" in out
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / f"step-{step:08d}"
    rerun = subprocess.run([*cmd[:2], *LONG, f"trainer.stop_at={step + 5}", f"hydra.run.dir={run_dir}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{step:08d}'} at step {step}" in rerun.stdout
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / f"step-{step + 5:08d}"


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
