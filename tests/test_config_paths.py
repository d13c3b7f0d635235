"""One source of defaults: pcdist.train(dict) and the command line compose the same conf/, and the
dataclasses' defaults (their documentation) equal it."""

import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

import pcdist
from pcdist.service.config import GROUPS, Config, choice_keys, compose, flat, groups, load_config, make_config

ROOT = Path(__file__).resolve().parents[1]

# (command-line overrides, the same run as pcdist.train's dict)
SAME_RUNS = [
    ([], {}),
    (["optim=sgd", "data=mnist", "experiment=pcx_fashion_mnist", "parallel=cpu_sim", "optim.lr=0.01", "pc.T=5",
      "model.dims=[64,32,10]", "trainer.seed=3"],
     {"optim": "sgd", "data": "mnist", "experiment": "pcx_fashion_mnist", "parallel": "cpu_sim", "optim.lr": 0.01,
      "pc": {"T": 5}, "model": {"dims": [64, 32, 10]}, "trainer.seed": 3}),
    # model=mupc brings its own pc and optim settings (a global package, after the pc and optim groups)
    (["model=mupc", "model.depth=8", "pc.x_lr=0.2"], {"model": "mupc", "model.depth": 8, "pc.x_lr": 0.2}),
    (["experiment=deep_narrow"], {"experiment": "deep_narrow"}),
]


def cli_config(*overrides: str) -> Config:
    """The job config the real train.py composes (Hydra's --cfg job), validated."""
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--cfg", "job", *overrides], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return load_config(yaml.safe_load(out.stdout))


@pytest.mark.parametrize("overrides, python", SAME_RUNS, ids=["defaults", "groups and values", "mupc", "deep_narrow"])
def test_python_and_the_command_line_compose_the_same_config(overrides, python):
    assert asdict(make_config(python)) == asdict(cli_config(*overrides))


def test_the_dataclass_defaults_are_conf_defaults():
    """Config() (what config.py documents key by key) is the run `python train.py` makes."""
    assert asdict(Config()) == asdict(make_config(None))
    assert Config().model.activation == "gelu" and Config().model.energy == "ce", "the CLI's model, not tanh/se"


def test_python_dicts_are_checked_like_the_command_line():
    with pytest.raises(pcdist.ConfigError, match="invalid config key trainer.foo"):
        make_config({"trainer": {"foo": 1}})
    with pytest.raises(pcdist.ConfigError, match="config pc.T=0 is invalid"):
        make_config({"pc": {"T": 0}})
    # a section given something else than its keys or an option's name ("invalid config key ?", or omegaconf's
    # own ConfigTypeError, which is no ConfigError)
    with pytest.raises(pcdist.ConfigError, match=r"^pcdist.train's config: trainer takes a dict of its keys, or the "
                                                 r"name of an option of conf/trainer/, not the int 5$"):
        make_config({"trainer": 5})
    with pytest.raises(pcdist.ConfigError, match=r"model takes a dict of its keys, .* not the list \['mlp'\]$"):
        make_config({"model": ["mlp"]})


SECTION_CHOICES = [f"{group}={option}" for group, options in groups().items() if group in GROUPS and
                   group != "experiment" for option in options]


@pytest.mark.parametrize("choice", SECTION_CHOICES)
def test_the_keys_a_group_choice_sets_are_those_its_composition_changes(choice):
    """What a resume applies of ``model=cnn`` or ``logger=none`` (passed_settings): choice_keys reads a file that
    holds its section only from the schema, without composing; the keys equal those that composing conf/ with
    and without the choice finds (the choice's section, and any key elsewhere it changes)."""
    from omegaconf import OmegaConf

    default = flat(OmegaConf.to_container(compose([]), resolve=True))
    chosen = flat(OmegaConf.to_container(compose([choice]), resolve=True))
    group = choice.split("=")[0]
    composed = {k for k, v in chosen.items() if k.split(".")[0] == group or default.get(k, v) != v or k not in default}
    assert set(choice_keys(choice)) == composed
    assert len(choice_keys(choice)) == len(composed), "each key once"


def test_a_choice_that_names_no_option_of_conf_reads_no_file(tmp_path):
    """What a resume applies of a choice named in a run folder's attempt file (text one may have been sent): an
    option that is no name of a file in conf/ ("model=../../outside") sets no key and reads no file outside conf/
    (a YAML there would otherwise be composed as the choice)."""
    outside = tmp_path / "outside.yaml"
    outside.write_text("model:\n  dims: [1, 2]\n")
    relative = "../" * (len(Path(pcdist.__file__).parents) + 2) + str(outside.with_suffix(""))[1:]
    assert choice_keys(f"model={relative}") == () and choice_keys("model=cnn"), "model=cnn sets its keys"
