"""The service as a stranger meets it: train.py's command line, launch/local.sh as shipped,
--help, one-line user errors (also under the real torchrun), the mesh and thread choices."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pcdist
from pcdist.service.cli import check_overrides
from pcdist.service.config import config_keys, load_config
from pcdist.service.device import cpu_threads
from test_config_data import SMALL, composed

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def run(cmd, timeout=300, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    full.update(WANDB_SILENT="true", **env)
    return subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("override, problem", [
    ("+trainer.max_steps=5", "config key trainer.max_steps already exists: set it with trainer.max_steps=..."),
    ("data=mnst", f"data=mnst: no such option in conf/data/ (options: "
                  f"{', '.join(sorted(p.stem for p in (CONF / 'data').glob('*.yaml')))}); did you mean mnist?"),
    ("trainer.batchsize=8", "unknown config key trainer.batchsize; did you mean trainer.batch_size?"),
    ("lr=0.1", "unknown config key lr; did you mean optim.lr?"),
    ("modle=cnn", "unknown config key modle; did you mean the config group model=cnn?"),
    ("model=mlp,cnnn", "model=cnnn: no such option in conf/model/ (options: cnn, deconv, mlp, mupc, vgg); did you "
                       "mean cnn?"),  # each value a sweep lists (its --multirun got Hydra's report of the search path)
    ("model=choice(mlp,cnnn)", "model=cnnn: no such option"),  # an Optuna search space's too
    # a group set to null, a number or a list: Hydra's traceback (conf/config.yaml writes "experiment: null")
    ("experiment=null", "experiment=null: a config group takes the name of one of its options (options: "),
    ("trainer=5", "trainer=5: a config group takes the name of one of its options (options: default)"),
    ("pc=[1,2]", "pc=[1,2]: a config group takes the name of one of its options (options: default)"),
    # a group's name mistyped near one of its keys: the group (optim.name=sgd kept AdamW's rate and warm-up)
    ("optimm=sgd", "unknown config key optimm; did you mean the config group optim=sgd?"),
    ("parallell=cpu_sim", "unknown config key parallell; did you mean the config group parallel=cpu_sim?"),
])
def test_overrides_are_checked_against_the_known_keys_and_groups(override, problem):
    """A key or option that does not exist is named with the nearest existing one; Hydra's own
    advice for a mistyped key would be to append it with +, which the config then refuses."""
    assert check_overrides(CONF, [override]).startswith(problem)


def test_valid_overrides_pass_the_check():
    assert check_overrides(CONF, ["trainer.max_steps=5", "data=mnist", "experiment=deep_narrow", "model.dims=[1,2]",
                                  "hydra.run.dir=x", "~logger.entity", "trainer.seed=1,2"]) is None


def test_torchrun_prints_a_user_error_once(tmp_path):
    """Every rank finds the mistake; the line appears once (local rank 0), not once per rank."""
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
               "trainer.mx_steps=5", f"hydra.run.dir={tmp_path}"], OMP_NUM_THREADS="1")
    assert out.returncode != 0
    line = "error: unknown config key trainer.mx_steps; did you mean trainer.max_steps?"
    assert (out.stdout + out.stderr).count(line) == 1, out.stderr[-3000:]


def test_local_sh_refuses_a_bad_override_in_one_line_with_status_2(tmp_path):
    """launch/local.sh checks the overrides for NPROC ranks in one process before torchrun starts."""
    out = run(["launch/local.sh", "parallel.layer=3", f"hydra.run.dir={tmp_path}"], NPROC="2", PYTHON=sys.executable)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: mesh parallel.data=1 x parallel.layer=3 = "
                                                                  "3 ranks, but the world size is 2")
    assert not tmp_path.joinpath("checkpoints").exists()
    for nproc in ("abc", "0"):  # bash's own errors before ("unbound variable", "division by 0")
        out = run(["launch/local.sh"], NPROC=nproc, PYTHON=sys.executable)
        assert (out.returncode, out.stderr) == (2, f"launch/local.sh: error: NPROC={nproc} is not a whole number "
                                                   f">= 1\n"), out.stderr
    out = run(["launch/local.sh"], NPROC="2", PYTHON=sys.executable, OMP_NUM_THREADS="abc")  # (not every worker's)
    assert (out.returncode, out.stderr) == (2, "launch/local.sh: error: OMP_NUM_THREADS=abc is not a whole number "
                                               ">= 1\n"), out.stderr
    out = run([sys.executable, "train.py", "--check"], OMP_NUM_THREADS="0")  # (libgomp may add a line of its own)
    assert out.returncode == 2 and "error: OMP_NUM_THREADS='0' is not a number of threads >= 1; unset it or set " \
                                   "trainer.threads\n" in out.stderr, out.stderr[-3000:]
    import venv  # a python without pcdist's requirements (a wrong PYTHON=): one line, not import's traceback

    venv.create(tmp_path / "bare", with_pip=False)
    bare = str(tmp_path / "bare" / "bin" / "python")
    out = run(["launch/local.sh"], NPROC="2", PYTHON=bare)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert re.match(f"train.py: error: {re.escape(bare)} cannot import (torch|omegaconf|hydra|yaml), which pcdist "
                    f"needs: install pcdist into it", out.stderr), out.stderr


def test_local_sh_trains_as_shipped_on_a_cpu_box(tmp_path):
    """NPROC=2 CPU processes with no parallel settings: the layer axis takes both (parallel.layer = 2 / 1),
    said in one line; with no terminal, progress is a line for the first step (at once, with its time) and one
    per logged step; train.log has every line the
    console shows (the mesh, the new run, the value step pc.x_lr=auto chose, the progress, the end),
    time-stamped."""
    run_dir = tmp_path / "run"
    out = run(["launch/local.sh", "logger=none", "logger.plots=false", "trainer.max_steps=22", "trainer.log_every=11",
               "trainer.eval_every=22", f"hydra.run.dir={run_dir}"], NPROC="2", PYTHON=sys.executable,
              OMP_NUM_THREADS="1")
    assert out.returncode == 0, out.stderr[-3000:]
    mesh = [l for l in out.stdout.splitlines() if l.startswith("mesh:")]
    assert mesh == ["mesh: 2 ranks = parallel.data 1 x parallel.layer 2 (parallel.layer = 2 processes / "
                    "parallel.data), 3 layers split into 2 slices; 1 torch thread per rank (OMP_NUM_THREADS)"]
    progress = [l for l in out.stdout.splitlines() if l.startswith("step ") and "/22" in l]
    assert [l.split()[1] for l in progress] == ["1/22", "11/22", "22/22"]
    assert re.fullmatch(r"step 1/22  first step \d+\.\d\d s \(with warm-up\)", progress[0]), progress[0]
    assert "accuracy" not in progress[1] and "accuracy" in progress[2], "accuracy where it was evaluated"
    logged = [l.split("  ", 1)[1] for l in (run_dir / "train.log").read_text().splitlines()]
    assert logged == out.stdout.splitlines(), "train.log holds what the console shows: mesh, new run, progress, end"
    assert logged[:2] == mesh + [f"new run in {run_dir} (config: configs/attempt-1.yaml)"]
    assert logged[2].startswith("pc.x_lr=auto: "), "the value step chosen from the first batches (both ranks agree)"
    assert logged[3:6] == progress
    assert logged[6].startswith("step 22: val/accuracy ") and logged[6].endswith(f"; run directory: {run_dir}")
    assert yaml_layer(run_dir) == 2


def test_ctrl_c_or_sigterm_to_local_sh_stops_the_workers_after_a_checkpoint_without_a_traceback(tmp_path):
    """Ctrl-C at a terminal signals launch/local.sh and torchrun's agent (torchrun starts each worker in a
    session of its own); SIGTERM may come to the script alone. The workers finish their step, checkpoint and
    stop; the script ends as train.py does (130, 3), and no torchrun traceback follows (it ended with the agent's
    SignalException, status 1). The stopped run resumes from that checkpoint. The agent runs with torch's default
    PET_SIGNALS_TO_HANDLE (both signals handled, as torch < 2.9 handles them whatever it is told): what keeps its
    handlers off is launch/torchrun_agent.py."""
    import signal

    run_dir = tmp_path / "run"
    ends = []
    for sig, status, line in ((signal.SIGINT, 130, "interrupted: stopped by Ctrl-C (SIGINT) after step "),
                              (signal.SIGTERM, 3, "pre-empted: stopped by a signal after step ")):
        proc = subprocess.Popen(["launch/local.sh", "logger=none", "logger.plots=false", "trainer.max_steps=100000",
                                 "trainer.log_every=5", f"hydra.run.dir={run_dir}"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env=dict(os.environ, NPROC="1", PYTHON=sys.executable, OMP_NUM_THREADS="1"))
        lines = []
        for out in proc.stdout:  # a few steps into this launch
            lines.append(out)
            if out.startswith("step ") and len([x for x in lines if x.startswith("step ")]) == 2:
                break
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # the terminal's foreground group: the script and the agent
        else:
            proc.send_signal(sig)
        out = "".join(lines) + proc.communicate(timeout=300)[0]
        assert proc.returncode == status and "Traceback" not in out and "FAILED" not in out, out[-3000:]
        stopped = [x for x in out.splitlines() if x.startswith(line)]
        assert len(stopped) == 1, out[-3000:]
        step = int(stopped[0][len(line):].split(";")[0])
        assert (run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
        # how to resume: this script again (it said python train.py, one process, from the caller's folder)
        assert stopped[0].endswith(f"; to resume: {ROOT}/launch/local.sh hydra.run.dir={run_dir}"), stopped[0]
        ends.append((out, step))
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{ends[0][1]:08d}'} at step {ends[0][1]}" in ends[1][0]


def _runs(pid: int, what: bytes) -> bool:
    """Process ``pid``'s command line holds ``what`` (False where it has ended)."""
    try:
        return what in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def test_sigterm_to_local_sh_while_its_workers_start_stops_them_after_a_checkpoint(tmp_path):
    """SIGTERM the moment torchrun has started the worker (it is importing torch: no handler of its own yet): the
    worker is not killed by it (torchrun would report it failed, status 1); it trains its first step, checkpoints
    and stops, and the script ends with status 3, as for a SIGTERM during training. Run from another directory:
    the relative run directory is the caller's, not the checkout's."""
    import signal

    proc = subprocess.Popen([str(ROOT / "launch/local.sh"), "logger=none", "logger.plots=false",
                             "trainer.max_steps=100000", "hydra.run.dir=run"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, NPROC="1", PYTHON=sys.executable, OMP_NUM_THREADS="1"))
    try:
        while not [w for agent in _children(proc.pid) if _runs(agent, b"torchrun_agent.py")  # the agent's worker
                   for w in _children(agent)]:  # (not the script's first $(dirname ...), before its traps)
            assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 3 and "Traceback" not in out and "FAILED" not in out, out[-3000:]
    stopped = re.findall(r"^pre-empted: stopped by a signal after step (\d+);", out, re.M)
    assert len(stopped) == 1, out[-3000:]
    assert (tmp_path / "run" / "checkpoints" / f"step-{int(stopped[0]):08d}" / "manifest.json").is_file()


def yaml_layer(run_dir):
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())["parallel"]["layer"]


def test_help_shows_every_key_with_its_value_and_the_docstring_from_config_py():
    """`python train.py --help <overrides>`: each key's value under those overrides, and the text written under
    its field in pcdist/service/config.py (read here straight from the source)."""
    out = run([sys.executable, "train.py", "--help", "experiment=deep_narrow", "pc.T=7"])
    assert out.returncode == 0, out.stderr[-3000:]
    source = (ROOT / "pcdist" / "service" / "schema.py").read_text()
    docs = {}  # "trainer.max_steps" -> the docstring under that field of TrainerConfig
    for cls, body in re.findall(r'^class (\w*)Config:\n(.*?)(?=^\S)', source, re.S | re.M):
        for name, doc in re.findall(r'^    (\w+): [^\n]*\n    """(.*?)"""', body, re.S | re.M):
            docs[f"{cls.lower()}.{name}" if cls else name] = " ".join(doc.split())
    c = load_config(composed("experiment=deep_narrow", "pc.T=7"))
    lines = out.stdout.splitlines()
    for key in config_keys():
        group, name = key.rsplit(".", 1) if "." in key else (None, key)
        value = getattr(getattr(c, group) if group else c, name)
        i = lines.index(f"  {key} = {'null' if value is None else value}")
        assert lines[i + 1].strip() == docs[key], key
    assert re.search(r"^  experiment +(\w+, )*deep_narrow\*", out.stdout, re.M), "the chosen preset is marked"


@pytest.mark.parametrize("argv, status, says", [
    (["trainer.batchsize=8"], 2, "error: unknown config key trainer.batchsize; did you mean trainer.batch_size?"),
    (["optim.lr=abc"], 2, "error: invalid value for config key optim.lr: Value 'abc' of type 'str' could not be "
                          "converted"),
    (["~model"], 2, "error: ~model: a config group cannot be left out"),
    (["--help", "pc.T=7"], 0, "  pc.T = 7\n"),
    (["--cfg", "job", "pc.T=7"], 0, "\n  T: 7\n"),  # Hydra's own printing
    (["pc.T=7", "--info"], 0, "\nDefaults List\n"),  # a bare --info last (it takes an optional value)
    (["--cfg", "job", "trainer.mx_steps=3"], 2, "error: unknown config key trainer.mx_steps; did you mean "
                                                 "trainer.max_steps?"),  # (Hydra's report, advising +key, status 1)
    (["--cfg", "job", "pc.T=abc"], 2, "error: invalid value for config key pc.T: Value 'abc' of type 'str' could "
                                      "not be converted"),  # (Hydra's six-line report, status 1)
    (["--version"], 0, f"pcdist {pcdist.__version__} (Hydra "),  # (Hydra's own version alone, before)
    (["pc.T=7", "--help"], 0, "  pc.T = 7\n"),  # options after the overrides, as Hydra takes them (the service's
    (["pc.T=7", "--cfg", "job"], 0, "\n  T: 7\n"),  # own overrides, appended after them, were an argparse error)
])
def test_the_command_lines_checks_and_help_answer_without_importing_torch(argv, status, says):
    """A mistyped key, a value of the wrong type, --help and Hydra's --cfg and --info are answered from the
    config alone: torch (1.5 of a refused command line's 2 CPU-s) is never imported (pcdist/__init__.py imports
    the API at its first use). A bare --info at the end used to be refused (the service's own overrides, added
    after it, were taken for its value)."""
    code = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
            f"sys.argv = ['train.py', *{argv!r}]\n"
            "runpy.run_path('train.py', run_name='__main__')")
    out = run([sys.executable, "-c", code])
    assert (out.returncode, out.stdout.splitlines()[-1]) == (status, "torch imported: False"), out.stderr[-3000:]
    assert says in (out.stdout if status == 0 else out.stderr[:len(says)]), out.stderr[-3000:]


def test_a_folder_named_pcdist_in_the_working_folder_is_named_in_one_line(tmp_path):
    """python -m pcdist in a folder holding a clone of this repository named pcdist/: with pcdist installed editable
    (make install), `import pcdist` finds that folder, a package of no code; --help worked, then training ended in an
    AttributeError traceback. One line names the folder; where the install wins over the folder, the command runs."""
    (tmp_path / "pcdist").symlink_to(ROOT)
    found = subprocess.run([sys.executable, "-c", "import pcdist; print(getattr(pcdist, '__file__', None))"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120).stdout.strip()
    out = subprocess.run([sys.executable, "-m", "pcdist", "--version"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    if found == "None":  # shadowed (the editable install)
        assert (out.returncode, out.stderr) == (2, f"error: 'import pcdist' finds the folder {tmp_path / 'pcdist'} (no "
                                                   f"pcdist package in it) before the installed pcdist: run from "
                                                   f"another folder, or give that folder another name (git clone ... "
                                                   f"pcdist-src)\n"), out.stderr
    else:
        assert out.returncode == 0 and out.stdout.startswith(f"pcdist {pcdist.__version__}"), out.stderr


COUNTED = """
import sys
import hydra._internal.hydra
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from omegaconf import OmegaConf
from pcdist.service.cli import CONF_DIR, _compose, main
# What Hydra composes for a run, as its own compose API does: the command line, the service's three overrides
# (cli._main), then the one Hydra's main appends where hydra.mode is unset.
service = ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.mode=RUN"]
reference = OmegaConf.to_yaml(_compose(CONF_DIR, [*sys.argv[1:], *service]))
run_job = hydra._internal.hydra.run_job
def recorded(*args, **kwargs):  # the config a run (not a sweep's job) is given, as it starts
    print("as Hydra composes it:", OmegaConf.to_yaml(kwargs["config"]) == reference)
    return run_job(*args, **kwargs)
hydra._internal.hydra.run_job = recorded
composed, load = [], ConfigLoaderImpl.load_configuration
def counted(self, *args, **kwargs):
    composed.append(kwargs.get("run_mode"))
    return load(self, *args, **kwargs)
ConfigLoaderImpl.load_configuration = counted
import atexit
atexit.register(lambda: print("compositions:", len(composed)))
sys.argv = ["train.py", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("mode, compositions, under", [([], 1, "runs/20"),
                                                       (["hydra.mode=MULTIRUN"], 4, "runs/multirun/")])
def test_a_run_composes_its_config_once_and_gets_the_config_hydra_would_compose(tmp_path, mode, compositions,
                                                                                under):
    """After the command line's checks had composed the config, Hydra's main composed it twice more: once only
    to read hydra.mode (Hydra.get_mode), once for the run. A plain run now composes once (the checks') and the
    run is given that config with Hydra's own last override applied: the same config, key for key, as Hydra
    composes (its compose API, in the same folder). hydra.mode=MULTIRUN set without --multirun still makes
    the launch a (one-job) sweep, as in Hydra, composed four times where it was five (the checks, then what
    Hydra's sweep composes for itself and its job)."""
    quick = ["trainer.max_steps=1", "logger=none", "logger.plots=false", "trainer.progress=off", *mode]
    out = subprocess.run([sys.executable, "-c", COUNTED, *quick], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"compositions: {compositions}\n" in out.stdout, out.stdout
    assert f"run directory: {tmp_path / under}" in out.stdout, out.stdout
    assert ("as Hydra composes it: True" in out.stdout) == (not mode), out.stdout
    assert "as Hydra composes it: False" not in out.stdout, out.stdout


def test_help_into_a_reader_that_has_gone_ends_without_a_traceback():
    """`python -m pcdist --help | head`: when the reader stops reading (here: before anything is written), the
    command ends quietly, not with a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "pcdist", "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_online_wandb_without_a_login_is_one_line(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    env.update(HOME=str(home), WANDB_CONFIG_DIR=str(home))
    out = subprocess.run([sys.executable, "train.py", "logger.mode=online", f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.count("\n") == 1 and "logger.mode=online needs a wandb login" in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "refused before any work"


def test_resuming_a_run_of_another_model_is_one_line(tmp_path):
    """A run directory whose checkpoint has other layer shapes: one line naming the run and the changed key,
    status 2, nothing overwritten (the resume policy refuses a model change before anything loads)."""
    pcdist.train(composed(*SMALL, "trainer.max_steps=2", f"run_dir={tmp_path}"))
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    out = run([sys.executable, "train.py", *SMALL, "trainer.max_steps=2", "model.dims=[64,32,10]",
               f"hydra.run.dir={tmp_path}"])
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.count("\n") == 1 and str(tmp_path) in out.stderr
    assert "model.dims ([64, 128, 128, 10] -> [64, 32, 10]: it changes the model's shape)" in out.stderr
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


def test_threads_trainer_setting_then_omp_num_threads_then_cores_per_local_rank():
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(3, {"OMP_NUM_THREADS": "2"}) == (3, "trainer.threads")
    assert cpu_threads(0, {"OMP_NUM_THREADS": "2"}) == (2, "OMP_NUM_THREADS")
    assert cpu_threads(0, {"LOCAL_WORLD_SIZE": "2"})[0] == max(1, cores // 2)
    assert cpu_threads(0, {})[0] == cores
    with pytest.raises(pcdist.ConfigError, match="OMP_NUM_THREADS='zero' is not a number of threads"):
        cpu_threads(0, {"OMP_NUM_THREADS": "zero"})


@pytest.mark.parametrize("entry", ["train.py", "-m pcdist", "import pcdist"])
def test_the_service_makes_waiting_openmp_threads_sleep_unless_told_otherwise(entry):
    """OMP_WAIT_POLICY=PASSIVE in every process that imports pcdist before torch (train.py, python -m pcdist,
    pcdist-train, their torchrun workers): spinning threads made runs 6-13x slower where another process
    holds a core (docs/service.md). Set before torch loads OpenMP, which reads it once; a user's value stays."""
    start = {"train.py": "import runpy, sys; sys.argv = ['train.py', '--help']; "
                         "runpy.run_path('train.py', run_name='__main__')",
             "-m pcdist": "import runpy, sys; sys.argv = ['pcdist', '--help']; "
                          "runpy.run_module('pcdist', run_name='__main__')",
             "import pcdist": "import pcdist"}[entry]
    code = ("import atexit, os\natexit.register(lambda: print('policy', os.environ.get('OMP_WAIT_POLICY')))\n"
            f"{start}")  # the commands end the process; its atexit functions run
    # a user's value: kept by pcdist/__init__.py, the one place that sets it, so checked on one entry
    for given, expected in ((None, "PASSIVE"),) + ((("ACTIVE", "ACTIVE"),) if entry == "import pcdist" else ()):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        env.update({"OMP_WAIT_POLICY": given} if given else {})
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.splitlines()[-1] == f"policy {expected}"


def test_train_keeps_the_users_omp_num_threads(tmp_path, monkeypatch):
    """A user's OMP_NUM_THREADS is what the run uses (it used to be replaced by cores / local ranks), and the
    caller's own thread count is what it leaves (pcdist.train from a notebook or a script)."""
    n = torch.get_num_threads()
    want = 1 if n > 1 else 2
    used, set_threads = [], torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda k: (used.append(k), set_threads(k)))
    monkeypatch.setenv("OMP_NUM_THREADS", str(want))
    pcdist.train(composed(*SMALL, "trainer.max_steps=1", f"run_dir={tmp_path}"))
    assert used[0] == want and torch.get_num_threads() == n, (used, torch.get_num_threads())


@pytest.mark.parametrize("status, code, stderr", [(3, 3, ""), ("a message", 1, "a message\n")])
def test_the_program_ends_as_pythons_exit_does_without_the_teardown(tmp_path, status, code, stderr):
    """end_process (how train.py and every command end) keeps what Python's own exit does: it waits for a
    thread that is not a daemon, runs the atexit functions, flushes a file left open (frozen too) and stdout,
    and exits with sys.exit's status (None: 0; a message: on stderr, 1)."""
    script = f"""
import atexit, gc, threading, time
from pathlib import Path
from pcdist.service.cli import end_process
d = Path({str(tmp_path)!r})
left_open = open(d / "open.txt", "w")
left_open.write("written, never closed")
gc.freeze()  # as a program may: a frozen file is flushed too
threading.Thread(target=lambda: (time.sleep(0.5), (d / "thread.txt").write_text("joined"))).start()
atexit.register(lambda: (d / "atexit.txt").write_text("ran"))
print("to stdout", end="")
end_process({status!r})
"""
    r = run([sys.executable, "-c", script])
    assert (r.returncode, r.stdout, r.stderr) == (code, "to stdout", stderr)
    assert [(tmp_path / f).read_text() for f in ("open.txt", "thread.txt", "atexit.txt")] == [
        "written, never closed", "joined", "ran"]


def test_a_ctrl_c_while_the_program_ends_ends_it_at_once_in_one_line(tmp_path):
    """A Ctrl-C that arrives while the process ends (an atexit function still running: wandb finishing its run,
    torch's own) ends it at once with status 130 and one line, not an exit function's KeyboardInterrupt
    traceback; what was to run after it does not."""
    script = f"""
import atexit, os, signal, time
from pathlib import Path
from pcdist.service.cli import end_process
atexit.register(lambda: Path({str(tmp_path / "after.txt")!r}).write_text("ran"))  # runs last: never reached
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(30)))
end_process(0)
"""
    r = run([sys.executable, "-c", script])
    assert (r.returncode, r.stderr) == (130, "Ctrl-C while the process was ending: ended at once\n"), r.stderr[-2000:]
    assert not (tmp_path / "after.txt").exists()



def test_check_of_a_resume_checks_the_runs_own_settings(tmp_path, capsys, monkeypatch):
    """``--check hydra.run.dir=<a run>`` (launch/local.sh's and slurm.sbatch's pre-check of a resume) checks what
    the launch will run: the run's own settings. It checked the defaults: a 2-layer run resumed on 3 layer ranks
    said ok, then every rank refused; a changed model shape was refused only by the ranks."""
    from pcdist.service.cli import CONF_DIR, before_hydra

    run_dir = tmp_path / "run"
    pcdist.train({"model": {"dims": [64, 32, 10]}, "trainer": {"max_steps": 2, "batch_size": 32, "progress": "off"},
                  "logger": "none", "logger.plots": False, "run_dir": str(run_dir)})
    capsys.readouterr()

    def check(world: str, *argv: str) -> tuple[int, str]:
        monkeypatch.setenv("WORLD_SIZE", world)
        with pytest.raises(SystemExit) as info:
            before_hydra(CONF_DIR, [f"hydra.run.dir={run_dir}", "trainer.max_steps=4", *argv, "--check"])
        out = capsys.readouterr()
        return info.value.code, out.out + out.err

    assert check("2") == (0, "ok: mesh: 2 ranks = parallel.data 1 x parallel.layer 2 (parallel.layer = 2 processes / "
                             "parallel.data), 2 layers split into 2 slices\n")
    code, said = check("3")
    assert code == 2 and said.startswith("error: 3 processes with parallel.data=1 leave 3 layer ranks, but the model "
                                         "has only 2 layers"), said
    code, said = check("1", "model.dims=[64,16,10]")
    assert code == 2 and said.startswith(f"error: cannot resume {run_dir} with changed model.dims"), said
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000002"], "a check writes nothing"

def test_the_collector_is_left_as_it_was_and_a_crash_reports_no_leaks():
    """pcdist's import turns the garbage collector off while it imports, then on again; an exception ends the
    process by Python's own exit: the traceback, and no leak report of triton's objects (nanobind lists the
    objects a teardown left unfreed)."""
    script = """
import gc
assert gc.isenabled()
from pcdist.service import cli
assert gc.isenabled(), "import pcdist left the collector off"
def crash():
    raise RuntimeError("a bug")
cli._main = crash
cli.main()
"""
    r = run([sys.executable, "-c", script])
    assert r.returncode == 1 and r.stderr.rstrip().endswith("RuntimeError: a bug"), r.stderr[-3000:]
    assert "leaked" not in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("argv, env, says", [
    (["hydra.run.dir="], {}, "error: hydra.run.dir= names no directory (an unset variable?)"),
    (["run_dir=runs/mine"], {}, "error: run_dir=runs/mine: on the command line the run directory is hydra.run.dir="),
    (["~model"], {}, "error: ~model: a config group cannot be left out; choose one of its options"),
    (["--check"], {"WORLD_SIZE": "abc"}, "error: WORLD_SIZE='abc': the number of processes to check for must be"),
    (["optim.lr=${no.such.key}"], {}, "error: config optim.lr: Interpolation key 'no.such.key' not found"),
    (["hydra.run.dir=${oc.env:PCDIST_NO_SUCH_VARIABLE}", "--check"], {},
     "error: config hydra.run.dir: KeyError raised while resolving interpolation: \"Environment variable "
     "'PCDIST_NO_SUCH_VARIABLE' not found\""),
    # --check (launch/local.sh's pre-check) refuses what every rank would: it said ok
    (["model.width=5", "--check"], {"WORLD_SIZE": "2"}, "error: model.width=5: model.name=mlp does not read"),
    (["trainer.epochs=1", "trainer.max_steps=3", "--check"], {"WORLD_SIZE": "2"},
     "error: trainer.epochs=1 and trainer.max_steps=3 both set how long the run trains"),
    (["data=arrays", "data.path=/nonexistent/x.npz", "--check"], {"WORLD_SIZE": "2"},
     "error: data.path=/nonexistent/x.npz: no such file or folder"),
    # the data against the model, as each rank reads them (--check said ok, then every rank failed)
    (["model.dims=[100,32,10]", "--check"], {"WORLD_SIZE": "2"},
     "error: data digits has 64 input features (1 x 8 x 8) but model.dims[0]=100"),
    (["trainer.batch_size=5000", "--check"], {}, "error: data digits has 1437 training samples, fewer than "
                                                 "trainer.batch_size=5000"),
    (["data.val_fraction=0.9999", "--check"], {}, "error: data digits has 0 training samples"),  # (an IndexError)
    (["data=synthetic", "model.dims=[64,1]", "--check"], {},  # (trained, reporting an accuracy of 1.0)
     "error: data=synthetic labels by argmax over model.dims[-1]=1 classes: a classifier needs at least 2"),
    (["data=synthetic", "data.synthetic_val=0", "--check"], {},  # (it named data.synthetic_train=2048)
     "error: config data.synthetic_val=0 is invalid: allowed an integer >= 1"),
])
def test_command_lines_that_would_write_elsewhere_or_crash_are_one_line(argv, env, says, capsys, monkeypatch):
    """An empty hydra.run.dir= (an unset variable) made the current folder the run directory; run_dir= on the
    command line was ignored (a new run started instead of the one named); ~model was a traceback, and so were a
    WORLD_SIZE that is no number for --check and an override's ${...} that does not resolve: each is one line,
    exit status 2, before anything runs."""
    from pcdist.service.cli import CONF_DIR, before_hydra

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as info:
        before_hydra(CONF_DIR, argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(says) and err.count("\n") == 1, err


def test_a_size_that_does_not_fit_in_memory_is_one_line_and_leaves_no_run_directory(tmp_path):
    """A width typed with extra zeros asked for 25 TB: torch's allocator's traceback (41 lines)."""
    r = run([sys.executable, "train.py", "model.dims=[64,100000000000,10]", "logger=none",
             f"hydra.run.dir={tmp_path}/new/run"])
    assert r.returncode == 1 and r.stderr.startswith("error: out of memory: can't allocate memory: you tried to "
                                                     "allocate ") and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert "model.*" in r.stderr and not (tmp_path / "new").exists()


def _disk_full():
    """In the child: every write beyond 0 bytes fails (EFBIG, as a full disk's ENOSPC) instead of killing it."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


def test_a_full_disk_is_one_line_for_a_new_run_and_for_evaluate_and_leaves_nothing_half_written(tmp_path):
    """(review rv117) A disk full as a run starts (its lock, config.yaml, model.json) was a traceback, and could
    leave an empty config.yaml that the rerun refused as files pcdist did not write; evaluate on a read-only or
    full disk was a traceback. Each is one line, status 2; the new run's directory is gone, and a run's files
    are as they were."""
    full = dict(os.environ, WANDB_SILENT="true")
    r = subprocess.run([sys.executable, "train.py", "logger=none", f"hydra.run.dir={tmp_path}/new/run"], cwd=ROOT,
                       env=full, capture_output=True, text=True, timeout=300, preexec_fn=_disk_full)
    assert r.returncode == 2 and r.stderr == "error: writing the run directory: File too large (a full or " \
                                             "read-only disk, or no permission?)\n", r.stderr[-2000:]
    assert not (tmp_path / "new").exists()
    run_dir = tmp_path / "run"
    pcdist.train({"run_dir": str(run_dir), "logger": "none", "trainer.max_steps": 2, "trainer.progress": "off"})
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    r = subprocess.run([sys.executable, "-m", "pcdist", "evaluate", str(run_dir)], cwd=tmp_path, env=full,
                       capture_output=True, text=True, timeout=300, preexec_fn=_disk_full)
    assert r.returncode == 2 and r.stderr == "error: writing its files: File too large (a full or read-only disk, " \
                                             "or no permission?)\n", r.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
