"""Progress where there is no terminal, the bar where there is one, and plots readable at any depth."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import pcdist
from pcdist.service.metrics import RunLogger, plot_heatmap, plot_inference, plot_training, read_metrics

NO_WANDB = SimpleNamespace(name="none", mode="disabled", plots=True)


def logger(tmp_path, progress):
    return RunLogger(tmp_path, {"model": {"dims": [4, 3]}}, NO_WANDB, 33, progress)


def feed(log):
    log.progress(11, energy=2.5, samples_per_s=100.0)
    log.progress(22, energy=1.25, accuracy=0.5, samples_per_s=120.0)
    log.progress(33, energy=0.75, samples_per_s=110.0)


def test_without_a_terminal_progress_is_a_line_per_call_on_stdout_and_in_train_log(tmp_path, capsys):
    log = logger(tmp_path, "auto")  # pytest's captured stderr is not a terminal: no bar
    feed(log)
    log.close()
    out = capsys.readouterr().out.splitlines()
    assert [l.split()[:2] for l in out] == [["step", "11/33"], ["step", "22/33"], ["step", "33/33"]]
    assert "energy 2.5" in out[0] and "100 samples/s" in out[0]
    assert [("accuracy 0.5000" in l) for l in out] == [False, True, False], "accuracy only where evaluated"
    assert [l.split("  ", 1)[1] for l in (tmp_path / "train.log").read_text().splitlines()] == out


def test_the_bar_shows_the_latest_accuracy_and_off_prints_nothing(tmp_path, capsys):
    bar = logger(tmp_path / "bar", "on")
    feed(bar)
    assert "acc=0.5000" in bar._bar.postfix and "F=0.75" in bar._bar.postfix
    bar.close()
    quiet = logger(tmp_path / "off", "off")
    feed(quiet)
    quiet.close()
    assert capsys.readouterr().out == ""
    assert len((tmp_path / "off" / "train.log").read_text().splitlines()) == 3


@pytest.fixture(scope="module")
def deep_trace():
    """The per-layer energies of one batch over T=12 inference steps of a real 20-layer PC network."""
    torch.manual_seed(0)
    net = pcdist.PCNetwork.from_dims([8] * 20 + [3], activation="tanh", seed=0)
    tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.01), T=12)
    x, y = torch.randn(4, 8), torch.randn(4, 3)
    tr.step(x, y)
    return tr.trace(x, y)


def test_a_deep_network_gets_one_colour_per_layer_and_a_colour_bar(deep_trace):
    fig = plot_inference(deep_trace, "20 layers")
    ax = fig.axes[0]
    colours = {tuple(np.round(line.get_color(), 6)) for line in ax.get_lines()}
    assert len(ax.get_lines()) == len(colours) == 20, "no colour repeats"
    assert ax.get_legend() is None and len(fig.axes) == 2, "a colour bar (second axes) instead of a 20-entry legend"


def test_a_shallow_network_gets_a_legend_and_layers_stuck_at_zero_are_named():
    trace = [[0.0, 0.0, 1.0], [0.0, 0.5, 0.8], [0.0, 0.25, 0.7]]
    ax = plot_inference(trace, "3 layers").axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["layer 1", "layer 2", "layer 3"]
    assert ax.get_title().endswith("exactly 0 throughout: layer 1")


def test_the_heat_map_is_layers_by_steps_of_log10_energy_with_zeros_marked(deep_trace):
    image = plot_heatmap(deep_trace, "20 layers").axes[0].get_images()[0].get_array()
    e = np.asarray(deep_trace).T
    assert image.shape == (20, 13)
    assert (np.ma.getmaskarray(image) == (e == 0)).all()
    pos = e > 0
    np.testing.assert_allclose(np.asarray(image)[pos], np.log10(e[pos]))


def test_the_accuracy_axis_spans_zero_to_one_and_the_title_names_the_result():
    rows = [{"step": 10, "train/energy": 2.0}, {"step": 20, "val/accuracy": 0.96}, {"step": 20, "train/energy": 1.0},
            {"step": 30, "val/accuracy": 0.975}]
    ax = plot_training(rows, "digits, 64-128-10").axes[0]
    assert ax.get_ylim() == (0.0, 1.0)
    assert "digits, 64-128-10" in ax.get_title() and "0.9750 at step 30" in ax.get_title()
    assert list(ax.get_lines()[0].get_ydata()) == [0.96, 0.975]


@pytest.mark.parametrize("energies", [[2.0, 0.5, 0.02, 0.004], [0.3050, 0.3031, 0.3012, 0.3003]],
                         ids=["decades", "a narrow range"])
def test_log_axes_are_labelled_with_plain_numbers_at_their_ticks(energies):
    """The log energy axis of the training plot and the symlog axis of the inference plot carry labels without
    mathtext (no ``$``: its parser costs every run a quarter of a second), each the number at its tick; a
    training energy spanning less than a decade still gets several (the symlog axis labels its decades)."""
    rows = [{"step": 10 * (i + 1), "train/energy": e} for i, e in enumerate(energies)]
    trace = [[e, e / 10] for e in energies]
    training, inference = plot_training(rows, "x"), plot_inference(trace, "x")
    for fig, ax, least in ((training, training.axes[1], 2), (inference, inference.axes[0], 1)):
        fig.draw_without_rendering()
        shown = [(tick.get_loc(), tick.label1.get_text() or tick.label2.get_text())
                 for tick in [*ax.yaxis.get_major_ticks(), *ax.yaxis.get_minor_ticks()]
                 if ax.get_ylim()[0] <= tick.get_loc() <= ax.get_ylim()[1]]
        labels = [(loc, text) for loc, text in shown if text]
        assert len(labels) >= least, shown
        for loc, text in labels:
            assert "$" not in text and float(text.replace("\u2212", "-")) == pytest.approx(loc, rel=5e-3), (loc, text)


def test_metrics_hold_validation_energy_and_training_accuracy_that_the_weights_give(tmp_path):
    """Every logged step has train/accuracy (the step's batch, after its update) and every evaluation
    val/energy beside val/accuracy. At the end both validation numbers are recomputed here from the last
    checkpoint's weights: val/energy is the energy of the feed-forward init with the output clamped to the
    labels, where every hidden error is zero, so it is the cross-entropy of the prediction (a batch mean)."""
    from pcdist.service.checkpoint import latest_checkpoint, load_checkpoint
    from pcdist.service.data import load_dataset

    pcdist.train({"model.dims": [64, 16, 10], "pc.T": 3, "trainer": {"max_steps": 6, "log_every": 2, "eval_every": 3},
                  "logger": "none", "trainer.progress": "off", "run_dir": str(tmp_path)})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/accuracy" in r] == [r["step"] for r in rows if "train/energy" in r] \
        == [2, 4, 6]
    assert all(0 <= r["train/accuracy"] <= 1 and r["train/accuracy"] * 64 == round(r["train/accuracy"] * 64)
               for r in rows if "train/accuracy" in r), "a fraction of the 64 samples of the batch"
    evaluated = [r for r in rows if "val/accuracy" in r]
    assert [r["step"] for r in evaluated] == [3, 6] and all("val/energy" in r for r in evaluated)
    net = pcdist.PCNetwork(pcdist.mlp_specs([64, 16, 10], "gelu"), energy="ce")
    load_checkpoint(latest_checkpoint(tmp_path), net, None)
    val = load_dataset("digits").flat()
    with torch.no_grad():
        logits = net(val.x_val)
    assert evaluated[-1]["val/accuracy"] == pytest.approx((logits.argmax(1) == val.y_val).float().mean().item())
    ce = torch.nn.functional.cross_entropy(logits.double(), val.y_val).item()
    assert evaluated[-1]["val/energy"] == pytest.approx(ce, rel=1e-5)


def test_the_wandb_logger_ends_a_run_without_its_summary(tmp_path):
    """wandb offline (the default logger): no run history and summary (~30 lines) when the run ends; the
    numbers are in metrics.jsonl, train.log and the plots."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "train.py"), "model.dims=[64,16,10]", "pc.T=2",
                          "trainer.max_steps=4", "trainer.eval_every=2", "trainer.log_every=2", "trainer.progress=off",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300,  # a wandb service an earlier test of this worker started is not this run's
                         env={k: v for k, v in os.environ.items() if k not in ("WANDB_SILENT", "WANDB_SERVICE")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*")), "the wandb run was written"
    said = out.stdout + out.stderr
    assert "Run summary" not in said and "Run history" not in said, said
    lines = said.splitlines()
    ours, wandbs = [x for x in lines if not x.startswith("wandb:")], [x for x in lines if x.startswith("wandb:")]
    # pcdist: the run directory, the chosen pc.x_lr, the last step; wandb: where its offline run went (its
    # summary and history would be ~30 lines)
    assert len(ours) <= 3 and len(wandbs) <= 4, said


def png_title(path) -> str:
    """The Title a PNG carries (the plot's title, kept in the file's metadata)."""
    from PIL import Image

    with Image.open(path) as img:
        return img.text["Title"]


@pytest.mark.parametrize("preset, says", [
    (["experiment=mupc_digits", "model.depth=6"], "6 layers 64-128(x5)-10: residual identity, 5 x residual relu"),
    (["experiment=signals_cnn"], "4 layers 1x64-25x32-25x16-25x8-10: 3 x conv1d gelu max-pool, dense"),
    ([], "3 layers 64-128-128-10: 2 x dense gelu, dense"),
])
def test_plot_titles_describe_the_network_that_trained(tmp_path, preset, says):
    """A μPC run and a Conv1d run leave model.dims at its default; their plots must describe the layers that
    trained (their number, the value nodes' shapes, the kinds and activations), not model.dims."""
    run_dir = tmp_path / "run"
    pcdist.train([*preset, "trainer.max_steps=2", "trainer.eval_every=2", "trainer.log_every=1", "logger=none",
                  "trainer.progress=off", f"run_dir={run_dir}"])
    for name in ("accuracy_energy.png", "inference_energy.png", "inference_heatmap.png"):
        title = png_title(run_dir / name)
        assert says in title and "64-128-128-10 gelu (3 layers)" not in title, (name, title)


def test_plots_false_draws_no_pictures_and_a_resume_with_plots_draws_them(tmp_path):
    """logger.plots=false: the run writes its logs and checkpoints but no picture (pc.diagnostics' neither);
    resumed with logger.plots=true (a logger setting, applied on resume), it draws every one of them."""
    run = ["model.dims=[64,16,10]", "pc.T=2", "trainer.log_every=1", "trainer.eval_every=2", "logger=none",
           "trainer.progress=off", "pc.diagnostics=true", "pc.diagnostics_every=2", f"run_dir={tmp_path}"]
    pcdist.train([*run, "trainer.max_steps=2", "logger.plots=false"])
    assert (tmp_path / "metrics.jsonl").is_file() and (tmp_path / "diagnostics.jsonl").is_file()
    assert list(tmp_path.glob("*.png")) == []
    pcdist.train([*run, "trainer.max_steps=4", "logger.plots=true"])
    assert {p.name for p in tmp_path.glob("*.png")} == {"accuracy_energy.png", "inference_energy.png",
                                                      "inference_heatmap.png", "diagnostics_energy.png",
                                                      "diagnostics_cosine.png"}


def test_metrics_with_a_last_line_cut_short_read_as_a_resume_keeps_them(tmp_path):
    """A run killed while writing its last row (or a full disk) leaves it cut short: read_metrics (pcdist.load,
    evaluate, predict, export, compare) leaves it out, as a resume drops it; a damaged row before the last (not
    JSON, not a logged step's) is a RunError naming the file and the line (a ValueError traceback at the command
    line); compare leaves out a value that is not a number (a hand-edited row: a TypeError)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 5, "train/energy": 1.5}\n{"step": 10, "train/energy": 1.25}\n{"step": 15, "train/en')
    assert read_metrics(path) == [{"step": 5, "train/energy": 1.5}, {"step": 10, "train/energy": 1.25}]
    path.write_text('{"step": 5, "train/energy": 1.5}\n{"step": 10, "tra\n{"step": 15, "train/energy": 1.0}\n')
    with pytest.raises(pcdist.RunError, match=f"^{path}: line 2 is not a JSON row"):
        read_metrics(path)
    good = b'{"step": 5, "train/energy": 1.5}\n'
    path.write_bytes(good + b'{"step": 10, "train/energy": 1.25}\xff\xfe\n')  # bytes that are not UTF-8, last
    assert read_metrics(path) == [{"step": 5, "train/energy": 1.5}]
    path.write_bytes(good + b"\xff\xfe\n" + good)  # and before the last (a UnicodeDecodeError traceback)
    with pytest.raises(pcdist.RunError, match=f"^{path}: line 2 is not a JSON row \\(not UTF-8 text\\)"):
        read_metrics(path)
    for row in ('["x"]', '{"train/energy": 1.0}', '{"step": "7"}'):
        path.write_text(f'{{"step": 5, "train/energy": 1.5}}\n{row}\n{{"step": 15, "train/energy": 1.0}}\n')
        with pytest.raises(pcdist.RunError, match=f"^{path}: line 2 is not a row of a logged step"):
            read_metrics(path)
    from pcdist.service.compare import _summary

    rows = [{"step": 5, "val/accuracy": 0.5}, {"step": 10, "val/accuracy": "x", "train/energy": "y"}]
    assert _summary(rows)["val/accuracy"] == 0.5 and _summary(rows)["train/energy"] is None


def test_the_step_time_leaves_out_the_evaluations_and_checkpoints_between_log_points(tmp_path, monkeypatch):
    """perf/step_s (and samples_per_s, comm_fraction) are the training steps' own: the evaluation and checkpoint
    of the previous logged step were counted in (a generative run's step_s went from 0.002 s to 0.19 s after each
    evaluation). Each evaluation here is made to take 1 s more (a sleep): the step after it still takes well under
    that, however busy the machine (a step of this network takes milliseconds)."""
    import time

    from pcdist.service.trainer import ServiceTrainer

    slow = ServiceTrainer._evaluate

    def evaluate(self, done):
        time.sleep(1.0)
        return slow(self, done)

    monkeypatch.setattr(ServiceTrainer, "_evaluate", evaluate)
    run_dir = tmp_path / "run"
    pcdist.train({"run_dir": str(run_dir), "logger": "none", "logger.plots": False, "model.dims": [64, 16, 10],
                  "trainer": {"max_steps": 4, "log_every": 1, "eval_every": 2, "ckpt_every": 4, "progress": "off"}})
    rows = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "perf/step_s" in r}
    assert sorted(rows) == [1, 2, 3, 4]
    assert rows[3]["perf/step_s"] < 0.5, rows[3]  # the step after step 2's evaluation


def test_the_reconstructions_drawn_are_those_the_metric_scores(tmp_path, monkeypatch):
    """reconstructions.png inferred h_0 with the training solver (pc.solver) while val/reconstruction_mse used
    pc.eval_solver: with eval_solver=rk4 the picture showed reconstructions the metric did not score. The drawn
    row now equals the evaluator's own reconstruction of those held-out samples."""
    import pcdist.service.evaluators as evaluators
    import pcdist.service.validate as validate

    drawn, scored = [], []
    draw, add = validate.draw_grid, evaluators.Unsupervised.add

    def capture_draw(rows, labels, title, path):
        drawn.append((rows[1].detach().clone(), title))
        return draw(rows, labels, title, path)

    def capture_add(self, x, labels):
        own = self.trainer.infer(None, x, self.c.pc.eval_T, gather=False, solver=self.c.pc.eval_solver,
                                 tol=self.c.pc.eval_tol)
        scored.append(evaluators.forward_mean(self.trainer, own.get(0, x)))
        return add(self, x, labels)

    monkeypatch.setattr(validate, "draw_grid", capture_draw)
    monkeypatch.setattr(evaluators.Unsupervised, "add", capture_add)
    pcdist.train(["experiment=unsupervised_digits", "trainer.max_steps=2", "trainer.eval_every=2",
                  "trainer.dtype=float64", "pc.x_momentum=0", "pc.eval_T=12", "pc.eval_solver=rk4", "logger=none",
                  "trainer.progress=off",
                  f"hydra.run.dir={tmp_path / 'run'}"])
    (row, title), = drawn
    torch.testing.assert_close(row.reshape(len(row), -1), scored[0][:len(row)].reshape(len(row), -1), atol=1e-10,
                               rtol=0)
    assert "h_0 inferred in 12 rk4 steps" in title


def test_pictures_that_cannot_be_written_are_a_warning_not_the_runs_end(tmp_path, capsys):
    """(review rv117) A full disk as a finished run drew its pictures ended it in a traceback, status 1 (and,
    where a checkpoint's write had failed first, hid that error's one line): the run's record is whole, so the
    pictures' failure is one warning line. (Here a folder stands where a picture goes.)"""
    run = tmp_path / "run"
    short = {"run_dir": str(run), "logger": "none", "trainer.progress": "off", "trainer.ckpt_every": 2}
    pcdist.train({**short, "logger.plots": False, "trainer.max_steps": 2})
    (run / "accuracy_energy.png").mkdir()
    capsys.readouterr()
    assert pcdist.train({**short, "trainer.max_steps": 4})["step"] == 4
    err = capsys.readouterr().err
    assert "warning: the run's pictures were not drawn (Is a directory: " in err and \
        "metrics.jsonl and the checkpoints are complete" in err
    assert not list(run.glob(".*.part"))


def test_the_throughput_and_the_step_time_describe_the_same_steps(tmp_path):
    """(review rv115) perf/samples_per_s counted one step's samples over log_every steps' time (off by log_every):
    with steps between log points, samples_per_s x step_s is the batch size in every row."""
    run = tmp_path / "run"
    pcdist.train({"logger": {"name": "none", "plots": False}, "run_dir": str(run), "model": {"dims": [64, 16, 10]},
                  "trainer": {"max_steps": 12, "batch_size": 32, "log_every": 4, "eval_every": 100, "progress": "off"}})
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "perf/samples_per_s" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["perf/samples_per_s"] * r["perf/step_s"] == pytest.approx(32, rel=1e-9)
