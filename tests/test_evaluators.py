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
