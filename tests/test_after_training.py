"""After training (issue 23): load a run back, evaluate, predict, export; the user's own modules through
the service; to_layers / to_sequential give back the user's structure; the backprop twin.

Every test runs the real parts: real torchrun for the layer-parallel run, the commands' own main (in a real
subprocess where the exit status, the current folder or the command's name matter), a subprocess that cannot
import pcdist for the exported program.
"""

import contextlib
import csv
import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch import nn

import pcdist
from pcdist.service.data import load_dataset
from pcdist.service.metrics import read_metrics
from spawn import run as spawn_run

ROOT = Path(__file__).resolve().parents[1]
SHORT = {"trainer": {"max_steps": 40, "eval_every": 20, "log_every": 10, "ckpt_every": 20, "progress": "off"},
         "logger": "none", "logger.plots": False}


def cli(*args, cwd=None, check=True) -> subprocess.CompletedProcess:
    """``python -m pcdist <args>``: a process of its own where ``cwd`` is given (what the current folder holds
    matters: a stranger's run folder, --trust-code), else the command's own main in this process (the files
    written and the lines printed are the command's; test_errors_point_to_the_help_... checks the exit status
    and the one line of a process)."""
    if cwd is not None:
        out = subprocess.run([sys.executable, "-m", "pcdist", *map(str, args)], cwd=cwd, capture_output=True,
                             text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    else:
        from pcdist.service.commands import main as command

        stdout, stderr, path = io.StringIO(), io.StringIO(), list(sys.path)
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                status = command(list(map(str, args)))
        finally:
            sys.path[:] = path  # the commands take the current folder off sys.path
        out = subprocess.CompletedProcess(args, status, stdout.getvalue(), stderr.getvalue())
    if check:
        assert out.returncode == 0, f"{args}: {out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


def logged_accuracy(run_dir) -> float:
    return [r["val/accuracy"] for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "val/accuracy" in r][-1]


def held_out_accuracy(run) -> float:
    """Accuracy of a loaded run on the raw digits validation split (the test loads the data, load does not)."""
    ds = load_dataset("digits")
    return float((run.predict(ds.x_val).argmax(1) == ds.y_val).double().mean())


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """One small trained run with data.normalize=true (its statistics must travel with the run)."""
    run_dir = tmp_path_factory.mktemp("after") / "run"
    result = pcdist.train({**SHORT, "run_dir": str(run_dir), "data": {"normalize": True}})
    return run_dir, result


# -- load ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("normalize", [True, False])
def test_load_a_torchrun_layer_parallel_run_into_one_process_without_the_data(tmp_path, normalize):
    """A run written by 2 layer ranks (each checkpointing its own slice) comes back whole in one
    process, built from what the run recorded, and reproduces the logged validation accuracy; with
    data.normalize=true only the saved statistics can prepare the inputs as in training."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
           "parallel.layer=2", "trainer.max_steps=30", "trainer.eval_every=15", "trainer.ckpt_every=15",
           "logger=none", "logger.plots=false", "trainer.progress=off", f"data.normalize={str(normalize).lower()}",
           f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-4000:]
    assert len(list((run_dir / "checkpoints" / "step-00000030").glob("layers-*.pt"))) == 2, "one file per layer slice"
    run = pcdist.load(run_dir)
    assert run.network.owns_all and run.step == 30 and run.config.parallel.layer == 2
    assert (run.inputs.mean is not None) == normalize
    assert held_out_accuracy(run) == logged_accuracy(run_dir)
    assert [r["step"] for r in run.metrics if "val/accuracy" in r] == [15, 30]


def test_load_picks_last_best_or_a_step_and_names_bad_requests(digits_run):
    run_dir, result = digits_run
    assert pcdist.load(run_dir).step == 40 and pcdist.load(run_dir, 20).step == 20
    acc = {r["step"]: r["val/accuracy"] for r in read_metrics(run_dir / "metrics.jsonl") if "val/accuracy" in r}
    assert pcdist.load(run_dir, "best").step == max(acc, key=lambda s: (acc[s], s))
    with pytest.raises(pcdist.RunError, match="no checkpoint at step 7 .kept: steps 20, 40"):
        pcdist.load(run_dir, 7)
    for bad in (20.7, True, "2x", 10**400):  # (20.7 loaded step 20)
        with pytest.raises(pcdist.RunError, match=r"^checkpoint=.*: use 'last', 'best' or a step number$"):
            pcdist.load(run_dir, bad)
    assert pcdist.load(run_dir, "20").step == pcdist.load(run_dir, 20.0).step == 20
    with pytest.raises(pcdist.RunError, match="not a pcdist run directory"):
        pcdist.load(run_dir.parent)


def test_the_best_checkpoint_damaged_gives_the_next_best_with_a_warning(digits_run, tmp_path):
    """checkpoint="best" where the best-scoring kept checkpoint is damaged: the next best valid one, with a
    warning naming the damaged one (it raised); every scored one damaged is one line."""
    run_dir, _ = digits_run
    copy = shutil.copytree(run_dir, tmp_path / "copy")
    acc = {r["step"]: r["val/accuracy"] for r in read_metrics(copy / "metrics.jsonl") if "val/accuracy" in r}
    order = sorted((s for s in acc if (copy / "checkpoints" / f"step-{s:08d}").is_dir()),
                   key=lambda s: (acc[s], s), reverse=True)
    best = copy / "checkpoints" / f"step-{order[0]:08d}"
    (best / "meta.pt").write_bytes(b"damaged")
    with pytest.warns(UserWarning, match=f"skipping damaged checkpoint {re.escape(str(best))}: "):
        assert pcdist.load(copy, "best").step == order[1]
    (copy / "checkpoints" / f"step-{order[1]:08d}" / "meta.pt").write_bytes(b"damaged")
    with pytest.warns(UserWarning), pytest.raises(pcdist.RunError, match="every checkpoint with a logged "
                                                                         "val/accuracy is damaged"):
        pcdist.load(copy, "best")
    # a logged accuracy that is not a number (a hand-edited row) is no score (a TypeError traceback)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r["step"] == order[0] and "val/accuracy" in r:
            r["val/accuracy"] = "high"
    shutil.copytree(run_dir / "checkpoints", copy / "checkpoints", dirs_exist_ok=True)
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert pcdist.load(copy, "best").step == order[1]


def test_a_run_copied_without_its_x_lr_json_keeps_the_value_step_it_chose(digits_run, tmp_path):
    """pc.x_lr=auto's choice lived only in x_lr.json: a copy without it was loaded and evaluated at 0.1 (an energy
    after T 1.15 against the run's 1.35), without a word. The checkpoint records the step; a damaged x_lr.json
    where no checkpoint does is one line naming it."""
    from pcdist.service.autostep import saved_x_lr

    run_dir, _ = digits_run
    chosen = json.loads((run_dir / "x_lr.json").read_text())["x_lr"]
    copy = shutil.copytree(run_dir, tmp_path / "copy")
    (copy / "x_lr.json").unlink()
    assert chosen != 0.1 and pcdist.load(copy).config.pc.x_lr == pcdist.load(run_dir).config.pc.x_lr == chosen
    assert pcdist.evaluate(copy, write=False)["energy"] == pcdist.evaluate(run_dir, write=False)["energy"]
    (copy / "x_lr.json").write_text("")
    with pytest.raises(pcdist.ConfigError, match=rf"^{re.escape(str(copy / 'x_lr.json'))} is damaged "
                                                 r"\(JSONDecodeError: .*\); it holds the value step pc.x_lr=auto"):
        saved_x_lr(copy)
    numbered = tmp_path / "numbered"  # a step set as a number is the config's: a resume with auto chooses one
    pcdist.train({**SHORT, "run_dir": str(numbered), "pc": {"x_lr": 0.003}, "trainer": {**SHORT["trainer"],
                                                                                        "max_steps": 4}})
    pcdist.train({**SHORT, "run_dir": str(numbered), "pc": {"x_lr": "auto"}, "trainer": {**SHORT["trainer"],
                                                                                         "max_steps": 8}})
    record = json.loads((numbered / "x_lr.json").read_text())
    assert pcdist.load(numbered).config.pc.x_lr == record["x_lr"] != 0.003 and record["step"] == 4
    assert "(at the weights of step 4, this run's now)" in (numbered / "train.log").read_text(), \
        "chosen at trained weights, not at the initial ones the docs describe: said"
    # trained on with a number, then auto again: chosen at the weights of then (it took x_lr.json's of step 4)
    pcdist.train({**SHORT, "run_dir": str(numbered), "pc": {"x_lr": 0.003}, "trainer": {**SHORT["trainer"],
                                                                                        "max_steps": 12}})
    pcdist.train({**SHORT, "run_dir": str(numbered), "pc": {"x_lr": "auto"}, "trainer": {**SHORT["trainer"],
                                                                                         "max_steps": 16}})
    assert json.loads((numbered / "x_lr.json").read_text())["step"] == 12
    assert "(at the weights of step 12, this run's now)" in (numbered / "train.log").read_text()


def test_evaluate_on_other_data_than_the_runs_is_refused(tmp_path):
    """evaluate data.path= is for data that moved: a file of other data (another split, other labels) is refused
    in one line and nothing is written (it scored the other file's split and overwrote eval.json); the run's own
    file moved evaluates as before."""
    d = load_dataset("digits")
    arrays = {"x_train": d.x_train.numpy(), "y_train": d.y_train.numpy(), "x_val": d.x_val.numpy(),
              "y_val": d.y_val.numpy()}
    np.savez(tmp_path / "a.npz", **arrays)
    np.savez(tmp_path / "b.npz", **{**arrays, "x_val": arrays["x_val"][:50], "y_val": arrays["y_val"][:50]})
    shutil.copy(tmp_path / "a.npz", tmp_path / "moved.npz")
    run_dir = tmp_path / "run"
    pcdist.train({**SHORT, "run_dir": str(run_dir), "data": {"name": "arrays", "path": str(tmp_path / "a.npz")}})
    own = pcdist.evaluate(run_dir)
    before = (run_dir / "eval.json").read_text()
    with pytest.raises(pcdist.RunError, match=rf"^{re.escape(str(run_dir))} was trained on other data than these "
                                              rf"\(validation samples {len(d.x_val)} -> 50; the labels differ\)"):
        pcdist.evaluate(run_dir, [f"data.path={tmp_path / 'b.npz'}"])
    assert (run_dir / "eval.json").read_text() == before
    moved = pcdist.evaluate(run_dir, [f"data.path={tmp_path / 'moved.npz'}"], write=False)
    assert moved["accuracy"] == own["accuracy"]


def test_a_damaged_model_json_is_one_line_naming_it(tmp_path):
    """model.json damaged or not pcdist's (layers, inputs or structure of another type, an energy pcdist does not
    know, a size that is not a number, normalisation of another length or a std of 0, inputs that are not what the
    first layer reads): one RunError naming the file, never a traceback from deep in the rebuild, nor an
    evaluation of 0.0 and an exported program of NaN (a std of 0)."""
    run_dir = tmp_path / "run"
    pcdist.train({**SHORT, "run_dir": str(run_dir), "data": {"normalize": True}})
    good = json.loads((run_dir / "model.json").read_text())
    damages = {"layers": lambda m: m.update(layers=[1, 2, 3]), "inputs": lambda m: m.update(inputs="x"),
               "structure": lambda m: m.update(structure=[1]), "energy": lambda m: m.update(energy="zzz"),
               "size": lambda m: m["layers"][0]["fields"].update(in_features="abc"),
               "mean": lambda m: m["inputs"]["normalize"].update(mean=[0.0] * 7),
               "std": lambda m: m["inputs"]["normalize"].update(std=[0.0] * len(m["inputs"]["normalize"]["std"])),
               "classes": lambda m: m["inputs"].update(num_classes="ten"),
               "shape": lambda m: m["inputs"].update(sample_shape=[32]), "list": lambda m: m.clear()}
    for name, damage in damages.items():
        model = json.loads(json.dumps(good))
        damage(model)
        (run_dir / "model.json").write_text(json.dumps(model if name != "list" else [1]))
        with pytest.raises(pcdist.RunError, match=rf"^{re.escape(str(run_dir / 'model.json'))} is damaged or was "
                                                  r"not written by pcdist \("):
            pcdist.load(run_dir)
    (run_dir / "model.json").write_text(json.dumps(good))
    assert pcdist.load(run_dir).step == SHORT["trainer"]["max_steps"]


def test_a_run_whose_model_json_was_lost_takes_its_own_inputs_or_names_the_file(digits_run, tmp_path):
    """model.json lost from a copy: the run's own images were refused ("this run takes [N, 64]", the first layer's
    shape, as for a run from before the file), and a normalised run's refusal said the run predated the file. The
    checkpoint's record of its data gives the samples' shape; the normalisation is only in the file."""
    run_dir = tmp_path / "run"
    pcdist.train({**SHORT, "run_dir": str(run_dir), "trainer": {**SHORT["trainer"], "max_steps": 4}})
    copy = shutil.copytree(run_dir, tmp_path / "copy")
    (copy / "model.json").unlink()
    x = load_dataset("digits").x_val[:50]
    assert torch.equal(pcdist.load(copy).predict(x), pcdist.load(run_dir).predict(x))
    assert pcdist.evaluate(copy, write=False)["accuracy"] == pcdist.evaluate(run_dir, write=False)["accuracy"]
    normalised = shutil.copytree(digits_run[0], tmp_path / "normalised")
    (normalised / "model.json").unlink()
    with pytest.raises(pcdist.RunError, match=rf"^{re.escape(str(normalised / 'model.json'))} is missing: it holds "
                                              r"the input normalisation this run was trained with"):
        pcdist.load(normalised)


def test_train_returns_the_trained_network(digits_run):
    """result.network is the network the run ended with: the same weights the last checkpoint holds."""
    run_dir, result = digits_run
    loaded = pcdist.load(run_dir).network
    for a, b in zip(result.network.parameters(), loaded.parameters()):
        assert torch.equal(a, b)
    assert result["val/accuracy"] == logged_accuracy(run_dir)


def test_network_call_takes_what_training_takes(digits_run):
    """Images into an MLP are flattened as in training, float64 is cast, integers are refused."""
    net = pcdist.load(digits_run[0]).network
    x = torch.randn(5, 1, 8, 8, dtype=torch.float64)
    assert torch.equal(net(x), net(x.float().flatten(1)))
    with pytest.raises(ValueError, match="float inputs, got torch.uint8"):
        net(torch.zeros(5, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"takes inputs \[batch, 64\], got \[5, 65\]"):
        net(torch.zeros(5, 65))


# -- the command line: evaluate, predict, export ------------------------------------------------------

def test_evaluate_writes_eval_json_and_a_confusion_matrix(digits_run):
    run_dir, _ = digits_run
    out = cli("evaluate", run_dir, "pc.T=5")
    assert "val accuracy" in out.stdout
    ev = json.loads((run_dir / "eval.json").read_text())
    assert ev["accuracy"] == pytest.approx(logged_accuracy(run_dir), abs=1e-12)
    conf = np.array(ev["confusion"])
    assert conf.sum() == ev["samples"] == 360 and np.trace(conf) / conf.sum() == pytest.approx(ev["accuracy"])
    per_class = np.diag(conf) / conf.sum(1)
    assert np.allclose(per_class, ev["per_class_accuracy"])
    assert ev["overrides"] == ["pc.T=5"]
    assert ev["T"] == 5 and math.isfinite(ev["energy"]) and ev["energy"] <= ev["loss"] + 1e-6, \
        "inference lowers the label-clamped energy below its feed-forward value"
    assert (run_dir / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluate_and_predict_run_where_device_says(digits_run, tmp_path):
    """--device auto takes a GPU where there is one (here the CPU: the same figures); a device this machine lacks is
    one line naming it, as pcdist.load(device=...) says it, before anything is read or written."""
    run_dir, _ = digits_run
    auto = cli("evaluate", run_dir, "pc.T=5", "--device", "auto")
    assert json.loads((run_dir / "eval.json").read_text())["accuracy"] == pytest.approx(logged_accuracy(run_dir),
                                                                                        abs=1e-12), auto.stdout
    with pytest.raises(pcdist.RunError, match=r"^device 'mps': pcdist runs on cpu or cuda"):  # (a traceback)
        pcdist.load(run_dir, device="mps")
    from pcdist.service.evaluate import held_out_test

    run, data = pcdist.load(run_dir), load_dataset("digits")
    with pytest.raises(pcdist.RunError, match=r"^the labels go from 10 to 19, but the run's network has 10 classes "
                                              r"\(0 to 9\): not the data it was trained on$"):  # (a reshape's error)
        held_out_test(run, run.config, data.x_val, data.y_val + 10, "supervised")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine has the device the refusals below ask for")
    for args in (("evaluate", run_dir), ("predict", run_dir, tmp_path / "x.npz", "--out", tmp_path / "p.npz")):
        out = cli(*args, "--device", "cuda", check=False)
        assert out.returncode == 2 and out.stderr == "error: device 'cuda': this machine has no CUDA device; use cpu " \
                                                      "(or auto)\n", out.stderr
    with pytest.raises(pcdist.RunError, match="device 'gpu' is not a device"):
        pcdist.load(run_dir, device="gpu")
    assert not (tmp_path / "p.npz").exists()


def test_predict_applies_the_saved_preprocessing(digits_run, tmp_path):
    run_dir, _ = digits_run
    ds = load_dataset("digits")
    np.savez(tmp_path / "inputs.npz", x=ds.x_val.numpy())
    cli("predict", run_dir, tmp_path / "inputs.npz", "--out", tmp_path / "pred.npz")
    pred = np.load(tmp_path / "pred.npz")
    assert (pred["labels"] == ds.y_val.numpy()).mean() == pytest.approx(logged_accuracy(run_dir), abs=1e-12)
    assert np.allclose(pred["probabilities"].sum(1), 1.0, atol=1e-5)


def test_predict_takes_the_held_out_inputs_of_a_data_file_or_the_array_named(digits_run, tmp_path):
    """The .npz a run trained from (x_train, y_train, x_val, y_val) has no x: predict takes its held-out inputs,
    x_val (or x_test), and says which; --key names any array; a file it cannot choose from is one line."""
    run_dir, _ = digits_run
    ds = load_dataset("digits")
    arrays = {"x_train": ds.x_train.numpy(), "y_train": ds.y_train.numpy(), "x_val": ds.x_val.numpy(),
              "y_val": ds.y_val.numpy()}
    np.savez(tmp_path / "arrays.npz", **arrays)
    out = cli("predict", run_dir, tmp_path / "arrays.npz", "--out", tmp_path / "new" / "val")  # a folder made, the
    # name given .npz as numpy gives it, and said so (a missing folder was a traceback; "-> val" named no file)
    assert (f"{len(ds.x_val)} predictions of {tmp_path / 'arrays.npz'}'s x_val -> {tmp_path / 'new' / 'val.npz'} "
            f"(logits, labels, probabilities)") in out.stdout, out.stdout
    val = np.load(tmp_path / "new" / "val.npz")
    assert (val["labels"] == ds.y_val.numpy()).mean() == pytest.approx(logged_accuracy(run_dir), abs=1e-12)
    cli("predict", run_dir, tmp_path / "arrays.npz", "--key", "x_train", "--out", tmp_path / "train.npz")
    assert len(np.load(tmp_path / "train.npz")["labels"]) == len(ds.x_train)
    np.savez(tmp_path / "both.npz", x_val=arrays["x_val"], x_test=arrays["x_val"][:5])
    out = cli("predict", run_dir, tmp_path / "both.npz", "--out", tmp_path / "p.npz", check=False)
    assert out.returncode == 2 and out.stderr == (f"error: {tmp_path / 'both.npz'} holds arrays x_val, x_test; name "
                                                  f"the inputs with --key (e.g. --key x_test), or save them as x\n")
    out = cli("predict", run_dir, tmp_path / "both.npz", "--key", "x", "--out", tmp_path / "p.npz", check=False)
    assert out.returncode == 2 and "holds no array 'x' (it holds x_val, x_test)" in out.stderr
    assert not (tmp_path / "p.npz").exists()
    out = cli("predict", run_dir, run_dir / "config.yaml", "--out", tmp_path / "p.npz", check=False)  # not numpy's:
    assert out.returncode == 2 and out.stderr == (  # it said the file held pickled data, and how to load it unsafely
        f"error: {run_dir / 'config.yaml'} is not a numpy .npz / .npy file (predict reads those alone, and never "
        f"unpickles)\n"), out.stderr


NO_PCDIST = """
import sys
sys.modules["pcdist"] = None  # any import of pcdist now fails
try:
    import pcdist
    raise SystemExit("pcdist is importable")
except ImportError:
    pass
import numpy as np, torch
program = torch.export.load(sys.argv[1]).module()
x = torch.from_numpy(np.load(sys.argv[2]))
np.save(sys.argv[3], program(x).detach().numpy())
print("ran without pcdist:", "pcdist" in sys.modules and sys.modules["pcdist"] is not None)
"""


def test_exported_program_runs_without_pcdist_and_matches_the_network(digits_run, tmp_path):
    """The .pt2 is loaded and run by a process that cannot import pcdist; it applies the run's
    normalisation itself, so raw inputs give the network's logits (float32, 1e-6)."""
    run_dir, _ = digits_run
    out = cli("export", run_dir, tmp_path / "net.pt2")
    assert "a torch.export program (raw inputs float32 [N, 1, 8, 8] -> logits)" in out.stdout
    x = load_dataset("digits").x_val[:100]
    np.save(tmp_path / "x.npy", x.numpy())
    (tmp_path / "standalone.py").write_text(NO_PCDIST)
    got = subprocess.run([sys.executable, str(tmp_path / "standalone.py"), str(tmp_path / "net.pt2"),
                          str(tmp_path / "x.npy"), str(tmp_path / "y.npy")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    assert "ran without pcdist: False" in got.stdout
    want = pcdist.load(run_dir).predict(x)
    torch.testing.assert_close(torch.from_numpy(np.load(tmp_path / "y.npy")), want, rtol=1e-6, atol=1e-6)
    assert want.dtype == torch.float32


class Unexportable(nn.Module):
    """A layer whose forward reads a tensor's value into Python control flow: torch.export refuses it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 10)

    def forward(self, h):
        return self.lin(h) if float(h.sum()) != 1234.5 else self.lin(-h)


def test_export_falls_back_to_the_state_dict_and_names_the_layer(tmp_path, capfd):
    """A layer torch.export cannot trace: the weights are saved instead (tensors only), named as what they are (a
    .pt2 is torch.export's archive), keyed as the layers' own nn.Sequential (they load into the user's modules),
    and the note names the layer and why, without torch's tracing logs (80 lines of them came first)."""
    run_dir = tmp_path / "run"
    layers = lambda: [nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh()), Unexportable()]  # noqa: E731
    pcdist.train({**SHORT, "run_dir": str(run_dir), "trainer": {**SHORT["trainer"], "max_steps": 4}}, layers=layers)
    out = cli("export", run_dir, tmp_path / "net.pt2", check=False)  # only code rebuilds Unexportable
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "pcdist.load(run_dir, layers=...)" in out.stderr
    res = pcdist.export(run_dir, tmp_path / "net.pt2", layers=layers)
    assert res["format"] == "state_dict" and "layer 2 (Unexportable) cannot be exported" in res["note"]
    assert res["path"] == str(tmp_path / "net.state_dict.pt") and not (tmp_path / "net.pt2").exists()
    saved = torch.load(tmp_path / "net.state_dict.pt", weights_only=True)
    net = pcdist.load(run_dir, layers=layers).network
    mine = nn.Sequential(*layers())
    mine.load_state_dict(saved["state_dict"])  # the user's own modules take it as it is
    x = torch.rand(5, 1, 8, 8)
    torch.testing.assert_close(mine(x), net(x.flatten(1)) if net.node_shapes[0] == (64,) else net(x))
    capfd.readouterr()
    pcdist.export(run_dir, tmp_path / "again.pt2", layers=layers)
    assert capfd.readouterr().err == ""


# -- bad input: one line naming the problem -----------------------------------------------------------

def test_bad_input_is_one_line_naming_the_problem(digits_run, tmp_path):
    run_dir, _ = digits_run
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    other = tmp_path / "other"  # another architecture's checkpoint copied into a copy of this run
    pcdist.train({**SHORT, "run_dir": str(other), "model": {"dims": [64, 32, 32, 10]},
                  "trainer": {**SHORT["trainer"], "max_steps": 2, "ckpt_every": 2}})
    mixed = tmp_path / "mixed"
    shutil.copytree(run_dir, mixed)
    shutil.rmtree(mixed / "checkpoints")
    shutil.copytree(other / "checkpoints", mixed / "checkpoints")
    np.savez(tmp_path / "bad.npz", x=np.zeros((3, 7), np.float32))
    cases = {
        ("evaluate", tmp_path / "nowhere"): "does not exist",
        ("evaluate", run_dir / "config.yaml"): "is not a directory",
        ("evaluate", tmp_path): "is not a pcdist run directory",
        ("export", empty, tmp_path / "x.pt2"): "holds no checkpoint",
        ("predict", run_dir, tmp_path / "bad.npz", "--out", tmp_path / "p.npz"): "inputs have shape [3, 7], but "
                                                                                   "this run takes [N, 1, 8, 8]",
        ("evaluate", mixed): "was written by a different model",
        ("predict", run_dir, tmp_path, "--out", tmp_path / "p.npz"): f"{tmp_path} is a folder; predict reads an .npz "
                                                                     f"or .npy file",  # (it said: does not exist)
    }
    for args, says in cases.items():
        out = cli(*args, check=False)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1 and says in out.stderr, out.stderr
    run = pcdist.load(run_dir)  # what predict prepares: numbers that training would take, else one line
    nan = np.zeros((3, 64), np.float32)
    nan[2, 5] = np.nan
    for x, says in ((nan, "input 2 holds NaN or Inf"), (np.full((2, 64), "a"), "inputs have dtype <U1"),
                    (np.ones((2, 64), np.complex64), "inputs have dtype complex64")):
        with pytest.raises(pcdist.RunError, match=re.escape(says)):
            run.preprocess(x)


def test_errors_point_to_the_help_of_the_command_that_was_run(digits_run, tmp_path):
    """A mistyped key after `evaluate` gets the did-you-mean the training command gives, and every such line
    points to the --help of the command the user typed (python -m pcdist, pcdist-train, python train.py); so does
    a mistyped command. A key an evaluation cannot change (the model, the input preparation, the split) is refused,
    naming what it takes."""
    run_dir, _ = digits_run
    out = cli("evaluate", run_dir, "pc.TT=40", cwd=tmp_path, check=False)
    assert out.returncode == 2 and out.stderr == ("error: unknown config key pc.TT in override 'pc.TT=40'; did you "
                                                  "mean pc.T? (python -m pcdist --help lists every key)\n")
    out = cli("evalute", run_dir, cwd=tmp_path, check=False)  # a mistyped command: not an override without a value
    assert out.returncode == 2 and out.stderr == ("error: evalute: no such command; did you mean evaluate? (the "
                                                  "commands: evaluate, predict, export, compare; training takes "
                                                  "key=value overrides: python -m pcdist --help)\n"), out.stderr
    out = cli("evaluate", cwd=tmp_path, check=False)
    assert out.returncode == 2 and out.stderr.endswith("error: the following arguments are required: run_dir\n")
    for key in ("model.dims=[64,10]", "data.normalize=false", "model.energy=se", "data.val_fraction=0.5"):
        # keys an evaluation cannot change (they were accepted and did nothing, or model.energy half of something)
        with pytest.raises(pcdist.RunError, match=rf"^{re.escape(key)}: an evaluation takes pc.\* \(the inference\), "
                                                  rf"data.root and data.path"):
            pcdist.evaluate(run_dir, [key], write=False)
    for key, value in (("pc.mode=generative", "supervised"), ("pc.precision=[1,100]", "None"),
                       ("pc.prior_precision=1000", "1.0"), ("pc.latent_dim=3", "10"), ("pc.prior_mean=zero", "auto")):
        # pc.* keys that make the network: accepted and ignored (the numbers of the run's own), or a meaningless
        # test (an unsupervised latent read as class scores) written to eval.json
        with pytest.raises(pcdist.RunError, match=rf"^{re.escape(key)}: {key.split('=')[0]} is the run's own \(it "
                                                  rf"makes the network the checkpoint was trained as: "
                                                  rf"{key.split('=')[0]}={value}\); an evaluation takes the "
                                                  rf"inference's pc.\* keys"):
            pcdist.evaluate(run_dir, [key], write=False)
    assert pcdist.evaluate(run_dir, ["pc.mode=supervised", "pc.latent_dim=10"], write=False)["accuracy"] >= 0, \
        "the run's own values pass (a script passing its training overrides along)"
    # a number in exponent form, as training's command line takes it (YAML 1.1 read 1e-3 as a string: refused)
    exponent, decimal = (pcdist.evaluate(run_dir, over, write=False)
                         for over in (["pc.x_lr=1e-3", "pc.eval_tol=1e-4"], ["pc.x_lr=0.001", "pc.eval_tol=0.0001"]))
    assert exponent.pop("overrides") != decimal.pop("overrides") and exponent == decimal
    for command in ([sys.executable, "-m", "pcdist"], [str(Path(sys.executable).parent / "pcdist-train")],
                    [sys.executable, str(ROOT / "train.py")]):
        out = subprocess.run([*command, "pc.TT=40"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        shown = "python -m pcdist" if "-m" in command else ("pcdist-train" if len(command) == 1 else "python train.py")
        assert out.returncode == 2 and out.stderr == (f"error: unknown config key pc.TT; did you mean pc.T? ({shown} "
                                                      f"--help lists every key and group)\n"), out.stderr
    assert not list(tmp_path.iterdir()), "nothing left behind"


# -- the user's own modules --------------------------------------------------------------------------

class Block(nn.Module):
    """A user's own layer (the generic module kind): LayerNorm then a linear map, with a tanh."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, width)

    def forward(self, h):
        return torch.tanh(self.proj(self.norm(h)))


def make_layers():
    """The user's model, built deterministically (every rank builds the same initial weights)."""
    torch.manual_seed(0)
    return [nn.Sequential(OrderedDict(flat=nn.Flatten(), fc=nn.Linear(64, 32), act=nn.GELU())), Block(32),
            nn.Linear(32, 10)]


def _train_user_layers(rank, world, run_dir, stop_at, logger):
    cfg = {"trainer": {"max_steps": 20, "eval_every": 10, "log_every": 10, "ckpt_every": 10, "progress": "off",
                       "stop_at": stop_at}, "run_dir": run_dir, "parallel": {"layer": 2}, "logger": logger,
           "logger.plots": False, "pc": {"T": 5, "x_lr": 0.1}}  # see below
    pcdist.train(cfg, layers=make_layers)


def test_user_layers_through_the_service_layer_parallel_resumed_and_reloaded(tmp_path):
    """The user's modules (one a custom class) train on 2 layer ranks with wandb offline, stop at step 10
    and resume to 20, ending where an uninterrupted one-process run ends (1e-6, as test_service's resume
    across splits); pcdist.load rebuilds the exact modules from the recorded factory and reproduces the
    logged accuracy. (pc.x_lr 0.1, not auto's 0.005: at that step the lowest layer's update is orders of
    magnitude below backprop's, and AdamW scales the float32 round-off of the two splits' sums up past 1e-6
    within 20 steps.)"""
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    spawn_run(_train_user_layers, 2, str(resumed), 10, "wandb", timeout=300)
    assert [r["step"] for r in read_metrics(resumed / "metrics.jsonl") if "val/accuracy" in r] == [10]
    spawn_run(_train_user_layers, 2, str(resumed), None, "wandb", timeout=300)
    threads = torch.get_num_threads()
    try:  # one thread, as each spawned rank has
        pcdist.train({"trainer": {"max_steps": 20, "eval_every": 10, "log_every": 10, "ckpt_every": 10,
                                  "progress": "off", "threads": 1}, "run_dir": str(straight), "logger": "none",
                      "logger.plots": False, "pc": {"T": 5, "x_lr": 0.1}}, layers=make_layers)
    finally:
        torch.set_num_threads(threads)
    assert json.loads((resumed / "model.json").read_text())["factory"] == "test_after_training:make_layers"
    before = snapshot(resumed)  # a resume without the layers (the command line cannot pass them) says how to resume
    with pytest.raises(pcdist.ConfigError, match=rf"^{re.escape(str(resumed))} was trained on layers passed to "
                                                 rf"pcdist.train from Python; continue it there: pcdist.train\("):
        pcdist.train({"run_dir": str(resumed), "trainer": {"max_steps": 30}})
    assert snapshot(resumed) == before
    assert list((resumed / "wandb").glob("offline-run-*")), "wandb wrote its offline run"
    a, b = pcdist.load(resumed, trust_code=True), pcdist.load(straight, trust_code=True)
    for p, q in zip(a.network.parameters(), b.network.parameters()):  # as test_service's resume across splits
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg="resuming ends where the uninterrupted run ends")
    assert held_out_accuracy(a) == logged_accuracy(resumed)
    layers = a.network.to_layers()
    assert [type(m) for m in layers] == [type(m) for m in make_layers()]
    mine = nn.Sequential(*make_layers())
    mine.load_state_dict(nn.Sequential(*layers).state_dict())  # the user's own model takes the trained weights
    x = load_dataset("digits").x_val[:50]
    torch.testing.assert_close(mine(x), a.predict(x), rtol=1e-6, atol=1e-6)


def test_user_layers_without_a_factory_need_them_at_load(tmp_path):
    run_dir = tmp_path / "run"
    result = pcdist.train({**SHORT, "run_dir": str(run_dir), "trainer": {**SHORT["trainer"], "max_steps": 10}},
                          layers=make_layers())
    with pytest.raises(pcdist.RunError, match=r"layers \[2\] are the user's own modules"):
        pcdist.load(run_dir)
    run = pcdist.load(run_dir, layers=make_layers())
    assert held_out_accuracy(run) == logged_accuracy(run_dir) == result["val/accuracy"]
    with pytest.raises(pcdist.service.checkpoint.CheckpointError, match="holds 3 layers but 1 modules"):
        pcdist.load(run_dir, layers=[nn.Sequential(nn.Flatten(), nn.Linear(64, 10))])
    dense = [nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh())] + \
        [nn.Sequential(nn.Linear(32, 32), nn.Tanh())] + [nn.Linear(32, 10)]
    with pytest.raises(pcdist.service.checkpoint.CheckpointError, match="written by a different model"):
        pcdist.load(run_dir, layers=dense)


EVIL = """from pathlib import Path
Path(__file__).with_name("RAN").write_text("the run folder's code ran")
def layers():
    raise SystemExit(9)
"""
SHADOW = """from pathlib import Path
Path(__file__).with_name("SHADOWED").write_text(__name__)
raise SystemExit(7)
"""
"""A module named as one of pcdist's dependencies, lying in the folder one stands in."""


def snapshot(d: Path) -> dict:
    """Every file under ``d`` and its bytes; but for wandb's own debug logs (wandb/*/logs/), which wandb's
    service process, outliving the run by seconds, may still append its shutdown lines to."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and not p.relative_to(d).match("wandb/*/logs/*")}


def test_a_strangers_run_folder_never_runs_its_code(tmp_path):
    """model.json may name any "module:function" as the code that builds a run's layers. A run folder one
    was sent, naming "evil:layers" with an evil.py beside it and in the folder one stands in, must not get
    that code run by evaluate, predict, export or pcdist.load: each refuses in one line naming the factory
    and the opt-in, and nothing is imported or written. Passing the modules (layers=) needs no code of the
    folder; --trust-code is the explicit opt-in, and then the code runs, as asked. A yaml.py or numpy.py in
    the folder never stands in for the real package (`python -m` puts the current folder first on sys.path;
    pcdist takes it off before it imports anything, and --trust-code puts it last)."""
    shared = tmp_path / "shared"
    run_dir = shared / "run"
    pcdist.train({**SHORT, "run_dir": str(run_dir), "trainer": {**SHORT["trainer"], "max_steps": 10}},
                 layers=make_layers)
    model = json.loads((run_dir / "model.json").read_text())
    assert model["factory"] == "test_after_training:make_layers"
    model["factory"] = "evil:layers"
    (run_dir / "model.json").write_text(json.dumps(model))
    (shared / "evil.py").write_text(EVIL)
    (run_dir / "evil.py").write_text(EVIL)
    for name in ("yaml", "numpy"):
        (shared / f"{name}.py").write_text(SHADOW)
    np.savez(tmp_path / "x.npz", x=load_dataset("digits").x_val[:5].numpy())
    before = snapshot(shared)
    for args in (("evaluate", "run"), ("predict", "run", tmp_path / "x.npz", "--out", tmp_path / "p.npz"),
                 ("export", "run", tmp_path / "run.pt2")):
        out = cli(*args, cwd=shared, check=False)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, (args, out.stdout, out.stderr)
        assert "names 'evil:layers' to build them" in out.stderr and "--trust-code" in out.stderr, out.stderr
    with pytest.raises(pcdist.RunError, match=r"names 'evil:layers' .*pcdist.load\(run_dir, trust_code=True\)"):
        pcdist.load(run_dir)
    assert snapshot(shared) == before, "nothing ran, nothing was written"
    assert not (tmp_path / "p.npz").exists() and not (tmp_path / "run.pt2").exists()
    run = pcdist.load(run_dir, layers=make_layers())  # the modules passed in: no code of the folder
    assert held_out_accuracy(run) == logged_accuracy(run_dir)
    assert not (shared / "RAN").exists()
    out = cli("evaluate", "run", "--trust-code", cwd=shared, check=False)
    assert out.returncode == 9 and (shared / "RAN").is_file(), "--trust-code runs the named code, as asked"
    assert not (shared / "SHADOWED").exists(), "and no module of the folder stands in for a package"


# -- a run folder one was sent: what it holds is data ---------------------------------------------------

def _sent(run_dir: Path, to: Path) -> Path:
    """A copy of a trained run: a folder one was sent, to change as its sender could."""
    shutil.copytree(run_dir, to)
    return to


def _rewrite_meta(run_dir: Path, meta_bytes: bytes) -> Path:
    """The newest checkpoint's meta.pt replaced, and its digest in the manifest with it (a sender can)."""
    ck = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    (ck / "meta.pt").write_bytes(meta_bytes)
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["meta.pt"] = hashlib.sha256(meta_bytes).hexdigest()
    (ck / "manifest.json").write_text(json.dumps(manifest))
    return ck


class _System:
    """A pickle that calls os.system when it is loaded without weights_only."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_run_folder_with_links_out_of_it_is_never_written_through(digits_run, tmp_path):
    """A run folder one was sent may hold links to one's own files (eval.json -> ~/.bashrc, a hard link to it):
    evaluate and a resume would write through them. Each refuses in one line naming the link, and nothing
    changes, in the folder or behind the link; links below wandb/ are wandb's own. compare replaces a link
    where its picture goes instead of writing through it. Without the links, evaluate runs."""
    run = _sent(digits_run[0], tmp_path / "sent" / "run")
    for name in ("eval.json", "confusion.png"):  # written by an earlier evaluate of the module's run
        (run / name).unlink(missing_ok=True)
    mine = tmp_path / "mine.txt"
    mine.write_text("my own file\n")
    (run / "eval.json").symlink_to(mine)
    (run / "wandb").mkdir()
    (run / "wandb" / "debug.log").symlink_to(mine)  # wandb's own kind of link: not refused
    before = snapshot(run)
    out = cli("evaluate", run, check=False)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"holds links (eval.json -> {mine}): eval.json and confusion.png would write through" in out.stderr, \
        out.stderr
    with pytest.raises(pcdist.ConfigError, match="holds links .eval.json -> .*: a run continued there would write"):
        pcdist.train({"run_dir": str(run), "trainer.max_steps": 60, "logger.plots": False})
    assert snapshot(run) == before and mine.read_text() == "my own file\n", "nothing changed, nothing behind a link"
    (run / "eval.json").unlink()
    os.link(mine, run / "confusion.png")
    with pytest.raises(pcdist.RunError, match=r"\(confusion.png \(a hard link\)\)"):
        pcdist.evaluate(run)
    assert mine.read_text() == "my own file\n" and not (run / "eval.json").exists()
    (run / "confusion.png").unlink()
    assert pcdist.evaluate(run)["step"] == 40 and json.loads((run / "eval.json").read_text())["step"] == 40
    (run.parent / "compare.png").symlink_to(mine)
    cli("compare", run.parent)
    assert mine.read_text() == "my own file\n" and not (run.parent / "compare.png").is_symlink()
    assert (run.parent / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_a_resume_that_would_change_the_input_normalization_is_refused(digits_run, tmp_path):
    """model.json records the run's input normalization once, for every checkpoint it keeps: a resume with
    data.normalize changed would leave the earlier checkpoints read with the other inputs (evaluate --checkpoint
    of one of them gave 0.9333 where 0.9472 was logged). Refused in one line; nothing in the run changes."""
    run = _sent(digits_run[0], tmp_path / "run")
    before = snapshot(run)
    with pytest.raises(pcdist.ConfigError, match=r"cannot resume .* with changed data.normalize \(True -> False: it "
                                                 r"changes the inputs the model takes"):
        pcdist.train({"run_dir": str(run), "trainer": {"max_steps": 60}, "data": {"normalize": False}})
    assert snapshot(run) == before


def test_a_run_folder_that_is_itself_a_link_is_never_written_through(digits_run, tmp_path):
    """A folder given as the run (or a sweep's job folder one was sent) that is a link would take a run, eval.json
    and the pictures into the folder it leads to: refused in one line naming the link, nothing changed there."""
    elsewhere = _sent(digits_run[0], tmp_path / "elsewhere")
    (elsewhere / ".lock").write_text("pid 1 on a host since 2026-01-01 00:00:00\n")  # (its lock was removed)
    link = tmp_path / "sent"
    link.symlink_to(elsewhere)
    before = snapshot(elsewhere)
    with pytest.raises(pcdist.ConfigError, match=f"holds links .the directory itself -> {re.escape(str(elsewhere))}"
                                                 f".: a run continued there would write"):
        pcdist.train({"run_dir": str(link), "trainer.max_steps": 60, "logger.plots": False})
    with pytest.raises(pcdist.RunError, match="the directory itself -> "):
        pcdist.evaluate(link)
    assert snapshot(elsewhere) == before


def test_a_lock_file_that_is_not_pcdists_is_never_written_or_removed(tmp_path):
    """The run's .lock was opened, truncated and written before the link check, and removed on a refusal: a .lock
    hard-linked to a file elsewhere lost that file's text, and a project folder's own .lock (another tool's) was
    removed by a refusal saying "nothing was changed". Now each is refused in one line before anything is written."""
    precious = tmp_path / "precious.txt"
    precious.write_text("precious data\n")
    linked = tmp_path / "linked"
    linked.mkdir()
    os.link(precious, linked / ".lock")
    tool = tmp_path / "tool"
    tool.mkdir()
    (tool / ".lock").write_text("held by my-tool\n")
    for run, why in ((linked, "which is a hard link to another file"), (tool, "which pcdist did not write ('held by "
                                                                              "my-tool')")):
        with pytest.raises(pcdist.ConfigError, match=re.escape(f"{run} holds .lock, {why}: pcdist writes its lock "
                                                               f"there, so it uses no such directory; nothing was "
                                                               f"changed")):
            pcdist.train({"run_dir": str(run), **SHORT})
    assert precious.read_text() == "precious data\n" and (tool / ".lock").read_text() == "held by my-tool\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["linked", "precious.txt", "tool"]


def test_a_run_folder_holding_a_named_pipe_is_refused_not_waited_on(digits_run, tmp_path):
    """A train.log that is a named pipe (mkfifo needs no privilege; tar keeps them): a resume opened it to append
    and waited forever, silently, holding the directory. Refused in one line naming it; nothing changed."""
    run = _sent(digits_run[0], tmp_path / "run")
    (run / "train.log").unlink()
    os.mkfifo(run / "train.log")
    before = sorted(p.name for p in run.iterdir())
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run}", "trainer.max_steps=60",
                          "logger.plots=false"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))  # (an open that waits: a process with a deadline)
    assert out.returncode == 2 and out.stderr.strip() == (
        f"error: {run} holds train.log, which is not a regular file (a named pipe, a socket, a device): a run "
        f"continued there would write into it; nothing was changed: remove it, or choose another directory"), \
        out.stderr
    assert sorted(p.name for p in run.iterdir()) == before


def test_names_from_a_run_folder_reach_the_terminal_escaped(digits_run, tmp_path):
    """A file name in a folder one was sent is data: a control sequence in it (a window title set, the line
    erased, fake text) is printed escaped, in a refusal (a link's name) and in the warning about a damaged
    checkpoint (a name its manifest lists)."""
    run = _sent(digits_run[0], tmp_path / "run")
    evil = "\x1b]0;owned\x07\x1b[2K\rok: evaluation passed"
    fake = run / "checkpoints" / "step-99999999"
    fake.mkdir()
    (fake / "manifest.json").write_text(json.dumps({"files": {evil: "0" * 64}}))
    with pytest.warns(UserWarning, match=r"skipping damaged checkpoint .*step-99999999: \\x1b\]0;owned\\x07"
                                         r"\\x1b\[2K\\rok: evaluation passed listed in the manifest is missing"):
        pcdist.evaluate(run)
    shutil.rmtree(fake)
    (run / evil).symlink_to(tmp_path)
    out = cli("evaluate", run, check=False)
    assert out.returncode == 2 and "\x1b" not in out.stderr and "\r" not in out.stderr, repr(out.stderr)
    assert "holds links (\\x1b]0;owned\\x07\\x1b[2K\\rok: evaluation passed -> " in out.stderr, out.stderr
    (run / evil).unlink()  # an unlisted layer file's name, in an error line of the command (it came raw)
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    (newest / f"layers-{evil}.pt").write_bytes(b"x")
    out = cli("evaluate", run, "--checkpoint", str(int(newest.name[5:])), check=False)
    assert out.returncode == 2 and "\x1b" not in out.stderr and "\r" not in out.stderr, repr(out.stderr)
    assert "layers-\\x1b]0;owned\\x07" in out.stderr, out.stderr


def test_a_dollar_in_a_run_folders_names_is_drawn_as_written(digits_run, tmp_path):
    """Matplotlib reads $...$ as math: a run folder named math$\\bad{$ ended evaluate's confusion picture (after
    eval.json was written), and a setting of one job of a sweep ended compare's picture, in the parser's
    traceback. Drawn as written now."""
    run = _sent(digits_run[0], tmp_path / "math$\\bad{$")
    out = cli("evaluate", run, check=False)
    assert out.returncode == 0 and (run / "confusion.png").is_file(), out.stderr
    sweep = tmp_path / "sweep"
    for job, project in (("0", "pcdist"), ("1", "$\\undefinedmacro{$")):
        copy = _sent(digits_run[0], sweep / job)
        text = (copy / "config.yaml").read_text()
        (copy / "config.yaml").write_text(re.sub(r"(?m)^  project: .*$", lambda m: f"  project: '{project}'", text))
    out = cli("compare", sweep, check=False)
    assert out.returncode == 0 and (sweep / "compare.png").is_file(), out.stderr
    assert "$\\undefinedmacro{$" in out.stdout


def test_odd_values_in_a_run_folders_files_are_one_line_not_a_traceback(digits_run, tmp_path):
    """A checkpoint recording the auto value step as text, inputs to predict that are an array of Python objects,
    an earlier metrics row holding text for the energy: each ended in a traceback (the last after the resumed run
    had trained, in the end-of-run picture). One line naming the file for the first two; the third is drawn
    without that value."""
    run = _sent(digits_run[0], tmp_path / "run")
    meta = torch.load(sorted((run / "checkpoints").glob("step-*"))[-1] / "meta.pt", weights_only=True)
    meta["x_lr"] = "abc"
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    _rewrite_meta(run, buffer.getvalue())
    out = cli("evaluate", run, check=False)
    assert out.returncode == 2 and out.stderr == (f"error: {run}: its checkpoint records the value step "
                                                  f"pc.x_lr=auto chose as 'abc', not a number > 0: the checkpoint is "
                                                  f"damaged; resume from another (pcdist.load's checkpoint=), or set "
                                                  f"pc.x_lr to a number\n"), out.stderr
    objects = np.empty(4, dtype=object)
    objects[:] = [1, "a", 2, 3]
    np.savez(tmp_path / "objects.npz", x=objects)
    out = cli("predict", digits_run[0], tmp_path / "objects.npz", "--out", tmp_path / "p.npz", check=False)
    assert out.returncode == 2 and out.stderr == (f"error: {tmp_path / 'objects.npz'}: array 'x' cannot be read (an "
                                                  f"array of Python objects, which would be unpickled: predict never "
                                                  f"does)\n"), out.stderr
    texted = _sent(digits_run[0], tmp_path / "texted")
    rows = read_metrics(texted / "metrics.jsonl")
    rows[0]["train/energy"] = "x"
    (texted / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert pcdist.train({"run_dir": str(texted), "trainer": {"max_steps": 44}, "logger.plots": True})["step"] == 44
    assert (texted / "accuracy_energy.png").is_file()


def test_a_run_folders_text_is_data_never_an_expression_or_code(digits_run, tmp_path, monkeypatch):
    """A ${oc.env:...} or ${pcdist.new_run_dir:...} in a run's config is that string to pcdist.load, to evaluate
    with overrides and to a resume: nothing is read from the environment, no folder is made. A folder in
    checkpoints/ not named step-<8 digits> (step-00000040-$(touch x)) is no checkpoint. A meta.pt whose pickle
    names a function (os.system) is refused in one line; nothing runs."""
    monkeypatch.setenv("PCDIST_TEST_SECRET", "s3cret-value")
    made = tmp_path / "made"
    asked = {"project": "${oc.env:PCDIST_TEST_SECRET}", "run_name": f"${{pcdist.new_run_dir:{made}}}"}
    run = _sent(digits_run[0], tmp_path / "run")
    meta = torch.load(sorted((run / "checkpoints").glob("step-*"))[-1] / "meta.pt", weights_only=True)
    meta["config"]["logger"].update(asked)
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    _rewrite_meta(run, buffer.getvalue())
    logger = pcdist.load(run).config.logger
    assert {"project": logger.project, "run_name": logger.run_name} == asked
    assert pcdist.evaluate(run, ["pc.T=5"], write=False)["step"] == 40
    from pcdist.service.evaluate import _with_overrides  # the config evaluate runs with (it resolved them)

    with monkeypatch.context() as inside:
        inside.setenv("TORCHELASTIC_RUN_ID", "abc")  # (as in a torchrun job, where new_run_dir makes its record)
        evaluated = _with_overrides(pcdist.load(run).config, ["pc.T=5"]).logger
    assert {"project": evaluated.project, "run_name": evaluated.run_name} == asked and not made.exists()
    pcdist.train({"run_dir": str(run), "trainer.max_steps": 60, "logger.plots": False})  # resumed with its own
    resumed = pcdist.load(run)
    assert resumed.step == 60 and resumed.config.logger.project == asked["project"]
    assert not made.exists() and not any(b"s3cret-value" in data for data in snapshot(run).values())

    named = _sent(digits_run[0], tmp_path / "named")
    (named / "checkpoints" / "step-00000040").rename(named / "checkpoints" / "step-00000040-$(touch x)")
    assert pcdist.load(named).step == 20 and pcdist.evaluate(named, write=False)["checkpoint"] == "step-00000020"

    pickled = _sent(digits_run[0], tmp_path / "pickled")
    marker = tmp_path / "RAN"
    buffer = io.BytesIO()
    torch.save({"step": 40, "x": _System(marker)}, buffer)
    ck = _rewrite_meta(pickled, buffer.getvalue())
    out = cli("evaluate", pickled, check=False)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"{ck / 'meta.pt'} cannot be read as a checkpoint file pcdist wrote (it names code to run, which pcdist " \
           f"never runs: " in out.stderr, out.stderr
    assert "weights_only" not in out.stderr, "torch's advice to load it anyway, passed on"
    assert not marker.exists()

    typed = _sent(digits_run[0], tmp_path / "typed")  # an expression in a number's key: one line (a traceback)
    meta = torch.load(sorted((typed / "checkpoints").glob("step-*"))[-1] / "meta.pt", weights_only=True)
    meta["config"]["pc"]["T"] = "${oc.env:PCDIST_TEST_SECRET,30}"
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    _rewrite_meta(typed, buffer.getvalue())
    with pytest.raises(pcdist.RunError, match=r"the run's settings \(its checkpoint's, else config.yaml\) cannot be "
                                              r"read by this pcdist: invalid value for config key pc.T: "):
        pcdist.load(typed)


def test_compare_shows_and_writes_a_run_folders_text_as_text(digits_run, tmp_path):
    """compare prints what run folders hold and writes it as CSV: a control character (a terminal escape) is
    shown escaped, and a value a spreadsheet would take for a formula starts with a '."""
    runs = [_sent(digits_run[0], tmp_path / "sweep" / name) for name in ("0", "1")]
    for run, name in zip(runs, ("=HYPERLINK(\"http://x\")", "\x1b[31mred")):
        config = yaml.safe_load((run / "config.yaml").read_text())
        config["logger"]["run_name"] = name
        (run / "config.yaml").write_text(yaml.safe_dump(config))
    out = cli("compare", tmp_path / "sweep", "--csv", tmp_path / "c.csv")
    assert "\x1b" not in out.stdout and "\\x1b[31mred" in out.stdout, out.stdout
    rows = list(csv.DictReader(open(tmp_path / "c.csv")))
    assert [r["logger.run_name"] for r in rows] == ["'=HYPERLINK(\"http://x\")", "\x1b[31mred"]
    # and a setting's key (a column), and a seed given as text (the groups' seeds column): shown escaped too, the
    # key's CSV header cell guarded (they reached the terminal and the spreadsheet raw)
    for run, seed in zip(runs, ("\x1b[31mRED", 1)):
        config = yaml.safe_load((run / "config.yaml").read_text())
        config["\x1b]0;owned\x07=HYPERLINK(1)"] = config["=SUM(1)"] = 1 if seed == 1 else 2
        config["trainer"]["seed"] = seed
        (run / "config.yaml").write_text(yaml.safe_dump(config))
    out = cli("compare", tmp_path / "sweep", "--csv", tmp_path / "k.csv")
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout, out.stdout
    assert "\\x1b]0;owned\\x07=HYPERLINK(1)" in out.stdout and "\\x1b[31mRED" in out.stdout, out.stdout
    header = next(csv.reader(open(tmp_path / "k.csv")))
    assert "'=SUM(1)" in header and not any(h.startswith("=") for h in header), header


# -- to_layers / to_sequential give back the user's structure -------------------------------------------

def test_user_layers_that_do_not_fit_the_data_or_the_mode_are_one_line_before_the_run(tmp_path):
    """Layers whose end nodes are not the mode's (a first layer of 32 inputs on digits' 64 features; a generative
    stack that reads the data at h_0; a latent of another width) are refused, naming what goes there, before the
    run writes anything (it failed inside the first step and left the run directory)."""
    run_dir = tmp_path / "run"
    cfg = {**SHORT, "run_dir": str(run_dir)}
    for extra, layers, says in (
            ({}, [nn.Sequential(nn.Linear(32, 16), nn.ReLU()), nn.Linear(16, 10)],
             "layers=...: the first layer reads [32], but pc.mode=supervised puts data digits's samples [64] there"),
            ({"pc.mode": "generative", "model.energy": "se"}, [nn.Sequential(nn.Linear(64, 32), nn.Tanh()),
                                                               nn.Linear(32, 10)],
             "layers=...: the first layer reads [64], but pc.mode=generative puts the 10 classes [10] there"),
            ({"pc.mode": "unsupervised", "model.energy": "se", "pc.latent_dim": 5},
             [nn.Sequential(nn.Linear(8, 32), nn.Tanh()), nn.Linear(32, 64)],
             "layers=...: the first layer reads [8], but pc.mode=unsupervised puts pc.latent_dim=5 [5] there")):
        with pytest.raises(pcdist.ConfigError, match=re.escape(says)):
            pcdist.train({**cfg, **extra}, layers=layers)
        assert not run_dir.exists()


def test_a_user_layers_buffers_are_saved_and_loaded_with_its_weights(tmp_path):
    """A user's layer with calibrated BatchNorm statistics (eval mode: constants of the layer): the checkpoint holds
    them beside the weights, so pcdist.load(run_dir, layers=fresh modules) gives the network that was trained and
    logged (it gave the fresh modules' statistics) and to_layers() gives them back."""
    def my_layers():
        torch.manual_seed(0)
        return [nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.GELU()),
                nn.Sequential(nn.BatchNorm1d(32).eval(), nn.Linear(32, 32), nn.Tanh()), nn.Linear(32, 10)]

    layers = my_layers()
    with torch.no_grad():
        layers[1][0].running_mean.fill_(0.7)
        layers[1][0].running_var.fill_(0.05)
    result = pcdist.train({**SHORT, "run_dir": str(tmp_path), "trainer": {**SHORT["trainer"], "max_steps": 4}},
                          layers=layers)
    run = pcdist.load(tmp_path, layers=my_layers())
    assert torch.equal(run.network.to_layers()[1][0].running_mean, torch.full((32,), 0.7))
    assert held_out_accuracy(run) == result["val/accuracy"]


def test_compare_names_a_run_whose_config_is_damaged(digits_run, tmp_path):
    """A sweep holding a run whose config.yaml does not parse (or holds nothing): one line naming the file."""
    from pcdist.service.compare import compare

    run_dir, _ = digits_run
    cut = "trainer: {max_steps: 4\n  seed"
    for name, text, says in (("cut", cut, "is damaged (ParserError: while parsing a flow mapping"),
                             ("empty", "", "holds no settings")):
        sweep = tmp_path / name
        shutil.copytree(run_dir, sweep / "0")
        (sweep / "1").mkdir()
        (sweep / "1" / "config.yaml").write_text(text)
        with pytest.raises(pcdist.RunError, match=re.escape(f"{sweep / '1' / 'config.yaml'} {says}")):
            compare([sweep], plot=tmp_path / "c.png")


def _round_trip(model: nn.Sequential, x: torch.Tensor, net: pcdist.PCNetwork) -> None:
    back = net.to_sequential()
    assert list(back.state_dict()) == list(model.state_dict())
    assert [type(m) for m in back.modules()] == [type(m) for m in model.modules()]
    fresh = type(model)(*[m for m in model])  # the user's model, reloaded from the network's weights
    fresh.load_state_dict(back.state_dict())
    torch.testing.assert_close(fresh(x), net(x), rtol=1e-5, atol=1e-5)


def test_to_sequential_round_trips_an_mlp_of_bare_linears():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 10))
    _round_trip(model, torch.randn(4, 64), pcdist.PCNetwork.from_sequential(model))
    layers = [nn.Linear(64, 32), nn.Linear(32, 10)]
    back = pcdist.PCNetwork.from_layers(layers).to_layers()
    assert [type(m) for m in back] == [nn.Linear, nn.Linear], "a bare nn.Linear stays bare"
    assert list(nn.Sequential(*back).state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_to_sequential_round_trips_a_cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 8, 3, padding=1),
                          nn.GELU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    _round_trip(model, torch.randn(4, 1, 8, 8), pcdist.PCNetwork.from_sequential(model, input_shape=(1, 8, 8)))


def test_to_layers_round_trips_a_mupc_network():
    layers = pcdist.mupc_layers(64, 32, 6, 10, generator=torch.Generator().manual_seed(0))
    net = pcdist.PCNetwork.from_layers(layers)
    back = net.to_layers()
    assert [type(m) for m in back] == [pcdist.ResidualLinear] * 6
    model = nn.Sequential(*layers)
    assert list(nn.Sequential(*back).state_dict()) == list(model.state_dict())
    fresh = nn.Sequential(*pcdist.mupc_layers(64, 32, 6, 10))
    fresh.load_state_dict(nn.Sequential(*back).state_dict())
    x = torch.randn(4, 64)
    torch.testing.assert_close(fresh(x), net(x), rtol=1e-5, atol=1e-5)


def test_a_layer_without_parameters_comes_back_as_itself():
    """A PC layer that is a parameter-free module (u_2 = tanh(h_1)) trains, and the way back to torch modules
    gives it back in place, the other layers with the trained weights (it raised a bare StopIteration)."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(6, 5), nn.Tanh()), nn.Tanh(), nn.Linear(5, 3)]
    net = pcdist.PCNetwork.from_layers(layers, input_shape=(6,))
    pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=5).step(torch.randn(4, 6), torch.randn(4, 3))
    back = net.to_layers()
    assert [type(m) for m in back] == [nn.Sequential, nn.Tanh, nn.Linear]
    x = torch.randn(4, 6)
    torch.testing.assert_close(nn.Sequential(*back)(x), net(x))
    torch.testing.assert_close(net.to_sequential()(x), net(x))


def test_presets_return_the_structure_their_config_describes(digits_run):
    """model=mlp (dims 64-128-128-10, gelu): Linear, GELU, Linear, GELU, Linear."""
    seq = pcdist.load(digits_run[0]).network.to_sequential()
    assert [type(m) for m in seq] == [nn.Linear, nn.GELU, nn.Linear, nn.GELU, nn.Linear]


# -- the backprop twin -----------------------------------------------------------------------------

def test_backprop_twin_equals_a_hand_written_autograd_loop(tmp_path):
    """pc.algorithm=bp is plain backprop on the same network, data order, optimizer, schedule and seed:
    a hand-written loop (nn.Sequential, F.cross_entropy, AdamW, warm-up + cosine written out) gives
    the same logged losses and the same final weights (float32, 1e-6)."""
    steps, B, seed, lr, warm, wd = 24, 64, 3, 2e-3, 5, 1e-4
    cfg = {"pc": {"algorithm": "bp"}, "model": {"dims": [64, 32, 10], "activation": "tanh"},
           "optim": {"lr": lr, "warmup_steps": warm, "weight_decay": wd},
           "trainer": {"max_steps": steps, "log_every": 4, "eval_every": 12, "ckpt_every": 12, "seed": seed,
                       "batch_size": B, "progress": "off"}, "logger": "none", "logger.plots": False,
           "run_dir": str(tmp_path / "bp")}
    result = pcdist.train(cfg)

    model = pcdist.PCNetwork.from_dims([64, 32, 10], "tanh", seed=seed).to_sequential()  # the seeded init
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=wd, fused=True)

    def factor(s):
        if s < warm:
            return (s + 1) / (warm + 1)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / (steps - warm))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    ds = load_dataset("digits")
    x, labels = ds.x_train.flatten(1), ds.y_train
    n = len(x)
    losses = {}
    for step in range(steps):
        epoch, i = divmod(step, n // B)
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))[i * B:(i + 1) * B]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), labels[idx])
        loss.backward()
        opt.step()
        sched.step()
        losses[step + 1] = loss.item()
    logged = {r["step"]: r["train/energy"] for r in read_metrics(tmp_path / "bp" / "metrics.jsonl")
              if "train/energy" in r}
    assert list(logged) == [4, 8, 12, 16, 20, 24]
    for s, v in logged.items():
        assert v == pytest.approx(losses[s], rel=1e-6, abs=1e-6)
    for p, q in zip(result.network.to_sequential().parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    assert all(r.get("train/layer_energy/1", 0.0) == 0.0 for r in read_metrics(tmp_path / "bp" / "metrics.jsonl"))


def test_backprop_twin_refuses_several_processes():
    c = pcdist.service.config.make_config({"pc": {"algorithm": "bp"}})
    with pytest.raises(pcdist.ConfigError, match="pc.algorithm=bp .* trains in one process, but this launch has 2"):
        pcdist.service.run.check(c, 2)


def test_model_name_python_needs_layers():
    with pytest.raises(pcdist.ConfigError, match="model.name='python' stands for layers passed"):
        pcdist.train({"model": {"name": "python"}, "logger": "none"})


def test_normalize_scales_each_varying_feature_whatever_the_others_magnitude():
    """Tabular features in other units: a price near 5e5 beside a fraction of std 0.05 and a 0/1 flag. The fraction
    was taken for a constant (its deviation under 1e-6 of the whole set's largest value) and left unscaled (std 0.047
    where 1 is due); each feature is judged by its own magnitude, and only the constant ones keep std 1."""
    from pcdist.service.data import normalization_stats, normalized

    g = torch.Generator().manual_seed(0)
    n = 500
    x = torch.stack([5e5 + 1e5 * torch.randn(n, generator=g), 0.3 + 0.05 * torch.randn(n, generator=g),
                     (torch.rand(n, generator=g) < 0.5).float(), torch.full((n,), 5e5), torch.zeros(n)], 1)
    y = torch.zeros(n, dtype=torch.long)
    d = pcdist.data.Dataset(x, y, x[:10], y[:10], 2)
    mean, std = normalization_stats(d)
    want = x.double().std(0)  # the sample deviation (n - 1)
    assert torch.allclose(std[:3].double(), want[:3], rtol=1e-5) and std[3:].tolist() == [1.0, 1.0]
    assert torch.allclose(mean.double(), x.double().mean(0), rtol=1e-6)
    spread = normalized(d).x_train.double().std(0)
    assert torch.allclose(spread[:3], torch.ones(3, dtype=torch.float64), atol=1e-5), spread


def test_a_float64_normalised_run_is_evaluated_as_it_was_trained(tmp_path):
    """trainer.dtype=float64 with data.normalize=true: training standardised its float32 inputs in float32, then
    cast them, while pcdist.load and evaluate standardise in float64 (inputs 5e-8 apart, the loss 1e-8); both
    compute in the run's dtype, so evaluate gives the logged loss and accuracy exactly."""
    run_dir = tmp_path / "run"
    result = pcdist.train({**SHORT, "run_dir": str(run_dir), "trainer": {**SHORT["trainer"], "max_steps": 6,
                                                                          "eval_every": 6, "dtype": "float64"},
                           "data": {"normalize": True}})
    got = pcdist.evaluate(run_dir, write=False)
    assert (got["loss"], got["accuracy"]) == (result["val/energy"], result["val/accuracy"])


def test_normalize_leaves_a_feature_constant_in_training_unscaled_and_needs_two_samples(tmp_path):
    """Flattened images [N, 64] with data.normalize=true: a pixel 0 in every training image (a border) got a std
    floor of 1e-8, so a held-out image with ink there was multiplied by 1e8 (logits of 1e6, the wrong class) in
    the logged accuracy, evaluate, predict and the export. It keeps std 1 (scikit-learn's StandardScaler does the
    same), also read back from a run of before (its model.json holds the floor); one training sample (no deviation)
    is one line, not a diverged run of NaN."""
    d = load_dataset("digits")
    x_train, x_val = d.x_train.flatten(1).clone(), d.x_val.flatten(1).clone()
    x_train[:, 0], x_val[:, 0] = 0.0, 0.0
    x_val[:4, 0] = 0.5  # ink where no training image has any
    data = pcdist.data.Dataset(x_train, d.y_train, x_val, d.y_val, 10)
    run_dir = tmp_path / "run"
    config = {**SHORT, "run_dir": str(run_dir), "data": {"normalize": True}}
    pcdist.train(config, data=data)
    run = pcdist.load(run_dir)
    assert run.inputs.std[0] == 1.0
    deviation = x_train.std(0)
    assert torch.allclose(run.inputs.std, torch.where(deviation > 0, deviation, 1.0)), "the other pixels' deviation"
    assert run.preprocess(x_val[:4]).abs().max() < 100, "no held-out value blown up by the constant pixel"
    model = json.loads((run_dir / "model.json").read_text())
    model["inputs"]["normalize"]["std"][0] = 1e-8  # as a run of before wrote it
    (run_dir / "model.json").write_text(json.dumps(model))
    assert pcdist.load(run_dir).inputs.std[0] == 1.0
    one = pcdist.data.Dataset(x_train[:1], d.y_train[:1], x_val, d.y_val, 10)
    with pytest.raises(pcdist.data.DataError, match=r"^config data.normalize=true standardises by the training "
                                                    r"set's standard deviation, which needs 2 training samples or "
                                                    r"more; this data has 1$"):
        pcdist.train({**config, "run_dir": str(tmp_path / "one"), "trainer": {**SHORT["trainer"], "batch_size": 1}},
                     data=one)
