"""Every preset composes and trains; bad configs and bad data each give one exact, clear error."""

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import pcdist
from pcdist.service.data import DataError, load_dataset, read_idx
from datafiles import make_cifar10, make_cifar100, make_mnist, write_idx

CONF = Path(__file__).resolve().parents[1] / "conf"
PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
SMALL = ["trainer.max_steps=3", "trainer.epochs=null", "trainer.eval_every=2", "trainer.log_every=1",
         "trainer.ckpt_every=2", "logger=none", "logger.plots=false",
         "trainer.progress=off"]


def composed(*overrides: str):
    """conf/ composed with these overrides, as train.py composes it (pcdist.compose)."""
    return pcdist.compose(list(overrides))


def test_presets_are_all_covered():
    assert {"pcx_mnist", "pcx_fashion_mnist", "deep_narrow", "mupc_digits", "pcx_vgg5_cifar10", "pcx_vgg7_cifar10",
            "pcx_vgg5_cifar100", "pcx_vgg7_cifar100"} <= set(PRESETS)


def test_the_optimizer_and_the_data_chosen_on_the_command_line_are_the_ones_every_preset_trains():
    """A preset (a model or an experiment) may bring its own learning rates, not its own choice of a group: with
    model=mupc or the PCX VGG presets, optim=sgd trained AdamW without a word (their optim.name overwrote the
    group the user chose, and optim.momentum=0 was then refused as not AdamW's); experiment=generative_digits
    model=deconv trained an MLP (its model.name)."""
    models = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
    for preset in [f"experiment={p}" for p in PRESETS] + [f"model={m}" for m in models]:
        choices = [("optim", "sgd"), ("data", "synthetic")]  # (not the defaults: adamw, digits)
        if preset.startswith("experiment="):
            choices += [("model", "deconv"), ("model", "mupc")]
        for group, option in choices:
            got = composed(preset, f"{group}={option}")[group].name
            assert got == option, f"{preset} {group}={option} composes {group}.name={got}"


@pytest.mark.parametrize("preset", [None, *PRESETS])
def test_every_preset_composes_and_trains(preset, tmp_path):
    """Each experiment file composes with Hydra and runs a few real steps (generated files where needed: set
    on the composed config, as the same overrides on the command line would set them; one composition)."""
    over = [*SMALL, f"run_dir={tmp_path / 'run'}"]
    if preset is not None:
        over.append(f"experiment={preset}")
    cfg = composed(*over)
    light = {}
    if cfg.data.name in ("mnist", "fashion_mnist"):  # a batch and a half of 28 x 28 images, a small batch
        light.update({"data.root": str(make_mnist(tmp_path / "data", n_train=24)), "trainer.batch_size": 16})
    if cfg.pc.eval_T is not None and cfg.pc.eval_T > 10:  # the test-time inference runs, in fewer steps
        light["pc.eval_T"] = 10
    if cfg.data.name == "digits":  # a small batch: deep_narrow's 128 layers at T=128 cost seconds per batch of 64
        light["trainer.batch_size"] = 8
    if cfg.data.name == "synthetic":
        light.update({"data.synthetic_train": 256, "data.synthetic_val": 64, "trainer.batch_size": 32})
    if cfg.data.name in ("cifar10", "cifar100"):  # tiny files, a small batch: VGG on CPU costs seconds per image
        make = make_cifar10 if cfg.data.name == "cifar10" else make_cifar100
        light.update({"data.root": str(make(tmp_path / "data")), "trainer.batch_size": 4})
    for key, value in light.items():
        OmegaConf.update(cfg, key, value)
    result = pcdist.train(cfg)
    assert result["step"] == 3
    if cfg.pc.mode == "unsupervised":  # no labels: its test is the reconstruction
        assert 0.0 < result["val/reconstruction_mse"] < float("inf")
    else:
        assert 0.0 <= result["val/accuracy"] <= 1.0
    assert (tmp_path / "run" / "checkpoints" / "step-00000003" / "manifest.json").is_file()


def test_epochs_set_the_number_of_steps(tmp_path):
    """trainer.epochs=2 on digits (1437 training samples, batch 64): 2 x 22 = 44 steps."""
    result = pcdist.train(composed(*SMALL, "trainer.epochs=2", "trainer.max_steps=1", f"run_dir={tmp_path}"))
    assert result["step"] == 44


def test_epochs_and_max_steps_set_together_are_refused_naming_both(tmp_path):
    """trainer.epochs decides the length when set, so a trainer.max_steps passed beside it would be ignored
    (trainer.epochs=2 trainer.max_steps=50 trained 44 steps): refused in one line naming both and the way out,
    whether the epochs come from the same command, a preset or the run being resumed."""
    small = {"logger": "none", "logger.plots": False, "trainer": {"progress": "off", "eval_every": 1000}}
    with pytest.raises(pcdist.ConfigError, match=r"^trainer.epochs=2 and trainer.max_steps=50 both set how long the "
                                                 r"run trains, and trainer.epochs would win; set one: trainer.epochs="
                                                 r"null to train trainer.max_steps steps, or leave out "
                                                 r"trainer.max_steps$"):
        pcdist.train({**small, "trainer": {"epochs": 2, "max_steps": 50}, "run_dir": str(tmp_path / "a")})
    with pytest.raises(pcdist.ConfigError, match=r"^trainer.epochs=5 \(from experiment=deconv_mnist\) and "
                                                 r"trainer.max_steps=5 both"):
        pcdist.train(["experiment=deconv_mnist", "trainer.max_steps=5", "logger=none", f"run_dir={tmp_path / 'b'}"])
    run_dir = tmp_path / "c"
    assert pcdist.train({**small, "trainer": {"epochs": 1, "stop_at": 4}, "run_dir": str(run_dir)})["step"] == 4
    with pytest.raises(pcdist.ConfigError, match=r"^trainer.epochs=1 \(from the run's own settings\) and "
                                                 r"trainer.max_steps=30 both"):
        pcdist.train({**small, "trainer": {"max_steps": 30}, "run_dir": str(run_dir)})
    assert pcdist.train({**small, "trainer": {"max_steps": 30, "epochs": None}, "run_dir": str(run_dir)})["step"] == 30
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cifar10_files_train(tmp_path):
    root = make_cifar10(tmp_path / "cifar")
    result = pcdist.train(composed(*SMALL, "data=cifar10", f"data.root={root}", "model.dims=[3072,64,10]",
                                   "trainer.batch_size=16", f"run_dir={tmp_path / 'run'}"))
    assert result["step"] == 3


@pytest.mark.parametrize("name", ["mnist", "cifar10", "cifar100"])
def test_image_files_are_read_as_images(name, tmp_path):
    """The readers keep images [N, C, H, W] with each pixel where the file has it (CIFAR stores
    [N, 3072] channel-major rows), scaled to [0, 1], and the labels as written (CIFAR-100: the fine ones)."""
    if name == "mnist":
        root = make_mnist(tmp_path, n_train=5, n_val=3, gz=False)
        raw = read_idx(root / "train-images-idx3-ubyte", 2051)[:, None]
        labels = read_idx(root / "train-labels-idx1-ubyte", 2049)
    else:
        root = (make_cifar10 if name == "cifar10" else make_cifar100)(tmp_path)
        folder, first = ("cifar-10-batches-py", "data_batch_1") if name == "cifar10" else ("cifar-100-python", "train")
        d = pickle.loads((root / folder / first).read_bytes(), encoding="bytes")
        raw = np.asarray(d[b"data"]).reshape(-1, 3, 32, 32)
        labels = np.asarray(d[b"labels" if name == "cifar10" else b"fine_labels"])
    ds = load_dataset(name, str(root))
    n = len(raw)
    assert tuple(ds.x_train.shape[1:]) == raw.shape[1:] and ds.num_classes == (100 if name == "cifar100" else 10)
    torch.testing.assert_close(ds.x_train[:n], torch.from_numpy(raw.astype(np.float32) / 255.0), atol=0, rtol=0)
    assert ds.y_train[:n].tolist() == labels.tolist()


def test_a_cnn_trains_on_cifar100_images(tmp_path):
    """model=cnn keeps the images [3, 32, 32]: conv layers, then the dense output of 100 classes."""
    root = make_cifar100(tmp_path / "data")
    result = pcdist.train(composed(*SMALL, "model=cnn", "model.channels=[4,4]", "model.pool=[max,avg]",
                                   "data=cifar100", f"data.root={root}", "data.normalize=true", "data.augment=true",
                                   "trainer.batch_size=8", f"run_dir={tmp_path / 'run'}"))
    assert result["step"] == 3 and 0.0 <= result["val/accuracy"] <= 1.0
    state = torch.load(next((tmp_path / "run" / "checkpoints" / "step-00000003").glob("layers-*.pt")),
                       weights_only=True)["layers"]
    assert (tuple(state["layers.1.weight"].shape) == (4, 3, 3, 3)
            and tuple(state["layers.3.weight"].shape) == (100, 4 * 8 * 8))


BAD_CONFIGS = [
    (["pc.T=0"], "config pc.T=0 is invalid: allowed an integer >= 1"),
    # (each below was a traceback from torch or wandb, after the run directory was made)
    (["trainer.seed=9223372036854775808"], "config trainer.seed=9223372036854775808 is invalid: allowed a 64-bit "
                                           "integer (-2**63 to 2**63 - 1)"),
    (["trainer.threads=100000"], "config trainer.threads=100000 is invalid: allowed an integer from 0 (automatic) to "
                                 "1024 (torch crashes on tens of thousands)"),
    (["pc.init=newton", "pc.precision=[0,1,1]"], "config pc.init='newton' is invalid: allowed ff or deeppcr with "
                                                 "pc.precision=[0, 1, 1] (the inits near equilibrium need every "
                                                 "hidden layer's precision > 0)"),
    (["pc.solver=heun", "pc.value_noise=0.1"], "config pc.solver='heun' is invalid: allowed euler with "
                                               "pc.value_noise > 0 (MCPC's Langevin step is an Euler-Maruyama step"),
    (["logger=wandb", "logger.project=a/b"], "config logger.project='a/b' is invalid: allowed a name of 1-128 "
                                             "characters without / \\ # ? % :"),
    (["pc.x_lr=-1"], "config pc.x_lr=-1 is invalid: allowed a finite number > 0 or auto"),
    (["pc.x_lr=fast"], "config pc.x_lr='fast' is invalid: allowed a finite number > 0 or auto"),
    (["pc.value_optimizer=rmsprop"], "config pc.value_optimizer='rmsprop' is invalid: allowed sgd, nesterov, adam, "
                                     "adamw"),
    (["pc.value_optimizer=nesterov"], "config pc.x_momentum=0.0 is invalid: allowed a number in (0, 1) with "
                                      "pc.value_optimizer=nesterov"),
    (["pc.solver=adaptive"], "config pc.solver='adaptive' is invalid: allowed euler, heun, rk4 (adaptive: "
                             "pc.eval_solver only)"),
    (["pc.solver=heun", "pc.x_momentum=0.5"], "config pc.solver='heun' is invalid: allowed euler with "
                                              "pc.value_optimizer=sgd pc.x_momentum=0.5"),
    (["pc.value_optimizer=adam", "pc.eval_solver=adaptive"], "config pc.eval_solver='adaptive' is invalid: allowed "
                                                            "euler with pc.value_optimizer=adam pc.x_momentum=0.0"),
    (["pc.init=newton", "pc.mode=generative"], "config pc.init='newton' is invalid: allowed ff or deeppcr with "
                                               "pc.mode=generative"),
    (["pc.x_momentum=1"], "config pc.x_momentum=1.0 is invalid: allowed a number in [0, 1)"),
    (["pc.algorithm=dfa"], "config pc.algorithm='dfa' is invalid: allowed pc, ipc, bp"),
    (["optim.lr=0"], "config optim.lr=0.0 is invalid: allowed a finite number > 0"),
    (["optim.name=adam"], "config optim.name='adam' is invalid: allowed adamw, sgd"),
    (["data.num_classes=12"], "config data.num_classes=12 is invalid: allowed null with data=digits (it has its own "
                              "classes"),
    (["model.activation=swish"], "config model.activation='swish' is invalid: allowed tanh, relu, leaky_relu, gelu, "
                                 "hard_tanh, sigmoid, identity, silu, softplus, elu, mish"),
    (["model=cnn", "model.channels=[16,32,64]"], "config model.channels=[16, 32, 64] has 3 conv layers but model.pool="
                                                 "['max', 'max'] has 2 entries: one pooling (max, avg or none) per "
                                                 "conv layer, e.g. model.pool=[max,max,max]"),
    (["model.energy=mse"], "config model.energy='mse' is invalid: allowed se, ce"),
    (["parallel.layer=5"], "config parallel.layer=5 is invalid: allowed at most the number of layers "
                           "(3, from model.dims)"),
    (["parallel.data=2"], "parallel.data=2 x parallel.layer=1 needs 2 processes, but this is one process; launch it "
                          "with torchrun --nproc_per_node=2 train.py"),
    (["trainer.batch_size=0"], "config trainer.batch_size=0 is invalid: allowed an integer >= 1"),
    (["trainer.max_steps=abc"], "invalid value for config key trainer.max_steps: Value 'abc' of type 'str' could "
                                "not be converted to Integer"),
    (["model.dims=[64,128,...,128,10]"], "invalid value for config key model.dims[2]: Value '...' of type 'str' "
                                         "could not be converted to Integer"),
    (["+trainer.foo=1"], "unknown config key trainer.foo (python train.py --help lists every key and group)"),
    (["data.name=imagenet"], "config data.name='imagenet' is invalid: allowed digits, synthetic, mnist, "
                             "fashion_mnist, cifar10"),
    (["trainer.batch_size=100000"], "data digits has 1437 training samples, fewer than trainer.batch_size=100000"),
    (["model.dims=[10,128,10]"], "data digits has 64 input features (1 x 8 x 8) but model.dims[0]=10; "
                                 "set model.dims=[64,128,10]"),
    (["model.dims=[64,128,7]"], "data digits has 10 classes but model.dims[-1]=7"),
]


def test_an_optimizer_key_the_chosen_optimizer_does_not_read_is_refused(tmp_path):
    """optim.momentum under adamw, optim.betas under sgd, optim.final_lr_ratio under a constant schedule would change
    nothing: one line naming the override and the choice that reads it (a group's own keys are not the user's)."""
    for overrides, says in ((["optim.momentum=0.0"], "optim.momentum=0.0: optim.name=adamw does not read "
                                                     "optim.momentum (sgd does)"),
                            (["optim=sgd", "optim.betas=[0.1,0.2]"], "optim.betas=[0.1,0.2]: optim.name=sgd does not "
                                                                     "read optim.betas (adamw does)"),
                            (["optim.schedule=constant", "optim.final_lr_ratio=0.1"], "optim.final_lr_ratio=0.1: "
                             "optim.schedule=constant does not read optim.final_lr_ratio (cosine does)")):
        with pytest.raises(pcdist.ConfigError, match=re.escape(says)):
            pcdist.train([*SMALL, *overrides, f"run_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, value", [("PCDIST_NATIVE", "off"), ("PCDIST_GEMM", "cublas"),
                                         ("PCDIST_CHANNELS_LAST", "yes")])
def test_an_engine_switch_with_a_value_it_does_not_take_is_refused_before_any_work(name, value, tmp_path,
                                                                                  monkeypatch):
    """An engine switch (pcdist/engine/arguments.py ENV_SWITCHES) set to a value it does not take was read at the
    first step that used it: a traceback after the run directory was written, or (PCDIST_NATIVE=off: anything but
    "0") silently the default. The service refuses it in one line naming the variable and its values before the run
    directory exists; PCTrainer when it is made."""
    from pcdist.engine.arguments import ENV_SWITCHES

    monkeypatch.setenv(name, value)
    says = f"environment variable {name}={value!r}: allowed {', '.join(ENV_SWITCHES[name])}"
    with pytest.raises(pcdist.ConfigError, match=re.escape(says)):
        pcdist.train([*SMALL, f"run_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()
    net = pcdist.PCNetwork.from_dims([4, 8, 2])
    with pytest.raises(ValueError, match=re.escape(says)):
        pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1))
    monkeypatch.setenv(name, ENV_SWITCHES[name][-1])  # every value it takes is taken
    pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1))


def test_an_after_training_command_refuses_a_bad_engine_switch_in_one_line(tmp_path, monkeypatch, capsys):
    """evaluate (and predict, export) make a trainer too: a bad switch there is the same one line, status 2."""
    from pcdist.service.commands import main

    pcdist.train([*SMALL, f"run_dir={tmp_path / 'run'}"])
    capsys.readouterr()
    monkeypatch.setenv("PCDIST_NATIVE", "off")
    assert main(["evaluate", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == "error: environment variable PCDIST_NATIVE='off': allowed 1, 0 (unset: 1)\n"


def test_a_mistyped_group_option_from_python_gets_the_did_you_mean_of_the_command_line(tmp_path):
    """pcdist.train({"model": "cnnn"}) composes conf/ as train.py does, so it gets the same one line (not Hydra's
    search-path report); so does {"modle": "cnn"}."""
    with pytest.raises(pcdist.ConfigError) as info:
        pcdist.train({"model": "cnnn", "run_dir": str(tmp_path)})
    options = ", ".join(sorted(p.stem for p in (CONF / "model").glob("*.yaml")))
    assert str(info.value) == f"model=cnnn: no such option in conf/model/ (options: {options}); did you mean cnn?"
    with pytest.raises(pcdist.ConfigError) as info:  # a mistyped group's name: the command line's hint too
        pcdist.train({"modle": "cnn", "run_dir": str(tmp_path)})
    assert str(info.value) == ("unknown config key modle; did you mean the config group model=cnn? (python train.py "
                               "--help lists every key and group)")


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS, ids=[o[0] for o, _ in BAD_CONFIGS])
def test_bad_config_gives_its_exact_error(overrides, message, tmp_path):
    with pytest.raises(ValueError) as info:
        pcdist.train(composed(*SMALL, f"run_dir={tmp_path}", *overrides))
    assert message in str(info.value)
    assert isinstance(info.value, (pcdist.ConfigError, DataError)), "train.py prints these as one line"
    assert not (tmp_path / "checkpoints").exists(), "a bad config must fail before any work"


MNIST_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


@pytest.mark.parametrize("overrides, parts", [
    (["pc.T=0"], ["config pc.T=0 is invalid: allowed an integer >= 1"]),
    (["trainer.mx_steps=5"], ["unknown config key trainer.mx_steps; did you mean trainer.max_steps?"]),
    (["parallel=cpu_sim"], ["needs 2 processes", "torchrun --nproc_per_node=2"]),
    (["data=mnist", "data.root=/nonexistent/mnist", "model.dims=[784,10]"],
     ["data.root=/nonexistent/mnist is not a directory", *MNIST_FILES, "downloads nothing", "PCDIST_DATA"]),
], ids=["range", "typo", "cpu_sim", "mnist"])
def test_train_py_reports_bad_input_as_one_line(overrides, parts, tmp_path):
    """The user's mistake, not a bug: train.py prints one line naming it and exits with status 2, no traceback."""
    out = subprocess.run([sys.executable, str(CONF.parent / "train.py"), "logger=none", f"hydra.run.dir={tmp_path}",
                          *overrides], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr[-2000:]
    for part in parts:
        assert part in out.stderr


def test_unknown_key_without_plus_is_refused_naming_it():
    with pytest.raises(pcdist.ConfigError, match="^unknown config key trainer.foo "):
        composed("trainer.foo=1")


def test_missing_dataset_files_are_named(tmp_path):
    """A folder with only some of MNIST's four files: the error names the folder and exactly the missing ones."""
    root = make_mnist(tmp_path / "mnist")
    for name in MNIST_FILES[2:]:
        (root / f"{name}.gz").unlink()
    with pytest.raises(DataError) as info:
        pcdist.train(composed(*SMALL, "data=mnist", f"data.root={root}", "model.dims=[784,32,10]",
                              f"run_dir={tmp_path / 'run'}"))
    msg = str(info.value)
    assert str(root) in msg and "downloads nothing" in msg
    assert [f for f in MNIST_FILES if f in msg] == MNIST_FILES[2:]


@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip(tmp_path, gz):
    root = make_mnist(tmp_path, gz=gz)
    ds = load_dataset("mnist", str(root))
    assert ds.x_train.shape == (64, 1, 28, 28) and ds.x_val.shape == (32, 1, 28, 28)
    assert float(ds.x_train.max()) <= 1.0 and ds.y_train.dtype == torch.int64


def test_bad_idx_files(tmp_path):
    bad = tmp_path / "x-idx3-ubyte"
    write_idx(bad, np.zeros((4, 28, 28)), gz=False)
    bad.write_bytes(bad.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"header says \(4, 28, 28\) \(3136 bytes\) but 3126 bytes follow"):
        read_idx(bad, 2051)
    write_idx(bad, np.zeros(4), gz=False)
    with pytest.raises(DataError, match="not an IDX file with magic 2051 \\(found 2049\\)"):
        read_idx(bad, 2051)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_cifar_reader_never_unpickles_arbitrary_objects(tmp_path):
    root = make_cifar10(tmp_path)
    (root / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps({b"data": _Evil()}))
    with pytest.raises(DataError, match="refusing to unpickle posix.system"):
        load_dataset("cifar10", str(root))


def test_labels_out_of_range_are_refused(tmp_path):
    root = make_mnist(tmp_path)
    write_idx(root / "train-labels-idx1-ubyte", np.array([12] + [0] * 63), gz=True)
    with pytest.raises(DataError, match=r"mnist train labels span \[0, 12\], outside \[0, 10\)"):
        load_dataset("mnist", str(root))


def test_non_finite_inputs_are_refused(tmp_path):
    from pcdist.service.config import load_config
    from pcdist.service.data import Dataset
    from pcdist.service.datachecks import _check_data

    x = torch.randn(80, 64)
    x[3, 5] = float("nan")
    ds = Dataset(x, torch.zeros(80, dtype=torch.long), torch.randn(8, 64), torch.zeros(8, dtype=torch.long), 10)
    with pytest.raises(DataError, match="data digits train inputs contain NaN or Inf"):
        _check_data(load_config({}), ds)


def test_augment_for_a_model_that_flattens_the_images_is_refused_by_the_checks(tmp_path):
    """data.augment with an MLP on the digits' images passed the launch checks (the images are [1, 8, 8]) and
    failed at the first step, its run directory written (data review): the checks refuse it, before anything."""
    from pcdist.service.config import make_config
    from pcdist.service.datachecks import check_model_on_data

    with pytest.raises(pcdist.ConfigError, match=r"^config data.augment=true crops and flips images, but "
                                                 r"model.name=mlp reads them flattened"):
        check_model_on_data(make_config({"data": {"augment": True}}))
    with pytest.raises(pcdist.ConfigError, match=r"but the first of layers=... reads them flattened"):
        pcdist.train({"data": {"augment": True}, "run_dir": str(tmp_path / "run")},
                     layers=[torch.nn.Linear(64, 10)])  # (the service flattens its images; with nn.Flatten: fine)
    assert not (tmp_path / "run").exists()


def test_data_num_classes_beside_data_from_python_must_agree_with_it(tmp_path):
    """data.num_classes was accepted beside data passed from Python and ignored (5 or 12 trained the data's 10)."""
    d = pcdist.data.load_digits()
    with pytest.raises(pcdist.ConfigError, match=r"^config data.num_classes=12, but the data passed to pcdist.train "
                                                 r"has num_classes=10"):
        pcdist.train({"data": {"num_classes": 12}, "run_dir": str(tmp_path / "run")}, data=d)
    assert not (tmp_path / "run").exists()



def test_data_keys_a_data_set_does_not_read_are_said_in_a_line(tmp_path, capsys):
    """data.val_fraction (read by digits) set for synthetic data did nothing without a word (data review); refusing
    it would break runs made so and sweeps over data sets sharing it: the run says it in one line, with
    data.layout (read by your own data only)."""
    pcdist.train({"data": {"name": "synthetic", "val_fraction": 0.3, "synthetic_train": 128, "synthetic_val": 32,
                           "layout": "channels_first"},
                  "model": {"dims": [64, 16, 10]}, "trainer": {"max_steps": 1, "batch_size": 32, "progress": "off"},
                  "pc": {"T": 2, "x_lr": 0.1}, "logger": "none", "logger.plots": False,
                  "run_dir": str(tmp_path / "run")})
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: this run (data")]
    assert notes == ["note: this run (data=synthetic, logger=none) does not read data.val_fraction=0.3 (read by "
                     "data=digits), data.layout=channels_first (read by your own data)"]


def test_loader_and_wandb_keys_a_run_does_not_read_are_said_in_a_line():
    """data.num_workers / prefetch_factor on data held in memory, logger.project / entity / run_name without wandb:
    accepted without a word (review); said in the same line, and nothing where they are read."""
    from pcdist.service.config import load_config
    from pcdist.service.datachecks import unread_keys_note

    c = load_config(pcdist.compose(["data.num_workers=7", "data.prefetch_factor=9", "logger=none",
                                    "logger.project=foo", "logger.run_name=bar"]))
    assert unread_keys_note(c) == (
        "note: this run (data=digits, logger=none) does not read data.num_workers=7 (read by streamed data: a "
        "folder of .npy files or a StreamedData), data.prefetch_factor=9 (read by streamed data: a folder of .npy "
        "files or a StreamedData), logger.project=foo (read by logger=wandb), logger.run_name=bar (read by "
        "logger=wandb)")
    assert unread_keys_note(c, streamed=True).endswith("does not read logger.project=foo (read by logger=wandb), "
                                                       "logger.run_name=bar (read by logger=wandb)")
    assert unread_keys_note(load_config(pcdist.compose(["logger=none"]))) is None
    assert unread_keys_note(load_config(pcdist.compose(["logger=wandb", "logger.project=foo"]))) is None


@pytest.mark.parametrize("pc, said", [
    ({"latent_dim": 5, "eval_T": 50, "prior_precision": 7.0}, "pc.latent_dim=5 (read by pc.mode=unsupervised), "
     "pc.prior_precision=7.0 (read by a free h_0: pc.mode=generative or unsupervised), pc.eval_T=50 (read by the "
     "generative and unsupervised tests)"),
    ({"precision_decay": 0.5, "mode": "generative", "latent_dim": 5}, "pc.latent_dim=5 (read by "
     "pc.mode=unsupervised), pc.precision_decay=0.5 (read by pc.precision_schedule=top_down)"),
    ({"mode": "generative", "eval_T": 5, "precision_schedule": "top_down", "precision_decay": 0.5}, None),
    ({"diagnostics_every": 5}, "pc.diagnostics_every=5 (read by pc.diagnostics=true)"),
    ({"diagnostics_every": 5, "diagnostics": True}, None),
])
def test_pc_keys_a_run_does_not_read_are_said_in_a_line(pc, said):
    """pc.latent_dim, pc.prior_*, pc.eval_* in a supervised run, pc.precision_decay without its schedule: accepted
    without a word (config review), where an unread model.* or optim.* key is refused; said in one line (a sweep
    over modes shares them), and nothing where each key is read."""
    from pcdist.service.config import load_config, unread_pc_note

    c = load_config(pcdist.compose([f"pc.{k}={v}" for k, v in pc.items()]))
    assert unread_pc_note(c) == (None if said is None else f"note: this run does not read {said}")


def test_a_warm_up_longer_than_the_run_is_said_in_a_line(tmp_path, capsys):
    """optim.warmup_steps=100 in a 4-step run was shortened to the run without a word (config review)."""
    pcdist.train({"optim": {"warmup_steps": 100}, "model": {"dims": [64, 16, 10]}, "pc": {"T": 2, "x_lr": 0.1},
                  "trainer": {"max_steps": 4, "progress": "off"}, "logger": "none", "logger.plots": False,
                  "run_dir": str(tmp_path / "run")})
    assert ("note: optim.warmup_steps=100 is longer than the run (trainer.max_steps=4): the warm-up is shortened to "
            "the run, and no cosine decay follows") in capsys.readouterr().out.splitlines()


def test_a_test_time_solver_goes_with_training_noise():
    """MCPC's noise is an Euler-Maruyama step of training; the tests' inference (pc.eval_solver) runs without it, so
    heun, rk4 or adaptive there go with pc.value_noise > 0 (they were refused, in a line that read as if euler
    needed noise)."""
    from pcdist.service.config import load_config

    for solver in ("heun", "adaptive"):
        c = load_config(pcdist.compose(["experiment=generative_digits", "pc.value_noise=0.1",
                                        f"pc.eval_solver={solver}"]))
        assert c.pc.eval_solver == solver
    net = pcdist.PCNetwork.from_dims([4, 8, 3], seed=0)
    tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=2, value_noise=0.1)
    assert len(tr.infer(None, torch.randn(5, 3), solver="adaptive")) == 3


def test_pc_inference_settings_given_to_a_backprop_run_are_said_in_a_line():
    """pc.algorithm=bp reads none of PC's inference settings (they were accepted without a word); the ones the user
    gives are said, a preset's are not (model=mupc brings pc.T and pc.x_lr), and a PC run says nothing."""
    from pcdist.service.config import backprop_note, load_config

    given = ["pc.algorithm=bp", "pc.T=3", "pc.x_lr=0.3", "pc.init=newton", "optim.lr=0.01"]
    assert backprop_note(load_config(pcdist.compose(given)), given) == (
        "note: pc.algorithm=bp trains by backprop and does not read pc.T=3, pc.x_lr=0.3, pc.init=newton (PC's "
        "inference settings)")
    preset = ["model=mupc", "pc.algorithm=bp"]
    assert backprop_note(load_config(pcdist.compose(preset)), preset) is None
    assert backprop_note(load_config(pcdist.compose(given[1:])), given[1:]) is None
