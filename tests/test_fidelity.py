"""The service side of issue 22: pc.diagnostics in a run (metrics, files, pictures, the instability
warning), 1-D signals through data=arrays and model=cnn (Conv1d layers), and their config errors.

Why it matters: a user who trains on their own 1-D data must get Conv1d layers from the shapes of
their arrays, and a run whose inference blows up must say so, with the fix, instead of training
silently at chance (docs/fidelity.md).
"""

import json

import numpy as np
import pytest

import pcdist
from pcdist.service.metrics import read_metrics
from pcdist.service.signals import save_signals

def cfg(tmp_path, **over) -> list[str]:
    """Command-line overrides (as train.py takes them) of a quiet run in tmp_path/run."""
    def text(v):
        return ("[" + ",".join(map(str, v)) + "]" if isinstance(v, list)
                else str(v).lower() if isinstance(v, bool) else v)

    return ["logger=none", "trainer.progress=off", f"run_dir={tmp_path / 'run'}",
            *(f"{k}={text(v)}" for k, v in over.items())]


def test_diagnostics_in_a_run_are_logged_written_and_drawn(tmp_path):
    """pc.diagnostics=true, every 3 steps of 7: diagnoses before the updates of steps 1, 4, 7 (weights after
    0, 3, 6 updates), each with one cos and norm ratio per layer in metrics.jsonl and the energy of every layer
    at every inference step (T + 1 rows) in diagnostics.jsonl; both pictures drawn. At the feed-forward init
    the output layer's update is backprop's gradient, so after inference its cos stays near 1 on digits."""
    T = 5
    result = pcdist.train(cfg(tmp_path, **{"pc.diagnostics": True, "pc.diagnostics_every": 3, "pc.T": T,
                                          "trainer.max_steps": 7, "trainer.eval_every": 7}))
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "diagnostics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 3, 6]
    L = 3
    for r in records:
        assert len(r["energy_trace"]) == T + 1 and all(len(row) == L for row in r["energy_trace"])
        assert len(r["cosine"]) == L and all(-1 - 1e-9 <= c <= 1 + 1e-9 for c in r["cosine"])
        assert r["inference"] in ("converging", "oscillating", "diverging")
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "diag/cosine/1" in r]
    assert [r["step"] for r in rows] == [0, 3, 6]
    assert all(f"diag/norm_ratio/{l}" in rows[0] for l in range(1, L + 1))
    assert records[0]["cosine"][-1] > 0.9
    assert (run / "diagnostics_energy.png").stat().st_size > 0 and (run / "diagnostics_cosine.png").stat().st_size > 0
    assert result["step"] == 7


def test_diagnostics_off_write_nothing(tmp_path):
    """The default: no diagnostics file, no diag/ metric."""
    pcdist.train(cfg(tmp_path, **{"trainer.max_steps": 2, "pc.T": 3}))
    assert not (tmp_path / "run" / "diagnostics.jsonl").exists()
    assert not any(k.startswith("diag/") for r in read_metrics(tmp_path / "run" / "metrics.jsonl") for k in r)


@pytest.mark.parametrize("diagnostics", [True, False])
def test_an_unstable_inference_is_named_in_the_log_with_its_fix(diagnostics, tmp_path):
    """pc.x_lr=3 is far beyond 2 / (the energy's curvature) for the digits MLP: the energy grows over the
    inference steps; the diagnostics (when on) and the end-of-run trace (always) say so in train.log with a
    smaller pc.x_lr; that smaller step, diagnosed on the same weights, makes the energy fall."""
    over = {"pc.x_lr": 3.0, "pc.T": 10, "trainer.max_steps": 2, "trainer.on_divergence": "skip",
            "pc.diagnostics": diagnostics, "pc.diagnostics_every": 1, "logger.plots": False}  # no picture read
    pcdist.train(cfg(tmp_path, **over))
    log = (tmp_path / "run" / "train.log").read_text()
    lines = [line for line in log.splitlines() if "inference is unstable" in line]
    assert any("(one batch at the final weights)" in line for line in lines)
    assert any("(pc.diagnostics)" in line for line in lines) == diagnostics
    fix = float(lines[-1].split("pc.x_lr=")[1].split(" ")[0])
    assert 0 < fix < 3.0
    if diagnostics:
        first = json.loads((tmp_path / "run" / "diagnostics.jsonl").read_text().splitlines()[0])
        assert first["energy"][-1] > first["energy"][0], "the energy grew over the inference steps"
    import torch

    from pcdist.service.data import load_digits, one_hot

    d = load_digits().flat()
    x, y = d.x_train[:64], one_hot(d.y_train[:64], 10)
    net = pcdist.PCNetwork.from_dims([64, 128, 128, 10], activation="gelu", energy="ce", seed=0)
    trainer = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=10, x_lr=fix)
    e = pcdist.diagnose(trainer, x, y)["energy"]
    assert e[-1] < e[0]


def signals_npz(tmp_path, flat=False):
    a = save_signals(str(tmp_path / "s.npz"), n_train=640, n_val=200, length=32, motif=8)
    if flat:
        np.savez(tmp_path / "flat.npz", **{k: v[:, 0] if k.startswith("x") else v for k, v in a.items()})
        return tmp_path / "flat.npz"
    return tmp_path / "s.npz"


CNN = {"model": "cnn", "model.channels": [8, 8, 8], "model.pool": ["max", "max", "none"],
       "model.stride": [1, 1, 1], "model.padding": [2, 2, 2], "model.kernel_size": 5, "pc.T": 3,
       "optim.lr": 0.01, "trainer.max_steps": 100, "trainer.eval_every": 100, "trainer.batch_size": 32}


def test_1d_signals_train_a_conv1d_network_end_to_end(tmp_path):
    """data=arrays with x [N, 1, L] and model=cnn: three Conv1d layers ([C, L] value nodes, 1-D kernels,
    strides and padding from the lists) trained through the service to well above chance on the generated
    signals: ten classes, 200 validation signals, so guessing scores 0.1 +- 0.021 and 0.2 is 4.7 of those
    above it (trainer.seed 0-7 reach 0.285-0.48 in these 100 steps: 0.3, the bound before, failed at seed
    1). The same signals as [N, L] with data.signal=true are the same run: the same network and accuracy."""
    runs = {}
    for flat in (False, True):
        path = signals_npz(tmp_path, flat)
        over = {**CNN, "data": "arrays", "data.path": str(path), **({"data.signal": True} if flat else {}),
                "logger.plots": False}  # no picture read
        runs[flat] = pcdist.train(cfg(tmp_path / str(flat), **over))
    specs = runs[False].network.specs
    assert [type(s).__name__ for s in specs] == ["Conv", "Conv", "Conv", "Dense"]
    assert [s.spatial for s in specs[:3]] == [(32,), (16,), (8,)]
    assert runs[False]["val/accuracy"] > 0.2, runs[False]["val/accuracy"]
    assert runs[True].network.specs == specs
    assert runs[True]["val/accuracy"] == runs[False]["val/accuracy"]


def test_flat_signals_without_data_signal_name_the_key(tmp_path):
    """Flat arrays [N, L] for a conv model: data.signal=true is named; vectors of another data set (synthetic), which
    has no such key, are not told to set it (it was, then refused it)."""
    path = signals_npz(tmp_path, flat=True)
    with pytest.raises(Exception, match=r"\(one-channel signals \[N, L\]: add data\.signal=true\)$"):
        pcdist.train(cfg(tmp_path, **{**CNN, "data": "arrays", "data.path": str(path), "trainer.max_steps": 1}))
    with pytest.raises(pcdist.data.DataError, match=r"\(data=synthetic gives vectors: a conv model needs images, or "
                                                    r"signals: data=signals, or data=arrays with data.signal=true\)$"):
        pcdist.train(cfg(tmp_path, **{**CNN, "data": "synthetic", "trainer.max_steps": 1}))


@pytest.mark.parametrize("over,key", [({"model.stride": [1, 2, 1]}, "model.stride"),
                                      ({"model.padding": [-1, 0]}, "model.padding"),
                                      ({"pc.diagnostics_every": 0}, "pc.diagnostics_every"),
                                      ({"data.signal": True}, "data.signal"),
                                      ({"pc.diagnostics": True, "pc.algorithm": "bp"}, "pc.diagnostics")])
def test_bad_settings_name_their_key(over, key, tmp_path):
    conf = cfg(tmp_path, **({"model": "cnn"} if key.startswith("model") else {}), **over, **{"trainer.max_steps": 1})
    with pytest.raises(pcdist.ConfigError, match=key.replace(".", r"\.")):
        pcdist.train(conf)
