"""Run directories: a new one per launch (agreed by every torchrun rank and restart), resuming as a visible
choice, changed settings on resume decided per key, and the config of every attempt kept."""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import pcdist
from pcdist.service.metrics import read_metrics
from pcdist.service.rundir import LOCK, ON_RESUME, new_run_dir
from pcdist.engine.trainer import warmup_cosine
from spawn import free_port
from test_service import ROOT

TINY = ["model.dims=[64,16,10]", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.log_every=1", "pc.T=2",
        "logger=none", "logger.plots=false", "trainer.progress=off"]


def run_dirs(root: Path) -> list[Path]:
    """Run directories under root/runs/<date>/ (those with a config.yaml)."""
    return sorted(p.parent for p in root.glob("runs/*/*/config.yaml"))


def test_two_launches_at_once_write_two_directories_and_torchrun_ranks_agree(tmp_path):
    """A plain `python train.py` and a torchrun launch of two layer ranks (without --standalone: the rendezvous
    id 'none'), started together in one folder without hydra.run.dir: two directories, each holding one run's
    files only; both torchrun ranks wrote their layer slice into the same one."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launches = [[sys.executable, str(ROOT / "train.py"), *TINY, "trainer.seed=1"],
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                 str(ROOT / "train.py"), "parallel.layer=2", *TINY, "trainer.seed=2"]]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in launches]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    dirs = {yaml.safe_load((d / "config.yaml").read_text())["trainer"]["seed"]: d for d in run_dirs(tmp_path)}
    assert sorted(dirs) == [1, 2] and len(run_dirs(tmp_path)) == 2, run_dirs(tmp_path)
    for seed, d in dirs.items():
        assert [r["step"] for r in read_metrics(d / "metrics.jsonl") if "train/energy" in r] == [1, 2]
        assert sorted(p.name for p in (d / "configs").iterdir()) == ["attempt-1.yaml"]
        assert len(list((d / "checkpoints/step-00000002").glob("layers-*.pt"))) == seed, "one file per layer rank"
        assert f"run directory: {d}" in outs[seed - 1][0]


def test_new_names_differ_per_launch_and_agree_within_a_torchrun_launch(tmp_path, monkeypatch):
    """One process: every call is new (the clock and random digits). Under torchrun the name depends on the
    launch only (on one node its agent, so that a later launch reusing an --rdzv-id gets its own directory; on
    several nodes the rendezvous id): every rank, every restart and every later call for the same launch agrees;
    another launch differs."""
    assert new_run_dir(tmp_path) != new_run_dir(tmp_path)
    for run_id in (str(uuid.uuid4()), "none", "job-4711"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
        first = new_run_dir(tmp_path)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")  # a restarted worker, even a day later
        assert new_run_dir(tmp_path) == first
        assert new_run_dir(tmp_path, call=2) not in (first, new_run_dir(tmp_path, call=3))
        assert first.parent.parent == tmp_path and first.name.endswith(
            {"none": f"p{os.getppid()}", "job-4711": f"job-4711-p{os.getppid()}"}.get(run_id, run_id[:8]))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", str(uuid.uuid4()))
    assert new_run_dir(tmp_path) != first
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-4711")  # a later launch on one node reusing the id: its own
    reused = new_run_dir(tmp_path)
    with monkeypatch.context() as later:
        later.setattr(os, "getppid", os.getpid)  # another agent (this process: another pid and start time)
        assert new_run_dir(tmp_path) != reused and new_run_dir(tmp_path).name.endswith(f"job-4711-p{os.getpid()}")
        later.setenv("GROUP_WORLD_SIZE", "2")  # several nodes: the id is what they share, and names the launch
        on_nodes = new_run_dir(tmp_path)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert new_run_dir(tmp_path) == on_nodes
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(pcdist.ConfigError, match="torchrun on several nodes with the rendezvous id 'none': the ranks "
                                                 "cannot agree on a new run directory; pass --standalone or --rdzv-id"):
        new_run_dir(tmp_path)


# ---------------------------------------------------------------------------------------------
# Resuming


def cfg(run_dir, **over):
    c = {"logger": {"name": "none", "plots": False}, "run_dir": str(run_dir), "pc": {"T": 4},
         "model": {"dims": [64, 32, 10]},
         "trainer": {"max_steps": 24, "eval_every": 24, "log_every": 4, "ckpt_every": 12, "dtype": "float64",
                     "progress": "off", "batch_size": 32}, "optim": {"warmup_steps": 4}}
    for k, v in over.items():
        c.setdefault(k, {}).update(v) if isinstance(v, dict) else c.__setitem__(k, v)
    return c


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stopped_at_12(tmp_path_factory) -> Path:
    """A run of cfg() stopped (trainer.stop_at) after its checkpoint at step 12 of 24."""
    run_dir = tmp_path_factory.mktemp("stopped")
    pcdist.train(cfg(run_dir, trainer={"stop_at": 12}))
    return run_dir


def copy_of(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst


def test_rerunning_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys):
    pcdist.train(cfg(tmp_path, trainer={"max_steps": 12}))
    before = snapshot(tmp_path)
    capsys.readouterr()
    result = pcdist.train(cfg(tmp_path, trainer={"max_steps": 12}))
    out = capsys.readouterr().out
    assert result["finished"] and result["step"] == 12
    assert out == (f"{tmp_path} is already finished: its newest checkpoint is step 12 and trainer.max_steps=12; "
                   f"nothing to train (raise trainer.max_steps to train on, or leave out the run directory for a "
                   f"new run)\n")
    assert snapshot(tmp_path) == before, "a rerun into a finished run must not write anything"


def test_resume_never_and_require_refuse_with_one_line(stopped_at_12, tmp_path):
    with pytest.raises(pcdist.ConfigError, match=f"^resume=require but {tmp_path / 'new'} holds no checkpoint"):
        pcdist.train(cfg(tmp_path / "new", resume="require"))
    assert not (tmp_path / "new/checkpoints").exists()
    copy_of(stopped_at_12, tmp_path / "done")
    before = snapshot(tmp_path / "done")
    with pytest.raises(pcdist.ConfigError, match=r"^resume=never but .*done holds a run \(checkpoint step-00000012\)"):
        pcdist.train(cfg(tmp_path / "done", resume="never"))
    assert snapshot(tmp_path / "done") == before
    assert pcdist.train(cfg(tmp_path / "done", resume="require"))["step"] == 24


@pytest.mark.parametrize("bad", ["[1, 2]", '{"step": "5"}', '{"step": 2, "train/ene'])
def test_a_damaged_metrics_row_before_the_last_is_refused_and_changes_nothing(stopped_at_12, tmp_path, bad):
    """A metrics.jsonl line before the last that is not a row pcdist writes (not an object, a step that is not an
    integer, a line cut short): the resume is refused in one line naming the file and line, and nothing in the
    directory changes (it failed with a traceback after rewriting model.json, or deleted the line without a word).
    Cut short as the last line (a run killed while writing it) it is dropped, and the resume goes on."""
    run = copy_of(stopped_at_12, tmp_path / "run")
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([rows[0], bad, *rows[1:]]) + "\n")
    before = snapshot(run)
    with pytest.raises(pcdist.ConfigError, match=f"^cannot resume {run}: {run / 'metrics.jsonl'}: line 2 is not "):
        pcdist.train(cfg(run))
    assert snapshot(run) == before
    (run / "metrics.jsonl").write_text("\n".join([*rows, bad]) + "\n" if bad.endswith("ene") else "\n".join(rows))
    if bad.endswith("ene"):
        assert pcdist.train(cfg(run))["step"] == 24
        assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "train/energy" in r] == list(range(4, 25, 4))


def test_changed_settings_on_resume_are_applied_said_and_kept(stopped_at_12, tmp_path, capsys):
    """Stop at 12, resume with a new LR, T and length: each change is one line with its decision; from step 12
    on the LR follows the new schedule (what a straight run with the new settings logs); every attempt's
    config is kept and config.yaml is the latest."""
    new = {"optim": {"lr": 0.01}, "pc": {"T": 3}, "trainer": {"max_steps": 36, "stop_at": 36}}
    copy_of(stopped_at_12, tmp_path / "run")
    capsys.readouterr()
    pcdist.train(cfg(tmp_path / "run", **new))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"resumed from {tmp_path / 'run/checkpoints/step-00000012'} at step 12 of 36 with the run's "
                        f"own settings (config: configs/attempt-2.yaml)")
    assert "resume: pc.T changed 4 -> 3: applied (from the resumed step on)" in lines
    assert "resume: optim.lr changed 0.002 -> 0.01: applied (the LR schedule is recomputed at the resumed step)" \
        in lines
    assert "resume: trainer.max_steps changed 24 -> 36: applied (the LR schedule is recomputed at the resumed step)" \
        in lines
    # trainer.stop_at (12 then, given now) is this launch's, not a setting of the run that changed: no line
    assert not [line for line in lines if line.startswith("resume: trainer.stop_at")], lines
    # The LR each step trains with after the resume is the new schedule's: an independent LambdaLR at each logged
    # step.
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01)
    sched = warmup_cosine(opt, 4, 36)
    expected = {}
    for step in range(1, 37):
        expected[step] = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
    logged = {r["step"]: r["train/lr"] for r in read_metrics(tmp_path / "run/metrics.jsonl") if "train/lr" in r}
    for step in (16, 24, 36):
        assert logged[step] == pytest.approx(expected[step], rel=1e-12), step
    attempts = [yaml.safe_load((tmp_path / f"run/configs/attempt-{n}.yaml").read_text()) for n in (1, 2)]
    assert attempts[0]["optim"]["lr"] == 0.002 and attempts[0]["pc"]["T"] == 4
    assert attempts[1]["optim"]["lr"] == 0.01 and attempts[1]["pc"]["T"] == 3
    assert yaml.safe_load((tmp_path / "run/config.yaml").read_text()) == attempts[1]
    assert "# resume: optim.lr changed 0.002 -> 0.01" in (tmp_path / "run/configs/attempt-2.yaml").read_text()


def test_an_ipc_runs_schedule_spans_its_steps_and_a_resume_with_another_T_keeps_its_place(tmp_path):
    """ipc takes T weight steps per training step and the engine steps the schedule after each: the service's
    schedule (warm-up and cosine over trainer.max_steps) ran out at max_steps / T, and the weights stopped for the
    rest of the run. It counts max_steps x T optimizer steps (warm-up x T), and a resume with another T puts the
    new T's schedule at the same fraction of the run. Each logged train/lr is the closed form's at that step's
    first weight step; the weights still move in the run's last steps."""
    def closed_form(T, step):  # the LR of training step `step`'s first weight step, an independent LambdaLR
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.002)
        sched = warmup_cosine(opt, 4 * T, 24 * T)
        for _ in range((step - 1) * T):
            opt.step()
            sched.step()
        return opt.param_groups[0]["lr"]

    run = tmp_path / "run"
    pcdist.train(cfg(run, pc={"T": 4, "algorithm": "ipc"}, trainer={"stop_at": 12}))
    old = shutil.copytree(run, tmp_path / "old")  # its checkpoint as one made before the fix: schedule not recorded
    meta_path = old / "checkpoints" / "step-00000012" / "meta.pt"
    meta = torch.load(meta_path, weights_only=False)
    del meta["optimizer_steps"]
    meta["lr"], meta["scheduler"]["_last_lr"] = 0.0, [0.0]  # (the rate of the schedule that had run out)
    torch.save(meta, meta_path)
    manifest = json.loads((meta_path.parent / "manifest.json").read_text())
    manifest["files"]["meta.pt"] = hashlib.sha256(meta_path.read_bytes()).hexdigest()
    (meta_path.parent / "manifest.json").write_text(json.dumps(manifest))
    pcdist.train(cfg(run, pc={"T": 2, "algorithm": "ipc"}, trainer={"ckpt_every": 4}))
    logged = {r["step"]: r["train/lr"] for r in read_metrics(run / "metrics.jsonl") if "train/lr" in r}
    assert sorted(logged) == [4, 8, 12, 16, 20, 24]
    for step, lr in logged.items():
        assert lr == pytest.approx(closed_form(4 if step <= 12 else 2, step), rel=1e-12, abs=1e-15), step
    # (such a checkpoint's LR was the used-up schedule's 0: its first step trained at it, silently)
    pcdist.train(cfg(old, pc={"T": 4, "algorithm": "ipc"}, trainer={"stop_at": 13, "log_every": 1}))
    first = [r for r in read_metrics(old / "metrics.jsonl") if r["step"] == 13][0]["train/lr"]
    assert first == pytest.approx(closed_form(4, 13), rel=1e-12) and first > 0
    assert logged[24] > 0
    w20, w24 = (torch.load(run / f"checkpoints/step-{s:08d}/layers-0001-0003.pt", weights_only=True)["layers"]
                for s in (20, 24))
    assert any(not torch.equal(w20[k], w24[k]) for k in w20)


def test_changes_to_the_model_or_data_are_refused_naming_every_key(stopped_at_12, tmp_path):
    tmp_path = copy_of(stopped_at_12, tmp_path / "run")
    before = snapshot(tmp_path)
    with pytest.raises(pcdist.ConfigError) as info:
        pcdist.train(cfg(tmp_path, model={"dims": [64, 16, 10]}, trainer={"seed": 1, "batch_size": 16}))
    assert str(info.value) == (
        f"cannot resume {tmp_path} with changed model.dims ([64, 32, 10] -> [64, 16, 10]: it changes the "
        f"model's shape), trainer.batch_size (32 -> 16: it changes the global batches (the data order) and what a "
        f"step is), trainer.seed (0 -> 1: it changes the initial weights and the data order); leave out "
        f"model.dims=[64,16,10] trainer.batch_size=16 trainer.seed=1 (a resume continues with the run's own settings), "
        f"or start a new run directory")
    assert snapshot(tmp_path) == before, "a refused resume writes nothing"


def test_the_policy_table_covers_what_a_resume_cannot_change():
    """The refusals docs/service.md's table documents, read from its row, are the code's, no more and no fewer (the
    test named 7 of them: a refusal of data.num_classes turned into "applied" passed, and the code refused
    data.signal, which the docs did not say)."""
    row = next(line for line in (ROOT / "docs" / "service.md").read_text().splitlines()
               if line.startswith("| `model.*`"))
    documented = {k.removesuffix(".*") for k in re.findall(r"`([a-z_]+\.[a-z_.*]+)`", row.split(" | ")[0])}
    refused = {k for k, (decision, _) in ON_RESUME.items() if decision == "refused"}
    synthetic = {k for k in refused if k.startswith("data.synthetic_")}
    assert synthetic and "data.synthetic_*" in documented
    assert documented - {"data.synthetic_*", "pc.prior_mean"} == refused - synthetic, (documented, refused)


# ---------------------------------------------------------------------------------------------
# Resuming from the command line: the run's own settings, only what is passed now applied, and
# nothing in the directory changes unless the run continues

CLI_RUN = ["model.dims=[64,16,10]", "pc.T=2", "trainer.log_every=2", "trainer.eval_every=4", "trainer.ckpt_every=4",
           "logger=none", "logger.plots=false", "trainer.progress=off"]


def train_py(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_stopped_run_resumed_with_only_its_directory_continues_with_its_own_settings(tmp_path):
    """Made with trainer.max_steps=12 trainer.stop_at=6 and other overrides, the run says it stopped early and how
    to resume; resumed with hydra.run.dir alone it continues to step 12 with every setting it was made with (no
    conf/ default comes back: max_steps stays 12, ckpt_every 4), and changes nothing but what stop_at was for."""
    run_dir = tmp_path / "run"
    first = train_py(tmp_path, *CLI_RUN, "trainer.max_steps=12", "trainer.stop_at=6", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.splitlines()[-1].startswith(
        "stopped early at step 6 of 12 (trainer.stop_at=6): val/accuracy ")
    assert first.stdout.splitlines()[-1].endswith(
        f"run directory: {run_dir}; to train on, resume it with its own settings: python train.py "
        f"hydra.run.dir={run_dir}")
    second = train_py(tmp_path, f"hydra.run.dir={run_dir}")
    assert second.returncode == 0, second.stderr[-3000:]
    out = second.stdout.splitlines()
    assert out[0] == (f"resumed from {run_dir / 'checkpoints/step-00000006'} at step 6 of 12 with the run's own "
                      f"settings (config: configs/attempt-2.yaml)")
    assert not [line for line in out if line.startswith("resume:")], "nothing was changed, so nothing is said"
    assert out[-1].startswith("step 12: val/accuracy ")
    attempts = [yaml.safe_load((run_dir / f"configs/attempt-{n}.yaml").read_text()) for n in (1, 2)]
    assert attempts[0]["trainer"].pop("stop_at") == 6 and attempts[1]["trainer"].pop("stop_at") is None
    assert attempts[0] == attempts[1], "the resume ran with the run's own settings"
    assert attempts[1]["trainer"]["max_steps"] == 12 and attempts[1]["model"]["dims"] == [64, 16, 10]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [  # ckpt_every 4, the stop, ckpt_keep 3
        "step-00000006", "step-00000008", "step-00000012"]
    log = (run_dir / "train.log").read_text()
    for said in (f"new run in {run_dir}", "stopped early at step 6 of 12", "resumed from", "step 12: val/accuracy"):
        assert said in log, f"train.log lacks {said!r}"


@pytest.fixture(scope="module")
def mupc_run(tmp_path_factory) -> Path:
    """A small μPC run made from a preset (experiment=mupc_digits) and stopped at step 2 of 4."""
    run_dir = tmp_path_factory.mktemp("mupc") / "run"  # made as train.py makes it (the command line as a list)
    pcdist.train(["experiment=mupc_digits", "model.depth=4", "trainer.max_steps=4", "trainer.stop_at=2",
                  "trainer.ckpt_every=2", "logger=none", "logger.plots=false", "trainer.progress=off",
                  f"run_dir={run_dir}"])
    return run_dir


def test_a_preset_run_resumes_without_repeating_the_preset(mupc_run, tmp_path):
    run_dir = copy_of(mupc_run, tmp_path / "run")
    out = train_py(tmp_path, f"hydra.run.dir={run_dir}", "optim.lr=0.005")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resume: optim.lr changed 0.01 -> 0.005: applied (the LR schedule is recomputed at the resumed step)" \
        in out.stdout.splitlines()
    attempt = yaml.safe_load((run_dir / "configs/attempt-2.yaml").read_text())
    assert attempt["model"]["name"] == "mupc" and attempt["model"]["depth"] == 4 and attempt["pc"]["T"] == 4
    assert '# overrides: ["optim.lr=0.005"]' in (run_dir / "configs/attempt-2.yaml").read_text()


def test_a_preset_passed_again_on_resume_comes_back_whole(tmp_path):
    """experiment=X passed again on a resume sets every key the preset's file writes, those equal to conf/'s
    defaults too (pc.prior_precision: 1.0): after a resume that changed pc.eval_T and pc.prior_precision, both
    come back to the preset's values, not only the one that differs from the defaults."""
    run_dir = tmp_path / "run"
    small = ["logger=none", "logger.plots=false", "trainer.progress=off", "trainer.eval_every=1000",
             f"run_dir={run_dir}"]
    pcdist.train(["experiment=generative_digits", "trainer.max_steps=2", "pc.eval_T=5", *small])
    pcdist.train(["trainer.max_steps=4", "pc.eval_T=6", "pc.prior_precision=0.5", *small])
    pcdist.train(["experiment=generative_digits", "trainer.max_steps=6", "pc.eval_T=7", *small])
    attempts = [yaml.safe_load((run_dir / f"configs/attempt-{n}.yaml").read_text())["pc"] for n in (1, 2, 3)]
    assert [(a["eval_T"], a["prior_precision"]) for a in attempts] == [(5, 1.0), (6, 0.5), (7, 1.0)]


def test_a_refused_or_pointless_resume_changes_nothing_in_the_run_directory(mupc_run, tmp_path):
    """A refusal names the override to leave out (or, for a config composed whole, the run's own to add back);
    neither it nor a rerun of a finished run writes anything into the directory."""
    run_dir = copy_of(mupc_run, tmp_path / "run")
    before = snapshot(run_dir)
    out = train_py(tmp_path, f"hydra.run.dir={run_dir}", "model=mlp")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert out.stderr.startswith(f"error: cannot resume {run_dir} with changed model.name ('mupc' -> 'mlp': it "
                                 f"changes the model's shape)")
    assert out.stderr.endswith("; leave out model=mlp (a resume continues with the run's own settings), or start a new "
                               "run directory\n")
    with pytest.raises(pcdist.ConfigError, match=r"; add back experiment=mupc_digits model.depth=4 \(the run was made "
                                                 r"with: experiment=mupc_digits model.depth=4 "):
        pcdist.train(pcdist.compose([f"run_dir={run_dir}", "logger=none"]))  # a whole config, without the preset
    assert snapshot(run_dir) == before
    assert pcdist.train([f"run_dir={run_dir}", "trainer.stop_at=4"])["step"] == 4  # trained to its end
    after = snapshot(run_dir)
    assert train_py(tmp_path, f"hydra.run.dir={run_dir}").stdout == (
        f"{run_dir} is already finished: its newest checkpoint is step 4 and trainer.max_steps=4; nothing to train "
        f"(raise trainer.max_steps to train on, or leave out the run directory for a new run)\n")
    assert snapshot(run_dir) == after
    pcdist.train({"run_dir": str(run_dir), "trainer.dtype": "float64"})  # a changed setting, and nothing to train
    assert snapshot(run_dir) == after, "not even model.json is written again (it would record float64)"
    assert not (run_dir / ".hydra").exists() and not (run_dir / "pcdist.log").exists(), "Hydra writes nothing there"


def test_a_resume_checks_what_it_changes_against_the_run_s_own_settings(tmp_path, capsys):
    """How keys go together is checked on the config the launch trains with: an MNIST run whose files moved
    resumes with data.root=<the new place> (checked against data=mnist, not against conf/'s default digits, which
    reads no data.root), and a two-layer run takes one precision per its two layers; the same keys on a fresh
    launch over the defaults are still refused, naming the key."""
    from datafiles import make_mnist

    old = make_mnist(tmp_path / "m1", n_train=64)
    run_dir = tmp_path / "run"
    small = {"model": {"dims": [784, 16, 10]}, "trainer": {"max_steps": 4, "stop_at": 2, "ckpt_every": 2,
                                                            "eval_every": 2, "batch_size": 16, "dtype": "float32"}}
    pcdist.train(cfg(run_dir, data={"name": "mnist", "root": str(old)}, **small))
    new = old.rename(tmp_path / "m2")
    capsys.readouterr()
    assert pcdist.train({"run_dir": str(run_dir), "data": {"root": str(new)}, "pc": {"precision": [1.0, 0.5]},
                         "trainer": {"stop_at": None}})["step"] == 4
    said = capsys.readouterr().out
    assert f"resume: data.root changed {str(old)!r} -> {str(new)!r}: applied, with a warning" in said, said
    assert "resume: pc.precision changed None -> [1.0, 0.5]: applied" in said, said
    with pytest.raises(pcdist.ConfigError, match=r"^config data.root=.* is read by data=mnist, fashion_mnist"):
        pcdist.train(cfg(tmp_path / "fresh", data={"root": str(new)}))
    with pytest.raises(pcdist.ConfigError, match=r"^config pc.precision=\[1.0, 0.5\] is invalid: allowed a number or "
                                                 r"one number per layer \(3\)"):
        pcdist.train(cfg(tmp_path / "fresh", pc={"precision": [1.0, 0.5]}, model={"dims": [64, 16, 16, 10]}))
    assert not (tmp_path / "fresh").exists()


def test_a_resume_refused_at_its_checkpoint_changes_nothing_in_the_run_directory(tmp_path):
    """A model that the settings do not show (a conv net on in-memory images of another size) is refused where
    the checkpoint is read, naming both models: model.json, the run's record of its layers and input
    normalization that pcdist.load and evaluate read, must not have been rewritten for the refused attempt. (The
    checkpoint's record of its data refuses the other images first, as it does here; a checkpoint without one,
    from before it, meets the model's refusal.)"""
    digits = pcdist.data.load_dataset("digits")

    def images(side: int) -> pcdist.data.Dataset:
        def up(x):
            return torch.nn.functional.interpolate(x.view(-1, 1, 8, 8), size=(side, side))
        return pcdist.data.Dataset(up(digits.x_train), digits.y_train, up(digits.x_val), digits.y_val, 10)

    run_dir = tmp_path / "run"
    pcdist.train(["model=cnn", "trainer.max_steps=4", "trainer.stop_at=2", "trainer.ckpt_every=2", "logger=none",
                  "logger.plots=false", "trainer.progress=off", f"run_dir={run_dir}"], data=images(8))
    before = snapshot(run_dir)
    with pytest.raises(pcdist.data.DataError, match=r"its data changed since its checkpoint was trained \(sample "
                                                    r"shape \[1, 8, 8\] -> \[1, 16, 16\]\)"):
        pcdist.train({"run_dir": str(run_dir)}, data=images(16))
    assert snapshot(run_dir) == before
    meta = run_dir / "checkpoints" / "step-00000002" / "meta.pt"
    old = torch.load(meta, weights_only=False)
    del old["data"]
    torch.save(old, meta)  # (its checksum in the manifest mended as a checkpoint of before the record would have it)
    manifest = json.loads((meta.parent / "manifest.json").read_text())
    manifest["files"]["meta.pt"] = hashlib.sha256(meta.read_bytes()).hexdigest()
    (meta.parent / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(run_dir)
    with pytest.raises(pcdist.service.checkpoint.CheckpointError, match=r"step-00000002 was written by a different "
                       r"model: conv \[1, 8, 8\].*; this run has conv \[1, 16, 16\]"):
        pcdist.train({"run_dir": str(run_dir)}, data=images(16))
    assert snapshot(run_dir) == before
    assert pcdist.load(run_dir).inputs.sample_shape == (1, 8, 8)


def _edited_meta(run: Path, edit) -> Path:
    """The run's newest meta.pt edited (its checksum in the manifest mended, as a stranger or a newer pcdist would
    have written it)."""
    meta = sorted((run / "checkpoints").glob("step-*"))[-1] / "meta.pt"
    torch.save(edit(torch.load(meta, weights_only=True)), meta)
    manifest = json.loads((meta.parent / "manifest.json").read_text())
    manifest["files"]["meta.pt"] = hashlib.sha256(meta.read_bytes()).hexdigest()
    (meta.parent / "manifest.json").write_text(json.dumps(manifest))
    return meta


def _newer(m):
    m["config"]["trainer"]["grad_clip"] = 1.0
    return m


def _without_config(m):
    del m["config"]
    return m


@pytest.mark.parametrize("case, edit, config_yaml, says", [
    ("newer", _newer, None, r"cannot resume {run}: its checkpoint's settings hold trainer.grad_clip, which this pcdist "
                            r"does not know \(a run of a newer pcdist\?\); resume it with the pcdist that made it"),
    ("settings", lambda m: {**m, "config": "text"}, None, r"{meta} holds settings that are a str, not a mapping"),
    ("step", lambda m: {k: v for k, v in m.items() if k != "step"}, None, r"{meta} holds no step \(a whole number"),
    ("list", lambda m: [1, 2], None, r"{meta} holds a list, not a checkpoint file pcdist wrote"),
    ("tag", _without_config, "!!python/object/apply:os.system ['true']\n", r"{run}/config.yaml is damaged \("),
    ("yaml-list", _without_config, "- 1\n", r"{run}/config.yaml holds a list: not the run's settings"),
])
def test_a_run_folder_pcdist_did_not_write_is_refused_in_one_line_naming_the_file(stopped_at_12, tmp_path, case,
                                                                                  edit, config_yaml, says):
    """A checkpoint that passes its manifest but whose meta.pt is not what this pcdist wrote: settings it does not
    know (a newer pcdist's: the resume dropped them without a word), settings or a step that are not there, not a
    mapping; an older run's config.yaml (its checkpoint keeps no settings) that is not YAML or not a mapping. A
    resume, train.py --check and pcdist.load each refuse it in one line naming the file (they failed with
    tracebacks: AttributeError, KeyError, an uncaught CheckpointError under --check), and nothing changes."""
    run = copy_of(stopped_at_12, tmp_path / "run")
    meta = _edited_meta(run, edit)
    if config_yaml is not None:
        (run / "config.yaml").write_text(config_yaml)
    says = says.format(run=re.escape(str(run)), meta=re.escape(str(meta)))
    before = snapshot(run)
    with pytest.raises(pcdist.errors.USER_ERRORS, match=says):
        pcdist.train(cfg(run))
    if case == "newer":  # evaluate's refusal names the run (it read as a mistyped key on the command line)
        says = rf"{re.escape(str(run))}: the run's settings \(its checkpoint's, else config.yaml\) cannot be read by "
    with pytest.raises(pcdist.errors.USER_ERRORS, match=says):
        pcdist.load(run)
    assert snapshot(run) == before
    if case == "list":
        out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--check", f"hydra.run.dir={run}"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and out.stderr.startswith(f"error: {meta} holds a list") and \
            out.stderr.count("\n") == 1, out.stderr[-3000:]


def test_a_launch_that_fails_before_training_leaves_no_run_directory(tmp_path):
    """A bad value, bad data, resume=require on a mistyped directory: one line each and nothing under runs/."""
    (tmp_path / "a-file").write_text("not a directory")
    for args in (["trainer.max_steps=0"], ["data=arrays", "data.path=missing.npz"],
                 ["resume=require", "hydra.run.dir=runs/2026-01-01/typo"], ["hydra.run.dir=a-file"]):
        out = train_py(tmp_path, *args, "logger=none")
        assert out.returncode == 2 and out.stderr.count("\n") == 1, (args, out.stderr[-3000:])
        assert not (tmp_path / "runs").exists(), f"{args} left {sorted(tmp_path.rglob('*'))}"
    assert "cannot make the run directory" in out.stderr and "a file is there" in out.stderr, out.stderr
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / LOCK).mkdir()  # what opening the lock meets in a read-only directory: an OSError
    with pytest.raises(pcdist.ConfigError, match=f"^cannot write in the run directory {re.escape(str(tmp_path))}"):
        pcdist.train({"run_dir": str(tmp_path / "locked"), "trainer.max_steps": 2})
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(ROOT / "train.py"), "trainer.max_steps=0", "logger=none"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode != 0 and out.stderr.count("error: config trainer.max_steps=0 is invalid") == 1, out.stderr
    left = [p for p in tmp_path.glob("runs/*/*") if p.parent.name != ".launches"]
    assert not left, f"under torchrun too (only the launch's name record stays, in runs/.launches): {left}"


def test_a_folder_with_logs_but_no_checkpoint_is_refused_and_left_as_it_is(tmp_path):
    """A run killed before its first checkpoint leaves its logs and no checkpoint. A rerun into that folder must
    neither start a new run there (a second run appended to metrics.jsonl and drawn into the same plot) nor touch
    it: one line naming the folder, what it holds and the way out, exit status 2, every file as it was."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *CLI_RUN, "trainer.max_steps=1000000",
                             "trainer.ckpt_every=1000000", f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # killed once it has logged (it checkpoints only at its end, which it never reaches)
        wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size > 0,
                 proc, "the first metrics")
    finally:
        proc.kill()
        proc.wait()
    assert not list((run_dir / "checkpoints").glob("step-*"))
    before = snapshot(run_dir)
    assert before.pop(".lock").startswith(b"pid "), "the killed run's lock file stays (the kernel let its lock go)"
    out = train_py(tmp_path, *CLI_RUN, f"hydra.run.dir={run_dir}")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert out.stderr == (f"error: {run_dir} holds a run's files (metrics.jsonl, train.log, config.yaml, configs) "
                          f"but no checkpoint to resume (it stopped before its first one), and a new run there would "
                          f"mix with them; choose a new run directory (hydra.run.dir=..., or the config key run_dir), "
                          f"or remove {run_dir} to start it over\n")
    with pytest.raises(pcdist.ConfigError, match="holds a run's files"):
        pcdist.train(cfg(run_dir))
    assert snapshot(run_dir) == before, "nothing overwritten, appended or added (the stale lock file removed)"


def test_a_launch_stopped_before_it_logged_anything_is_started_over(tmp_path):
    """Ctrl-C or SIGTERM during a launch's start can land after it made its files and before it logged a step
    (it leaves an empty train.log and metrics.jsonl, and model.json): nothing there can mix with a new run, so a
    rerun starts the run over there, saying so in one line. Files of those names that pcdist did not write (a
    project's config.yaml) are refused, and so is a half-written first checkpoint (checkpoints/ with a step-*.tmp),
    something the run saved."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("train.log", "metrics.jsonl"):
        (run_dir / name).write_text("")
    pcdist.train(cfg(run_dir))
    said = (run_dir / "train.log").read_text().splitlines()
    assert said[0].endswith(f"start: {run_dir} holds the files of a launch that stopped before it logged a step "
                            f"(metrics.jsonl, train.log): the run starts over there"), said[:2]
    assert "new run in" in said[1] and pcdist.load(run_dir).step == 24
    mine = tmp_path / "project"  # a folder of files pcdist did not write: a project's own, given as hydra.run.dir
    for name, text in (("config.yaml", "lr: 0.1\n"), ("model.json", '{"arch": "resnet"}'),
                       ("train.log", "epoch 1 loss 0.3\n")):
        (mine / name).parent.mkdir(exist_ok=True)
        (mine / name).write_text(text)
        with pytest.raises(pcdist.ConfigError, match=f"^{re.escape(str(mine))} holds files that pcdist did not write "
                                                     f".{name}., which a run there would overwrite; nothing was "
                                                     f"changed: choose a new run directory"):
            pcdist.train(cfg(mine))
        assert (mine / name).read_text() == text and sorted(p.name for p in mine.iterdir()) == [name]
        (mine / name).unlink()
    again = tmp_path / "again"
    (again / "checkpoints" / "step-00000012.tmp").mkdir(parents=True)
    (again / "train.log").write_text("")
    with pytest.raises(pcdist.ConfigError, match="holds a run's files .checkpoints, train.log. but no checkpoint"):
        pcdist.train(cfg(again))


def test_a_launch_into_a_directory_another_run_trains_in_is_refused(tmp_path):
    """Two launches into one run directory at once (started together, or a resume while the run still trains)
    would mix their steps, logs and checkpoints. The first rank of a run holds its directory (a lock the kernel
    lets go when the process ends): another launch is refused in one line naming the holder, and writes nothing.
    Once the run has stopped (SIGTERM: it checkpoints), its lock file is gone and the same call resumes it."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *CLI_RUN, "trainer.max_steps=1000000",
                             f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: list((run_dir / "checkpoints").glob("step-*")), proc, "the first checkpoint")
        held = f"^{re.escape(str(run_dir))} is in use by another run \\(pid {proc.pid} on "
        with pytest.raises(pcdist.ConfigError, match=held):
            pcdist.train(cfg(run_dir, trainer={"max_steps": 1000000}))
        from pcdist.service.checks import check_as_launched  # what train.py --check runs (launch/*.sh first): it
        from pcdist.service.config import make_config  # refused nothing there, and torchrun restarted the refused

        with pytest.raises(pcdist.ConfigError, match=held):  # launch until the run ended, then trained on in it
            check_as_launched(make_config(cfg(run_dir, trainer={"max_steps": 1000000})), {}, 1, run_dir)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=300)[0]
    assert "new run in" in out and "pre-empted" in out, out[-2000:]
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/energy" in r]
    assert steps == sorted(set(steps)), "one run's steps, each once: the refused launch wrote nothing"
    assert not (run_dir / LOCK).exists(), "a run that ends lets its directory go"
    stopped = max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))
    pcdist.train({"run_dir": str(run_dir), "trainer.max_steps": stopped + 4})
    assert pcdist.load(run_dir).step == stopped + 4 and not (run_dir / LOCK).exists()


def test_a_torchrun_launch_refused_a_directory_stays_refused_when_torchrun_restarts_it(tmp_path):
    """Two jobs launched together into one run directory both pass train.py --check (no run holds it yet); the
    one whose first rank comes second is refused by the lock. torchrun restarts a refused worker: the restart,
    finding the directory free once the other run had ended, took it for its own and trained the second job's
    settings on in it (cluster review). A launch once refused stays refused through its restarts: its record in
    the directory's .refused/ says so, and the run's files are never written by it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # the run that holds it: the lock a run's first rank holds (lock_run_dir's), without torch
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | "
                               "os.O_CREAT); fcntl.lockf(fd, fcntl.LOCK_EX); os.write(fd, b'pid %d on here' % "
                               "os.getpid()); print('held', flush=True); sys.stdin.read()", str(run_dir / LOCK)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        launch = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                                   "--max-restarts=1", str(ROOT / "train.py"), *CLI_RUN, "trainer.max_steps=4",
                                   f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in launch.stdout:  # its first attempt is refused; then the holder ends, before the restart
            lines.append(line)
            if "is in use by another run" in line:
                break
        holder.kill()
        holder.wait()
        out = "".join(lines) + launch.communicate(timeout=300)[0]
    finally:
        holder.kill()
    assert launch.returncode != 0, out[-3000:]
    assert "this torchrun launch was refused the directory at an earlier attempt (held by pid " in out, out[-3000:]
    from pcdist.service.rundir import run_files

    assert run_files(run_dir) == [], "the refused launch wrote none of a run's files"
    assert [p.name for p in (run_dir / ".refused").iterdir()], "its record names the launch"
    # a lock still held by the launch's own earlier attempt (ending): no record, or every restart would be refused
    from pcdist.service.rundir import _remember_refusal

    own = run_dir / ".refused" / "agent-1-2-none-r0"
    _remember_refusal(own, f"pid 7 on here since today (launch {own.name})")
    assert not own.exists()


def wait_for(ready, proc, what: str, timeout: float = 300) -> None:
    """Wait until ``ready()`` (generous deadline; fails at once if ``proc`` exits first)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the process exited before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.05)


def test_a_launch_refused_at_its_first_attempt_is_refused_again_when_torchrun_restarts_it(tmp_path, monkeypatch):
    """torchrun restarts a worker refused with status 2 (--max-restarts): the restart may start over or resume
    only in a directory an earlier attempt of the same launch wrote (its configs/attempt-<n>.yaml names the
    launch). Into a project's folder (its own config.yaml), another run's files without a checkpoint, or another
    run with resume=never, the restart is refused as the first attempt was and changes nothing (it had trained
    there, overwriting the project's config.yaml). The launch's own directory, killed before its first checkpoint
    or finished with resume=never, is started over or resumed by its restart, and by a SLURM requeue of its job."""
    short = {"trainer": {"max_steps": 4, "ckpt_every": 4, "eval_every": 4}}
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.yaml").write_text("my_project: important\nlr: 3\n")
    other = tmp_path / "other"  # another launch's run, killed before its first checkpoint
    pcdist.train(cfg(other, **short))
    shutil.rmtree(other / "checkpoints")
    finished = tmp_path / "finished"
    pcdist.train(cfg(finished, **short))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-4711")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    for run_dir, over, said in ((project, {}, "holds files that pcdist did not write (config.yaml)"),
                                (other, {}, "holds a run's files (metrics.jsonl"),
                                (finished, {"resume": "never"}, "resume=never but")):
        before = snapshot(run_dir)
        with pytest.raises(pcdist.ConfigError, match=re.escape(said)):
            pcdist.train(cfg(run_dir, **short, **over))
        assert snapshot(run_dir) == before, run_dir
    own = tmp_path / "own"  # this launch's first attempt, killed before its first checkpoint
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    pcdist.train(cfg(own, **short))
    shutil.rmtree(own / "checkpoints")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert pcdist.train(cfg(own, **short))["step"] == 4, "started over by its restart"
    assert pcdist.train(cfg(own, resume="never", **short))["step"] == 4, "resumed (finished) by its restart"
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-4712")  # a SLURM requeue: a new torchrun, the same job
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    requeued = tmp_path / "requeued"
    pcdist.train(cfg(requeued, **short))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-4713")
    assert pcdist.train(cfg(requeued, resume="never", **short))["step"] == 4
    monkeypatch.setenv("SLURM_JOB_ID", "78")  # another job
    with pytest.raises(pcdist.ConfigError, match="resume=never but"):
        pcdist.train(cfg(requeued, resume="never", **short))


def _lets_go_after_the_logging_rank(rank, world, cfg):
    pcdist.train(cfg)
    run_dir = Path(cfg["run_dir"])
    if rank == 0:  # it held the directory; rank 1, the last layer slice, logs
        assert not (run_dir / LOCK).exists(), "the directory let go"
        assert (run_dir / "train.log").read_text().splitlines()[-1].endswith(f"run directory: {run_dir}")
        assert (run_dir / "accuracy_energy.png").is_file(), "the logging rank's plots, drawn as it closes"


def test_the_first_rank_lets_the_directory_go_only_after_the_logging_rank_is_done(tmp_path):
    """Two layer slices: the first rank holds the directory, the last one logs. When the first rank's run ends,
    the logging rank has written its last line and drawn its plots (its close): the first rank let the directory
    go as soon as its own part ended, and a second launch could take it while the first still wrote there."""
    from spawn import run

    c = cfg(tmp_path / "run", parallel={"layer": 2}, trainer={"max_steps": 4, "eval_every": 4, "ckpt_every": 4})
    c["logger"] = {"name": "none", "plots": True}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        run(_lets_go_after_the_logging_rank, 2, c, timeout=240)


def test_the_resume_line_is_a_command_a_shell_runs_for_a_folder_with_spaces(tmp_path):
    """The line a stopped run prints to resume it (`to resume: ...`) names its folder as one shell argument: a
    run directory with a space was printed bare and split in two when pasted (cluster review), and one that Hydra
    would take apart (`a,b` a sweep, `[1]` a list) failed with Hydra's own message. train.py takes such a folder,
    quoted as the line quotes it, as that folder (it made a folder named with the quotes beside the run)."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from pcdist.service.config import make_config, run_dir_override
    from pcdist.service.resume import resume_command

    for folder in ("/tmp/a b/run", "/tmp/ab/run", "/tmp/it's/run", "/tmp/a,b=[1]/run", " x\\'\\"):
        word = shlex.split(resume_command(make_config(None), folder))[-1]
        assert OverridesParser.create().parse_overrides([word])[0].value() == folder, word
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), run_dir_override("runs/a,b=[1]"), "logger=none",
                          "trainer.max_steps=1", "trainer.progress=off", "pc.T=2", "pc.x_lr=0.1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_dir() and "checkpoints" not in p.parts
            and "configs" not in p.parts] == [Path("runs"), Path("runs/a,b=[1]")]
    assert (tmp_path / "runs/a,b=[1]/checkpoints/step-00000001/manifest.json").is_file()


def test_a_resume_on_data_that_changed_since_the_checkpoint_is_refused(tmp_path):
    """The same data.path rewritten with other samples (half of them, the labels rolled) resumed without a word,
    and by trainer.epochs to another length (44 steps -> 20: the LR schedule's too; data review). A checkpoint
    records its data's identity: such a resume is refused in one line and changes nothing; the data restored, it
    resumes."""
    from pcdist.service.data import DataError

    d = pcdist.data.load_digits()
    arrays = {"x_train": d.x_train.numpy(), "y_train": d.y_train.numpy(), "x_val": d.x_val.numpy(),
              "y_val": d.y_val.numpy()}
    path, run_dir = tmp_path / "data.npz", tmp_path / "run"
    np.savez(path, **arrays)
    cfg_ = {"data": {"name": "arrays", "path": str(path)}, "run_dir": str(run_dir), "logger": "none",
            "logger.plots": False, "pc": {"T": 2, "x_lr": 0.1}, "model": {"dims": [64, 16, 10]},
            "trainer": {"epochs": 1, "stop_at": 3, "ckpt_every": 3, "progress": "off"}}
    pcdist.train(cfg_)
    before = snapshot(run_dir)
    np.savez(path, **dict(arrays, x_train=arrays["x_train"][:700], y_train=np.roll(arrays["y_train"][:700], 1)))
    with pytest.raises(DataError, match=rf"^cannot resume {re.escape(str(run_dir))}: its data changed since its "
                                        r"checkpoint was trained \(training samples 1437 -> 700; the labels differ\)"):
        pcdist.train({"run_dir": str(run_dir), "trainer": {"stop_at": 5}})
    assert snapshot(run_dir) == before
    np.savez(path, **dict(arrays, y_val=(arrays["y_val"] + 1) % 10))  # the same sizes: the content tells
    with pytest.raises(DataError, match=r"was trained \(the labels differ\); a resume would train on other data"):
        pcdist.train({"run_dir": str(run_dir), "trainer": {"stop_at": 5}})
    np.savez(path, **arrays)
    pcdist.train({"run_dir": str(run_dir), "trainer": {"stop_at": 5}})
    assert pcdist.load(run_dir).step == 5


def test_a_resume_on_torch_datasets_whose_targets_changed_is_refused(tmp_path):
    """Torch Datasets that keep their labels as torchvision's do (``targets``; the validation split a Subset of
    one, as random_split makes): a resume on the same sizes and shapes with other labels is refused as the arrays'
    is; the labels restored, it resumes."""
    from pcdist.service.data import DataError, StreamedData

    d = pcdist.data.load_digits()

    class Digits(torch.utils.data.Dataset):
        def __init__(self, x, y):
            self.x, self.targets = x, list(y.tolist())

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i], self.targets[i]

    def data(shift_val: int) -> StreamedData:
        val = Digits(d.x_val, (d.y_val + shift_val) % 10)
        return StreamedData(Digits(d.x_train, d.y_train), torch.utils.data.Subset(val, range(100)), 10)

    run_dir = tmp_path / "run"
    cfg_ = {"run_dir": str(run_dir), "logger": "none", "logger.plots": False, "pc": {"T": 2, "x_lr": 0.1},
            "model": {"dims": [64, 16, 10]}, "data": {"num_workers": 0},
            "trainer": {"max_steps": 4, "stop_at": 2, "ckpt_every": 2, "eval_every": 2, "progress": "off"}}
    pcdist.train(cfg_, data=data(0))
    before = snapshot(run_dir)
    with pytest.raises(DataError, match=r"was trained \(the labels differ\); a resume would train on other data"):
        pcdist.train({"run_dir": str(run_dir), "trainer": {"stop_at": 4}}, data=data(1))
    assert snapshot(run_dir) == before
    pcdist.train({"run_dir": str(run_dir), "trainer": {"stop_at": 4}}, data=data(0))
    assert pcdist.load(run_dir).step == 4


def test_hydra_run_dir_given_to_pcdist_train_is_the_runs_directory(tmp_path):
    """pcdist.train(["hydra.run.dir=..."]) (the command line as a list) and {"hydra": {"run": {"dir": ...}}} trained a
    new run in a folder of their own, the key dropped without a word: a resume from Python started afresh. It is
    run_dir; Hydra's other settings (a sweep's) are one line, and two directories for one run too."""
    quick = ["trainer.max_steps=2", "logger=none", "logger.plots=false", "trainer.progress=off"]
    run = tmp_path / "run"
    assert pcdist.train([f"hydra.run.dir={run}", *quick])["run_dir"] == str(run)
    resumed = pcdist.train({"hydra": {"run": {"dir": str(run)}}, "trainer": {"max_steps": 3}, "logger": "none",
                            "logger.plots": False})
    assert (resumed["run_dir"], resumed["step"]) == (str(run), 3)
    for cfg, says in (({"hydra.sweep.dir": str(tmp_path / "s")}, "hydra.sweep.dir: Hydra's settings are read by the "
                                                                 "command line"),
                      (["hydra/sweeper=optuna"], "hydra/sweeper: Hydra's settings are read by the command line"),
                      ({"hydra.run.dir": str(run), "run_dir": str(tmp_path / "b")}, "hydra.run.dir and run_dir name "
                                                                                    "two directories for one run")):
        with pytest.raises(pcdist.ConfigError, match=re.escape(says)):
            pcdist.train(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]

