"""Progress where there is no terminal, the bar where there is one, and plots readable at any depth."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import pcdist
from pcdist.service.metrics import RunLogger, plot_heatmap, plot_inference, plot_training

NO_WANDB = SimpleNamespace(name="none", mode="disabled")


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
