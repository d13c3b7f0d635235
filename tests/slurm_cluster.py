"""A real one-node SLURM cluster on this machine, for tests: munged, slurmctld and slurmd (Debian's
``slurm-wlm`` and ``munge``), started by hand with their own key, sockets, ports, spool and state under
one folder, and torn down at the end. Jobs are submitted with the real ``sbatch`` and run as the
caller (root: the daemons must be root to switch users and to manage cgroups).

    with SlurmCluster(tmp_path, proctrack="cgroup") as cluster:
        job = cluster.sbatch(["launch/slurm.sbatch", "trainer.max_steps=10"], cwd=tmp_path)
        cluster.wait_state(job, "COMPLETED")

``SlurmCluster.unavailable()`` says why no cluster can run here (None if one can): no slurm-wlm or
munge installed, not root, or (proctrack/cgroup) no writable cgroup v1 freezer or cgroup v2 hierarchy.

The node is declared with more CPUs than the machine has (``SlurmdParameters=config_overrides``),
so that two jobs of two CPU processes each fit on a small CI machine, and with two GPUs that are
only a count (``gres.conf`` without device files: no CUDA device is ever visible), so that a job
that asks for GPUs sees SLURM's GPU variables. Two partitions: ``debug`` (the default) and ``high``,
whose jobs pre-empt debug's (``preempt/partition_prio``, ``PreemptMode=REQUEUE``, ``GraceTime``).
``cred_expire`` is lowered from 120 s to 10 s (how long SLURM holds a requeued job before it may start
again), and the scheduler's periodic pass from every 60 s to every 2 s (it starts a requeued job once
the hold is over).

Run it by hand to try things: ``python tests/slurm_cluster.py /tmp/slurm`` starts a cluster and prints
the ``SLURM_CONF`` to export; Ctrl-C stops it.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo", "squeue")
NODE_CPUS = 4
NODE_GPUS = 2
GRACE_S = 60
CRED_EXPIRE_S = 10
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)),
                                      None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _running() -> set[str]:
    """The names (comm) of the processes running here."""
    names = set()
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            names.add(comm.read_text().strip())
        except OSError:
            pass
    return names


def cgroup_problem() -> str | None:
    """Why proctrack/cgroup cannot run here, or None: SLURM 22.05 needs the cgroup v1 freezer
    controller mounted and writable (cgroup/v1), or a writable unified cgroup v2 hierarchy (cgroup/v2)."""
    mounts = Path("/proc/self/mounts").read_text().split("\n")
    freezer = [m.split()[1] for m in mounts if m.split()[2:3] == ["cgroup"] and "freezer" in m.split()[3].split(",")]
    if freezer:
        probe = Path(freezer[0]) / f"pcdist-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
            return None
        except OSError as e:
            return f"the cgroup v1 freezer hierarchy {freezer[0]} is not writable ({e.strerror})"
    if Path("/sys/fs/cgroup/cgroup.controllers").is_file():
        return None if os.access("/sys/fs/cgroup", os.W_OK) else "/sys/fs/cgroup (cgroup v2) is not writable"
    return "no cgroup v1 freezer controller and no cgroup v2 hierarchy is mounted"


def cgroup_version() -> str:
    """The cgroup plugin SLURM picks here: v1 when the freezer controller is mounted as cgroup v1."""
    mounts = Path("/proc/self/mounts").read_text()
    return "cgroup/v1" if re.search(r"^\S+ \S+ cgroup \S*freezer", mounts, re.M) else "cgroup/v2"


class SlurmCluster:
    """munged + slurmctld + slurmd under ``root``; ``proctrack`` is ``cgroup`` or ``linuxproc``."""

    def __init__(self, root: Path, proctrack: str = "cgroup"):
        self.root = Path(root)
        self.proctrack = proctrack
        self.procs: dict[str, subprocess.Popen] = {}
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "etc" / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.version = ""

    @staticmethod
    def unavailable(proctrack: str = "cgroup") -> str | None:
        """Why a cluster cannot be started here, or None."""
        missing = [n for n in (*DAEMONS, *CLIENTS) if _which(n) is None]
        if missing:
            return (f"SLURM is not installed ({', '.join(missing)} not found): apt-get install slurm-wlm munge "
                    "(.ci/run does)")
        if os.geteuid() != 0:
            return "the SLURM daemons must run as root (slurmd switches users and manages cgroups)"
        if proctrack == "cgroup":
            problem = cgroup_problem()
            if problem:
                return f"proctrack/cgroup cannot run in this container: {problem}"
        return None

    # --- start and stop -------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 120) -> None:
        for d in ("etc", "munge", "state", "spool", "log", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # munged refuses a socket folder that others may write to
        self._start_munge()
        self._write_config()
        for daemon in ("slurmctld", "slurmd"):
            log = open(self.root / "log" / f"{daemon}.out", "w")  # noqa: SIM115 (closed with the process)
            args = [_which(daemon), "-D", "-f", str(self.conf)] + (["-i"] if daemon == "slurmctld" else [])
            if daemon == "slurmd":
                args += ["-N", self.node]
            self.procs[daemon] = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            state = subprocess.run(["sinfo", "-h", "-n", self.node, "-o", "%T"], env=self.env, capture_output=True,
                                   text=True).stdout.strip()
            if state.rstrip("*") in ("idle", "mixed", "allocated"):
                break
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}) while starting:\n{self.logs(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node is not idle after {timeout} s (sinfo: {state!r}):\n"
                                   f"{self.logs('slurmctld')}\n{self.logs('slurmd')}")
            time.sleep(0.2)
        self.version = subprocess.run(["sinfo", "--version"], env=self.env, capture_output=True,
                                      text=True).stdout.strip()

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = self.root / "munge" / "munge.socket"
        log = open(self.root / "log" / "munged.out", "w")  # noqa: SIM115
        self.procs["munged"] = subprocess.Popen(
            [_which("munged"), "-F", "-f", f"--socket={self.socket}", f"--key-file={key}",
             f"--pid-file={self.root / 'run' / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}",
             f"--seed-file={self.root / 'munge' / 'munged.seed'}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.logs('munged')}")
            time.sleep(0.05)

    def _write_config(self) -> None:
        r = self.root
        # A job-id range of its own: slurmd names cgroups by job id, and another cluster may run beside this one.
        first_job = random.randrange(1000, 60_000_000, 1000)
        cgroup = "cgroup/v1" if cgroup_version() == "cgroup/v1" else "cgroup/v2"
        self.conf.write_text(f"""\
ClusterName=pcdist-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}
SlurmdPidFile={r / 'run' / 'slurmd.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/{self.proctrack}
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=3600
KillWait=30
FirstJobId={first_job}
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
GresTypes=gpu
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} Gres=gpu:{NODE_GPUS} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={GRACE_S}
PartitionName=high Nodes={self.node} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
""")
        # GPUs in name only: SLURM drops a GPU without a device file, so each is an empty file here.
        (r / "dev").mkdir(exist_ok=True)
        for i in range(NODE_GPUS):
            (r / "dev" / f"gpu{i}").touch()
        (r / "etc" / "gres.conf").write_text(f"AutoDetect=off\nName=gpu File={r / 'dev'}/gpu[0-{NODE_GPUS - 1}]\n")
        (r / "etc" / "cgroup.conf").write_text(f"CgroupPlugin={cgroup}\nCgroupMountpoint=/sys/fs/cgroup\n")

    def stop(self) -> None:
        """Cancel every job, wait for the node to be empty, then stop the daemons (slurmd first)."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "-u", str(os.getuid())], env=self.env, capture_output=True)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and subprocess.run(
                    ["squeue", "-h", "-t", "RUNNING,COMPLETING"], env=self.env, capture_output=True,
                    text=True).stdout.strip():
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._remove_cgroups()

    def _remove_cgroups(self) -> None:
        """Remove the (empty) cgroups slurmd made, unless another slurmd runs here and may still use them."""
        if self.proctrack != "cgroup" or "slurmd" in _running():
            return
        for top in Path("/sys/fs/cgroup").glob(f"*/slurm_{self.node}"):
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
                try:
                    d.rmdir()
                except OSError:
                    pass

    def logs(self, daemon: str, tail: int = 4000) -> str:
        text = ""
        for f in sorted((self.root / "log").glob(f"{daemon}*")):
            text += f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}\n"
        return text

    # --- jobs -----------------------------------------------------------------------------------------

    def run(self, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        out = subprocess.run(list(args), env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
                             timeout=kw.pop("timeout", 60), **kw)
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def sbatch(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
        """Submit; returns the job id."""
        return self.run("sbatch", "--parsable", *args, cwd=cwd, env=env or {}).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, Reason, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, until, timeout: float, what: str) -> dict[str, str]:
        """Poll the job until ``until(fields)`` holds; fail with its state and log after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if until(fields):
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: {what} not reached within {timeout} s; now {fields.get('JobState')}"
                                     f" ({fields.get('Reason')}):\n{self.logs('slurmctld', 3000)}")
            time.sleep(0.25)

    def wait_finished(self, job_id: str, timeout: float = 600) -> dict[str, str]:
        return self.wait(job_id, lambda f: f.get("JobState") in FINISHED, timeout, "a final state")


if __name__ == "__main__":
    import sys

    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pcdist-slurm")
    proctrack = sys.argv[2] if len(sys.argv) > 2 else "cgroup"
    why = SlurmCluster.unavailable(proctrack)
    if why:
        sys.exit(why)
    with SlurmCluster(root, proctrack) as c:
        print(f"{c.version}, proctrack/{proctrack}: export SLURM_CONF={c.conf}", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
