"""Sweeps: Hydra's --multirun, each job its own run directory, checked before the first starts, and never mixed
with an earlier sweep's runs (real Hydra, real subprocesses). The Optuna sweeper and ``python -m pcdist compare``
over seeds are tested on the sweeps of docs/after-training.md (tests/test_docs_after_training.py)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pcdist.service.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["trainer.max_steps=12", "trainer.eval_every=6", "trainer.log_every=6", "trainer.ckpt_every=12",
         "logger=none", "logger.plots=false", "trainer.progress=off"]


def train_py(*args, cwd) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def jobs(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if (p / "config.yaml").is_file()), key=lambda p: int(p.name))


def test_multirun_over_two_values_gives_two_run_directories(tmp_path):
    """`--multirun optim.lr=1e-3,2e-3` (sweep syntax the pre-check must let through) launches two jobs,
    each a complete run directory with its own value."""
    sweep = tmp_path / "sweep"
    out = train_py("--multirun", "optim.lr=1e-3,2e-3", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    runs = jobs(sweep)
    assert [p.name for p in runs] == ["0", "1"]
    assert [yaml.safe_load((p / "config.yaml").read_text())["optim"]["lr"] for p in runs] == [1e-3, 2e-3]
    for p in runs:
        assert (p / "checkpoints" / "step-00000012").is_dir() and f"run directory: {p}" in out.stdout
        assert [r["step"] for r in read_metrics(p / "metrics.jsonl") if "val/accuracy" in r] == [6, 12]


def test_a_diverged_job_is_one_line_and_the_sweep_goes_on_then_ends_with_status_1(tmp_path):
    """A sweep over the value step whose first job diverges: that job is one line naming its directory (no
    checkpoint was written before it), the next job trains to its end, and the sweep ends with status 1 naming
    the job that diverged (it was Hydra's traceback, and the sweep stopped there)."""
    sweep = tmp_path / "sweep"
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--multirun", "pc.x_lr=1000,0.01", *QUICK,
                          f"hydra.sweep.dir={sweep}"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: {sweep / '0'}: step ") and "the energy diverged to" in lines[0], lines
    assert "no checkpoint was written before it. Lower optim.lr or pc.x_lr" in lines[0]
    assert lines[-1] == f"error: 1 job(s) of the sweep diverged: {sweep / '0'}", lines
    assert (sweep / "1" / "checkpoints" / "step-00000012").is_dir()


def test_an_optuna_study_counts_a_diverged_trial_failed_and_goes_on(tmp_path):
    """The same under the Optuna sweeper (its seed 0 tries x_lr 0.01, then 1000): the diverged trial returned NaN,
    which ended the whole study in two chained tracebacks, without optimization_results.yaml; it is counted failed,
    the study ends with its best trial written, and the launch with status 1 naming the trial that diverged."""
    sweep = tmp_path / "sweep"
    optuna = ["hydra/sweeper=optuna", "hydra.sweeper.direction=maximize", "hydra.sweeper.n_trials=2",
              "hydra.sweeper.sampler.seed=0"]
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--multirun", *optuna, "pc.x_lr=choice(1000,0.01)",
                          *QUICK, f"hydra.sweep.dir={sweep}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    steps = {job: yaml.safe_load((sweep / job / "config.yaml").read_text())["pc"]["x_lr"] for job in ("0", "1")}
    assert sorted(steps.values()) == [0.01, 1000], steps
    diverged, good = (job for x_lr in (1000, 0.01) for job in steps if steps[job] == x_lr)
    assert out.stderr.strip().splitlines()[-1] == f"error: 1 job(s) of the sweep diverged: {sweep / diverged}"
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_params"] == {"pc.x_lr": 0.01}
    assert best["best_value"] == read_metrics(sweep / good / "metrics.jsonl")[-1]["val/accuracy"]


def test_an_optuna_study_whose_every_trial_diverged_ends_in_one_line(tmp_path):
    """No trial completed (the only one diverged): the study has no best trial, which was Optuna's ValueError as a
    traceback through Hydra's; now one line naming the trials, status 1, and no optimization_results.yaml."""
    sweep = tmp_path / "sweep"
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--multirun", "hydra/sweeper=optuna",
                          "hydra.sweeper.n_trials=1", "pc.x_lr=choice(1000,2000)", *QUICK, f"hydra.sweep.dir={sweep}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (f"error: no trial of the Optuna study completed (1 diverged: "
                                                   f"{sweep / '0'}): it has no best trial, and wrote no "
                                                   f"optimization_results.yaml")
    assert not (sweep / "optimization_results.yaml").exists()


def test_check_of_a_sweep_checks_each_job_and_a_glob_sweep_is_listed(tmp_path):
    """--check --multirun over lists checks every job as the run it will be (a list had been read as one ambiguous
    value: "add --multirun", given already), each mesh said once; glob(...) lists a group's options as Hydra's
    sweeper does (it was "ConfigLoader is not set"). Nothing is written."""
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--check", "--multirun", "optim=glob(*)",
                          "model.dims=[64,32,10],[64,32,32,10]"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    mesh = "ok: mesh: 1 rank = parallel.data 1 x parallel.layer 1 (parallel.layer = 1 process / parallel.data), "
    assert out.stdout.splitlines() == [f"{mesh}2 layers split into 1 slice", f"{mesh}3 layers split into 1 slice "
                                                                              f"(4 jobs)"], out.stdout
    assert list(tmp_path.iterdir()) == []


def test_an_optuna_search_space_is_checked_before_the_first_trial(tmp_path):
    """pc.T=choice(0,4) under Optuna: a trial that drew 4 trained, the one that drew 0 failed after it, leaving
    folders that refused the corrected relaunch; each listed value is checked first, one line, nothing written."""
    said = refused("--multirun", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "pc.T=choice(4,0)", *QUICK,
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert said == "error: the search space's pc.T=0: config pc.T=0 is invalid: allowed an integer >= 1; no trial " \
                   "was started\n", said
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_into_no_folder_or_with_its_job_in_its_own_folder_is_refused(tmp_path):
    """hydra.sweep.dir='' (quoted: the unquoted empty value was refused already) wrote the jobs and multirun.yaml
    into the current folder; hydra.sweep.subdir=. with one job passed the checks, then the job was refused as a
    sweep's folder, leaving it behind. Each is one line before anything is written."""
    said = refused("--multirun", "pc.T=4", *QUICK, "hydra.sweep.dir=''", cwd=tmp_path)
    assert said == "error: hydra.sweep.dir names no directory (an empty value); give the sweep a folder of its own\n"
    said = refused("--multirun", "pc.T=4", *QUICK, f"hydra.sweep.dir={tmp_path / 'sd'}", "hydra.sweep.subdir=.",
                   cwd=tmp_path)
    assert said.startswith(f"error: sweep job 0 would run in the sweep's own folder {tmp_path / 'sd'} "), said
    assert list(tmp_path.iterdir()) == []


def test_multirun_still_names_a_mistyped_key_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--multirun", "optim.lrr=1e-3,2e-3"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "unknown config key optim.lrr; did you mean optim.lr?" in out.stderr


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def refused(*args, cwd) -> str:
    """The one line of a refused launch (exit status 2)."""
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert "new run in" not in out.stdout, "no job started"
    return out.stderr


def test_a_sweep_into_an_earlier_sweeps_folder_refuses_and_changes_nothing(tmp_path):
    """A sweep run again into the hydra.sweep.dir of an earlier one must never resume or report the earlier runs as
    its own: other values (pc.T=12,16), other fixed settings (a new LR and length), more runs than the folder's, or
    another sweeper: each refused before any job starts, in one line naming the folder and the way out, and the
    folder stays as it was. The same sweep again is the same runs: it resumes them (here: nothing left to train)."""
    sweep = tmp_path / "sweep"
    train_py("--multirun", "pc.T=4,8", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    before = snapshot(sweep)
    said = refused("--multirun", "pc.T=12,16", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert said == (f"error: sweep job 0 (pc.T=12): {sweep}/0 holds another run, made with pc.T=4 (this job: 12); a "
                    f"sweep never continues a run of other settings: give the sweep a new hydra.sweep.dir, or resume "
                    f"that run on its own: python train.py hydra.run.dir={sweep}/0 [the settings to change]; no job "
                    f"was started\n")
    said = refused("--multirun", "optim.lr=1e-2,2e-2", *QUICK, "trainer.max_steps=24", f"hydra.sweep.dir={sweep}",
                   cwd=tmp_path)
    assert said.startswith(f"error: sweep job 0 (optim.lr=0.01): {sweep}/0 holds another run, made with ") and \
        "optim.lr=0.002 (this job: 0.01)" in said and "trainer.max_steps=12 (this job: 24)" in said, said
    said = refused("--multirun", "pc.T=4", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert said == (f"error: sweep directory {sweep}: it holds runs that are no job of this sweep (1), which this "
                    f"sweep would mix with its own; give the sweep a new hydra.sweep.dir (no job was started)\n")
    said = refused("--multirun", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "pc.T=range(4, 12, step=4)",
                   *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert said.startswith(f"error: sweep directory {sweep}: it holds the runs of an earlier sweep (0, 1)"), said
    said = refused("--multirun", "pc.T=4,8,12", *QUICK, "resume=require", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    # (found only after jobs 0 and 1 had run, leaving an empty 2/)
    assert said == (f"error: sweep job 2 (pc.T=12): resume=require but {sweep}/2 holds no checkpoint to resume; "
                    f"check the directory (hydra.run.dir, or the config key run_dir) or drop resume=require to start "
                    f"a new run; no job was started\n"), said
    assert snapshot(sweep) == before, "a refused sweep changes nothing in the folder"
    again = train_py("--multirun", "pc.T=4,8", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert again.stdout.count("is already finished") == 2 and "new run in" not in again.stdout, again.stdout
    assert again.stdout.count("a sweep's jobs keep their settings: to train longer, launch the sweep with a larger "
                              "trainer.max_steps into a new hydra.sweep.dir") == 2, again.stdout


def test_a_run_and_a_sweep_never_share_a_folder_and_compare_shows_both_where_they_do(tmp_path):
    """A single run launched into a sweep's folder (its job's /0 left out) trained beside the jobs, and a sweep
    launched into a run's folder wrote its jobs into it; compare then showed only the run, the jobs hidden. Each
    launch is refused in one line, changing nothing; compare of a folder holding both (made by an earlier pcdist)
    lists the run and the jobs."""
    import shutil

    import pcdist
    from pcdist.service.compare import find_runs

    sweep, run = tmp_path / "sweep", tmp_path / "run"
    train_py("--multirun", "pc.T=2,3", *QUICK, "trainer.max_steps=2", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    before = snapshot(sweep)
    with pytest.raises(pcdist.ConfigError, match=rf"^{re.escape(str(sweep))} is a sweep's folder \(multirun.yaml, "
                                                 rf"\.pcdist-sweep\.json, 0/, 1/\), whose runs a run there would mix "
                                                 rf"with; to resume one of its jobs name its folder"):
        pcdist.train({"run_dir": str(sweep), "logger": "none", "trainer": {"max_steps": 2}})
    assert snapshot(sweep) == before
    pcdist.train({"run_dir": str(run), "logger": {"name": "none", "plots": False},
                  "trainer": {"max_steps": 2, "progress": "off"}, "pc": {"T": 2}})
    before = snapshot(run)
    said = refused("--multirun", "pc.T=2,3", *QUICK, f"hydra.sweep.dir={run}", cwd=tmp_path)
    assert said.startswith(f"error: sweep directory {run} holds a run (checkpoints, metrics.jsonl, train.log, "
                           f"config.yaml, configs), whose files this sweep's jobs would mix with"), said
    assert snapshot(run) == before
    mixed = shutil.copytree(sweep, tmp_path / "mixed")
    for name in ("config.yaml", "metrics.jsonl", "checkpoints"):
        (shutil.copytree if (run / name).is_dir() else shutil.copy)(run / name, mixed / name)
    assert find_runs([mixed]) == [mixed, mixed / "0", mixed / "1"]


def test_a_sweep_into_a_folder_another_sweep_is_launching_into_is_refused_before_it_writes(tmp_path):
    """Two different sweeps launched at once into one new folder both passed the checks (it held nothing yet):
    the second was refused only at its first job, after Hydra had written its multirun.yaml over the first's. A
    sweep now claims its folder before Hydra writes (.pcdist-sweep.json: its overrides, process and host); a
    folder claimed by another sweep whose process runs is refused in one line, and nothing is written."""
    import json
    import socket

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    claim = {"overrides": ["optim.lr=1e-3,3e-3"], "pid": os.getpid(), "host": socket.gethostname()}
    (sweep / ".pcdist-sweep.json").write_text(json.dumps(claim))  # (this test's process: it runs)
    before = snapshot(sweep)
    said = refused("--multirun", "pc.T=4,8", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert said == (f"error: sweep directory {sweep}: another sweep is launching into it (process {os.getpid()} on "
                    f"{socket.gethostname()}: optim.lr=1e-3,3e-3), which this sweep would mix with its own; give the "
                    f"sweep a new hydra.sweep.dir, or remove {sweep}/.pcdist-sweep.json if that sweep has ended (no "
                    f"job was started)\n"), said
    assert snapshot(sweep) == before, "no multirun.yaml, no job directory"
    (tmp_path / "a-file").touch()
    said = refused("--multirun", "pc.T=4,8", *QUICK, f"hydra.sweep.dir={tmp_path / 'a-file'}", cwd=tmp_path)
    assert said == f"error: hydra.sweep.dir={tmp_path / 'a-file'}: a file is there, not a folder; choose another\n"


def test_every_job_of_a_sweep_is_checked_before_the_first_starts(tmp_path):
    """A bad value anywhere in a --multirun list: one line naming the job and the key, exit status 2, and nothing
    run or left behind (no job directory, no multirun.yaml)."""
    sweep = tmp_path / "badT"
    said = refused("--multirun", "pc.T=4,0", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert said == ("error: sweep job 1 (pc.T=0): config pc.T=0 is invalid: allowed an integer >= 1; no job was "
                    "started\n")
    said = refused("--multirun", "pc.T=4,8", "model.dims=[64,10],[40,10]", *QUICK, f"hydra.sweep.dir={sweep}",
                   cwd=tmp_path)
    assert said.startswith("error: sweep job 1 (pc.T=4 model.dims=[40,10]): data digits has 64 input features"), said
    said = refused("--multirun", "optim.schedule=cosine,constant", "optim.final_lr_ratio=0.1", *QUICK,
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path)  # a key one job does not read, as a run refuses it
    assert said == ("error: sweep job 1 (optim.schedule=constant): optim.final_lr_ratio=0.1: optim.schedule=constant "
                    "does not read optim.final_lr_ratio (cosine does), so it would change nothing; drop it or set "
                    "optim.schedule=cosine; no job was started\n"), said
    # two jobs in one directory (a subdir that leaves out a swept key; a value swept twice): the second resumed or
    # refused the first's run after it had trained (or reported it as its own, status 0)
    said = refused("--multirun", "trainer.seed=0,1", *QUICK, f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=T${pc.T}",
                   cwd=tmp_path)
    assert said.startswith(f"error: sweep jobs 0 (trainer.seed=0) and 1 (trainer.seed=1) would both run in "
                           f"{sweep / 'T20'} (hydra.sweep.subdir=T20)"), said
    said = refused("--multirun", "pc.T=5,5", *QUICK, f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=T${pc.T}",
                   cwd=tmp_path)
    assert said.startswith(f"error: sweep jobs 0 (pc.T=5) and 1 (pc.T=5) would both run in {sweep / 'T5'}"), said
    assert said.endswith("; no job was started\n")
    assert not sweep.exists() and sorted(tmp_path.iterdir()) == []


def test_a_sweep_with_a_relative_data_path_continues_its_own_jobs(tmp_path, monkeypatch):
    """A run records data.path as the absolute path it named (a resume from another folder reads the same
    file): relaunching a sweep with the same relative data.path must find each job's run its own, in the checks
    of every job before the first starts as in the job itself, and a run recorded by an earlier pcdist (the path
    as typed) must be its own too."""
    import hashlib
    import json

    import numpy as np
    import torch

    import pcdist
    from pcdist.service.checks import check_as_launched
    from pcdist.service.config import make_config, passed_settings

    d = pcdist.data.load_dataset("digits")
    monkeypatch.chdir(tmp_path)
    np.savez("my.npz", x_train=d.x_train.numpy(), y_train=d.y_train.numpy(), x_val=d.x_val.numpy(),
             y_val=d.y_val.numpy())
    job = ["data=arrays", "data.path=my.npz", "trainer.max_steps=2", "logger=none", "logger.plots=false",
           "trainer.progress=off"]
    run_dir = tmp_path / "sweep" / "0"
    pcdist.train([*job, f"run_dir={run_dir}"])
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["path"] == str(tmp_path / "my.npz")
    check_as_launched(make_config(job), passed_settings(job), 1, run_dir, sweep=True)
    ck = run_dir / "checkpoints" / "step-00000002"  # as an earlier pcdist recorded it: the path as typed
    meta = torch.load(ck / "meta.pt", weights_only=True)
    meta["config"]["data"]["path"] = "my.npz"
    torch.save(meta, ck / "meta.pt")
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["meta.pt"] = hashlib.sha256((ck / "meta.pt").read_bytes()).hexdigest()
    (ck / "manifest.json").write_text(json.dumps(manifest))
    check_as_launched(make_config(job), passed_settings(job), 1, run_dir, sweep=True)


def test_a_sweep_stopped_in_a_job_says_to_launch_the_sweep_again_which_runs_the_rest(tmp_path):
    """(reviews rv117, rv118) SIGTERM in job 0 printed job 0's own command line; pasted as printed, it finished job 0
    and the jobs after it never ran, without a word. The line gives the sweep's command, in the sweep's own folder
    (the default one is new at every launch: the command as given started another sweep) and without
    trainer.stop_at (which would stop it there again); pasted, it continues job 0 and runs job 1."""
    import glob
    import shlex
    import signal
    import time

    args = ["--multirun", "optim.lr=1e-3,2e-3", "trainer.max_steps=60", "trainer.log_every=1",
            "trainer.eval_every=60", "trainer.ckpt_every=60", "trainer.stop_at=50", "logger=none",
            "logger.plots=false", "trainer.progress=off"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 300
    logs = f"{tmp_path}/runs/multirun/**/0/train.log"  # (runs/multirun/<date>/<time>-<hex>/0: conf/config.yaml)
    while not any("step 2/" in Path(f).read_text() for f in glob.glob(logs, recursive=True)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()  # (a line, not a time)
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    (sweep,) = [Path(p).parents[1] for p in glob.glob(logs, recursive=True)]
    assert proc.returncode == 3 and not (sweep / "1").exists(), out[-2000:] + err[-2000:]
    said = re.search(r"to resume: python train.py (.*) \(the same sweep: it continues this job, then runs the rest\)",
                     out + err)
    assert said, out[-2000:] + err[-2000:]
    again = shlex.split(said.group(1))
    assert again == [a for a in args if not a.startswith("trainer.stop_at=")] + [f"hydra.sweep.dir={sweep}"]
    out = train_py(*again, cwd=tmp_path)  # the line's command: job 0 resumed, then job 1, each to its end
    assert f"resumed from {sweep}/0/checkpoints/step-" in out.stdout, out.stdout[-2000:]
    assert [p.name for p in jobs(sweep)] == ["0", "1"] and (sweep / "1" / "checkpoints" / "step-00000060").is_dir()
    assert len(glob.glob(logs, recursive=True)) == 1, "no other sweep was started"


def test_a_run_into_a_job_folder_of_a_running_sweep_is_refused(tmp_path):
    """(review rv117) A single run into a job folder the running sweep had not reached yet was accepted; the sweep
    then met that run's files there and stopped, losing that job and every one after it. While the sweep's claim
    names a process that runs on this host, a run into one of its folders is refused; once it has ended, not."""
    import json
    import socket

    import pcdist

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    claim = {"overrides": ["optim.lr=1e-3,2e-3"], "host": socket.gethostname()}
    (sweep / ".pcdist-sweep.json").write_text(json.dumps({**claim, "pid": os.getppid()}))  # (a live process)
    cfg = {"run_dir": str(sweep / "1"), "logger": "none", "logger.plots": False, "trainer.max_steps": 2,
           "trainer.progress": "off"}
    with pytest.raises(pcdist.ConfigError, match=rf"^{sweep}/1 is a job folder of the sweep running into {sweep} "
                                                 rf"\(process {os.getppid()}: optim.lr=1e-3,2e-3\)"):
        pcdist.train(cfg)
    assert sorted(p.name for p in sweep.iterdir()) == [".pcdist-sweep.json"]
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (sweep / ".pcdist-sweep.json").write_text(json.dumps({**claim, "pid": int(ended.stdout)}))  # (it has ended)
    assert pcdist.train(cfg)["step"] == 2
