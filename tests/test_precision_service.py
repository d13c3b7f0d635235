"""trainer.precision through the service: recorded in the run, kept by a resume and by pcdist.load, refused
where it cannot hold (docs/gpu.md).

A bf16 run's network is its float32 master weights (the bfloat16 copy only computes the products), so
what a run writes and what comes back from it are float32, and a bf16 run stopped and resumed ends where an
uninterrupted bf16 run ends (the same products, from the same master weights, in the same order).
"""

import pytest
import torch
import yaml

import pcdist

COMMON = {"logger": "none", "trainer": {"max_steps": 20, "eval_every": 10, "ckpt_every": 10, "log_every": 5,
                                        "precision": "bf16", "progress": "off"}}


def train(run_dir, **trainer):
    return pcdist.train({**COMMON, "run_dir": str(run_dir), "trainer": {**COMMON["trainer"], **trainer}})


def test_a_bf16_run_is_recorded_resumed_and_loaded_as_bf16(tmp_path):
    straight = train(tmp_path / "straight")
    train(tmp_path / "split", stop_at=10)
    resumed = train(tmp_path / "split")
    assert resumed["step"] == 20 and resumed["val/accuracy"] == straight["val/accuracy"]
    assert resumed["train/energy"] == pytest.approx(straight["train/energy"], rel=1e-6)
    saved = yaml.safe_load((tmp_path / "split" / "config.yaml").read_text())
    assert saved["trainer"]["precision"] == "bf16"
    run = pcdist.load(tmp_path / "split")
    assert run.config.trainer.precision == "bf16"
    assert all(p.dtype == torch.float32 for p in run.network.parameters()), "the master weights come back"
    torch.testing.assert_close(run.network.layer_state_dict()["layers.1.weight"],
                               straight.network.layer_state_dict()["layers.1.weight"], atol=1e-6, rtol=0)


def test_bf16_with_float64_master_weights_is_one_line(tmp_path):
    with pytest.raises(pcdist.ConfigError, match="trainer.dtype.*float32 under trainer.precision=bf16"):
        train(tmp_path / "run", dtype="float64")
    assert not (tmp_path / "run").exists()


def test_backprop_under_bf16_runs_its_products_in_bfloat16(tmp_path):
    """pc.algorithm=bp (PC's twin of the same settings) honours trainer.precision: bf16 runs its forward pass under
    autocast (bfloat16 products, float32 weights and loss), so its energy moves off float32's by bfloat16's
    rounding and no further; and a run leaves the caller's TF32 switches and torch threads as it found them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # not what a run on this machine sets (its cores, or OMP_NUM_THREADS)
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32, torch.get_num_threads()
    bf16 = train(tmp_path / "bf16", max_steps=30, eval_every=30, ckpt_every=30)
    fp32 = pcdist.train({**COMMON, "pc": {"algorithm": "bp"}, "run_dir": str(tmp_path / "fp32"),
                         "trainer": {**COMMON["trainer"], "precision": "fp32", "max_steps": 30, "eval_every": 30,
                                     "ckpt_every": 30}})
    bp16 = pcdist.train({**COMMON, "pc": {"algorithm": "bp"}, "run_dir": str(tmp_path / "bp16"),
                         "trainer": {**COMMON["trainer"], "max_steps": 30, "eval_every": 30, "ckpt_every": 30}})
    assert bp16["train/energy"] != fp32["train/energy"], "the products ran in bfloat16"
    assert bp16["train/energy"] == pytest.approx(fp32["train/energy"], rel=0.02)
    assert abs(bp16["val/accuracy"] - fp32["val/accuracy"]) <= 0.02 and bf16["step"] == 30
    after = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32, torch.get_num_threads()
    torch.set_num_threads(threads)
    assert after == before
