"""The PC modes through the training service: config keys, each mode's metrics and pictures, wandb
images, checkpoints of a learned prior and resume, the real torchrun, the conv decoder preset, and
one-line errors for what cannot work."""

import shutil

import pytest
import torch

import pcdist
from pcdist.service.checkpoint import latest_checkpoint
from pcdist.service.metrics import read_metrics
from datafiles import make_mnist
from test_service import PNG, layer_state, torchrun
from wandb_files import offline_run

QUICK = {"trainer.max_steps": 12, "trainer.eval_every": 6, "trainer.log_every": 3, "trainer.ckpt_every": 6,
         "trainer.progress": "off", "logger": "none"}


def train(tmp_path, name="run", **overrides):
    cfg = {**QUICK, "run_dir": str(tmp_path / name), **overrides}
    return pcdist.train(cfg), tmp_path / name


def test_generative_run_classifies_by_inference_and_draws_samples(tmp_path):
    """experiment=generative_digits (shortened): val/accuracy by inference and val/reconstruction_mse at every
    evaluation, samples.png drawn (and logged to wandb as an image); both ends clamped in training, so no
    prior energy is logged."""
    result, run_dir = train(tmp_path, experiment="generative_digits", logger="wandb", **{"pc.eval_T": 30})
    rows = read_metrics(run_dir / "metrics.jsonl")
    val = [r for r in rows if "val/accuracy" in r]
    assert [r["step"] for r in val] == [6, 12]
    assert all(0.0 <= r["val/accuracy"] <= 1.0 and r["val/reconstruction_mse"] > 0 for r in val)
    assert result["val/accuracy"] == val[-1]["val/accuracy"]
    assert not any("train/prior_energy" in r for r in rows)
    assert (run_dir / "samples.png").read_bytes()[:8] == PNG
    assert not (run_dir / "reconstructions.png").exists()
    _, history = offline_run(run_dir, until_step=12)
    images = [h for h in history if h.get("images/samples/_type") == "image-file"]
    assert [h["_step"] for h in images] == [6, 12]
    files = next((run_dir / "wandb").glob("offline-run-*")) / "files"
    assert all((files / h["images/samples/path"]).read_bytes()[:8] == PNG for h in images)



def test_plots_false_leaves_out_the_samples_and_still_evaluates(tmp_path):
    """logger.plots=false in the generative mode: the evaluation runs and is logged, no picture is drawn."""
    _, run_dir = train(tmp_path, experiment="generative_digits", **{"logger.plots": False, "trainer.max_steps": 2,
                                                                    "trainer.eval_every": 2, "pc.eval_T": 5})
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "val/accuracy" in r] == [2]
    assert list(run_dir.glob("*.png")) == []

def test_unsupervised_run_logs_the_prior_draws_reconstructions_and_resumes(tmp_path):
    """pc.mode=unsupervised with a learned prior mean and value noise: the checkpoint holds layers.0.mean, and a
    run stopped at step 12 and resumed ends exactly where the uninterrupted run ends (the noise of each
    step drawn from its step number)."""
    over = {"experiment": "unsupervised_digits", "pc.prior_mean": "learned", "pc.value_noise": 0.01, "pc.T": 20,
            "pc.eval_T": 40, "trainer.dtype": "float64"}
    whole, whole_dir = train(tmp_path, "whole", **over)
    rows = read_metrics(whole_dir / "metrics.jsonl")
    assert all("train/prior_energy" in r for r in rows if "train/energy" in r)
    assert [r["step"] for r in rows if "val/reconstruction_mse" in r] == [6, 12]
    assert not any("val/accuracy" in r for r in rows)
    assert (whole_dir / "reconstructions.png").read_bytes()[:8] == PNG
    state = layer_state(latest_checkpoint(whole_dir))
    assert state["layers.0.mean"].shape == (10,) and state["layers.0.mean"].abs().max() > 0
    train(tmp_path, "resumed", **over, **{"trainer.stop_at": 6})
    resumed, resumed_dir = train(tmp_path, "resumed", **over)
    assert resumed["val/reconstruction_mse"] == pytest.approx(whole["val/reconstruction_mse"], rel=1e-12)
    for key, value in layer_state(latest_checkpoint(resumed_dir)).items():
        torch.testing.assert_close(value, state[key], atol=1e-12, rtol=0, msg=key)


def test_generative_mode_over_two_layer_ranks_under_torchrun_equals_one_process(tmp_path):
    """The real torchrun, parallel.layer=2, float64, with precisions and value noise: every metric equals the
    single process's to 1e-9."""
    over = ["experiment=generative_digits", "pc.precision=[2.0,1.0]", "pc.value_noise=0.01", "pc.eval_T=30",
            "trainer.dtype=float64", *[f"{k}={v}" for k, v in QUICK.items()]]
    torchrun(2, "parallel.layer=2", *over, f"hydra.run.dir={tmp_path / 'p2'}")
    one, _ = train(tmp_path, "p1", experiment="generative_digits", **{"pc.precision": [2.0, 1.0],
                   "pc.value_noise": 0.01, "pc.eval_T": 30, "trainer.dtype": "float64"})
    rows = {r["step"]: r for r in read_metrics(tmp_path / "p2" / "metrics.jsonl") if "val/accuracy" in r}
    p1 = {r["step"]: r for r in read_metrics(tmp_path / "p1" / "metrics.jsonl") if "val/accuracy" in r}
    assert rows.keys() == p1.keys() == {6, 12}
    for step in rows:
        assert rows[step]["val/accuracy"] == p1[step]["val/accuracy"]
        assert rows[step]["val/reconstruction_mse"] == pytest.approx(p1[step]["val/reconstruction_mse"], abs=1e-9)
    train_p2 = [r["train/energy"] for r in read_metrics(tmp_path / "p2" / "metrics.jsonl") if "train/energy" in r]
    train_p1 = [r["train/energy"] for r in read_metrics(tmp_path / "p1" / "metrics.jsonl") if "train/energy" in r]
    assert train_p2 == pytest.approx(train_p1, abs=1e-9)
    assert one["val/accuracy"] == rows[12]["val/accuracy"]


def test_augmented_images_at_the_top_train_alike_on_two_layer_ranks(tmp_path):
    """data.augment with the images at h_L (generative mode, a deconv decoder): the crops and flips were drawn on
    the first layer slice only, where the data are not used, so two layer ranks trained on the bare images,
    without a word. Two gloo ranks equal one process (float64), which the augmentation changes."""
    from spawn import run
    from test_service import _train_worker

    cfg = {**QUICK, "trainer.max_steps": 4, "trainer.eval_every": 4, "trainer.log_every": 1, "model": "deconv",
           "pc.mode": "generative", "pc.T": 5, "pc.eval_T": 5, "pc.x_lr": 0.05, "optim": "sgd",
           "trainer.batch_size": 16, "trainer.dtype": "float64", "logger.plots": False}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        run(_train_worker, 2, {**cfg, "data.augment": True, "parallel.layer": 2, "run_dir": str(tmp_path / "p2")},
            timeout=240)
    energies = {}
    for name, over in (("p2", None), ("p1", {"data.augment": True}), ("bare", {})):
        if over is not None:
            train(tmp_path, name, **{**cfg, **over})
        energies[name] = [r["train/energy"] for r in read_metrics(tmp_path / name / "metrics.jsonl")
                          if "train/energy" in r]
    assert energies["p2"] == pytest.approx(energies["p1"], rel=1e-9) and len(energies["p2"]) == 4
    assert energies["p1"][1:] != pytest.approx(energies["bare"][1:], rel=1e-6), "the augmentation trained"


def test_mcpc_samples_are_drawn_on_a_data_axis(tmp_path):
    """Generative MCPC over parallel.data=2 (2 gloo ranks): each data rank samples h_L for every label, so the
    value noise of the samples' inference is drawn for a global batch of ranks x classes; the evaluation draws
    samples.png and the run ends."""
    from spawn import run
    from test_service import _train_worker

    cfg = {**QUICK, "trainer.max_steps": 6, "experiment": "generative_digits", "parallel.data": 2,
           "pc.value_noise": 0.01, "pc.eval_T": 5, "run_dir": str(tmp_path / "run")}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        run(_train_worker, 2, cfg, timeout=240)
    assert (tmp_path / "run" / "samples.png").read_bytes()[:8] == PNG
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val/accuracy" in r] == [6]


def test_the_conv_decoder_preset_trains_on_mnist_shaped_files(tmp_path):
    """experiment=deconv_mnist on standard IDX files (random 28 x 28 images): a conv decoder from the label to
    1 x 28 x 28 under the Bernoulli energy, its samples drawn per class."""
    root = make_mnist(tmp_path / "mnist", n_train=64, n_val=32)
    _, run_dir = train(tmp_path, experiment="deconv_mnist", **{"data.root": str(root), "trainer.epochs": None,
                       "trainer.max_steps": 4, "trainer.eval_every": 4, "trainer.batch_size": 16,
                       "pc.T": 3, "pc.eval_T": 3, "data.num_workers": 0})
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "val/accuracy" in r] == [4]
    assert (run_dir / "samples.png").read_bytes()[:8] == PNG
    kinds = [s["kind"] for s in torch.load(latest_checkpoint(run_dir) / "meta.pt", weights_only=True)["model"]]
    assert kinds == ["dense", "module", "module", "module"]
    # its module layers are pcdist's own: the run loads and evaluates without the user's code or layers
    from pcdist.service.evaluate import evaluate

    got, val = evaluate(run_dir, write=False), [r for r in rows if "val/accuracy" in r][-1]
    assert (got["accuracy"], got["reconstruction_mse"]) == (val["val/accuracy"], val["val/reconstruction_mse"])


@pytest.mark.parametrize("overrides, message", [
    ({"pc.mode": "generative", "model": "cnn"}, "model.name='cnn' is invalid"),
    ({"pc.mode": "generative"}, "model.energy='ce' is invalid: allowed se, bce or zero with pc.mode=generative"),
    ({"model.energy": "zero", "pc.algorithm": "bp"}, "model.energy='zero' is invalid: allowed se or ce with "
                                                     "pc.mode=supervised"),
    ({"pc.mode": "unsupervised", "model.energy": "se"},
     "pc.mode=unsupervised needs model.dims[0]=10 (h_0: pc.latent_dim=10), but model.dims=[64, 128, 128, 10]"),
    ({"pc.mode": "generative", "model.energy": "se", "model.dims": [10, 64, 10]},
     "pc.mode=generative needs model.dims[-1]=64 (h_L: data digits's 64 features (1 x 8 x 8))"),
    ({"pc.precision": [1.0, -2.0, 1.0]}, "pc.precision=[1.0, -2.0, 1.0] is invalid"),
    ({"pc.precision": [1.0, 2.0]}, "pc.precision=[1.0, 2.0] is invalid: allowed a number or one number per layer (3)"),
    ({"pc.mode": "unsupervised", "model.energy": "se", "model.dims": [10, 64], "pc.prior_precision": 0.0,
      "optim.weight_decay": 0.0}, "pc.prior_precision=0.0 is invalid: allowed > 0 in unsupervised training"),
    ({"pc.mode": "generative", "model.energy": "se", "model.dims": [10, 64], "pc.precision_schedule": "bottom_up"},
     "pc.precision_schedule='bottom_up' is invalid: allowed none, top_down"),
    ({"model": "deconv", "model.energy": "se"}, "model.name='deconv' is invalid"),
    ({"experiment": "generative_digits", "pc.prior_mean": "learned"},
     "pc.prior_mean='learned' is invalid: allowed auto, uniform or zero with pc.mode=generative (training clamps h_0"),
])
def test_what_cannot_work_is_one_line_naming_the_key(overrides, message, tmp_path):
    with pytest.raises(ValueError) as info:
        train(tmp_path, **overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("mode", ["generative", "unsupervised"])
def test_evaluating_a_run_reproduces_its_logged_test(mode, tmp_path):
    """python -m pcdist evaluate on a generative / unsupervised run: the network loaded from its checkpoint
    (a learned prior mean included) gives the test the run logged at its last evaluation, exactly."""
    from pcdist.service.evaluate import evaluate

    over = {"experiment": f"{mode}_digits", "pc.eval_T": 30, "pc.T": 10}
    if mode == "unsupervised":
        over["pc.prior_mean"] = "learned"
    result, run_dir = train(tmp_path, **over)
    got = evaluate(run_dir)
    assert got["mode"] == mode and got["T"] == 30
    assert got["reconstruction_mse"] == pytest.approx(result["val/reconstruction_mse"], rel=1e-6)
    if mode == "generative":
        assert got["accuracy"] == pytest.approx(result["val/accuracy"], abs=1e-12)
        assert (run_dir / "confusion.png").read_bytes()[:8] == PNG
    assert (run_dir / "eval.json").is_file()
    lost = tmp_path / "lost"  # model.json lost: the data sit at h_L (its inputs had been taken from h_0's 10)
    shutil.copytree(run_dir, lost, ignore=shutil.ignore_patterns("eval.json", "*.png"))
    (lost / "model.json").unlink()
    again = evaluate(lost, write=False)
    assert {k: again[k] for k in ("accuracy", "reconstruction_mse") if k in got} == \
        {k: got[k] for k in ("accuracy", "reconstruction_mse") if k in got}


def test_a_resume_that_would_add_or_drop_a_learned_prior_mean_is_refused_naming_the_key(tmp_path):
    """pc.prior_mean to or from learned changes the model's parameters: refused in one line naming the key (it was
    applied, then the load failed blaming the checkpoint); zero <-> uniform changes none, and is applied."""
    short = {"pc.T": 3, "pc.eval_T": 3, "trainer.max_steps": 2, "trainer.eval_every": 2, "trainer.ckpt_every": 2,
             "logger.plots": False}
    _, run_dir = train(tmp_path, experiment="unsupervised_digits", **short)
    with pytest.raises(pcdist.ConfigError, match=rf"^cannot resume {run_dir} with changed pc.prior_mean \('auto' -> "
                                                 r"'learned': a learned mean is a parameter of the model, which the "
                                                 r"checkpoint does not hold\); leave out pc.prior_mean=learned"):
        pcdist.train({"run_dir": str(run_dir), "pc.prior_mean": "learned", "trainer.max_steps": 3})
    assert pcdist.train({"run_dir": str(run_dir), "pc.prior_mean": "uniform", "trainer.max_steps": 3})["step"] == 3
    _, learned = train(tmp_path, name="learned", experiment="unsupervised_digits", **short,
                       **{"pc.prior_mean": "learned"})
    with pytest.raises(pcdist.ConfigError, match=r"\('learned' -> 'zero': a learned mean is a parameter of the model, "
                                                 r"which the checkpoint holds\)"):
        pcdist.train({"run_dir": str(learned), "pc.prior_mean": "zero", "trainer.max_steps": 3})


def test_a_resume_into_another_mode_of_the_same_shape_says_so(tmp_path, capsys):
    """An unsupervised run (latent dim 10, as many as the classes) resumed as generative: the network's shapes agree,
    so it runs, but h_0 then holds labels instead of a latent; it had been applied without a word. With a learned
    prior mean it is refused: generative training clamps h_0, so the mean would never train."""
    short = {"pc.T": 3, "pc.eval_T": 3, "trainer.max_steps": 2, "trainer.eval_every": 2, "trainer.ckpt_every": 2,
             "logger.plots": False}
    _, run_dir = train(tmp_path, experiment="unsupervised_digits", **short)
    _, learned = train(tmp_path, name="learned", experiment="unsupervised_digits", **short,
                       **{"pc.prior_mean": "learned"})
    with pytest.raises(pcdist.ConfigError, match=r"^config pc.prior_mean='learned' is invalid: allowed auto, uniform "
                                                 r"or zero with pc.mode=generative"):
        pcdist.train({"run_dir": str(learned), "pc.mode": "generative", "trainer.max_steps": 3})
    capsys.readouterr()
    assert pcdist.train({"run_dir": str(run_dir), "pc.mode": "generative", "trainer.max_steps": 3})["step"] == 3
    assert "resume: pc.mode changed 'unsupervised' -> 'generative': applied, with a warning (h_0 and h_L now hold " \
           "other things" in capsys.readouterr().out
