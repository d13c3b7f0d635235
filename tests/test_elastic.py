"""A worker SIGKILLed mid-run under torchrun --max-restarts=1: the restarted group resumes from
the newest valid checkpoint and ends with exactly the weights of an uninterrupted run, whether
the workers share the agent's rendezvous store (torch's default) or keep their own."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from spawn import run
from test_service import ROOT, _train_worker, layer_state, torchrun

# parallel.timeout_s=15: how long a neighbour of the killed rank may wait before the restart (docs/service.md).
COMMON = ["parallel.layer=2", "parallel.timeout_s=15", "trainer.max_steps=400", "trainer.ckpt_every=50",
          "trainer.eval_every=200", "trainer.log_every=50", "trainer.dtype=float64", "logger=none",
          "logger.plots=false", "trainer.progress=off",
          "pc.T=10"]  # T=10: cheaper steps, still 300 of them left when the worker is killed


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The weights of the uninterrupted run (2 real gloo ranks, tests/spawn.py: how it is launched changes nothing
    in its numbers)."""
    run_dir = tmp_path_factory.mktemp("straight")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # as torchrun sets it for several processes
        run(_train_worker, 2, [*COMMON, f"run_dir={run_dir}"], timeout=300)
    return layer_state(run_dir / "checkpoints/step-00000400")


@pytest.mark.parametrize("store", ["shared", "own"])
def test_sigkilled_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path, straight, store):
    """``shared``: torch's default, the workers use the agent's store, which outlives them and still holds
    the dead group's keys (pytorch/pytorch#135712; each attempt must use its own keys). ``own``:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, rank 0 hosts a new store per attempt."""
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "--monitor-interval=0.5", str(ROOT / "train.py"), *COMMON, f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(OMP_NUM_THREADS="1", **({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if store == "own" else {}))
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
    assert "pytorch/pytorch#135712" not in out, "no warning where restarts work"
    killed = layer_state(run_dir / "checkpoints/step-00000400")
    assert straight.keys() == killed.keys()
    for k in straight:
        torch.testing.assert_close(killed[k], straight[k], atol=1e-12, rtol=0, msg=k)


OWN_GROUP = """
import os
import torch.distributed as dist, pcdist
dist.init_process_group("gloo")  # the script's own group, on the keys every attempt shares
pcdist.init_distributed()
dist.destroy_process_group()
print("agent store", os.environ.get("TORCHELASTIC_USE_AGENT_STORE"))
"""


def test_a_group_created_outside_pcdist_is_warned_about_under_restarts(tmp_path):
    """Only a process group pcdist did not create can still read a dead attempt's keys; rank 0 says so."""
    script = tmp_path / "own_group.py"
    script.write_text(OWN_GROUP)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                          "--max-restarts=1", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    # torchrun hands its workers the agent's store from torch 2.5 on (torch 2.4's workers make their own: no warning)
    shared = out.stdout.split()[-1] == "True"
    assert shared or tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5), out.stdout
    assert out.stderr.count("call pcdist.init_distributed() instead of init_process_group") == int(shared)


def test_every_attempt_says_its_mesh_also_when_it_resumes_on_fewer_ranks(tmp_path, monkeypatch):
    """A run on 2 layer ranks continued by a torchrun of 1 process, as the surviving agent of a lost node does
    (fewer ranks, the same run directory): every attempt says its mesh, on the console and in train.log, so a
    run that went on with a different mesh never does so silently."""
    run_dir = tmp_path / "run"
    quick = ["trainer.max_steps=40", "trainer.ckpt_every=20", "trainer.eval_every=40", "trainer.log_every=20",
             "logger=none", "trainer.progress=off"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as torchrun sets it for several processes
    run(_train_worker, 2, [*quick, "trainer.stop_at=20", f"run_dir={run_dir}"])  # 2 real gloo ranks (tests/spawn.py)
    out = torchrun(1, *quick, f"hydra.run.dir={run_dir}")
    one = ("mesh: 1 rank = parallel.data 1 x parallel.layer 1 (parallel.layer = 1 process / parallel.data), 3 layers "
           "split into 1 slice; 1 torch thread per rank (OMP_NUM_THREADS)")
    assert one in out.stdout.splitlines(), out.stdout[-3000:]
    said = [line.split("  ", 1)[1] for line in (run_dir / "train.log").read_text().splitlines() if "  mesh: " in line]
    assert said == [one.replace("1 rank =", "2 ranks =")
                    .replace("parallel.layer 1 (parallel.layer = 1 process", "parallel.layer 2 (parallel.layer = 2 "
                             "processes").replace("into 1 slice", "into 2 slices"), one], said
    assert f"resumed from {run_dir / 'checkpoints/step-00000020'} at step 20" in out.stdout
