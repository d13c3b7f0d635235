"""The model registry (pcdist/service/models.py): a model registered by name trains through ``pcdist.train``
with the layers its builder made (model.json, the network, evaluation), and an unknown model.name still gets its
one line."""

import dataclasses
import json
import math

import pytest
import torch

import pcdist
from pcdist.engine.network import mlp_specs
from pcdist.service.config import ModelConfig, compose, load_config
from pcdist.service.models import MODELS, Model, model_specs, register_model

QUICK = {"trainer.max_steps": 4, "trainer.eval_every": 2, "trainer.log_every": 1, "trainer.ckpt_every": 2,
         "trainer.progress": "off", "logger": "none", "logger.plots": False}


class Funnel(Model):
    """A tiny MLP variant: the data's features, one hidden layer of model.width, the classes."""

    name, layers_key, keys = "funnel", "model.width", ("width", "activation")

    def specs(self, c, bottom, top, classes):
        return mlp_specs([math.prod(bottom), c.model.width, math.prod(top)], c.model.activation)

    def num_layers(self, m):
        return 2


@pytest.fixture
def funnel():
    """Funnel registered as model.name=funnel for one test."""
    model = register_model(Funnel())
    yield model
    MODELS.pop("funnel")


def test_a_registered_model_trains_with_the_layers_its_builder_made(funnel, tmp_path):
    run_dir = tmp_path / "run"
    result = pcdist.train({**QUICK, "model.name": "funnel", "model.width": 16, "run_dir": str(run_dir)})
    assert 0.0 <= result["val/accuracy"] <= 1.0
    layers = json.loads((run_dir / "model.json").read_text())["layers"]
    assert [(x["kind"], x["fields"]["in_features"], x["fields"]["out_features"]) for x in layers] == [
        ("dense", 64, 16), ("dense", 16, 10)]
    assert result.network.num_layers == 2
    assert pcdist.load(run_dir).network.node_shapes == [(64,), (16,), (10,)]
    assert pcdist.evaluate(run_dir, write=False)["samples"] > 0


def test_the_registry_names_its_models_in_the_one_line_for_an_unknown_one(funnel, tmp_path):
    with pytest.raises(pcdist.ConfigError) as info:
        pcdist.train({**QUICK, "model.name": "funnell", "run_dir": str(tmp_path)})
    assert str(info.value) == "config model.name='funnell' is invalid: allowed mlp, mupc, cnn, vgg, deconv, funnel"
    with pytest.raises(pcdist.ConfigError) as info:
        pcdist.train({**QUICK, "model.name": "funnel", "parallel.layer": 3, "run_dir": str(tmp_path)})
    assert str(info.value) == ("config parallel.layer=3 is invalid: allowed at most the number of layers (2, from "
                               "model.width)")


def test_an_unknown_model_gets_the_same_one_line_as_before(tmp_path):
    with pytest.raises(pcdist.ConfigError) as info:
        pcdist.train({**QUICK, "model.name": "cnnn", "run_dir": str(tmp_path)})
    assert str(info.value) == "config model.name='cnnn' is invalid: allowed mlp, mupc, cnn, vgg, deconv"
    with pytest.raises(pcdist.ConfigError) as info:
        pcdist.train({"model": "cnnn", "run_dir": str(tmp_path)})
    assert str(info.value).startswith("model=cnnn: no such option in conf/model/ (options: ")
    assert str(info.value).endswith("); did you mean cnn?")


# A second valid value of every model key, and each built-in model on samples it takes (pc.mode, shape).
OTHER = {"dims": [64, 32, 10], "width": 64, "depth": 5, "activation": "tanh", "init": "orthogonal",
         "channels": [16, 8], "kernel_size": 5, "pool": ["avg", "avg"], "head": [16], "variant": "vgg7",
         "stride": [2, 1], "padding": [2, 1]}
ON = {"mlp": ("supervised", (64,)), "mupc": ("supervised", (64,)), "cnn": ("supervised", (1, 8, 8)),
      "vgg": ("supervised", (3, 32, 32)), "deconv": ("generative", (1, 8, 8))}


@pytest.mark.parametrize("name", list(ON))
def test_a_model_declares_exactly_the_keys_its_layers_read(name):
    """A key outside a model's ``keys`` leaves its layers as they are (so refusing it loses nothing), and each key in
    them changes its layers: the declaration the refusal below relies on, checked against the builders."""
    assert set(OTHER) == {f.name for f in dataclasses.fields(ModelConfig)} - {"name", "energy"}
    mode, shape = ON[name]
    c = load_config(compose([f"model={name}", f"pc.mode={mode}"] + ["model.energy=se"] * (mode != "supervised")))

    def layers(**change):
        return repr(model_specs(dataclasses.replace(c, model=dataclasses.replace(c.model, **change)), shape, 10))

    assert set(MODELS[name].keys) <= set(OTHER)
    for key, value in OTHER.items():
        assert (layers(**{key: value}) != layers()) == (key in MODELS[name].keys), key


def test_a_model_key_the_model_does_not_read_is_refused_not_ignored(tmp_path):
    """model.dims set beside model=cnn used to train the cnn as if it were not there; now one line names the key,
    the models that read it and the way out, from the command line and from pcdist.train's dict alike, and
    nothing is written."""
    want = (r"^model.dims=\[64,10\]: model.name=cnn does not read model.dims \(mlp does\), so it would change "
            r"nothing; drop it or pick model=mlp \(model.name=cnn reads model.energy, model.channels, ")
    run_dir = str(tmp_path / "run")
    for cfg in (["model=cnn", "model.dims=[64,10]", f"run_dir={run_dir}"],
                {"model": "cnn", "model.dims": [64, 10], "run_dir": run_dir},
                {"model": {"name": "cnn", "dims": [64, 10]}, "run_dir": run_dir}):
        with pytest.raises(pcdist.ConfigError, match=want):
            pcdist.train(cfg)
    with pytest.raises(pcdist.ConfigError, match=r"^model.channels=\[3\]: model.name=mupc does not read "
                                                 r"model.channels \(cnn and deconv do\)"):
        pcdist.train(["experiment=mupc_digits", "model.channels=[3]", f"run_dir={run_dir}"])
    with pytest.raises(pcdist.ConfigError, match=r"^model.width=8: the layers passed to pcdist.train\(cfg, "
                                                 r"layers=...\) does not read model.width \(mupc does\), so it would "
                                                 r"change nothing; drop it \(the layers"):
        pcdist.train({"model.width": 8, "run_dir": run_dir}, layers=[torch.nn.Linear(64, 10)])
    assert not (tmp_path / "run").exists()
