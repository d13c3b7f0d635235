"""Checkpoints: a damaged newest checkpoint falls back to the previous one; a failed write
never damages what is on disk; a checkpoint of another model shape is refused."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import pcdist
from pcdist.service.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from pcdist.service.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


# The model these tests load checkpoints into (pcdist.PCNetwork.from_dims(..., activation="tanh")).
TANH = {"dims": [64, 128, 128, 10], "activation": "tanh", "energy": "se"}


def train_two_checkpoints(run_dir: Path) -> None:
    pcdist.train({"logger": {"name": "none", "plots": False}, "run_dir": str(run_dir), "model": TANH,
                  "trainer": {"max_steps": 8, "ckpt_every": 4, "eval_every": 8, "log_every": 4, "progress": "off"}})


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    train_two_checkpoints(run_dir)
    return run_dir


def copy_run(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return dst


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_manifest", "delete_layer_file", "files_not_a_mapping",
                                    "a_path_for_a_file_name", "layers_not_a_number", "an_unlisted_layer_file"])
def test_damaged_newest_checkpoint_falls_back_with_a_warning(two_checkpoints, tmp_path, damage):
    run = copy_run(two_checkpoints, tmp_path / "run")
    newest = run / "checkpoints" / "step-00000008"
    layer_file = next(newest.glob("layers-*.pt"))
    if damage == "truncate":
        layer_file.write_bytes(layer_file.read_bytes()[:100])
    elif damage == "flip":
        raw = bytearray(layer_file.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        layer_file.write_bytes(bytes(raw))
    elif damage == "delete_manifest":
        (newest / "manifest.json").unlink()
    elif damage in ("files_not_a_mapping", "a_path_for_a_file_name", "layers_not_a_number"):  # (a traceback before)
        manifest = json.loads((newest / "manifest.json").read_text())
        if damage == "files_not_a_mapping":
            manifest["files"] = "abc"
        elif damage == "a_path_for_a_file_name":
            manifest["files"] = {f"../step-00000004/{k}": v for k, v in manifest["files"].items()}
        else:
            manifest["layers"] = "3"
        (newest / "manifest.json").write_text(json.dumps(manifest))
    elif damage == "an_unlisted_layer_file":  # zeros for every layer, beside the checked files: it was loaded after
        part = torch.load(layer_file, weights_only=True)  # them, unchecked, and replaced their weights
        part["layers"] = {k: torch.zeros_like(v) for k, v in part["layers"].items()}
        torch.save(part, newest / "layers-9999-9999.pt")
    else:
        layer_file.unlink()
    with warnings.catch_warnings(record=True) as seen:  # at every call (a second was silent: Python's default
        warnings.simplefilter("default")  # shows a warning of one line of code once)
        for _ in range(2):
            found = latest_checkpoint(run)
    assert [str(w.message).startswith(f"skipping damaged checkpoint {newest}") for w in seen] == [True, True]
    assert found == run / "checkpoints" / "step-00000004"


def test_a_checkpoint_pruned_while_it_is_read_is_not_damaged_and_load_reads_the_next(two_checkpoints, tmp_path,
                                                                                       monkeypatch):
    """pcdist.load of a run still training: the run prunes (trainer.ckpt_keep) the checkpoint a reader has just
    chosen. The reader named it damaged (a warning, or "every checkpoint is damaged") or failed on its missing
    files (a review: 431 of 1,158 loads of a live run); it lists the checkpoints again and reads the one that is
    there. The removal is what the trainer's pruning does (checkpoint._remove: out of the checkpoints' names
    first), here at the worst moment: between the listing and the read."""
    from pcdist.service import checkpoint as ckpt
    from pcdist.service import load as loader

    run = copy_run(two_checkpoints, tmp_path / "run")
    newest = run / "checkpoints" / "step-00000008"
    real_verify, real_meta = ckpt._verify, loader.read_meta

    def pruned_at(real):
        def call(path, *a):
            if path == newest and newest.is_dir():
                ckpt._remove(newest)
            return real(path, *a)
        return call

    monkeypatch.setattr(ckpt, "_verify", pruned_at(real_verify))
    assert ckpt.newest_valid(run) == (run / "checkpoints" / "step-00000004", [])
    monkeypatch.setattr(ckpt, "_verify", real_verify)
    run = copy_run(two_checkpoints, tmp_path / "run2")
    newest = run / "checkpoints" / "step-00000008"
    monkeypatch.setattr(loader, "read_meta", pruned_at(real_meta))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "skipping damaged checkpoint"
        assert pcdist.load(run).step == 4
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004"]


CLI = ["model.dims=[64,32,10]", "pc.T=4", "trainer.max_steps=8", "trainer.ckpt_every=4", "trainer.log_every=1",
       "trainer.eval_every=4", "logger=none", "logger.plots=false", "trainer.progress=off"]


def train_py(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *CLI, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def test_resume_after_a_damaged_checkpoint_says_so_and_redoes_the_lost_steps(tmp_path):
    """The newest checkpoint (step 8) truncated: the rerun resumes from step 4, saying in one line which checkpoint
    it skipped and why (no Python warning), trains steps 5-8 again to the same weights, and metrics.jsonl holds each
    step once, the redone rows equal to the first run's."""
    run_dir = tmp_path / "run"
    pcdist.train([*CLI, f"run_dir={run_dir}"])  # the first run: as train.py makes it (the command line as a list)
    good = torch.load(next((run_dir / "checkpoints/step-00000008").glob("layers-*.pt")), weights_only=True)
    first = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/energy" in r]
    layer_file = next((run_dir / "checkpoints/step-00000008").glob("layers-*.pt"))
    truncate(layer_file)
    out = train_py(tmp_path, f"hydra.run.dir={run_dir}")
    assert out.returncode == 0 and "Warning" not in out.stderr, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[:2] == [f"resume: skipped the damaged checkpoint step-00000008 ({layer_file.name}: checksum mismatch "
                         f"(truncated or corrupted)); resuming from the newest valid one, step-00000004 (the damaged "
                         f"one is kept as <name>.damaged)",
                         f"resumed from {run_dir / 'checkpoints/step-00000004'} at step 4 of 8 with the run's own "
                         f"settings (config: configs/attempt-2.yaml)"], lines
    redone = torch.load(next((run_dir / "checkpoints/step-00000008").glob("layers-*.pt")), weights_only=True)
    for k, v in good["layers"].items():
        torch.testing.assert_close(redone["layers"][k], v, atol=1e-6, rtol=0)
    assert (run_dir / "checkpoints/step-00000008.damaged" / layer_file.name).stat().st_size == 100
    again = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/energy" in r]
    assert [r["step"] for r in again] == list(range(1, 9)), "every step once: the rows after step 4 were dropped"
    for a, b in zip(first, again):
        assert b["train/energy"] == pytest.approx(a["train/energy"], rel=1e-5), a["step"]


def test_a_skipped_damaged_checkpoint_is_set_aside_and_never_takes_a_good_ones_place(two_checkpoints, tmp_path):
    """A resume from step 4 that skipped a damaged step 8 keeps it as step-00000008.damaged (for a look) and trains
    on past it: with checkpoints every 3 steps and ckpt_keep=2 the two newest good ones stay (6 and 9; the damaged
    one counted among them pruned the good step 6), and a later resume never meets the damaged one again."""
    run = copy_run(two_checkpoints, tmp_path / "run")
    truncate(next((run / "checkpoints" / "step-00000008").glob("layers-*.pt")))
    pcdist.train({"run_dir": str(run), "trainer.ckpt_every": 3, "trainer.ckpt_keep": 2, "trainer.max_steps": 9,
                  "logger.plots": False})
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-00000006", "step-00000008.damaged", "step-00000009"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no damaged checkpoint met, so no warning
        assert latest_checkpoint(run) == run / "checkpoints" / "step-00000009"
    pcdist.train({"run_dir": str(run), "trainer.max_steps": 12, "trainer.ckpt_every": 3, "logger.plots": False})
    assert pcdist.load(run).step == 12 and (run / "checkpoints" / "step-00000008.damaged").is_dir()


def test_a_step_damaged_twice_is_set_aside_twice_and_the_run_resumes_each_time(two_checkpoints, tmp_path):
    """Step 8 damaged, the run resumed from 4 (step 8 set aside, written again), then step 8 damaged again: the
    second resume sets it aside beside the first (step-00000008.damaged-2; renaming onto the first failed with a
    traceback at every later resume) and ends at step 8 again."""
    run = copy_run(two_checkpoints, tmp_path / "run")
    for _ in range(2):
        truncate(next((run / "checkpoints" / "step-00000008").glob("layers-*.pt")))
        assert pcdist.train({"run_dir": str(run), "logger.plots": False})["step"] == 8
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-00000004", "step-00000008", "step-00000008.damaged", "step-00000008.damaged-2"]


def _run_of_two_checkpoints(tmp_path: Path) -> tuple[Path, Path, Path, dict]:
    """A one-slice run with checkpoints at steps 4 and 8: (the run, its newest checkpoint, that checkpoint's one
    layer file, its manifest as a dict)."""
    run = tmp_path / "run"
    pcdist.train({"logger": {"name": "none", "plots": False}, "run_dir": str(run), "model": TANH,
                  "parallel": {"layer": 1}, "trainer": {"max_steps": 8, "ckpt_every": 4, "eval_every": 8,
                                                         "progress": "off"}})
    newest = run / "checkpoints" / "step-00000008"
    (layers,) = newest.glob("layers-*.pt")
    return run, newest, layers, json.loads((newest / "manifest.json").read_text())


@pytest.mark.parametrize("manifest", ["with the layer count", "of an older pcdist"])
def test_a_checkpoint_whose_files_leave_out_a_layer_is_damaged(tmp_path, manifest):
    """A checkpoint whose manifest matches its files but whose layer files leave out layers (a slice's file
    missing from the listing that made the manifest: a shared filesystem): skipped as damaged, saying which
    layers have no file, and the run resumes from the previous one (it was taken as valid and failed with a bare
    KeyError). A manifest of an older pcdist, without the layer count, is held to files from layer 1 on, and a
    file that lacks the model's layers is one line naming the checkpoint."""
    import hashlib

    run, newest, layers, body = _run_of_two_checkpoints(tmp_path)
    assert layers.name == "layers-0001-0004.pt" and body["layers"] == 3
    if manifest == "of an older pcdist":
        del body["layers"]
    # the slice of layers 1..3 rewritten as a file of layers 2..3, and its manifest entry with it
    part = torch.load(layers, weights_only=True)
    part["layers"] = {k: v for k, v in part["layers"].items() if not k.startswith("layers.1.")}
    layers.unlink()
    torch.save(part, newest / "layers-0002-0004.pt")
    del body["files"][layers.name]
    body["files"]["layers-0002-0004.pt"] = hashlib.sha256((newest / "layers-0002-0004.pt").read_bytes()).hexdigest()
    (newest / "manifest.json").write_text(json.dumps(body))
    found, = [w for w in _warned(lambda: latest_checkpoint(run))]
    assert f"skipping damaged checkpoint {newest}: manifest.json: layers 1..1 have no file" in found
    net = pcdist.PCNetwork.from_dims(TANH["dims"], activation="tanh")
    with pytest.raises(CheckpointError, match=f"{newest} does not hold this model's layers: missing 'layers.1."):
        load_checkpoint(newest, net, None)
    assert pcdist.train({"run_dir": str(run), "logger.plots": False})["step"] == 8  # resumed from step 4


@pytest.mark.parametrize("edit,said", [("the last layer left out", "layers 3..3 have no file"),
                                       ("a layer in two files", "layers 2..3 are in two files")])
def test_a_checkpoint_whose_files_end_short_or_overlap_is_damaged(tmp_path, edit, said):
    """The other ends of the same check: layer files that stop before the last layer (a slice's file missing from
    the listing) or that hold a layer twice (one would win silently): skipped as damaged, saying so."""
    import hashlib

    run, newest, layers, body = _run_of_two_checkpoints(tmp_path)
    part = torch.load(layers, weights_only=True)
    if edit == "the last layer left out":
        part["layers"] = {k: v for k, v in part["layers"].items() if not k.startswith("layers.3.")}
        layers.unlink()
        del body["files"][layers.name]
        name = "layers-0001-0003.pt"
    else:
        part["layers"] = {k: v for k, v in part["layers"].items() if not k.startswith("layers.1.")}
        name = "layers-0002-0004.pt"
    torch.save(part, newest / name)
    body["files"][name] = hashlib.sha256((newest / name).read_bytes()).hexdigest()
    (newest / "manifest.json").write_text(json.dumps(body))
    found, = [w for w in _warned(lambda: latest_checkpoint(run))]
    assert f"skipping damaged checkpoint {newest}: manifest.json: {said}" in found
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (said again)
        assert latest_checkpoint(run) == run / "checkpoints" / "step-00000004"


def _warned(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in seen]


def test_a_run_whose_every_checkpoint_is_damaged_is_refused_untouched(tmp_path):
    """With its only checkpoint truncated, a rerun neither restarts the run from step 0 in the same folder nor
    changes anything: one line naming the checkpoint and why, exit status 2; pcdist.train refuses alike."""
    run_dir = tmp_path / "run"
    pcdist.train([*CLI, "trainer.ckpt_every=8", f"run_dir={run_dir}"])  # as train.py makes it
    layer_file = next((run_dir / "checkpoints/step-00000008").glob("layers-*.pt"))
    truncate(layer_file)
    before = snapshot(run_dir)
    out = train_py(tmp_path, f"hydra.run.dir={run_dir}", "trainer.ckpt_every=8")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert out.stderr == (f"error: cannot resume {run_dir}: every checkpoint in it is damaged (step-00000008 "
                          f"({layer_file.name}: checksum mismatch (truncated or corrupted))); nothing in it was "
                          f"changed: restore its checkpoints, or choose a new run directory (hydra.run.dir=..., or the "
                          f"config key run_dir)\n")
    with pytest.raises(pcdist.ConfigError, match="every checkpoint in it is damaged"):
        pcdist.train({"run_dir": str(run_dir), "logger": "none"})
    assert snapshot(run_dir) == before


WRITER = textwrap.dedent("""
    import resource, signal, sys, torch, pcdist
    from pcdist.service.checkpoint import CheckpointError, latest_checkpoint, save_checkpoint
    run_dir = sys.argv[1]
    net = pcdist.PCNetwork.from_dims([64, 512, 512, 10], seed=0)
    opt = torch.optim.AdamW(net.parameters())
    meta = torch.load(latest_checkpoint(run_dir) / "meta.pt", weights_only=True)
    meta["step"] = 99
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)               # get EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # the disk is 'full' at 200 kB per file
    try:
        save_checkpoint(run_dir, 99, net, opt, meta, keep=1, writer=True, leader=True)
    except CheckpointError as e:
        print("write failed:", e)
        sys.exit(7)
""")


def test_a_checksum_valid_meta_without_the_resume_state_is_one_error_and_changes_nothing(two_checkpoints, tmp_path):
    """A meta.pt without its schedule, rate or RNG state (no pcdist wrote one: a file made elsewhere, its manifest
    signed again) ended a resume in a KeyError traceback; now a CheckpointError naming the file, before any write."""
    import hashlib
    import json

    run = copy_run(two_checkpoints, tmp_path / "run")
    newest = run / "checkpoints/step-00000008"
    meta = torch.load(newest / "meta.pt", weights_only=True)
    del meta["rng"], meta["lr"]
    torch.save(meta, newest / "meta.pt")
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["meta.pt"] = hashlib.sha256((newest / "meta.pt").read_bytes()).hexdigest()
    (newest / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(run)
    with pytest.raises(CheckpointError, match=rf"^{newest}/meta.pt holds no lr, rng: not a checkpoint file pcdist "
                                              r"wrote; nothing in the run directory was changed$"):
        pcdist.train({"run_dir": str(run), "logger": "none", "trainer.max_steps": 12})
    assert snapshot(run) == before


def test_a_checkpoint_folder_that_cannot_be_made_is_a_checkpoint_error_naming_it(two_checkpoints, tmp_path):
    """A step-N.tmp/ that cannot be made (a read-only folder, a full disk; here a file in its place) ended the run in
    a traceback, and under torchrun the peers' line blamed a dead rank; now a CheckpointError naming the folder,
    which the service prints in one line and passes to the peers."""
    run = copy_run(two_checkpoints, tmp_path / "run")
    (run / "checkpoints/step-00000099.tmp").write_text("in the way")
    net = pcdist.PCNetwork.from_dims([64, 128, 128, 10], activation="tanh")
    meta = torch.load(run / "checkpoints/step-00000008/meta.pt", weights_only=True)
    with pytest.raises(CheckpointError, match=rf"^writing the checkpoint {run}/checkpoints/step-00000099 failed: "
                                              rf"cannot make {run}/checkpoints/step-00000099.tmp: File exists"):
        save_checkpoint(run, 99, net, torch.optim.AdamW(net.parameters()), {**meta, "step": 99}, keep=2, writer=True,
                        leader=True)
    assert latest_checkpoint(run) == run / "checkpoints/step-00000008"


def test_a_failed_write_never_damages_the_previous_checkpoint(two_checkpoints, tmp_path):
    """A writer that hits a file-size limit mid-checkpoint (disk full) leaves the previous one intact."""
    run = copy_run(two_checkpoints, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in (run / "checkpoints/step-00000008").iterdir()}
    out = subprocess.run([sys.executable, "-c", WRITER, str(run)], capture_output=True, text=True)
    assert out.returncode == 7 and "write failed" in out.stdout and "disk full" in out.stdout, out.stderr[-2000:]
    assert not (run / "checkpoints/step-00000099").exists(), "a failed checkpoint must not be published"
    assert latest_checkpoint(run) == run / "checkpoints/step-00000008"
    assert {p.name: p.read_bytes() for p in (run / "checkpoints/step-00000008").iterdir()} == before
    net = pcdist.PCNetwork.from_dims([64, 128, 128, 10], activation="tanh")
    assert load_checkpoint(run / "checkpoints/step-00000008", net, None)["step"] == 8
    # its step-00000099.tmp stayed for good where step 99 was not written again (a resume on another split):
    # the next checkpoint written removes it
    assert (run / "checkpoints/step-00000099.tmp").is_dir()
    meta = torch.load(run / "checkpoints/step-00000008/meta.pt", weights_only=True)
    save_checkpoint(run, 9, net, torch.optim.AdamW(net.parameters()), {**meta, "step": 9}, keep=2, writer=True,
                    leader=True)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000008", "step-00000009"]


def test_checkpoint_of_another_model_shape_is_refused(two_checkpoints):
    net = pcdist.PCNetwork.from_dims([64, 256, 10], activation="gelu")
    with pytest.raises(CheckpointError, match=r"was written by a different model: dense 64->128 tanh, "
                       r"dense 128->128 tanh, dense 128->10 None; "
                       r"this run has dense 64->256 gelu, dense 256->10 None"):
        load_checkpoint(latest_checkpoint(two_checkpoints), net, None)


def test_divergence_stops_the_run_naming_step_layer_and_value(tmp_path):
    """A learning rate that blows the weights up: the run stops with the step, the layer and the value,
    and the checkpoint written before the divergence is intact and loadable."""
    cfg = {"logger": {"name": "none", "plots": False}, "run_dir": str(tmp_path), "model": TANH,
           "optim": {"name": "sgd", "lr": 2.0, "momentum": 0.9, "warmup_steps": 0},
           "trainer": {"max_steps": 200, "ckpt_every": 2, "log_every": 2, "eval_every": 100,
                       "progress": "off", "max_energy": 1e4}}
    with pytest.raises(FloatingPointError, match=r"step \d+: the energy diverged to \S+ \(layer \d: \S+; limit "
                                                 r"trainer.max_energy=10000.0\); the last good checkpoint is ") as e:
        pcdist.train(cfg)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None, "the checkpoints before the divergence must be on disk"
    assert f"the last good checkpoint is {ckpt}. Lower optim.lr or pc.x_lr" in str(e.value)
    last = (tmp_path / "train.log").read_text().splitlines()[-1]  # the run's record says why it ended (it did not)
    assert last.endswith(f"  error: {e.value}"), last
    net = pcdist.PCNetwork.from_dims([64, 128, 128, 10], activation="tanh")
    assert load_checkpoint(ckpt, net, None)["step"] >= 2
    assert all(torch.isfinite(p).all() for p in net.parameters()), "a checkpoint never holds diverged weights"


def test_skip_mode_drops_diverged_updates_and_counts_them(tmp_path):
    """on_divergence=skip with a value learning rate that blows inference up: no weight update is ever
    applied (the weights stay at their seeded init) and every batch is counted as skipped; the run says so at
    each log point and in its last line (it ended as a success with a counter in metrics.jsonl its only trace).
    Under ipc (T = 2) the first weight step of each batch, at the feed-forward init, is taken and the second
    skipped: half of them, which is not said to be all (it was: skips were counted against steps)."""
    cfg = {"logger": {"name": "none", "plots": False}, "run_dir": str(tmp_path), "model": TANH, "pc": {"x_lr": 1e6},
           "trainer": {"max_steps": 6, "ckpt_every": 6, "log_every": 3, "eval_every": 6, "progress": "off",
                       "on_divergence": "skip", "max_energy": 1e3}}
    result = pcdist.train(cfg)
    assert result["step"] == 6 and result["train/skipped_updates"] == 6
    log = (tmp_path / "train.log").read_text()
    for since, at in ((0, 3), (3, 6)):
        assert (f"step {at}: every weight update since step {since} was skipped (3: an energy above "
                f"trainer.max_energy=1000.0 or not finite, trainer.on_divergence=skip): the weights are not "
                f"training") in log
    assert "6 weight updates skipped (trainer.on_divergence=skip); run directory" in log
    init = pcdist.PCNetwork.from_dims([64, 128, 128, 10], activation="tanh", seed=0)
    trained = pcdist.PCNetwork.from_dims([64, 128, 128, 10], activation="tanh")
    load_checkpoint(latest_checkpoint(tmp_path), trained, None)
    for a, b in zip(init.parameters(), trained.parameters()):
        assert torch.equal(a, b)
    stopped = {**cfg, "run_dir": str(tmp_path / "stopped")}  # the count goes on over a resume (it restarted at 0)
    pcdist.train({**stopped, "trainer": {**cfg["trainer"], "stop_at": 3}})
    assert pcdist.train(stopped)["train/skipped_updates"] == 6
    assert ("step 6: every weight update since step 3 was skipped (3: " in (tmp_path / "stopped/train.log").read_text())
    ipc = pcdist.train({**cfg, "run_dir": str(tmp_path / "ipc"), "pc": {"x_lr": 1e6, "algorithm": "ipc", "T": 2}})
    assert ipc["train/skipped_updates"] == 6
    log = (tmp_path / "ipc" / "train.log").read_text()
    assert "was skipped" not in log and "6 weight updates skipped (trainer.on_divergence=skip)" in log


def test_skip_mode_changes_nothing_when_training_is_healthy(tmp_path):
    """With healthy training, skip mode takes exactly the updates stop mode takes."""
    base = {"logger": {"name": "none", "plots": False}, "model": TANH,
            "trainer": {"max_steps": 6, "ckpt_every": 6, "log_every": 3, "eval_every": 6, "progress": "off"}}
    results = {}
    for mode in ("stop", "skip"):
        cfg = {**base, "run_dir": str(tmp_path / mode), "trainer": {**base["trainer"], "on_divergence": mode}}
        results[mode] = pcdist.train(cfg)
        nets = pcdist.PCNetwork.from_dims([64, 128, 128, 10], activation="tanh")
        load_checkpoint(latest_checkpoint(tmp_path / mode), nets, None)
        results[mode + "_w"] = [p.clone() for p in nets.parameters()]
    assert results["skip"]["train/skipped_updates"] == 0
    for a, b in zip(results["stop_w"], results["skip_w"]):
        assert torch.equal(a, b)


LEGACY = Path(__file__).resolve().parent / "data" / "checkpoint-860de00-step-00000002"


def test_a_checkpoint_written_before_layer_kinds_still_loads(tmp_path):
    """tests/data holds a real checkpoint written by pcdist at commit 860de00 (before layer kinds;
    its meta records the model as [dims, activations]): 64-16-16-10 gelu, AdamW, step 2. It must
    verify, load every layer's weights and optimizer state as written, and still refuse another model."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(LEGACY), str(run / "checkpoints" / "step-00000002")], check=True)
    path = latest_checkpoint(run)
    assert path == run / "checkpoints" / "step-00000002"
    net = pcdist.PCNetwork.from_dims([64, 16, 16, 10], activation="gelu", energy="ce")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    assert load_checkpoint(path, net, opt)["step"] == 2
    saved = torch.load(path / "layers-0001-0004.pt", weights_only=True)
    state = net.layer_state_dict()
    assert set(state) == set(saved["layers"])
    for key, value in saved["layers"].items():
        assert torch.equal(state[key], value), key
    for l in (1, 2, 3):
        g, k = net._locate(l)
        for name, p in (("weight", g.weight), ("bias", g.bias)):
            for s in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][s][k], saved["optimizer"][f"layers.{l}.{name}"][s]), (l, name, s)
    with pytest.raises(CheckpointError, match="was written by a different model: dense 64->16 gelu"):
        load_checkpoint(path, pcdist.PCNetwork.from_dims([64, 16, 16, 10], activation="tanh"), None)
