"""One evaluator per PC mode (pcdist/service/evaluators.py): ``python -m pcdist evaluate`` runs the test that
validation ran during training, so it reproduces the logged numbers (pc.eval_solver included)."""

import pytest

import pcdist
from pcdist.service.evaluate import evaluate
from pcdist.service.evaluators import EVALUATORS

QUICK = {"trainer.max_steps": 6, "trainer.eval_every": 3, "trainer.log_every": 3, "trainer.ckpt_every": 3,
         "trainer.progress": "off", "logger": "none", "logger.plots": False}


def test_every_mode_has_one_evaluator():
    assert list(EVALUATORS) == ["supervised", "generative", "unsupervised"]
    assert all(e.mode == mode for mode, e in EVALUATORS.items())


def test_evaluating_a_supervised_run_reproduces_its_logged_accuracy(tmp_path):
    result = pcdist.train({**QUICK, "run_dir": str(tmp_path / "run")})
    got = evaluate(tmp_path / "run", write=False)
    assert got["mode"] == "supervised" and got["samples"] == sum(map(sum, got["confusion"]))
    assert got["accuracy"] == result["val/accuracy"]
    assert got["loss"] == pytest.approx(result["val/energy"], rel=1e-5)


def test_eval_jsons_energies_and_confusion_matrix_equal_an_independent_count(tmp_path):
    """eval.json's energy (the label-clamped network's after pc.T steps, a mean per sample) and loss (the same at
    the feed-forward init) against the engine's own trace of the whole validation set, under an output precision
    of 3 (the loss left it out), and its confusion matrix (rows: the true class, columns: the predicted one)
    against a count of the loaded run's predictions (the energy off by the number of samples, or the matrix
    transposed, passed: the test recomputed the per-class values from the matrix written)."""
    import math

    import numpy as np
    import torch

    from pcdist.service.data import load_dataset

    result = pcdist.train({**QUICK, "pc.precision": [1.0, 1.0, 3.0], "run_dir": str(tmp_path / "run")})
    got = evaluate(tmp_path / "run", ["pc.T=5"], write=False)
    run, val = pcdist.load(tmp_path / "run"), load_dataset("digits")
    conf = np.zeros((10, 10), dtype=np.int64)
    np.add.at(conf, (val.y_val.numpy(), run.predict(val.x_val).argmax(1).numpy()), 1)
    assert np.array_equal(np.array(got["confusion"]), conf)
    net = run.network
    trainer = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=5, x_lr=run.config.pc.x_lr)
    x = val.x_val.reshape(len(val.x_val), -1).to(next(net.parameters()).dtype)
    y = torch.nn.functional.one_hot(val.y_val, 10).to(x.dtype)
    trace = trainer.trace(x, y)
    assert got["energy"] == pytest.approx(math.fsum(trace[-1]), rel=1e-5)
    assert got["loss"] == pytest.approx(math.fsum(trace[0]), rel=1e-5) == pytest.approx(result["val/energy"])


def test_evaluates_loss_is_the_feed_forward_loss_whatever_the_init(tmp_path):
    """eval.json's loss is the label-clamped energy at the feed-forward state, as val/energy is: from a run whose
    pc.init is newton too (it took the energy after that init, a smaller number)."""
    result = pcdist.train({**QUICK, "pc.init": "newton", "run_dir": str(tmp_path / "run")})
    got = evaluate(tmp_path / "run", write=False)
    assert got["loss"] == pytest.approx(result["val/energy"], rel=1e-5)
    assert got["energy"] < got["loss"], "the energy after inference is the loss's, lowered"


def test_evaluating_an_unsupervised_run_uses_its_eval_solver(tmp_path):
    """The unsupervised test infers with pc.eval_solver, in training and in evaluate alike."""
    over = {"experiment": "unsupervised_digits", "pc.eval_T": 20, "pc.T": 10, "pc.eval_solver": "adaptive",
            "pc.x_momentum": 0.0}
    result = pcdist.train({**QUICK, **over, "run_dir": str(tmp_path / "run")})
    got = evaluate(tmp_path / "run", write=False)
    assert got["reconstruction_mse"] == pytest.approx(result["val/reconstruction_mse"], rel=1e-6)


def test_evaluating_a_bf16_generative_run_reproduces_its_logged_metrics(tmp_path):
    """trainer.precision=bf16: the generative test by inference runs the run's precision in training and in
    evaluate alike (evaluate in float32 gave another accuracy)."""
    over = {"experiment": "generative_digits", "pc.eval_T": 20, "trainer.precision": "bf16"}
    result = pcdist.train({**QUICK, **over, "run_dir": str(tmp_path / "run")})
    got = evaluate(tmp_path / "run", write=False)
    assert (got["accuracy"], got["reconstruction_mse"]) == (result["val/accuracy"], result["val/reconstruction_mse"])
