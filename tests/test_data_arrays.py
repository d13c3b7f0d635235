"""Your own data: arrays on disk through train.py (data=arrays), and datasets passed to pcdist.train,
streamed by real DataLoader worker processes in the same global batch order as in-memory data."""

import gzip
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import pcdist
from pcdist.service.data import DataError, StreamedData, load_arrays, load_dataset, load_digits
from pcdist.service.metrics import read_metrics
from test_service import layer_state, torchrun

ROOT = Path(__file__).resolve().parents[1]


def digits_images(classes=3):
    """scikit-learn's digits of the first ``classes`` classes as [N, 1, 8, 8] float32 images in [0, 1]."""
    d = load_digits()
    keep_tr, keep_va = d.y_train < classes, d.y_val < classes
    return d.x_train[keep_tr].numpy(), d.y_train[keep_tr].numpy(), d.x_val[keep_va].numpy(), d.y_val[keep_va].numpy()


def save_npz(path, x_train, y_train, x_val, y_val, **extra):
    np.savez(path, x_train=x_train, y_train=y_train, x_val=x_val, y_val=y_val, **extra)
    return path


def test_train_py_trains_on_an_npz_of_images_with_three_classes(tmp_path, monkeypatch):
    """data=arrays data.path=three.npz through the real train.py: images [N, 1, 8, 8], 3 classes, learned well
    beyond chance (1/3); the run records where the data came from as an absolute path, so that evaluating it from
    another folder, which holds a three.npz of its own (its labels shuffled), reads the run's data all the same."""
    npz = save_npz(tmp_path / "three.npz", *digits_images(3))
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "data=arrays", "data.path=three.npz",
                          "model.dims=[64,32,3]", "trainer.max_steps=30", "trainer.eval_every=30",
                          "trainer.batch_size=32", "logger=none", "logger.plots=false", "trainer.progress=off",
                          f"hydra.run.dir={run_dir}"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    accuracy = float(out.stdout.split("val/accuracy ")[1].split(";")[0])
    assert accuracy > 0.8, "digits 0, 1, 2 are easy: 30 steps must learn them far beyond chance (1/3)"
    saved = (run_dir / "config.yaml").read_text()
    assert "name: arrays" in saved and f"path: {npz}\n" in saved
    x, y, xv, yv = digits_images(3)
    rng = np.random.default_rng(0)
    (tmp_path / "other").mkdir()
    save_npz(tmp_path / "other" / "three.npz", x, rng.permutation(y), xv, rng.permutation(yv))
    monkeypatch.chdir(tmp_path / "other")
    assert pcdist.evaluate(run_dir)["accuracy"] == pytest.approx(accuracy, abs=1e-4)


def test_inputs_keep_their_shape_and_dtype_rules(tmp_path):
    """Images stay [N, C, H, W]; uint8 is scaled to [0, 1], other integers keep their values, float64 stays
    float64; the number of classes is the largest label + 1 unless data.num_classes says more."""
    rng = np.random.default_rng(0)
    x8 = rng.integers(0, 256, (10, 3, 4, 4), dtype=np.uint8)
    y = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4])
    ds = load_arrays(save_npz(tmp_path / "u8.npz", x8, y, x8[:4], np.array([5, 0, 1, 2])))
    assert ds.x_train.shape == (10, 3, 4, 4) and ds.x_train.dtype == torch.float32
    torch.testing.assert_close(ds.x_train, torch.from_numpy(x8.astype(np.float32) / 255))
    assert ds.num_classes == 6 and ds.num_features == 48, "max label 5 (in val) + 1; 3 x 4 x 4 features"
    counts = rng.integers(-5, 500, (10, 7)).astype(np.int64)
    ds = load_arrays(save_npz(tmp_path / "i64.npz", counts, y, counts, y), num_classes=9)
    assert torch.equal(ds.x_train, torch.from_numpy(counts).float()) and ds.num_classes == 9
    x64 = rng.standard_normal((10, 7))
    assert load_arrays(save_npz(tmp_path / "f64.npz", x64, y, x64, y)).x_train.dtype == torch.float64


def test_wrong_model_width_names_the_image_shape(tmp_path):
    npz = save_npz(tmp_path / "d.npz", np.zeros((40, 3, 4, 4), np.float32), np.arange(40) % 5,
                   np.zeros((8, 3, 4, 4), np.float32), np.arange(8) % 5)
    with pytest.raises(DataError, match=r"^data arrays has 48 input features \(3 x 4 x 4\) but model.dims\[0\]=64; "
                                        r"set model.dims=\[48,10,5\]$"):
        pcdist.train({"data": {"name": "arrays", "path": str(npz)}, "model": {"dims": [64, 10, 5]},
                      "logger": {"name": "none"}, "run_dir": str(tmp_path / "run")})


def train_py_refuses(tmp_path, *args) -> str:
    """The line ``train.py <args>`` prints when it refuses the launch (``error: `` and the error pcdist.train raises
    on the same command line, in this process; test_rundir checks that the command line prints it as its one line,
    with exit status 2, and leaves no run directory)."""
    with pytest.raises((pcdist.ConfigError, DataError)) as info:
        pcdist.train([*args, "logger=none", f"run_dir={tmp_path / 'run'}"])
    return f"error: {info.value}\n"


def test_channels_last_arrays_for_a_conv_model_are_one_line_saying_the_layout(tmp_path):
    """Images [N, H, W, C] and signals [N, L, C] (numpy's and Keras' habit) with model=cnn: one line saying the
    layout the model reads and the transpose that gives it, not a conv layer's failure deep in a traceback. Images
    without their channel ([N, H, W]) are signals [C, L] to the model: they train, with a note saying so."""
    x_tr, y_tr, x_va, y_va = digits_images(3)
    images = save_npz(tmp_path / "hwc.npz", x_tr.transpose(0, 2, 3, 1), y_tr, x_va.transpose(0, 2, 3, 1), y_va)
    said = train_py_refuses(tmp_path, "data=arrays", f"data.path={images}", "model=cnn")
    assert said == (f"error: data arrays ({images}) has samples of shape [8, 8, 1], channels-last [H, W, C], but "
                    f"model.name=cnn reads images [C, H, W] channels-first; transpose the arrays to [N, 1, 8, 8]: "
                    f"x.transpose(0, 3, 1, 2) (numpy) or x.permute(0, 3, 1, 2) (torch); if they are channels-first "
                    f"already (8 channels), set data.layout=channels_first\n")
    rng = np.random.default_rng(0)
    signals = save_npz(tmp_path / "lc.npz", rng.standard_normal((64, 40, 1), np.float32), np.arange(64) % 4,
                       rng.standard_normal((16, 40, 1), np.float32), np.arange(16) % 4)
    said = train_py_refuses(tmp_path, "data=arrays", f"data.path={signals}", "model=cnn", "trainer.batch_size=16")
    assert said.startswith(f"error: data arrays ({signals}) has samples of shape [40, 1], channels-last [L, C], but "
                           f"model.name=cnn reads signals [C, L] channels-first; transpose the arrays to "
                           f"[N, 1, 40]"), said
    transposed = save_npz(tmp_path / "cl.npz", *(a.transpose(0, 2, 1) if a.ndim == 3 else a for a in
                                                  np.load(signals).values()))
    assert pcdist.train({"data": {"name": "arrays", "path": str(transposed)}, "model": "cnn", "logger": "none",
                         "logger.plots": False, "trainer": {"max_steps": 2, "batch_size": 16, "progress": "off"},
                         "run_dir": str(tmp_path / "ok")})["step"] == 2, "the layout said trains"
    assert "note:" not in (tmp_path / "ok" / "train.log").read_text(), "signals [1, 40] are signals"
    # samples that are channels-first though they look channels-last: refused by default, the line naming
    # data.layout (signals: 16 channels of length 3); with data.layout=channels_first they train as given (images of
    # 16 channels, 8 x 4: the input node is [16, 8, 4], the first convolution's output [32, 4, 2])
    short = save_npz(tmp_path / "short.npz", rng.standard_normal((64, 16, 3), np.float32), np.arange(64) % 4,
                     rng.standard_normal((16, 16, 3), np.float32), np.arange(16) % 4)
    said = train_py_refuses(tmp_path, "data=arrays", f"data.path={short}", "model=cnn", "trainer.batch_size=16")
    assert said.endswith("if they are channels-first already (16 channels of length 3), set "
                         "data.layout=channels_first\n"), said
    narrow = save_npz(tmp_path / "narrow.npz", rng.standard_normal((64, 16, 8, 4), np.float32), np.arange(64) % 4,
                      rng.standard_normal((16, 16, 8, 4), np.float32), np.arange(16) % 4)
    said = train_py_refuses(tmp_path, "data=arrays", f"data.path={narrow}", "model=cnn", "trainer.batch_size=16")
    assert said.endswith("if they are channels-first already (16 channels), set data.layout=channels_first\n"), said
    run = pcdist.train({"data": {"name": "arrays", "path": str(narrow), "layout": "channels_first"}, "model": "cnn",
                        "logger": "none", "logger.plots": False, "run_dir": str(tmp_path / "narrow"),
                        "trainer": {"max_steps": 2, "batch_size": 16, "progress": "off"}})
    assert run["step"] == 2
    assert pcdist.load(tmp_path / "narrow").network.node_shapes[:2] == [(16, 8, 4), (32, 4, 2)]
    # one-channel images without their channel ([N, 8, 8]) train as signals of 8 channels: allowed, with a note
    gray = save_npz(tmp_path / "gray.npz", x_tr[:, 0], y_tr, x_va[:, 0], y_va)
    pcdist.train({"data": {"name": "arrays", "path": str(gray)}, "model": "cnn", "logger": "none",
                  "logger.plots": False, "trainer": {"max_steps": 1, "batch_size": 16, "progress": "off"},
                  "run_dir": str(tmp_path / "gray")})
    assert ("note: data arrays's samples [8, 8] are read as 1-D signals of 8 channels and length 8 (model.name=cnn "
            "builds Conv1d layers on [C, L]); if they are one-channel images, give them their channel: x[:, None], "
            "shape [N, 1, 8, 8]") in (tmp_path / "gray" / "train.log").read_text()


def test_own_arrays_with_the_default_mlp_get_both_fixes_at_once_and_a_note_on_labels_from_1(tmp_path):
    """40 features and labels 1..4 with the default MLP (64 inputs, 10 classes): one line with the whole
    model.dims to set (both ends), noting that labels from 1 leave class 0 empty; the said value then trains."""
    rng = np.random.default_rng(0)
    own = save_npz(tmp_path / "own.npz", rng.standard_normal((64, 40), np.float32), 1 + np.arange(64) % 4,
                   rng.standard_normal((16, 40), np.float32), 1 + np.arange(16) % 4)
    said = train_py_refuses(tmp_path, "data=arrays", f"data.path={own}")
    assert said == ("error: data arrays has 40 input features but model.dims[0]=64 and 5 classes but model.dims[-1]="
                    "10; set model.dims=[40,128,128,5] (no label is below 1, so class 0 is empty: labels are class ids "
                    "from 0; if yours start at 1, subtract 1, y - 1)\n")
    folder = tmp_path / "own"  # the same arrays as a folder (memory-mapped): the same line (it had no note)
    folder.mkdir()
    with np.load(own) as arrays:
        for name in ("x_train", "y_train", "x_val", "y_val"):
            np.save(folder / f"{name}.npy", arrays[name])
    with pytest.raises(pcdist.data.DataError) as info:
        pcdist.train({"data": {"name": "arrays", "path": str(folder)}, "logger": "none",
                      "run_dir": str(tmp_path / "f")})
    assert f"error: {info.value}\n" == said
    assert pcdist.train({"data": {"name": "arrays", "path": str(own)}, "model": {"dims": [40, 128, 128, 5]},
                         "logger": "none", "logger.plots": False, "trainer": {"max_steps": 2, "progress": "off"},
                         "run_dir": str(tmp_path / "ok")})["step"] == 2


def test_a_resume_that_changes_a_key_its_data_set_does_not_read_is_applied_saying_so(tmp_path, capsys):
    """data.val_fraction is read by data=digits alone (an arrays file holds its own split): a fresh arrays run notes it
    unread, and a resume that changes it had been refused, saying it changes the train/validation split; it is
    applied, saying why. On digits the same change is still refused."""
    rng = np.random.default_rng(0)
    own = save_npz(tmp_path / "own.npz", rng.standard_normal((64, 6), np.float32), np.arange(64) % 3,
                   rng.standard_normal((16, 6), np.float32), np.arange(16) % 3)
    cfg = {"data": {"name": "arrays", "path": str(own)}, "model": {"dims": [6, 8, 3]}, "logger": "none",
           "logger.plots": False, "trainer": {"max_steps": 2, "ckpt_every": 2, "progress": "off"}}
    pcdist.train({**cfg, "run_dir": str(tmp_path / "a")})
    capsys.readouterr()
    resumed = {**cfg, "run_dir": str(tmp_path / "a"), "data": {**cfg["data"], "val_fraction": 0.3},
               "trainer": {**cfg["trainer"], "max_steps": 3}}
    assert pcdist.train(resumed)["step"] == 3
    assert "resume: data.val_fraction changed 0.2 -> 0.3: applied (data=arrays does not read it)" in \
        capsys.readouterr().out
    digits = {"logger": "none", "logger.plots": False, "trainer": {"max_steps": 2, "ckpt_every": 2, "progress": "off"},
              "run_dir": str(tmp_path / "d")}
    pcdist.train(digits)
    with pytest.raises(pcdist.ConfigError, match=r"changed data.val_fraction \(0.2 -> 0.3: it changes the "
                                                 r"train/validation split\)"):
        pcdist.train({**digits, "data": {"val_fraction": 0.3}, "trainer": {"max_steps": 3}})


X, Y = np.zeros((6, 4), np.float32), np.array([0, 1, 2, 0, 1, 2])


def nan_at(i, x=X):
    x = x.copy()
    x[i, 1] = np.nan
    return x


BAD_ARRAYS = [  # (arrays in the npz, data.num_classes, the exact message after "data.path=<file>: ")
    ({"x_train": X, "y_train": Y, "x_val": X}, None, "no array y_val; expected x_train, y_train, x_val, y_val "
                                                     "(found x_train, y_train, x_val)"),
    ({"x_train": X, "y_train": np.eye(3)[Y], "x_val": X, "y_val": Y}, None,
     "y_train has shape (6, 3); expected [N] integer class ids (not one-hot: use y.argmax(1))"),
    ({"x_train": X, "y_train": Y.astype(np.float32), "x_val": X, "y_val": Y}, None,
     "y_train has dtype float32; expected integer class ids (y.astype(int))"),
    ({"x_train": X, "y_train": Y[:5], "x_val": X, "y_val": Y}, None, "x_train has 6 samples but y_train has 5 labels"),
    ({"x_train": X, "y_train": Y, "x_val": np.zeros((6, 5), np.float32), "y_val": Y}, None,
     "x_train samples have shape (4,) but x_val samples (5,)"),
    ({"x_train": X[:, 0], "y_train": Y, "x_val": X, "y_val": Y}, None,
     "x_train has shape (6,); expected [N, features] or [N, C, H, W]"),
    ({"x_train": X, "y_train": Y, "x_val": X, "y_val": Y + 1}, 3,
     "labels span [0, 3], outside [0, 3) (data.num_classes=3)"),
    ({"x_train": X, "y_train": Y - 1, "x_val": X, "y_val": Y}, None,
     "labels span [-1, 2], outside [0, 3) (the largest label + 1)"),
    ({"x_train": X, "y_train": Y, "x_val": nan_at(4), "y_val": Y}, None, "x_val sample 4 holds NaN or Inf"),
    ({"x_train": X.astype(np.complex64), "y_train": Y, "x_val": X, "y_val": Y}, None,
     "x_train has dtype complex64; expected float or integer inputs"),
    ({"x_train": X, "y_train": Y[:, None], "x_val": X, "y_val": Y}, None,  # (the hint was y.argmax(1): all zeros)
     "y_train has shape (6, 1); expected [N] integer class ids (a column: use y.ravel())"),
    ({"x_train": (X * 255).astype(np.uint8), "y_train": Y, "x_val": X * 255, "y_val": Y}, None,  # 255x apart, silently
     "x_train is uint8 but x_val is float32: uint8 inputs are scaled to [0, 1] and others kept, so the two would "
     "differ in scale; save both alike"),
]


@pytest.mark.parametrize("arrays, num_classes, message", BAD_ARRAYS, ids=[m.split(";")[0] for *_, m in BAD_ARRAYS])
def test_bad_arrays_give_one_exact_error(arrays, num_classes, message, tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError) as info:
        load_arrays(str(path), num_classes)
    assert str(info.value) == f"data.path={path}: {message}"


def test_bad_files_give_one_exact_error(tmp_path):
    single = tmp_path / "x.npy"
    np.save(single, X)
    garbage = tmp_path / "g.npz"
    garbage.write_bytes(b"not a zip archive")
    folder = tmp_path / "folder"
    folder.mkdir()
    np.save(folder / "x_train.npy", X)
    np.save(folder / "y_train.npy", Y)
    cases = [(single, "a single array; expected an .npz (np.savez) with x_train, y_train, x_val, y_val"),
             (tmp_path / "absent.npz", "no such file or folder; expected an .npz with x_train, y_train, x_val, y_val "
                                       "or a folder of those four .npy files"),
             (folder, "missing x_val.npy, y_val.npy; a folder needs x_train.npy, y_train.npy, x_val.npy, y_val.npy")]
    for path, message in cases:
        with pytest.raises(DataError) as info:
            load_arrays(str(path))
        assert str(info.value) == f"data.path={path}: {message}"
    pickled = tmp_path / "pickled.npz"  # what np.save of a Python object writes: numpy's error talks of pickles
    np.save(pickled, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    pickled.write_bytes((tmp_path / "pickled.npz.npy").read_bytes())
    bad_folder = tmp_path / "objects"
    bad_folder.mkdir()
    for k in ("x_train", "y_train", "x_val", "y_val"):
        np.save(bad_folder / f"{k}.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    for path in (garbage, pickled):  # one line about the file, nothing of numpy's advice to unpickle it
        with pytest.raises(DataError) as info:
            load_arrays(str(path))
        assert str(info.value) == (f"data.path={path}: not an .npz archive (np.savez writes one); expected one with "
                                   f"x_train, y_train, x_val, y_val")
    with pytest.raises(DataError) as info:
        load_arrays(str(bad_folder))
    assert str(info.value) == (f"data.path={bad_folder}: x_train.npy is not a .npy file of numbers (np.save of a "
                               f"numeric array writes one)")


def test_object_and_big_endian_arrays(tmp_path):
    """An .npz holding an array of Python objects is one line (numpy refuses to unpickle it); arrays saved
    big-endian ('>f4', '>i8': another machine's) load as the native ones do."""
    objects = tmp_path / "objects.npz"
    np.savez(objects, x_train=np.array([[1.0], [2.0, 3.0]], dtype=object), y_train=Y, x_val=X, y_val=Y)
    with pytest.raises(DataError, match=f"^data.path={objects}: an array of Python objects"):
        load_arrays(str(objects))
    big, folder = tmp_path / "big.npz", tmp_path / "big"
    arrays = {"x_train": (X + 1).astype(">f4"), "y_train": Y.astype(">i8"), "x_val": X.astype(">f4"),
              "y_val": Y.astype(">i8")}
    np.savez(big, **arrays)
    folder.mkdir()
    for k, a in arrays.items():
        np.save(folder / f"{k}.npy", a)
    ds = load_arrays(str(big))
    assert torch.equal(ds.x_train, torch.from_numpy(X + 1)) and torch.equal(ds.y_val, torch.from_numpy(Y))
    x, y = load_arrays(str(folder)).train[3]
    assert torch.equal(x, torch.from_numpy(X[3] + 1)) and y == Y[3]


def test_a_dataset_from_python_is_checked_and_prepared_as_arrays_are(tmp_path, capsys):
    """pcdist.train(cfg, data=Dataset(...)): lengths, empty splits and sample shapes are one line as an .npz's; uint8
    images are scaled to [0, 1] as an .npz's are (and as predict and evaluate prepare them: the logged accuracy is
    evaluate's; training on 0-255 made them differ)."""
    from pcdist.data import Dataset
    from pcdist.service.evaluate import evaluate

    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (120,), generator=g)
    x = (torch.rand(120, 1, 4, 4, generator=g) * 80 + y[:, None, None, None] * 60).to(torch.uint8)
    cfg = {"model": {"dims": [16, 8, 3]}, "trainer": {"max_steps": 6, "batch_size": 20, "progress": "off"},
           "logger": "none", "logger.plots": False, "run_dir": str(tmp_path / "run")}
    for bad, message in ((Dataset(x[:90], y[:80], x[90:], y[90:], 3), "x_train has 90 samples but y_train has 80"),
                         (Dataset(x[:90], y[:90], x[90:90], y[90:90], 3), "x_val has no samples")):
        with pytest.raises(DataError, match=f"^pcdist.train\\(cfg, data=...\\): {message}"):
            pcdist.train(cfg, data=bad)
    ds = Dataset(x[:90], y[:90], x[90:], y[90:], 3)
    result = pcdist.train(cfg, data=ds)
    assert evaluate(tmp_path / "run", data=ds, write=False)["accuracy"] == result["val/accuracy"]
    assert float(pcdist.load(tmp_path / "run").preprocess(x[90:]).max()) <= 1.0
    stopped = tmp_path / "stopped"  # stopped early, it says how to go on: with the data again, from Python
    pcdist.train({**cfg, "run_dir": str(stopped), "trainer": {**cfg["trainer"], "stop_at": 3}}, data=ds)
    assert f"to train on, resume it with its own settings: pcdist.train({{'run_dir': '{stopped}'}}, data=...) with " \
        f"the same data" in capsys.readouterr().out


def test_data_path_or_root_where_the_data_set_does_not_read_it_is_refused_in_one_line(tmp_path):
    """data.path is read by data=arrays only: without it a run would silently train on the bundled digits."""
    npz = save_npz(tmp_path / "my.npz", *digits_images())
    with pytest.raises(pcdist.ConfigError) as info:
        pcdist.train({"data.path": str(npz), "logger": "none", "run_dir": str(tmp_path / "run")})
    assert str(info.value) == (f"config data.path={npz} is read by data=arrays only, but the data is digits: add "
                               f"data=arrays (or leave out data.path)")
    with pytest.raises(pcdist.ConfigError, match=r"^config data.root=/x is read by data=mnist, fashion_mnist, cifar10, "
                                                 r"cifar100 only, but the data is synthetic"):
        pcdist.train({"data": "synthetic", "data.root": "/x", "logger": "none", "run_dir": str(tmp_path / "run")})
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), f"data.path={npz}", "logger=none"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr == (f"error: config data.path={npz} is read by data=arrays only, but the data is digits: add "
                          f"data=arrays (or leave out data.path)\n")
    assert not (tmp_path / "runs").exists(), "a launch refused before training leaves no run directory"


def test_digits_are_the_same_from_load_digits_and_load_dataset():
    """Every reader keeps images [N, C, H, W]: load_digits() is load_dataset("digits"), and .flat() gives
    [N, 64]; the fields are named like the .npz arrays, the old names still read."""
    a, b = load_digits(), load_dataset("digits")
    assert a.x_train.shape == b.x_train.shape == (1437, 1, 8, 8) and a.x_val.shape == (360, 1, 8, 8)
    for k in ("x_train", "y_train", "x_val", "y_val"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert a.flat().x_train.shape == (1437, 64) and torch.equal(a.flat().x_train, a.x_train.reshape(1437, 64))
    assert a.labels_train is a.y_train and a.labels_val is a.y_val


def test_digits_and_their_split_equal_scikit_learns_without_importing_it():
    """load_digits reads scikit-learn's file and splits it without importing sklearn (a second per process);
    the images, labels and split equal sklearn's load_digits + train_test_split(stratify=...), and
    stratified_split equals train_test_split on random label sets, fractions and seeds (ties included)."""
    out = subprocess.run([sys.executable, "-c", "import sys; from pcdist.data import load_digits; load_digits(); "
                          "print(sorted(m for m in sys.modules if m.startswith('sklearn')))"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    from pcdist.service.data import stratified_split

    ref = sklearn_digits()
    ours = load_digits(val_fraction=0.25, seed=3)
    x_tr, x_va, y_tr, y_va = train_test_split(ref.data / 16.0, ref.target, test_size=0.25, random_state=3,
                                              stratify=ref.target)
    assert torch.equal(ours.x_train.flatten(1), torch.as_tensor(x_tr, dtype=torch.float32))
    assert torch.equal(ours.x_val.flatten(1), torch.as_tensor(x_va, dtype=torch.float32))
    assert torch.equal(ours.y_train, torch.as_tensor(y_tr)) and torch.equal(ours.y_val, torch.as_tensor(y_va))
    rng, tried = np.random.RandomState(5), 0
    while tried < 100:
        n, k = rng.randint(20, 300), rng.randint(2, 9)
        y = rng.randint(0, k, n)
        fraction, seed = rng.uniform(0.05, 0.7), rng.randint(0, 1000)
        if np.bincount(y).min() < 2 or min(math.ceil(fraction * n), n - math.ceil(fraction * n)) < k:
            continue  # sklearn refuses these
        tried += 1
        train, val = train_test_split(np.arange(n), test_size=fraction, random_state=seed, stratify=y)
        ours_train, ours_val = stratified_split(y, fraction, seed)
        assert np.array_equal(train, ours_train) and np.array_equal(val, ours_val), (n, k, fraction, seed)


def test_train_py_reports_a_missing_array_as_one_line(tmp_path):
    npz = tmp_path / "partial.npz"
    np.savez(npz, x_train=X, y_train=Y, x_val=X)
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "data=arrays", f"data.path={npz}", "logger=none",
                          f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr == (f"error: data.path={npz}: no array y_val; expected x_train, "
                                                  f"y_train, x_val, y_val (found x_train, y_train, x_val)\n")
    assert not (tmp_path / "run/checkpoints").exists()


def test_arrays_without_a_path_say_which_key_to_set(tmp_path):
    with pytest.raises(DataError, match=r"^data=arrays reads your arrays from data.path: set data.path="):
        pcdist.train({"data": "arrays", "logger": "none", "run_dir": str(tmp_path)})


# ---------------------------------------------------------------------------------------------
# Streamed data: DataLoader workers, the same global batches as in memory


class Samples(torch.utils.data.Dataset):
    """A plain map-style torch Dataset: one (x, label) per index, as user code would write it."""

    def __init__(self, x, labels, nan_at=None, wide_at=None):
        self.x, self.labels, self.nan_at, self.wide_at = x, labels, nan_at, wide_at

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.x[i].clone()
        if i == self.nan_at:
            x[0] = float("nan")
        if i == self.wide_at:
            x = torch.cat([x, x[:1]])
        return x, int(self.labels[i])


def small_cfg(run_dir, **extra):
    cfg = {"model": {"dims": [64, 16, 16, 16, 10]}, "logger": {"name": "none", "plots": False}, "run_dir": str(run_dir),
           "trainer": {"max_steps": 8, "eval_every": 8, "log_every": 4, "ckpt_every": 8, "dtype": "float64",
                       "progress": "off", "batch_size": 32}, "pc": {"T": 4}, "data": {"num_workers": 2}}
    for k, v in extra.items():
        cfg.setdefault(k, {}).update(v)
    return cfg


SMALL_CLI = ["model.dims=[64,16,16,16,10]", "trainer.max_steps=8", "trainer.eval_every=8", "trainer.log_every=4",
             "trainer.ckpt_every=8", "trainer.dtype=float64", "trainer.batch_size=32", "pc.T=4", "logger=none",
             "logger.plots=false", "trainer.progress=off"]


def digits_dataset():
    return load_digits().flat()


@pytest.fixture(scope="module")
def in_memory(tmp_path_factory):
    """The reference: small_cfg on the digits in memory, one process. Returns (run directory, result)."""
    run_dir = tmp_path_factory.mktemp("memory")
    return run_dir, pcdist.train(small_cfg(run_dir), data=digits_dataset())


@pytest.fixture(scope="module")
def npy_folder(tmp_path_factory):
    """The digits as a folder of x_train.npy, y_train.npy, x_val.npy, y_val.npy."""
    folder = tmp_path_factory.mktemp("npy")
    d = load_digits().flat()
    for k in ("x_train", "y_train", "x_val", "y_val"):
        np.save(folder / f"{k}.npy", getattr(d, k).numpy())
    return folder


def assert_same_weights(a: Path, b: Path, atol=0.0):
    wa, wb = layer_state(a / "checkpoints/step-00000008"), layer_state(b / "checkpoints/step-00000008")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0, msg=k)


def test_streamed_torch_datasets_train_exactly_as_in_memory(in_memory, tmp_path):
    """pcdist.train(cfg, data=StreamedData(...)) with 2 real DataLoader workers takes the same global batches
    as the in-memory Dataset: the same weights (float64) and the same validation accuracy."""
    ds = digits_dataset()
    data = StreamedData(Samples(ds.x_train, ds.y_train), Samples(ds.x_val, ds.y_val), 10)
    streamed = pcdist.train(small_cfg(tmp_path), data=data)
    assert streamed["step"] == in_memory[1]["step"] == 8
    assert streamed["val/accuracy"] == in_memory[1]["val/accuracy"]
    assert_same_weights(in_memory[0], tmp_path)
    assert "name: python" in (tmp_path / "config.yaml").read_text(), "the data came from Python"


def test_an_npy_folder_is_memory_mapped_and_streamed_like_memory(in_memory, npy_folder, tmp_path):
    """data=arrays on a folder of .npy files (memory-mapped, 2 workers) trains exactly as the same data in memory."""
    assert isinstance(load_arrays(str(npy_folder)), StreamedData)
    pcdist.train(small_cfg(tmp_path, data={"name": "arrays", "path": str(npy_folder)}))
    assert_same_weights(in_memory[0], tmp_path)


def test_a_streamed_run_leaves_no_worker_process_behind(npy_folder, tmp_path):
    """The DataLoader workers (training's, and validation's, kept between evaluations) stop when pcdist.train
    returns, and when a bad sample stops it: none outlives the run (left to the garbage collector, they lived on
    and stalled a later collection by seconds per worker)."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    pcdist.train(small_cfg(tmp_path / "a", data={"name": "arrays", "path": str(npy_folder)}))
    assert set(multiprocessing.active_children()) <= before
    x, labels = torch.rand(64, 64), torch.arange(64) % 10
    data = StreamedData(Samples(x, labels, nan_at=40), Samples(x[:16], labels[:16]), 10)
    with pytest.raises(DataError, match="sample 40 holds NaN"):
        pcdist.train(small_cfg(tmp_path / "b", trainer={"batch_size": 16}), data=data)
    assert set(multiprocessing.active_children()) <= before


def test_a_bad_streamed_sample_is_one_line_naming_it(tmp_path):
    """A NaN met by a worker process is reported as one line naming the sample, not a worker traceback; met in
    the validation split after training, the run's last checkpoint is written first."""
    x, labels = torch.rand(64, 64), torch.arange(64) % 10
    data = StreamedData(Samples(x, labels, nan_at=5), Samples(x[:16], labels[:16]), 10)
    with pytest.raises(DataError) as info:
        pcdist.train(small_cfg(tmp_path / "run", trainer={"batch_size": 64}), data=data)
    assert str(info.value) == "StreamedData train sample 5 holds NaN or Inf"
    # a sample of another shape (torch.stack's traceback, from the worker, naming no sample)
    data = StreamedData(Samples(x, labels, wide_at=9), Samples(x[:16], labels[:16]), 10)
    with pytest.raises(DataError) as info:
        pcdist.train(small_cfg(tmp_path / "wide", trainer={"batch_size": 64}), data=data)
    assert str(info.value) == \
        "StreamedData train sample 9 has shape (65,), expected (64,) (the first training sample's)"
    # in the validation split, met at the end-of-run evaluation: one line too, and the trained steps are kept
    data = StreamedData(Samples(x, labels), Samples(x[:16], labels[:16], nan_at=7), 10)
    with pytest.raises(DataError) as info:
        pcdist.train(small_cfg(tmp_path / "val", trainer={"batch_size": 64}), data=data)
    assert str(info.value) == "StreamedData val sample 7 holds NaN or Inf"
    assert (tmp_path / "val" / "checkpoints" / "step-00000008").is_dir()
    # met at an evaluation that is not a logged step (3, logging every 2): that step is checked and checkpointed
    # too (data review: nothing was saved, and the directory refused to resume once the sample was mended)
    with pytest.raises(DataError, match="val sample 7 holds NaN"):
        pcdist.train(small_cfg(tmp_path / "mid", trainer={"batch_size": 64, "eval_every": 3, "log_every": 2}),
                     data=data)
    assert [p.name for p in (tmp_path / "mid" / "checkpoints").glob("step-*")] == ["step-00000003"]
    mended = StreamedData(Samples(x, labels), Samples(x[:16], labels[:16]), 10)
    pcdist.train({"run_dir": str(tmp_path / "mid")}, data=mended)
    assert pcdist.load(tmp_path / "mid").step == 8


def _meets_a_bad_validation_sample(rank, world, run_dir):
    x, labels = torch.rand(64, 64), torch.arange(64) % 10
    data = StreamedData(Samples(x, labels), Samples(x[:16], labels[:16], nan_at=7), 10)
    cfg = small_cfg(run_dir, trainer={"batch_size": 64}, data={"num_workers": 0})
    cfg["parallel"] = {"data": 2, "timeout_s": 60}
    try:
        pcdist.train(cfg, data=data)
    except DataError as e:
        Path(run_dir, f"said-{rank}").write_text(str(e))


def test_a_bad_validation_sample_met_by_one_data_rank_stops_both_after_the_checkpoint(tmp_path):
    """Two data ranks: validation sample 7 (NaN) is in rank 0's share only. Both stop at that chunk together,
    the step's checkpoint written first, rank 0 naming the sample and rank 1 naming rank 0 and the sample (rank
    0 alone went on to checkpoint while rank 1 waited in the metrics reduce: both ended in PeerErrors after the
    timeout, the checkpoint never published and the sample named nowhere)."""
    from spawn import run

    run_dir = tmp_path / "run"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        run(_meets_a_bad_validation_sample, 2, str(run_dir), timeout=240)
    said = "StreamedData val sample 7 holds NaN or Inf"
    assert (run_dir / "said-0").read_text() == said
    assert (run_dir / "said-1").read_text() == f"rank 0 met a bad validation sample: {said}"
    assert (run_dir / "checkpoints" / "step-00000008" / "manifest.json").is_file()


def test_a_bad_sample_in_an_npy_folder_names_the_file(npy_folder, tmp_path):
    """A NaN met as a folder's x_train.npy is streamed is one line naming the folder, the file and the sample, also
    through data.signal=true (which wraps the arrays to add a channel)."""
    folder = tmp_path / "nan"
    folder.mkdir()
    for k in ("x_train", "y_train", "x_val", "y_val"):
        a = np.load(npy_folder / f"{k}.npy")
        if k == "x_train":
            a[5, 3] = np.nan
        np.save(folder / f"{k}.npy", a)
    for signal in (False, True):
        with pytest.raises(DataError) as info:
            pcdist.train(small_cfg(tmp_path / f"run{signal}", data={"name": "arrays", "path": str(folder),
                                                                    "signal": signal}))
        assert str(info.value) == f"data.path={folder}: x_train sample 5 holds NaN or Inf"


def test_a_dataloader_is_refused_with_the_reason():
    loader = torch.utils.data.DataLoader(Samples(torch.rand(8, 4), torch.zeros(8)))
    with pytest.raises(DataError, match=r"got a DataLoader: pass its .dataset; pcdist builds the loader so that "
                                        r"every rank takes its shard of the same global batch"):
        StreamedData(loader, loader, 2)


class CountedSamples(Samples):
    """Samples that count how often each index is read (num_workers=0: read in this process)."""

    def __init__(self, x, labels):
        super().__init__(x, labels)
        self.reads = [0] * len(labels)

    def __getitem__(self, i):
        self.reads[i] += 1
        return super().__getitem__(i)


def test_each_evaluation_of_streamed_data_reads_every_validation_sample_once(tmp_path):
    """A supervised run evaluated twice reads each validation sample exactly twice: nothing beyond what
    validation uses (the pictures' first chunk, which supervised runs never draw, was read at every evaluation)."""
    ds = digits_dataset()
    val = CountedSamples(ds.x_val, ds.y_val)
    cfg = small_cfg(tmp_path, trainer={"eval_every": 4}, data={"num_workers": 0}, logger={"plots": False})
    result = pcdist.train(cfg, data=StreamedData(Samples(ds.x_train, ds.y_train), val, 10))
    evaluations = sum("val/accuracy" in row for row in read_metrics(tmp_path / "metrics.jsonl"))
    assert result["step"] == 8 and evaluations == 2
    assert set(val.reads) == {evaluations}, sorted(set(val.reads))


def test_every_data_rank_cuts_its_validation_share_into_as_many_chunks():
    """Each validation chunk's inference may hold collectives of every rank (the adaptive solver's error norm per
    step): every data rank must cut its share into as many chunks (2049 rows on two ranks at 1024 gave 2 and 1,
    and the ranks waited on each other until the timeout). The chunks cover the share in order, none empty
    where every rank has rows, none longer than the size by more than the one row the shares differ by."""
    from pcdist.service.loader import val_split

    for n in (1, 2, 3, 7, 64, 1023, 1024, 1025, 2047, 2048, 2049, 4097):
        for data in (1, 2, 3, 4):
            for size in (1, 3, 1024):
                if n < data:
                    continue
                splits = [val_split(n, data, r, size) for r in range(data)]
                assert len({len(chunks) for chunks in splits}) == 1, (n, data, size)
                assert torch.equal(torch.cat([c for chunks in splits for c in chunks]), torch.arange(n))
                assert all(0 < len(c) <= size + 1 for chunks in splits for c in chunks), (n, data, size)


def test_streamed_folder_on_three_layer_ranks_under_torchrun_equals_one_process(in_memory, npy_folder, tmp_path):
    """The real torchrun, three layer slices (first, middle, last) each streaming an .npy folder through a
    DataLoader worker: every slice agrees on every batch, so the weights equal one in-memory process to 1e-9
    (float64) and so does the validation accuracy."""
    torchrun(3, "data=arrays", f"data.path={npy_folder}", "data.num_workers=1", "parallel.layer=3", *SMALL_CLI,
             f"hydra.run.dir={tmp_path}")
    assert len(list((tmp_path / "checkpoints/step-00000008").glob("layers-*.pt"))) == 3
    assert_same_weights(in_memory[0], tmp_path, atol=1e-9)
    val = [r["val/accuracy"] for r in read_metrics(tmp_path / "metrics.jsonl") if "val/accuracy" in r]
    assert val[-1] == in_memory[1]["val/accuracy"]


class Items(torch.utils.data.Dataset):
    """A map-style Dataset that returns whatever ``item(i)`` gives (the shapes users' datasets come in)."""

    def __init__(self, n, item):
        self.n, self.item = n, item

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.item(i)


def test_streamed_items_that_are_not_x_and_a_class_id_are_one_line_naming_the_sample(tmp_path):
    """A float label was truncated (2.9999998 trained as class 2: a fifth of the digits shifted), dicts, 1-tuples
    (unlabelled data) and one-hot labels ended in tracebacks (data review): each is one DataError naming the sample."""
    x = torch.rand(64)
    cases = [(lambda i: (x, 2.9999998), r"StreamedData train sample \d+ has label 2.9999998 \(torch.float64\); "
                                        r"expected an integer class id$"),
             (lambda i: {"x": x, "y": 1}, r"StreamedData train sample 0 is a dict; a StreamedData dataset returns "
                                          r"\(x, label\) pairs"),
             (lambda i: (x,), r"StreamedData train sample 0 is a tuple of 1; a StreamedData dataset returns \(x, "
                              r"label\) pairs, label an integer class id \(unlabelled data, pc.mode=unsupervised"),
             (lambda i: (x, torch.eye(10)[i % 10]), r"StreamedData train sample \d+ has a label of shape \[10\]; "
                                                   r"expected an integer class id \(one-hot: its argmax\)$")]
    for item, message in cases:
        with pytest.raises(DataError) as info:
            pcdist.train(small_cfg(tmp_path / "run", data={"num_workers": 0}),
                         data=StreamedData(Items(64, item), Items(16, lambda i: (x, 0)), 10))
        assert re.match(message, str(info.value)), str(info.value)
        assert not (tmp_path / "run" / "checkpoints").exists()


def test_damaged_or_misnamed_files_and_python_datasets_are_one_line(tmp_path):
    """A flipped byte in an .npz member, a cut .gz, an .npz saved as x_train.npy: tracebacks before (data review).
    A Dataset's class count may be a numpy integer (y.max() + 1); a Dataset without a validation split is named."""
    good = tmp_path / "good.npz"
    np.savez(good, x_train=np.arange(4000, dtype=np.float32).reshape(1000, 4), y_train=np.zeros(1000, np.int64),
             x_val=X, y_val=Y)
    raw = bytearray(good.read_bytes())
    raw[2000] ^= 0xFF  # inside x_train's data: the zip's CRC no longer matches
    (tmp_path / "flipped.npz").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=rf"^data.path={tmp_path}/flipped.npz: damaged \(BadZipFile: Bad CRC-32"):
        load_arrays(str(tmp_path / "flipped.npz"))
    folder = tmp_path / "folder"
    folder.mkdir()
    for k in ("x_train", "y_train", "x_val", "y_val"):
        np.save(folder / f"{k}.npy", X if k.startswith("x") else Y)
    (folder / "x_train.npy").write_bytes(good.read_bytes())
    with pytest.raises(DataError, match=r"x_train.npy is an .npz archive, not a .npy file"):
        load_arrays(str(folder))
    from pcdist.service.data import read_idx

    (tmp_path / "cut").write_bytes(gzip.compress(np.random.default_rng(0).bytes(5000))[:2000])
    with pytest.raises(DataError, match=r"cut: not a complete gzip file \(.*an interrupted download\?\)$"):
        read_idx(tmp_path / "cut", 2049)
    d = pcdist.data.load_digits()
    prepared = pcdist.service.data.prepared(pcdist.data.Dataset(d.x_train, d.y_train, d.x_val, d.y_val,
                                                                num_classes=np.int64(10)))
    assert prepared.num_classes == 10 and type(prepared.num_classes) is int
    with pytest.raises(DataError, match=r"a Dataset needs x_train, y_train, x_val and y_val \(got none for x_val, "
                                        r"y_val; a validation split is needed"):
        pcdist.service.data.prepared(pcdist.data.Dataset(d.x_train, d.y_train, None, None, num_classes=10))
