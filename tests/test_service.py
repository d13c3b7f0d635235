"""The training service end to end: the real torchrun, Hydra, wandb offline files, checkpoints, resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pcdist
from pcdist.service.metrics import read_metrics
from pcdist.distributed.partition import layer_flops, partition_layers
from spawn import run
from wandb_files import offline_run

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def torchrun(nproc: int, *overrides: str, timeout: float = 300, launcher: tuple[str, ...] = (),
             unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """train.py under the real torchrun (``launcher``: extra torchrun flags; ``unset``: variables
    removed from the environment); asserts success."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *launcher,
           str(ROOT / "train.py"), *overrides]
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"torchrun failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def slice_files(dims, P):
    """The checkpoint files P layer ranks write: one per FLOP-balanced slice."""
    specs = pcdist.mlp_specs(dims)
    slices = partition_layers([layer_flops(s, l) for l, s in enumerate(specs, 1)], P)
    return [f"layers-{a:04d}-{b:04d}.pt" for a, b in slices]


def layer_state(ckpt: Path) -> dict:
    state = {}
    for f in sorted(ckpt.glob("layers-*.pt")):
        state.update(torch.load(f, weights_only=True)["layers"])
    return state


def test_torchrun_two_layer_ranks_writes_a_complete_run_directory(tmp_path):
    """torchrun --nproc_per_node=2 with parallel.layer=2: every artifact exists and agrees with the others."""
    run_dir = tmp_path / "run"
    out = torchrun(2, "parallel.layer=2", "trainer.max_steps=44", "trainer.eval_every=22", "trainer.log_every=11",
                   "trainer.ckpt_every=22", f"hydra.run.dir={run_dir}")
    assert f"run directory: {run_dir}" in out.stdout
    rows = read_metrics(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if "train/energy" in r]
    val_rows = [r for r in rows if "val/accuracy" in r]
    assert [r["step"] for r in train_rows] == [11, 22, 33, 44]
    assert [r["step"] for r in val_rows] == [22, 44]
    assert all(len([k for k in r if k.startswith("train/layer_energy/")]) == 3 for r in train_rows)
    assert val_rows[-1]["val/accuracy"] > 0.5, "44 steps on digits must learn well beyond chance (0.1)"
    assert train_rows[-1]["train/energy"] < train_rows[0]["train/energy"]
    cfg = (run_dir / "config.yaml").read_text()
    assert "layer: 2" in cfg and "max_steps: 44" in cfg
    for png in ("accuracy_energy.png", "inference_energy.png", "inference_heatmap.png"):
        assert (run_dir / png).read_bytes()[:8] == PNG
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step-00000022", "step-00000044"]
    last = run_dir / "checkpoints" / "step-00000044"
    files = slice_files([64, 128, 128, 10], 2)
    assert sorted(p.name for p in last.glob("layers-*.pt")) == files
    assert set(json.loads((last / "manifest.json").read_text())["files"]) == {*files, "meta.pt"}
    # The offline wandb run holds the same numbers as metrics.jsonl, and the resolved config.
    config, history = offline_run(run_dir)
    assert config["parallel"]["layer"] == 2 and config["model"]["dims"] == [64, 128, 128, 10]
    logged = {h["_step"]: h for h in history}
    for r in train_rows:
        assert logged[r["step"]]["train/energy"] == pytest.approx(r["train/energy"], rel=1e-12)
    assert logged[44]["val/accuracy"] == pytest.approx(val_rows[-1]["val/accuracy"])


def base_cfg(run_dir, **trainer):
    t = {"max_steps": 24, "eval_every": 12, "log_every": 6, "ckpt_every": 12, "dtype": "float64", "progress": "off"}
    t.update(trainer)
    return {"logger": {"name": "none", "mode": "disabled", "plots": False}, "trainer": t, "run_dir": str(run_dir),
            "optim": {"warmup_steps": 4}, "pc": {"T": 8}}


def test_resume_gives_identical_weights(tmp_path):
    """2N steps straight == N steps, stop, resume to 2N: the same weights.

    Bit for bit in practice; held to 1e-12 (float64) because MKL's kernel choice may
    depend on memory alignment (conftest sets MKL_CBWR to remove that). A resume
    bug (optimizer state, LR schedule, data order) shows up at 1e-4 and above.
    """
    straight = pcdist.train(base_cfg(tmp_path / "a"))
    first = pcdist.train(base_cfg(tmp_path / "b", stop_at=12))
    assert first["step"] == 12 and sorted(p.name for p in (tmp_path / "b/checkpoints").iterdir()) == ["step-00000012"]
    resumed = pcdist.train(base_cfg(tmp_path / "b"))
    assert resumed["step"] == straight["step"] == 24
    a, b = layer_state(tmp_path / "a/checkpoints/step-00000024"), layer_state(tmp_path / "b/checkpoints/step-00000024")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-12, rtol=0, msg=k)
    assert resumed["val/accuracy"] == straight["val/accuracy"]


def _train_worker(rank, world, cfg):
    pcdist.train(cfg)


RESUME_MODELS = {"mlp": {}, "cnn": {"model": "cnn", "model.channels": [4, 8]},
                 "mupc": {"model": "mupc", "model.depth": 6, "model.width": 16}}


@pytest.mark.parametrize("model", list(RESUME_MODELS))
def test_resume_on_a_different_number_of_layer_ranks(tmp_path, model):
    """N steps on 2 layer ranks, then resume on 1 rank to 2N: equals 2N steps on 1 rank to 1e-6, for an
    MLP, a conv network (conv kind + dense head) and a μPC network (residual kind)."""
    cfg_of = lambda run_dir, **kw: {**base_cfg(run_dir, **kw), **RESUME_MODELS[model]}  # noqa: E731
    straight = pcdist.train(cfg_of(tmp_path / "a"))
    cfg = cfg_of(tmp_path / "b", stop_at=12)
    cfg["parallel"] = {"layer": 2}
    run(_train_worker, 2, cfg, timeout=240)
    files = sorted(p.name for p in (tmp_path / "b/checkpoints/step-00000012").glob("layers-*"))
    assert files == slice_files([64, 128, 128, 10], 2) if model == "mlp" else len(files) == 2, files
    resumed = pcdist.train(cfg_of(tmp_path / "b"))
    assert resumed["step"] == straight["step"]
    a, b = layer_state(tmp_path / "a/checkpoints/step-00000024"), layer_state(tmp_path / "b/checkpoints/step-00000024")
    assert a.keys() == b.keys()
    if model == "cnn":
        assert sum(t.dim() == 4 for t in a.values()) == 2, "two conv layers' weights [C_out, C_in, 3, 3]"
    if model == "mupc":
        assert len({k.split(".")[1] for k in a}) == 6 and not any("bias" in k for k in a), sorted(a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)


MUPC = {"model": {"name": "mupc", "depth": 128, "width": 32, "activation": "relu", "energy": "se"},
        "pc": {"T": 16, "x_lr": 0.3},
        "optim": {"name": "adamw", "lr": 0.01, "weight_decay": 0.0, "warmup_steps": 0, "schedule": "constant"},
        "trainer": {"dtype": "float64", "batch_size": 16, "max_steps": 3, "eval_every": 3, "log_every": 1,
                    "ckpt_every": 3, "progress": "off"},
        "logger": {"name": "none", "mode": "disabled", "plots": False}}


def test_torchrun_mupc_128_layers_on_four_layer_ranks_equals_one_process(tmp_path):
    """torchrun --nproc_per_node=4 train.py model=mupc model.depth=128 parallel.layer=4: the 128-layer
    μPC network trains split over four ranks, and its metrics and weights equal one process's (float64)."""
    overrides = [f"{group}.{key}={value}" for group, keys in MUPC.items() for key, value in keys.items()
                 if group != "logger"]
    overrides = ["model=mupc", "logger=none", *[o for o in overrides if not o.startswith("model.name")]]
    torchrun(4, *overrides, "parallel.layer=4", f"hydra.run.dir={tmp_path / 'p4'}", timeout=600)
    one = pcdist.train({**MUPC, "run_dir": str(tmp_path / "p1")})
    rows4, rows1 = {}, {}
    for rows, run_dir in ((rows4, tmp_path / "p4"), (rows1, tmp_path / "p1")):
        for r in read_metrics(run_dir / "metrics.jsonl"):
            rows.setdefault(r["step"], {}).update(r)
    assert sorted(rows4) == sorted(rows1) == [1, 2, 3]
    for step, r1 in rows1.items():
        layers = [k for k in r1 if k.startswith("train/layer_energy/")]
        assert len(layers) == 128
        for key in ["train/energy", *layers]:
            assert rows4[step][key] == pytest.approx(r1[key], abs=1e-9, rel=1e-9), (step, key)
    assert rows4[3]["val/accuracy"] == one["val/accuracy"]
    ckpt = "checkpoints/step-00000003"
    files = sorted(p.name for p in (tmp_path / "p4" / ckpt).glob("layers-*.pt"))
    assert len(files) == 4, files
    a, b = layer_state(tmp_path / "p4" / ckpt), layer_state(tmp_path / "p1" / ckpt)
    assert a.keys() == b.keys() and len(a) == 128
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-9, rtol=0, msg=k)


def test_the_logged_rate_follows_the_schedule_written_out_by_hand(tmp_path):
    """(review rv115) train/lr of every step against the schedules of docs/service.md written out here: cosine with
    a floor (optim.final_lr_ratio, which the pcx_vgg*_cifar100 presets set: dropping it passed every test) and the
    constant schedule's linear warm-up (min(1, (s + 1) / (warmup + 1)), as the cosine's)."""
    import math

    def rates(name, **optim):
        run = tmp_path / name
        pcdist.train({"logger": {"name": "none", "plots": False}, "run_dir": str(run), "model": {"dims": [64, 16, 10]},
                      "optim": {"name": "sgd", "lr": 0.2, **optim},
                      "trainer": {"max_steps": 10, "log_every": 1, "eval_every": 100, "progress": "off"}})
        return {r["step"]: r["train/lr"] for r in read_metrics(run / "metrics.jsonl") if "train/lr" in r}

    W, N, R = 3, 10, 0.25
    got = rates("cosine", schedule="cosine", warmup_steps=W, final_lr_ratio=R)
    assert sorted(got) == list(range(1, N + 1))
    for step, lr in got.items():
        s = step - 1  # the optimizer steps before this one
        f = (s + 1) / (W + 1) if s < W else R + (1 - R) * 0.5 * (1 + math.cos(math.pi * (s - W) / (N - W)))
        assert lr == pytest.approx(0.2 * f, abs=1e-12, rel=0), ("cosine", step)
    for step, lr in rates("constant", schedule="constant", warmup_steps=W).items():
        assert lr == pytest.approx(0.2 * min(1.0, step / (W + 1)), abs=1e-12, rel=0), ("constant", step)
