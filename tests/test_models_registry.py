"""The model registry (pcdist/service/models.py): a model registered by name trains through ``pcdist.train``
with the layers its builder made (model.json, the network, evaluation), and an unknown model.name still gets its
one line."""

import json
import math

import pytest

import pcdist
from pcdist.engine.network import mlp_specs
from pcdist.service.models import MODELS, Model, register_model

QUICK = {"trainer.max_steps": 4, "trainer.eval_every": 2, "trainer.log_every": 1, "trainer.ckpt_every": 2,
         "trainer.progress": "off", "logger": "none"}


class Funnel(Model):
    """A tiny MLP variant: the data's features, one hidden layer of model.width, the classes."""

    name, layers_key = "funnel", "model.width"

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
