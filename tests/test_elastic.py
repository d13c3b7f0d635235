"""A worker SIGKILLed mid-run under torchrun --max-restarts=1: the restarted group resumes from
the newest valid checkpoint and ends with exactly the weights of an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from test_service import ROOT, layer_state, torchrun

COMMON = ["parallel.layer=2", "parallel.timeout_s=60", "trainer.max_steps=400", "trainer.ckpt_every=50", "trainer.eval_every=200",
          "trainer.log_every=50", "trainer.dtype=float64", "logger=none", "trainer.progress=off"]


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_sigkilled_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path):
    torchrun(2, *COMMON, f"hydra.run.dir={tmp_path / 'straight'}")
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "--monitor-interval=0.5", str(ROOT / "train.py"), *COMMON, f"hydra.run.dir={run_dir}"]
    # torchrun's workers must not share the rendezvous store: on a restart they would read the
    # dead group's addresses (pytorch/pytorch#135712). launch/ scripts set the same.
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "checkpoints" / "step-00000100").is_dir():
            assert proc.poll() is None, f"the run ended before it could be interrupted:\n{proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint at step 100 within 180 s"
            time.sleep(0.05)
        workers = children(proc.pid)
        assert len(workers) == 2, f"expected 2 workers under the torchrun agent, found {workers}"
        os.kill(workers[1], signal.SIGKILL)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            raise AssertionError(f"the killed run did not finish within 120 s:\n{out[-5000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    (tmp_path / "torchrun.log").write_text(out)
    assert proc.returncode == 0, out[-4000:]
    assert "resumed from" in out and "step-0000" in out, "the restarted group must resume from a checkpoint"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE is not 1" not in out
    straight = layer_state(tmp_path / "straight/checkpoints/step-00000400")
    killed = layer_state(run_dir / "checkpoints/step-00000400")
    assert straight.keys() == killed.keys()
    for k in straight:
        torch.testing.assert_close(killed[k], straight[k], atol=1e-12, rtol=0, msg=k)


def test_restarts_with_a_shared_store_are_warned_about(tmp_path):
    """--max-restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 would fail at the first restart;
    rank 0 says so (once) when the run starts, naming the variable."""
    out = torchrun(2, "parallel.layer=2", "trainer.max_steps=2", "trainer.eval_every=2", "logger=none",
                   "trainer.progress=off", f"hydra.run.dir={tmp_path}", launcher=("--max-restarts=1",),
                   unset=("TORCH_DISABLE_SHARE_RDZV_TCP_STORE",))
    assert out.stderr.count("export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun") == 1
