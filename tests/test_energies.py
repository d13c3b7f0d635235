"""Output energies are small objects in a registry (pcdist/engine/energies.py): one added by a user works by
its name in every layer kind that can be the output layer, and in the service.

The added energy is the Huber loss (quadratic within delta, linear beyond), written as an Energy with its own
signal, value and top-node gradient. The independent reference is the same Huber loss given as a plain
callable: pcdist takes a callable's signal and gradient from autograd, so the two paths share nothing but
the formula. In float64, three pc steps (and with a free top node) must agree to 1e-12.
"""

import copy

import pytest
import torch
from torch import nn

import pcdist
from pcdist.engine.energies import ENERGIES, Energy, energy_of, register_energy

DELTA = 0.3


def huber_callable(u, target):
    r = (target - u).abs()
    return torch.where(r <= DELTA, 0.5 * r**2, DELTA * (r - 0.5 * DELTA)).flatten(1).sum(1)


class Huber(Energy):
    """sum_k huber(h_k - u_k): 0.5 r^2 for |r| <= delta, delta (|r| - delta / 2) beyond."""

    name, free_top = "huber", True

    def signal(self, u, y, out):
        return torch.clamp(torch.sub(y, u, out=out), -DELTA, DELTA, out=out)

    def value(self, u, y, d, prec):
        e = huber_callable(u, y).sum()
        return e if prec is None else (e * prec).sum()

    def top_grad(self, u, y, d, prec, out):
        out.copy_(torch.clamp(y - u, -DELTA, DELTA))
        return out if prec is None else out.mul_(prec)


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_energy(Huber())
    yield
    ENERGIES.pop("huber")


def layers(kind):
    torch.manual_seed(5)
    if kind == "dense":
        return [nn.Sequential(nn.Linear(5, 6), nn.Tanh()), nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 3)]
    if kind == "residual":
        return list(pcdist.mupc_layers(5, 6, 4, 3, "tanh", dtype=torch.float64))
    return [nn.Sequential(nn.Linear(5, 6), nn.Tanh()), nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 3))]  # module


@pytest.mark.parametrize("free_top", [False, True])
@pytest.mark.parametrize("kind", ["dense", "residual", "module"])
def test_a_registered_energy_works_by_name_in_every_output_kind(kind, free_top):
    mods = [m.to(torch.float64) for m in layers(kind)]
    runs = {}
    for energy in ("huber", huber_callable):
        net = pcdist.PCNetwork.from_layers(copy.deepcopy(mods), energy=energy,
                                           precision=[1.0] * (len(mods) - 1) + [1.5])
        assert (kind == "module") == any(g.kind.kind == "module" for g in net.groups)
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.05), T=5, x_lr=0.1)
        g = torch.Generator().manual_seed(1)
        out = []
        for _ in range(3):
            x, y = (torch.randn(8, 5, generator=g, dtype=torch.float64),
                    torch.randn(8, 3, generator=g, dtype=torch.float64))
            out.append(tr.step(x, None if free_top else y)["energy"])
        runs[energy if isinstance(energy, str) else "callable"] = (out, list(net.parameters()), tr.value_nodes())
    (e_a, w_a, h_a), (e_b, w_b, h_b) = runs["huber"], runs["callable"]
    assert e_a == pytest.approx(e_b, abs=1e-12, rel=0)
    for a, b in zip(w_a + h_a, w_b + h_b):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert energy_of("huber").name == "huber"


def test_the_service_takes_a_registered_energy_by_name(tmp_path):
    """model.energy=huber passes the config's check (the registry's names) and trains."""
    out = pcdist.train({"logger": "none", "run_dir": str(tmp_path / "run"), "model": {"energy": "huber"},
                        "trainer": {"max_steps": 6, "eval_every": 6, "ckpt_every": 6, "log_every": 3,
                                    "progress": "off"}})
    assert out["step"] == 6 and out["val/accuracy"] > 0.0


def test_an_unknown_energy_names_the_registered_ones():
    with pytest.raises(ValueError, match="unknown energy 'hubr'; allowed: 'se', 'ce', 'bce', 'zero', 'huber'"):
        pcdist.PCNetwork.from_dims([4, 3], energy="hubr")
