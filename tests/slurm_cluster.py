"""A real one-node SLURM cluster on this machine, for tests: munged, slurmctld and slurmd (Debian's
``slurm-wlm`` and ``munge``), started by hand with their own key, socket, ports, spool and state under one
folder, and stopped at the end. Jobs are submitted with the real ``sbatch`` and run as the caller.

    with SlurmCluster(tmp_path, proctrack="cgroup") as cluster:
        job = cluster.sbatch(["launch/slurm.sbatch", "trainer.max_steps=10"], cwd=tmp_path)
        cluster.wait_finished(job)

The daemons run as root (slurmd switches users and makes cgroups): the caller is root, or has
passwordless sudo. ``SlurmCluster.unavailable()`` says why no cluster can run here (None if one can).

proctrack/cgroup uses SLURM's cgroup/v1 plugin where the v1 freezer controller is mounted (a writable
hierarchy), else cgroup/v2 on the unified hierarchy with ``IgnoreSystemd=yes`` (slurmd is not started by
systemd here, so it makes its cgroups itself; SLURM calls that mode development and testing only).

The node is declared with more CPUs than the machine has (``SlurmdParameters=config_overrides``), so
that two jobs of two CPU processes each fit on a small CI machine, and with two GPUs that are a count
only (each "device" an empty file: CUDA never sees one), so that a job asking for GPUs gets SLURM's GPU
variables. Two partitions: ``debug`` (the default) and ``high``, whose jobs pre-empt debug's
(``preempt/partition_prio``, ``PreemptMode=REQUEUE``, ``GraceTime``). ``cred_expire`` is lowered from
120 s to 5 s (how long SLURM holds a requeued job before it may start again), the scheduler's periodic
pass from every 60 s to every second (it starts a requeued job once the hold is over), and
``batch_sched_delay`` from 3 s to 0: slurmctld's background loop ticks once a second and schedules a newly
submitted batch job at its next tick, so a job starts within a second of its submission.

By hand: ``python tests/slurm_cluster.py /tmp/slurm [cgroup|linuxproc]`` starts a cluster and prints
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
import tempfile
import time
from pathlib import Path

from ports import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo", "squeue")
NODE_CPUS = 4
NODE_GPUS = 2
GRACE_S = 60
CRED_EXPIRE_S = 5
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _which(name: str) -> str | None:
    """A program on PATH or in /usr/sbin, /sbin (not on a user's PATH on Debian)."""
    return shutil.which(name) or next((p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)),
                                      None)


def as_root() -> list[str] | None:
    """The prefix that runs a command as root: nothing for root, ``sudo -n`` with passwordless sudo, else None."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n"]
    return None


def _node_name() -> str:
    """This machine's short host name, as SLURM names a node, if it resolves (the job's rendezvous endpoint
    is the node's name), else localhost."""
    name = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(name)
        return name
    except OSError:
        return "localhost"


def _running() -> set[str]:
    """The names (comm) of the processes running here."""
    names = set()
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            names.add(comm.read_text().strip())
        except OSError:
            pass
    return names


def _mounts(fstype: str) -> list[tuple[str, list[str]]]:
    """(mount point, options) of every mount of ``fstype``."""
    rows = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    return [(r[1], r[3].split(",")) for r in rows if len(r) > 3 and r[2] == fstype]


def cgroup_setup() -> tuple[str, str, str | None]:
    """(SLURM's cgroup plugin, its mount point, why proctrack/cgroup cannot run here or None).
    PCDIST_SLURM_CGROUP=v2 picks the unified hierarchy where both are mounted (a hybrid layout)."""
    root = as_root()
    if root is None:
        return "", "", "the cgroup hierarchies need root"
    freezer = [point for point, options in _mounts("cgroup") if "freezer" in options]
    if freezer and os.environ.get("PCDIST_SLURM_CGROUP") != "v2":  # cgroup v1, or hybrid: SLURM's v1 plugin
        probe = Path(freezer[0]) / f"pcdist-probe-{os.getpid()}"
        made = subprocess.run([*root, "mkdir", str(probe)], capture_output=True, text=True)
        if made.returncode:
            return "", "", f"the cgroup v1 freezer hierarchy {freezer[0]} is not writable ({made.stderr.strip()})"
        subprocess.run([*root, "rmdir", str(probe)], capture_output=True)
        return "cgroup/v1", str(Path(freezer[0]).parent), None
    unified = [point for point, _ in _mounts("cgroup2")]
    if unified:
        probe = Path(unified[0]) / f"pcdist-probe-{os.getpid()}"
        made = subprocess.run([*root, "mkdir", str(probe)], capture_output=True, text=True)
        if made.returncode:
            return "", "", f"the cgroup v2 hierarchy {unified[0]} is not writable ({made.stderr.strip()})"
        subprocess.run([*root, "rmdir", str(probe)], capture_output=True)
        return "cgroup/v2", unified[0], None
    return "", "", "no cgroup v1 freezer controller and no cgroup v2 hierarchy is mounted"


SOCKET_PATH_MAX = 107
"""The longest path of a Unix socket; slurmstepd makes ``<spool>/<node>_<job id>.<step id>`` (about 30 characters
past the spool folder), munged its socket in the root."""


def _short(root: Path) -> Path:
    """``root``, or, where slurmstepd's sockets under it would pass the length limit (deep pytest folders, e.g. under
    pytest-xdist), a short folder in the temp dir that ``root`` links to (the files stay reachable through it)."""
    if len(str(root / "spool")) + 40 <= SOCKET_PATH_MAX:
        return root
    short = Path(tempfile.mkdtemp(prefix="slurm-"))
    root.parent.mkdir(parents=True, exist_ok=True)
    if root.is_dir() and not root.is_symlink():
        root.rmdir()  # an empty folder made for the cluster (a non-empty one is an error: not ours)
    root.symlink_to(short, target_is_directory=True)
    return short


class SlurmCluster:
    """munged + slurmctld + slurmd under ``root``; ``proctrack`` is ``cgroup`` or ``linuxproc``."""

    def __init__(self, root: Path, proctrack: str = "cgroup"):
        self.root = _short(Path(root))
        self.proctrack = proctrack
        self.procs: dict[str, subprocess.Popen] = {}
        self.node = _node_name()
        self.conf = self.root / "etc" / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.env["PATH"] = os.pathsep.join([self.env.get("PATH", ""), "/usr/sbin", "/sbin"])
        self.sudo = as_root() or []
        self.cgroup_plugin = self.cgroup_mount = ""
        self.version = ""

    @staticmethod
    def unavailable(proctrack: str = "cgroup") -> str | None:
        """Why a cluster cannot be started here, or None."""
        missing = [n for n in (*DAEMONS, *CLIENTS) if _which(n) is None]
        if missing:
            return (f"SLURM is not installed ({', '.join(missing)} not found): apt-get install slurm-wlm munge "
                    "(.ci/run does)")
        if as_root() is None:
            return ("the SLURM daemons must run as root (slurmd switches users and makes cgroups): run the tests "
                    "as root or with passwordless sudo")
        if proctrack == "cgroup":
            problem = cgroup_setup()[2]
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

    def _daemon(self, name: str, args: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")  # noqa: SIM115 (the process keeps it)
        self.procs[name] = subprocess.Popen([*self.sudo, _which(name), *args], env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def start(self, timeout: float = 120) -> None:
        for d in ("etc", "munge", "state", "spool", "log", "run", "dev"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # munged refuses a socket folder that others may write to
        if self.proctrack == "cgroup":
            self.cgroup_plugin, self.cgroup_mount, problem = cgroup_setup()
            if problem:
                raise RuntimeError(problem)
        self._start_munge()
        self._write_config()
        self._daemon("slurmctld", ["-D", "-i", "-f", str(self.conf)])
        self._daemon("slurmd", ["-D", "-f", str(self.conf), "-N", self.node])
        deadline = time.monotonic() + timeout
        while True:
            state = self.run("sinfo", "-h", "-n", self.node, "-o", "%T", check=False).stdout.strip()
            if state.rstrip("*") in ("idle", "mixed", "allocated"):
                break
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}) while starting:\n{self.logs(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node is not idle after {timeout} s (sinfo: {state!r}):\n"
                                   f"{self.logs('slurmctld')}\n{self.logs('slurmd')}")
            time.sleep(0.2)
        self.version = self.run("sinfo", "--version").stdout.strip()

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = self.root / "munge" / "munge.socket"
        self._daemon("munged", ["-F", "-f", f"--socket={self.socket}", f"--key-file={key}",
                                f"--pid-file={self.root / 'run' / 'munged.pid'}",
                                f"--log-file={self.root / 'log' / 'munged.log'}",
                                f"--seed-file={self.root / 'munge' / 'munged.seed'}"])
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.logs('munged')}")
            time.sleep(0.05)

    def _write_config(self) -> None:
        r = self.root
        # A job-id range of its own: slurmd names cgroups by job id, and another cluster may run beside this one.
        first_job = random.randrange(1000, 60_000_000, 1000)
        self.conf.write_text(f"""\
ClusterName=pcdist-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
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
SchedulerParameters=sched_interval=1,batch_sched_delay=0
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
        for i in range(NODE_GPUS):
            (r / "dev" / f"gpu{i}").touch()
        (r / "etc" / "gres.conf").write_text(f"AutoDetect=off\nName=gpu File={r / 'dev'}/gpu[0-{NODE_GPUS - 1}]\n")
        cgroup = [f"CgroupPlugin={self.cgroup_plugin or 'autodetect'}"]
        if self.cgroup_plugin:
            cgroup.append(f"CgroupMountpoint={self.cgroup_mount}")
        if self.cgroup_plugin == "cgroup/v2":
            cgroup += ["IgnoreSystemd=yes", "CgroupAutomount=yes"]
        (r / "etc" / "cgroup.conf").write_text("\n".join(cgroup) + "\n")

    def stop(self) -> None:
        """Cancel every job, wait for the node to be empty, then stop the daemons (slurmd first)."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "-u", str(os.getuid()), check=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self.run("squeue", "-h", "-t", "RUNNING,COMPLETING",
                                                           check=False).stdout.strip():
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            # sudo passes the signal on to the daemon; only root may signal sudo
            subprocess.run([*self.sudo, "kill", "-TERM", str(proc.pid)], capture_output=True)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                subprocess.run([*self.sudo, "kill", "-KILL", str(proc.pid)], capture_output=True)
                proc.wait()
        if self.sudo and self.root.is_dir():  # what root wrote (spool, state) back to the caller, to delete
            subprocess.run([*self.sudo, "chown", "-R", f"{os.getuid()}:{os.getgid()}", str(self.root)],
                           capture_output=True)
        self._remove_cgroups()

    def _remove_cgroups(self) -> None:
        """Remove the (empty) cgroups slurmd made, unless another slurmd runs here and may still use them."""
        if not self.cgroup_plugin or "slurmd" in _running():
            return
        mount = Path(self.cgroup_mount)
        for top in [*mount.glob(f"*/slurm_{self.node}"), *mount.glob("system.slice/*slurmstepd*")]:
            dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
            subprocess.run([*self.sudo, "rmdir", *map(str, dirs), str(top)], capture_output=True)

    def logs(self, daemon: str, tail: int = 4000) -> str:
        text = ""
        for f in sorted((self.root / "log").glob(f"{daemon}*")):
            try:
                text += f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}\n"
            except OSError as e:
                text += f"--- {f.name}: {e}\n"
        return text

    # --- jobs -----------------------------------------------------------------------------------------

    def run(self, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster, as the caller."""
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
        """Poll the job until ``until(fields)`` holds; fail with its state after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if until(fields):
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: {what} not reached within {timeout} s; now "
                                     f"{fields.get('JobState')} ({fields.get('Reason')}):\n"
                                     f"{self.logs('slurmctld', 3000)}")
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
        print(f"{c.version}, proctrack/{proctrack} {c.cgroup_plugin}: export SLURM_CONF={c.conf}", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
