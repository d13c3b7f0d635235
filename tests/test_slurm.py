"""launch/slurm.sbatch on a real one-node SLURM (tests/slurm_cluster.py: Debian's slurm-wlm and munge,
proctrack/cgroup; one test under proctrack/linuxproc), jobs submitted with sbatch from a folder that is
not the checkout, as a user would.

Pre-emption is the point: under proctrack/cgroup SLURM signals only the processes a step started (here
launch/slurm_node.sh, the shell around torchrun's agent), never the training processes themselves, and a
signal that kills the agent loses everything since the last checkpoint. Each way SLURM stops a job (scancel
--signal=USR1, the warning before the time limit, its own pre-emption with a grace time, scancel) must end
with every rank checkpointing the same step, and a requeued (or resubmitted) run must end exactly where an
uninterrupted run ends: the same logged metrics at every step and the same weights.

The tests skip, saying why, where SLURM is not installed or its daemons cannot run (neither root nor
passwordless sudo) or do not start; with PCDIST_REQUIRE_SLURM=1 (.ci/run sets it) they fail instead. Where
only proctrack/cgroup cannot run, they run under proctrack/linuxproc, and test_proctrack_cgroup_ran skips
saying why.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from pcdist.service.metrics import read_metrics
from slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "slurm.sbatch"
# Where a stop signal lands does not depend on how long SLURM takes to deliver it: the test stops the workers
# (SIGSTOP) as soon as the first step is logged and continues them once the signal is pending (Job.wait_training,
# release), so that it lands a few steps in (step 8 to 10 on a 2-core machine, idle or loaded). Under SLURM's own
# pre-emption it was once seen at step 22 (SLURM may continue the step's processes itself before its SIGTERM
# reaches them through launch/slurm_node.sh): the run is several times longer than that.
STEPS = 100
# ckpt_every beyond the run: the only checkpoints are the pre-emption's and the last.
RUN = [f"trainer.max_steps={STEPS}", "trainer.log_every=5", f"trainer.eval_every={STEPS // 2}",
       "trainer.ckpt_every=1000", "logger=none", "logger.plots=false", "trainer.progress=off",
       "parallel.timeout_s=120", "pc.T=5"]  # T=5: half a step's cost
TWO_CPUS = ["--cpus-per-task=2"]  # two CPU processes: two layer slices
NOISE = ("Traceback", "TCPStore", "Exception raised from", "frame #", "ChildFailedError", "nanobind")


def required() -> bool:
    return os.environ.get("PCDIST_REQUIRE_SLURM") == "1"


def start_cluster(root: Path, proctrack: str) -> tuple[SlurmCluster | None, str]:
    """A started cluster, or None and why not."""
    why = SlurmCluster.unavailable(proctrack)
    if why:
        return None, why
    cluster = SlurmCluster(root / proctrack, proctrack)
    try:
        cluster.__enter__()
    except RuntimeError as e:
        return None, f"SLURM with proctrack/{proctrack} did not start here: {str(e)[:3000]}"
    return cluster, ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """proctrack/cgroup, as on most production clusters; where it cannot run here (the reason is kept for
    test_proctrack_cgroup_ran), proctrack/linuxproc, so that every test still runs. Skipped where no SLURM
    can run at all; with PCDIST_REQUIRE_SLURM=1 that fails instead."""
    root = tmp_path_factory.mktemp("slurm")
    c, why_not_cgroup = start_cluster(root, "cgroup")
    if c is None:
        c, why = start_cluster(root, "linuxproc")
        if c is None:
            if required():
                pytest.fail(f"PCDIST_REQUIRE_SLURM=1 but {why}")
            pytest.skip(why)
    c.why_not_cgroup = why_not_cgroup
    try:
        yield c
    finally:
        c.stop()


def test_proctrack_cgroup_ran(cluster, tmp_path):
    """The other tests ran under proctrack/cgroup (unless this skips, saying why): a job step's processes
    are in the step's own cgroup, which SLURM signals (the step's tasks only) and, at the end, kills."""
    if cluster.proctrack != "cgroup":
        pytest.skip(f"the SLURM tests ran under proctrack/linuxproc: {cluster.why_not_cgroup}")
    job = cluster.sbatch(["--output=cgroup.out", "--wrap", "srun cat /proc/self/cgroup"], cwd=tmp_path)
    assert cluster.wait_finished(job, timeout=900)["JobState"] == "COMPLETED"
    assert re.search(rf"/slurm\S*/uid_\d+/job_{job}/step_0", (tmp_path / "cgroup.out").read_text()), \
        (tmp_path / "cgroup.out").read_text()


def job_env(**extra: str) -> dict[str, str]:
    """The submitting shell's environment, as a user's: nothing of torchrun's or a job's own. PYTHON only
    where this interpreter is not the checkout's .venv (the script's default)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "PET_", "TORCHELASTIC_", "OMP_", "PCDIST_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                         "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    if Path(sys.executable) != ROOT / ".venv" / "bin" / "python":
        env["PYTHON"] = sys.executable
    # launch/slurm_node.sh repeats a stop signal every second, not 5: a stopping worker must ignore the repeats
    # (a worker killed by one as it exits would make torchrun restart the group).
    env["RESEND_S"] = "1"
    return {**env, **extra}


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # ended meanwhile
        pass


def _state(pid: int, signum: int) -> str:
    """"gone", "pending" (``signum`` waits in process ``pid``), "stopped" or "running"."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
    except OSError:
        return "gone"
    if status["State"].strip().startswith(("Z", "X")):
        return "gone"
    if (int(status["ShdPnd"], 16) | int(status["SigPnd"], 16)) >> (signum - 1) & 1:
        return "pending"
    return "stopped" if status["State"].strip().startswith(("T", "t")) else "running"


class Job:
    """A job submitted from ``folder`` (not the checkout): its id, log and run directory."""

    def __init__(self, cluster: SlurmCluster, folder: Path, sbatch_args: list[str], overrides: list[str],
                 run_name: str | None = None, script: Path = SCRIPT, **env: str):
        self.cluster, self.folder = cluster, folder
        folder.mkdir(parents=True, exist_ok=True)
        if run_name:
            env["RUN_NAME"] = run_name
        self.id = cluster.sbatch([*sbatch_args, str(script), *overrides], cwd=folder, env=job_env(**env))
        self.run_dir = folder / "runs" / (run_name or f"slurm-{self.id}")

    @property
    def log(self) -> str:
        path = self.folder / f"slurm-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def fields(self) -> dict[str, str]:
        return self.cluster.job(self.id)

    def wait(self, until, what: str, timeout: float = 900) -> dict[str, str]:
        try:
            return self.cluster.wait(self.id, until, timeout, what)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- job log:\n{self.log[-6000:]}") from None

    def wait_finished(self, timeout: float = 900) -> dict[str, str]:
        return self.wait(lambda f: f.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
                         "a final state", timeout)

    def wait_training(self, hold: bool = False, timeout: float = 900) -> list[int]:
        """Until the run has logged its first step (so a stop signal now lands in its training loop). With
        ``hold``, its workers are then stopped (SIGSTOP) at once, and returned: ``release`` continues them once
        the stop signal is pending in each, so that it lands a few steps into the run however fast the machine
        trains and however long SLURM takes to deliver it."""
        metrics = self.run_dir / "metrics.jsonl"
        deadline = time.monotonic() + timeout
        pids: list[int] = []
        next_look = 0.0
        while not (metrics.is_file() and metrics.stat().st_size > 0):
            if time.monotonic() >= next_look:  # the job's state and workers every 0.25 s, the log every 0.01 s
                state = self.fields().get("JobState")
                assert state in ("PENDING", "RUNNING", "CONFIGURING"), \
                    f"job ended ({state}) before training:\n{self.log}"
                assert time.monotonic() < deadline, f"no training step logged within {timeout} s:\n{self.log}"
                if hold:
                    pids = workers(self.id)
                next_look = time.monotonic() + 0.25
            time.sleep(0.01)
        if not hold:
            return []
        for pid in pids:  # the workers found already first: the fewer steps before the stop, the better
            _signal(pid, signal.SIGSTOP)
        pids = sorted(set(pids) | set(workers(self.id)))
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        assert pids, self.log
        return pids

    def release(self, pids: list[int], signum: int, timeout: float = 100) -> None:
        """Continue the workers ``wait_training(hold=True)`` stopped once ``signum`` is pending in each (or it
        ended). A worker found not stopped before its signal waits is stopped again: a SIGSTOP lands only when
        the process leaves the kernel (one in a disk write shows "D" meanwhile; continued then, the SIGCONT
        would cancel the pending stop and let the run train on before SLURM's signal comes), and scancel sends
        SIGCONT before SIGTERM. If its signal had landed already, launch/slurm_node.sh sends it again within
        RESEND_S (5 s). Within parallel.timeout_s (120 s): a rank that waits for a stopped one longer than
        that fails."""
        deadline = time.monotonic() + timeout
        ready: set[int] = set()
        while len(ready) < len(pids):
            for pid in set(pids) - ready:
                state = _state(pid, signum)
                if state in ("gone", "pending"):
                    ready.add(pid)
                elif state == "running":
                    _signal(pid, signal.SIGSTOP)
            if time.monotonic() > deadline:
                for pid in pids:
                    _signal(pid, signal.SIGCONT)
                raise AssertionError(f"{signal.Signals(signum).name} not passed on to the workers {pids} within "
                                     f"{timeout} s:\n{self.log[-6000:]}")
            time.sleep(0.002)
        for pid in pids:
            _signal(pid, signal.SIGCONT)

    def assert_clean_log(self) -> None:
        for noise in NOISE:
            assert noise not in self.log, f"{noise!r} in the job's log:\n{self.log[-6000:]}"


def learned(run_dir: Path) -> dict[int, dict]:
    """Every logged step's training and validation metrics (timings left out), merged per step."""
    rows: dict[int, dict] = {}
    for row in read_metrics(run_dir / "metrics.jsonl"):
        rows.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k.startswith(("train/", "val/"))})
    return rows


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted((run_dir / "checkpoints" / f"step-{step:08d}").glob("layers-*.pt")):
        state.update(torch.load(f, weights_only=True)["layers"])
    assert state, f"no checkpoint of step {step} in {run_dir}"
    return state


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """The same metrics at every step the uninterrupted run logged, and the same final weights."""
    got, want = learned(run_dir), learned(reference)
    assert max(want) == STEPS and max(got) == STEPS
    for step, row in want.items():
        assert got.get(step) == row, f"step {step}: {got.get(step)} != uninterrupted {row}"
    final, straight = weights(run_dir, STEPS), weights(reference, STEPS)
    assert final.keys() == straight.keys()
    for name in straight:
        assert torch.equal(final[name], straight[name]), f"{name} differs from the uninterrupted run's"


def preempted_step(job: Job) -> int:
    m = re.search(r"pre-empted after step (\d+); requeued job", job.log) or re.search(
        r"stopped after step (\d+), checkpointed", job.log)
    assert m, f"no pre-emption in the log:\n{job.log[-6000:]}"
    return int(m.group(1))


def assert_resumed(job: Job, step: int) -> None:
    """The pre-emption's checkpoint is the only one before the end, and the next attempt started from it."""
    assert 0 < step < STEPS, f"pre-empted after step {step}: not within the run (1..{STEPS - 1})"
    ckpts = sorted(p.name for p in (job.run_dir / "checkpoints").iterdir())
    assert ckpts == [f"step-{step:08d}", f"step-{STEPS:08d}"], f"{ckpts}\n{job.log[-8000:]}"
    assert len(list((job.run_dir / "checkpoints" / f"step-{step:08d}").glob("layers-*.pt"))) == 2, \
        "both layer slices wrote their part of the pre-emption's step"
    assert f"resumed from {job.run_dir / 'checkpoints' / f'step-{step:08d}'} at step {step}" in job.log
    assert not (job.run_dir / "PREEMPTED").exists(), "the script removes PREEMPTED once it has acted on it"


@pytest.fixture(scope="module")
def pair(cluster, tmp_path_factory) -> tuple[Job, Job, int]:
    """Two two-process jobs at once on the node, and something else already listening on the port the
    second job's id points to: (the first, the second, that port)."""
    folder = tmp_path_factory.mktemp("pair")
    first = Job(cluster, folder / "first", TWO_CPUS, RUN)
    second = Job(cluster, folder / "second", ["--hold", *TWO_CPUS], RUN)
    taken = 15000 + int(second.id) % 15000
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", taken))
        squatter.listen()
        cluster.run("scontrol", "release", second.id)
        for job in (first, second):
            job.wait_finished()
    return first, second, taken


@pytest.fixture(scope="module")
def reference(pair) -> Path:
    """An uninterrupted two-process run: what every interrupted run must end as. The first job of the pair
    (test_two_jobs_on_one_node_never_meet checks that it trained alone, on two ranks)."""
    first = pair[0]
    fields = first.fields()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", first.log
    assert "mesh: 2 ranks" in first.log, first.log
    return first.run_dir


def test_the_script_as_shipped_trains_on_a_cpu_only_cluster(cluster, tmp_path):
    """No sbatch options: no GPU or core count of the script's may stop a CPU cluster from taking the job.
    One allocated CPU is one process; the checkout is found from the submitted script's path although the
    job is submitted from another folder (SLURM runs a copy of the script from its spool)."""
    job = Job(cluster, tmp_path / "elsewhere", [], ["trainer.max_steps=30", "trainer.eval_every=30",
                                                    "logger=none", "trainer.progress=off"])
    fields = job.wait_finished()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", job.log
    header = job.log.splitlines()[0]
    assert re.match(rf"== .* job {job.id} attempt 1 on {cluster.node}: 1 node\(s\) x 1 processes \(one per allocated"
                    rf" CPU; NPROC_PER_NODE sets it\), 1 threads each; rendezvous {cluster.node}:\d+; run directory "
                    rf"runs/slurm-{job.id}; checkout {ROOT}$", header), header
    assert re.search(rf"^step 30: val/accuracy [\d.]+; run directory: {job.run_dir}$", job.log, re.M), job.log
    assert (job.run_dir / "checkpoints" / "step-00000030" / "manifest.json").is_file()
    job.assert_clean_log()


def test_a_checkout_whose_path_has_a_space_is_found_from_the_submitted_script(cluster, tmp_path):
    """The checkout is found from the submitted script's path (scontrol's Command=, the path then the
    arguments) also where that path holds spaces (it was cut at the first one: no checkout found), and where it
    is relative and the job runs in another folder (--chdir): it is relative to where sbatch ran (it was taken
    from the job's folder: no checkout found there, or another one). A RUN_DIR that Hydra would take apart
    (a,b: a sweep; [1]: a list) is that directory."""
    spaced = tmp_path / "my code" / "pcdist"
    spaced.parent.mkdir()
    spaced.symlink_to(ROOT)
    (workdir := tmp_path / "elsewhere" / "deeper" / "still").mkdir(parents=True)
    job = Job(cluster, tmp_path / "elsewhere", [f"--chdir={workdir}", f"--output={tmp_path}/elsewhere/slurm-%j.out"],
              ["trainer.max_steps=2", "trainer.eval_every=2", "logger=none", "trainer.progress=off"],
              script=Path("../my code/pcdist/launch/slurm.sbatch"), RUN_DIR="runs/a,b[1]")
    fields = job.wait_finished()
    assert fields["JobState"] == "COMPLETED", job.log
    assert (workdir / "runs/a,b[1]/checkpoints/step-00000002/manifest.json").is_file(), job.log
    assert job.log.splitlines()[0].endswith(f"; checkout {spaced}"), job.log


def test_a_gpu_job_runs_one_process_per_gpu(cluster, tmp_path):
    """--gpus-per-node=2 (the test node's GPUs are a count only: no device is visible, so the two processes
    train on the CPU): the processes per node come from SLURM_GPUS_ON_NODE, the threads from the CPUs."""
    job = Job(cluster, tmp_path, ["--gpus-per-node=2", "--cpus-per-task=4"],
              ["trainer.max_steps=10", "trainer.eval_every=10", "logger=none", "trainer.progress=off"])
    fields = job.wait_finished()
    assert fields["JobState"] == "COMPLETED", job.log
    assert "1 node(s) x 2 processes (one per GPU, SLURM_GPUS_ON_NODE=2), 2 threads each" in job.log
    assert "mesh: 2 ranks = parallel.data 1 x parallel.layer 2" in job.log


def test_scancel_usr1_checkpoints_requeues_and_the_next_attempt_ends_as_an_uninterrupted_run(cluster, reference,
                                                                                            tmp_path):
    """scancel --signal=USR1 (what the time-limit warning sends too): every rank finishes the same step and
    checkpoints it, the script requeues the job (same id, same run directory), the next attempt resumes
    there, and the log of both attempts is kept (--open-mode=append), with no traceback or C++ trace."""
    job = Job(cluster, tmp_path, TWO_CPUS, RUN)
    held = job.wait_training(hold=True)
    cluster.run("scancel", "--signal=USR1", job.id)
    job.release(held, signal.SIGUSR1)
    fields = job.wait(lambda f: f["JobState"] == "COMPLETED" or f["JobState"] in ("FAILED", "CANCELLED"),
                      "the end of the requeued job")
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", job.log
    step = preempted_step(job)
    assert f"{cluster.node}: got SIGUSR1; the workers finish their step" in job.log
    assert [int(a) for a in re.findall(rf"job {job.id} attempt (\d+) on", job.log)] == [1, 2]
    assert job.log.count("pre-empted: stopped by a signal after step") == 1, "one line for all ranks"
    assert_resumed(job, step)
    assert_same_run(job.run_dir, reference)
    job.assert_clean_log()


def test_a_preempted_task_of_an_array_is_requeued_alone(cluster, tmp_path):
    """A job array of two tasks submitted from another folder; USR1 to the last task (whose own job id is the
    array's): it checkpoints, is requeued and resumes, while the other task trains to its end untouched. The script
    requeued "$SLURM_JOB_ID", which scontrol reads as the whole array (the other task cancelled "due to job requeue",
    or run again once finished), and looked its checkout up in every task's record (no checkout found)."""
    steps = 1500
    run = [f"trainer.max_steps={steps}", "trainer.log_every=50", f"trainer.eval_every={steps}",
           "trainer.ckpt_every=100000", "logger=none", "logger.plots=false", "trainer.progress=off", "pc.T=5"]
    array = cluster.sbatch(["--array=0-1", *TWO_CPUS, str(SCRIPT), *run], cwd=tmp_path, env=job_env())
    tasks = [f"{array}_0", f"{array}_1"]
    logs = lambda: "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("slurm-*.out"))  # noqa: E731
    deadline = time.monotonic() + 600
    while len(list(tmp_path.glob("runs/slurm-*/metrics.jsonl"))) < 2:  # both tasks train
        states = [cluster.job(t).get("JobState") for t in tasks]
        assert all(s in ("PENDING", "RUNNING", "CONFIGURING") for s in states), f"{states}\n{logs()[-6000:]}"
        assert time.monotonic() < deadline, logs()[-6000:]
        time.sleep(0.2)
    cluster.run("scancel", "--batch", "--signal=USR1", tasks[1])
    done = [cluster.wait(t, lambda f: f.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 900, "its end")
            for t in tasks]
    assert [(f["JobState"], f["Restarts"]) for f in done] == [("COMPLETED", "0"), ("COMPLETED", "1")], logs()[-6000:]
    requeued, other = sorted((p.read_text(errors="replace") for p in tmp_path.glob("slurm-*.out")),
                             key=lambda log: "attempt 2 on" not in log)  # (each task's own log: slurm-<its id>.out)
    assert "attempt 2 on" in requeued and "resumed from" in requeued, logs()[-6000:]
    assert "attempt 2 on" not in other and "DUE TO JOB REQUEUE" not in other, other[-3000:]  # (the requeued task's
    # own log has SLURM's line of its requeue; the "requeued job" line may not: the requeue ends its script at once)


def test_slurm_preemption_sigterm_with_grace_time_requeues_and_resumes(cluster, reference, tmp_path):
    """SLURM's own pre-emption: a job of a higher-priority partition needs the node's CPUs; the running
    job's step gets SIGTERM and the partition's GraceTime (60 s) before SIGKILL. The run checkpoints and
    requeues itself, the pre-empting job runs, then the run resumes and ends as the uninterrupted one."""
    job = Job(cluster, tmp_path / "low", TWO_CPUS, RUN)
    held = job.wait_training(hold=True)
    high = cluster.sbatch(["--partition=high", "--cpus-per-task=4", "--wrap", "sleep 1"], cwd=tmp_path)
    job.release(held, signal.SIGTERM)
    fields = job.wait(lambda f: f["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"), "the end of the run")
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", job.log
    assert cluster.job(high)["JobState"] == "COMPLETED"
    assert f"{cluster.node}: got SIGTERM; the workers finish their step" in job.log
    assert_resumed(job, preempted_step(job))
    assert_same_run(job.run_dir, reference)
    job.assert_clean_log()


def test_the_time_limit_warning_preempts_and_requeues(cluster, tmp_path):
    """A time limit of a minute (scontrol update TimeLimit=1 once the run trains): the script's
    --signal=USR1@120 is due at once; SLURM sends it within its periodic check, the run checkpoints and the
    job is requeued. (Its next attempt gets the same warning: the test cancels it.) The warning goes to the batch
    script (B:USR1), which passes it on to the step; the limit is lowered once the run trains, so that it lands
    in the training loop."""
    # One process: it trains flat out until SLURM's periodic check sends the warning (up to half a minute), niced
    # (every thread) so that it does not slow the tests beside it: what it waits for is SLURM's clock.
    overrides = [o for o in RUN if not o.startswith(("trainer.max_steps", "trainer.eval_every"))]
    job = Job(cluster, tmp_path, [], ["trainer.max_steps=100000", "trainer.eval_every=150", *overrides])
    job.wait_training()
    pids = workers(job.id)
    assert pids, job.log
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(task.name), 19)
            except OSError:  # ended meanwhile
                pass
    cluster.run("scontrol", "update", f"JobId={job.id}", "TimeLimit=1")
    job.wait(lambda f: "requeued job" in job.log or f["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
             "a requeue", 300)
    cluster.run("scancel", job.id)
    step = preempted_step(job)
    assert (job.run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
    assert f"{cluster.node}: got SIGUSR1" in job.log
    job.wait_finished()


def test_scancel_checkpoints_without_requeue_and_a_resubmission_with_run_name_resumes(cluster, reference, tmp_path):
    """scancel (SIGTERM to the batch script and the step, SIGKILL after KillWait): the run still
    checkpoints, but a cancelled job is not requeued. Submitting again with the same RUN_NAME (a new job
    id) resumes runs/<RUN_NAME> and ends as the uninterrupted run."""
    job = Job(cluster, tmp_path, TWO_CPUS, RUN, run_name="named")
    held = job.wait_training(hold=True)
    cluster.run("scancel", job.id)
    job.release(held, signal.SIGTERM)
    fields = job.wait_finished()
    assert fields["JobState"] == "CANCELLED" and fields["Restarts"] == "0", job.log
    step = preempted_step(job)
    assert f"resume with RUN_DIR={job.run_dir} sbatch [its sbatch options] {SCRIPT}" in job.log  # (absolute, as the
    # workers' line: it was relative to the folder the job was submitted from)
    # (the workers' own line too: it named python train.py hydra.run.dir=..., which this script refuses)
    assert f"to resume: RUN_DIR={job.run_dir} sbatch [its sbatch options] {SCRIPT}" in job.log, job.log
    again = Job(cluster, tmp_path, TWO_CPUS, RUN, run_name="named")
    assert again.id != job.id and again.run_dir == job.run_dir
    fields = again.wait_finished()
    assert fields["JobState"] == "COMPLETED", again.log
    assert_resumed(again, step)
    assert_same_run(again.run_dir, reference)


def test_a_new_job_never_continues_a_run_that_an_earlier_job_of_its_id_left(cluster, reference, tmp_path):
    """SLURM's job ids start again when its state is reset: a new job whose default run directory
    (runs/slurm-<job id>) holds an earlier job's run refuses it in one line (resume=never), changing nothing in it,
    instead of resuming it as its own."""
    job = Job(cluster, tmp_path, ["--hold"], ["trainer.max_steps=10", "logger=none", "trainer.progress=off"])
    shutil.copytree(reference, job.run_dir)
    before = sorted((p.relative_to(job.run_dir), p.stat().st_mtime_ns) for p in job.run_dir.rglob("*"))
    cluster.run("scontrol", "release", job.id)
    fields = job.wait_finished()
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0" and fields["Restarts"] == "0", job.log
    errors = [line for line in job.log.splitlines() if not line.startswith("== ")]
    assert errors == [f"error: resume=never but runs/slurm-{job.id} holds a run (checkpoint step-{STEPS:08d}); set "
                      f"RUN_NAME=<name> or RUN_DIR=<path> for a new run, or RUN_DIR=runs/slurm-{job.id} to continue it"
                      ], job.log
    assert sorted((p.relative_to(job.run_dir), p.stat().st_mtime_ns) for p in job.run_dir.rglob("*")) == before


def test_usr1_while_the_job_checks_its_overrides_requeues_it_and_the_next_attempt_trains(cluster, tmp_path):
    """USR1 to the batch script (scancel --batch, and the time limit's warning: B:USR1) before srun has started
    the workers: the job was killed by it (or, sent to the steps, it was lost). The script catches it from its
    start, lets its checks finish and requeues the job; the next
    attempt trains the run to its end. Sent with scancel --full, which signals the script's children too: the
    checks ignore it (the check ran in a shell function's subshell, which USR1 killed, and the job failed). The
    checks are held until the script has said it got the signal (a PYTHON that waits for a file when it is
    train.py --check), so that it lands there however fast the machine is."""
    release = tmp_path / "release"
    python = tmp_path / "python"
    python.write_text(f"#!/usr/bin/env bash\nif [[ \" $* \" == *\" --check \"* ]]; then\n"
                      f"  while [[ ! -e {release} ]]; do sleep 0.1; done\nfi\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    job = Job(cluster, tmp_path / "run", [], ["trainer.max_steps=10", "trainer.eval_every=10", "logger=none",
                                              "trainer.progress=off"], PYTHON=str(python))
    job.wait(lambda f: f"job {job.id} attempt 1 on" in job.log or f["JobState"] not in ("PENDING", "CONFIGURING",
                                                                                          "RUNNING"), "the checks")
    cluster.run("scancel", "--full", "--signal=USR1", job.id)
    job.wait(lambda f: "got SIGUSR1" in job.log or f["JobState"] != "RUNNING", "the signal")
    release.touch()
    fields = job.wait(lambda f: f["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"), "the end of the job")
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", job.log
    assert "launch/slurm.sbatch: got SIGUSR1" in job.log and "before training started: the job is requeued once its " \
                                                            "checks end" in job.log
    assert f"== got SIGUSR1 before training started; requeued job {job.id}" in job.log
    assert [int(a) for a in re.findall(rf"job {job.id} attempt (\d+) on", job.log)] == [1, 2]
    assert sorted(p.name for p in (job.run_dir / "checkpoints").iterdir()) == ["step-00000010"], job.log
    assert f"new run in {job.run_dir}" in job.log and "resumed from" not in job.log
    job.assert_clean_log()


def test_usr1_as_srun_starts_reaches_the_workers_and_requeues(cluster, reference, tmp_path):
    """USR1 to the batch script as srun starts, before srun has set its own handler (held there by an srun on
    PATH that waits for a file, then runs the real one): it killed srun, and the job failed unrequeued; a
    moment later srun passed it on only once its step ran, and it was lost. srun now starts with USR1 ignored
    and the script sends it again every RESEND_S seconds until srun ends: the workers stop, the job is
    requeued, and the run ends as an uninterrupted one."""
    release = tmp_path / "release"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/usr/bin/env bash\necho '== srun held'\nwhile [[ ! -e {release} ]]; do "
                                  f"sleep 0.1; done\nexec {shutil.which('srun')} \"$@\"\n")
    (bin_dir / "srun").chmod(0o755)
    job = Job(cluster, tmp_path / "run", TWO_CPUS, RUN, PATH=f"{bin_dir}:{os.environ['PATH']}")
    job.wait(lambda f: "== srun held" in job.log or f["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING"),
             "srun")
    cluster.run("scancel", "--batch", "--signal=USR1", job.id)
    job.wait(lambda f: "got SIGUSR1" in job.log or f["JobState"] != "RUNNING", "the signal")
    release.touch()
    fields = job.wait(lambda f: f["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"), "the end of the job")
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", job.log
    assert "launch/slurm.sbatch: got SIGUSR1" in job.log and "passing it to the workers" in job.log
    assert f"{cluster.node}: got SIGUSR1; the workers finish their step" in job.log
    assert [int(a) for a in re.findall(rf"job {job.id} attempt (\d+) on", job.log)] == [1, 2]
    assert_same_run(job.run_dir, reference)
    job.assert_clean_log()


def workers(job_id: str) -> list[int]:
    """The training processes of the job: the children of its torchrun agent (launch/torchrun_agent.py, or
    torchrun itself)."""
    agents, parents = set(), {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            cmd = (stat.parent / "cmdline").read_bytes().split(b"\0")
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        pid = int(stat.parent.name)
        parents[pid] = ppid
        agent = cmd[1:3] == [b"-m", b"torch.distributed.run"] or b"".join(cmd[1:2]).endswith(b"/torchrun_agent.py")
        if agent and f"--rdzv_id={job_id}".encode() in cmd:
            agents.add(pid)
    return sorted(pid for pid, ppid in parents.items() if ppid in agents)


def test_a_crashed_worker_is_restarted_once_then_the_job_fails_without_requeue(cluster, tmp_path):
    """MAX_RESTARTS=1: a SIGKILLed worker makes torchrun restart the node's group, which resumes from the
    newest checkpoint; a second crash, with no restart left, fails the job (non-zero exit, not requeued:
    a crash is not a pre-emption), promptly, without hanging."""
    # 300 steps of T=20: the slower steps leave the second kill time to land before the run's end on a busy
    # machine (the run ends at the second kill). A checkpoint every 10 steps: the first kill after the first.
    # parallel.timeout_s=15: how long a neighbour of a killed rank may wait before the restart (docs/service.md).
    overrides = [o for o in RUN if not o.startswith(("trainer.max_steps", "trainer.eval_every", "trainer.ckpt_every",
                                                     "parallel.timeout_s", "pc.T"))]
    job = Job(cluster, tmp_path, TWO_CPUS, [*overrides, "trainer.max_steps=300", "trainer.eval_every=150",
                                            "trainer.ckpt_every=10", "parallel.timeout_s=15", "pc.T=20"],
              MAX_RESTARTS="1")
    job.wait(lambda f: (job.run_dir / "checkpoints" / "step-00000010" / "manifest.json").is_file()
             or f["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING"), "the first checkpoint", 300)
    crashed = workers(job.id)
    assert len(crashed) == 2, crashed
    os.kill(crashed[1], signal.SIGKILL)
    job.wait(lambda f: "resumed from" in job.log or f["JobState"] != "RUNNING", "the restarted group's resume", 300)
    restarted = workers(job.id)
    assert len(restarted) == 2 and not set(restarted) & set(crashed), (crashed, restarted)
    os.kill(restarted[0], signal.SIGKILL)
    fields = job.wait_finished(timeout=900)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0" and fields["Restarts"] == "0", job.log
    assert re.search(r"resumed from \S+/step-\d{8} at step", job.log), job.log
    assert "requeue" not in job.log


@pytest.mark.parametrize("sbatch_args, overrides, env, error", [
    ([], ["trainer.max_step=5"], {}, "error: unknown config key trainer.max_step; did you mean trainer.max_steps?"),
    (TWO_CPUS, [], {"NPROC_PER_NODE": "4"}, "error: 4 processes with parallel.data=1 leave 4 layer ranks, but the "
                                            "model has only 3 layers"),
    ([], [], {"NPROC_PER_NODE": "0"}, "launch/slurm.sbatch: error: NPROC_PER_NODE=0 is not a whole number >= 1"),
    ([], [], {"MAX_RESTARTS": "x"}, "launch/slurm.sbatch: error: MAX_RESTARTS=x is not a whole number >= 0"),
    (["--ntasks-per-node=2"], [], {}, "launch/slurm.sbatch: error: SLURM_TASKS_PER_NODE=2: the job needs exactly one "
                                      "task per node"),
    ([], ["++hydra.run.dir=/tmp/x"], {}, "launch/slurm.sbatch: error: ++hydra.run.dir=/tmp/x: the run directory is "
                                         "set with RUN_DIR=<path> or RUN_NAME=<name>"),  # (++: it got past before)
    ([], [], {"RUN_DIR": "it's"}, "launch/slurm.sbatch: error: RUN_DIR=it's: a run directory with a quote, a "
                                  "backslash or a $ is not supported; choose another"),
], ids=["override", "mesh", "nproc", "restarts", "tasks", "run-dir", "quote"])
def test_a_mistake_is_one_line_and_the_job_fails_before_any_worker_starts(cluster, tmp_path, sbatch_args, overrides,
                                                                          env, error):
    job = Job(cluster, tmp_path, sbatch_args, overrides, **env)
    fields = job.wait_finished(timeout=900)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0" and fields["Restarts"] == "0", job.log
    errors = [line for line in job.log.splitlines() if not line.startswith("== ")]
    assert len(errors) == 1 and errors[0].startswith(error), job.log
    assert not (job.run_dir / "metrics.jsonl").exists()


def test_two_jobs_on_one_node_never_meet(pair, reference):
    """Two two-process jobs at once on the node, and something else already listening on the port the
    second job's id points to: each job rendezvous on its own port and trains its own two ranks, so both
    end exactly as an uninterrupted run (a job that met the other would have trained 4 ranks, or hung).
    The first of them is the reference the pre-emption tests end as: the second must equal it."""
    first, second, taken = pair
    for job in (first, second):
        assert job.fields()["JobState"] == "COMPLETED", job.log
    ports = [int(re.search(r"rendezvous \S+:(\d+);", job.log).group(1)) for job in (first, second)]
    assert ports[1] != taken and ports[0] != ports[1], ports
    a, b = first.fields(), second.fields()
    assert b["StartTime"] < a["EndTime"], f"the jobs did not overlap: {a['StartTime']}-{a['EndTime']}, " \
                                          f"{b['StartTime']}-{b['EndTime']}"
    for job in (first, second):
        assert "mesh: 2 ranks" in job.log
        job.assert_clean_log()
    assert_same_run(second.run_dir, reference)


def test_usr1_preemption_under_proctrack_linuxproc(cluster, reference, tmp_path):
    """The same pre-emption under proctrack/linuxproc, which signals every process of the step (the agent
    and the workers too, directly): the agent must survive it there as well."""
    if cluster.proctrack == "linuxproc":
        linuxproc = cluster
    else:
        linuxproc, why = start_cluster(tmp_path / "slurm", "linuxproc")
        if linuxproc is None:
            pytest.fail(why)
    try:
        job = Job(linuxproc, tmp_path / "run", TWO_CPUS, RUN)
        held = job.wait_training(hold=True)
        linuxproc.run("scancel", "--signal=USR1", job.id)
        job.release(held, signal.SIGUSR1)
        fields = job.wait(lambda f: f["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"), "the end of the run")
        assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", job.log
        assert_resumed(job, preempted_step(job))
        assert_same_run(job.run_dir, reference)
        job.assert_clean_log()
    finally:
        if linuxproc is not cluster:
            linuxproc.stop()
