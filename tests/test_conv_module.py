"""The conv and module kinds against the independent autograd reference, in float64.

The reference (tests/reference.py ``pc_step``) predicts each layer by calling the user's own
torch modules (nn.Conv2d, nn.MaxPool2d, nn.LayerNorm, ...) and takes every gradient from
torch.autograd of the energy; pcdist computes the same steps with its conv kind (aten
convolution and its backward, pooling backward with saved indices) and its module kind
(torch.func VJPs, vmapped stacks). After every step the value nodes, energies and weights
must agree to 1e-10.
"""

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import pcdist
from pcdist.engine.layers import AnyModule
from pcdist.engine.network import split_sequential
from reference import Gate, pc_step

pytestmark = pytest.mark.usefixtures("single_thread")

DT = torch.float64
ATOL = 1e-10


class Residual(nn.Module):
    """A small attention-free residual block: h + 0.5 tanh(W LayerNorm(h))."""

    def __init__(self, d):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, h):
        return h + 0.5 * torch.tanh(self.lin(self.norm(h)))


class Branchy(nn.Module):
    """tanh(W h + b), chosen by a data-dependent Python branch that vmap cannot trace."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        s = self.lin(h)
        return torch.tanh(s) if float(s.detach().abs().max()) < 1e6 else s


def conv_net(name):
    """(layers: one module per PC layer, input shape)."""
    torch.manual_seed(sum(map(ord, name)))
    if name == "2d-maxpool-fused":  # layers 2 and 3 stack into one group of K = 2
        seq = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
                            nn.Conv2d(3, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 3, 3, padding=1), nn.ReLU(),
                            nn.Flatten(), nn.Linear(48, 4))
        shape = (1, 8, 8)
    elif name == "2d-stride-avgpool":
        seq = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.GELU(), nn.AvgPool2d(2, 1),
                            nn.Conv2d(4, 4, (3, 2), padding=(1, 0), bias=False), nn.Sigmoid(),
                            nn.Flatten(), nn.Linear(4 * 3 * 2, 6), nn.Tanh(), nn.Linear(6, 4))
        shape = (2, 7, 7)
    elif name == "2d-dilated-grouped":
        seq = nn.Sequential(nn.Conv2d(2, 4, 3, padding=2, dilation=2), nn.Tanh(),
                            nn.Conv2d(4, 4, 3, padding="same", groups=2), nn.LeakyReLU(0.1), nn.MaxPool2d(3, 2, 1),
                            nn.Flatten(), nn.Linear(4 * 3 * 3, 4))
        shape = (2, 6, 6)
    elif name == "2d-grouped-stack":  # three equal layers with grouped, bias-free convolutions and a 3 / 1 pooling
        same = [nn.Conv2d(4, 4, 3, padding=1, groups=2, bias=False), nn.Tanh(), nn.AvgPool2d(3, 1, 1)]
        seq = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), *[copy.deepcopy(m) for m in same * 3],
                            nn.Flatten(), nn.Linear(4 * 5 * 5, 4))
        shape = (2, 5, 5)
    else:  # "1d": two stacked 1-D layers, max pooling, then a dense output
        seq = nn.Sequential(nn.Conv1d(2, 4, 5, padding=2), nn.Tanh(), nn.Conv1d(4, 4, 3, padding=1), nn.Tanh(),
                            nn.Conv1d(4, 4, 3, padding=1), nn.Tanh(), nn.Conv1d(4, 4, 3, padding=1), nn.Tanh(),
                            nn.MaxPool1d(2),
                            nn.Flatten(), nn.Linear(4 * 5, 4))
        shape = (2, 10)
    return list(split_sequential(seq.to(DT))), shape


def module_net(name):
    torch.manual_seed(sum(map(ord, name)))
    if name == "layernorm-linear":
        layers = [nn.Linear(5, 7), nn.Sequential(nn.LayerNorm(7), nn.Linear(7, 7), nn.Tanh()),
                  nn.Sequential(nn.LayerNorm(7), nn.Linear(7, 7), nn.Tanh()), nn.Linear(7, 4)]
        layers[0] = nn.Sequential(layers[0], nn.Tanh())
    elif name == "residual-blocks":  # three identical blocks: one vmapped group of K = 3
        layers = [nn.Sequential(nn.Linear(5, 7), nn.Tanh()), Residual(7), Residual(7), Residual(7), nn.Linear(7, 4)]
    else:  # "mixed": conv, a generic block on an image node, dense, residual (μPC) and generic
        layers = [nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU()),
                  Gate(2),
                  nn.Sequential(nn.Flatten(), nn.Linear(2 * 4 * 4, 6), nn.Tanh()),
                  pcdist.ResidualLinear(6, 6, "tanh", scale=0.4, dtype=DT),
                  Residual(6), nn.Linear(6, 4)]
    return [m.to(DT) for m in layers], ((1, 4, 4) if name == "mixed" else (5,))


def compare(layers, shape, energy, algorithm, x_momentum, optimizer, steps=3, T=4):
    net = pcdist.PCNetwork.from_layers(copy.deepcopy(layers), energy=energy, input_shape=shape)
    make_opt = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                "adamw": lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.01)}[optimizer]
    trainer = pcdist.PCTrainer(net, make_opt(net.parameters()), T=T, x_lr=0.1, x_momentum=x_momentum,
                               algorithm=algorithm)
    ref = copy.deepcopy(layers)
    params = [p for m in ref for p in m.parameters()]
    opt = make_opt(params)
    gen = torch.Generator().manual_seed(7)
    for s, B in enumerate((5, 7, 6)[:steps]):
        x = torch.randn(B, *shape, generator=gen, dtype=DT)
        y = nn.functional.one_hot(torch.randint(0, 4, (B,), generator=gen), 4).to(DT)
        stats = trainer.step(x, y)
        ref_stats, hs = pc_step(lambda l, h: ref[l - 1](h), len(ref), params, opt, x, y, T, 0.1, x_momentum,
                                algorithm, energy)
        for n, (a, b) in enumerate(zip(trainer.value_nodes(), hs)):
            assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m: f"step {s}: h_{n}: {m}")
        assert stats["energy"] == pytest.approx(ref_stats["energy"], abs=ATOL, rel=0)
        assert stats["layer_energies"] == pytest.approx(ref_stats["layer_energies"], abs=ATOL, rel=0)
        for a, b in zip(net.to_layers().parameters(), params):
            assert_close(a.detach(), b.detach(), atol=ATOL, rtol=0, msg=lambda m: f"step {s}: weights: {m}")
    with torch.no_grad():
        assert_close(net(x), nn.Sequential(*ref)(x), atol=ATOL, rtol=0)
    return net


CONV = ["2d-maxpool-fused", "2d-stride-avgpool", "2d-dilated-grouped", "1d"]
MODES = [("pc", 0.0, "se", "sgd"), ("pc", 0.5, "ce", "adamw"), ("ipc", 0.0, "ce", "sgd"), ("ipc", 0.5, "se", "adamw")]


@pytest.mark.parametrize("algorithm,x_momentum,energy,optimizer", MODES, ids=["-".join(map(str, m)) for m in MODES])
@pytest.mark.parametrize("name", CONV)
def test_conv_kind_equals_the_reference(name, algorithm, x_momentum, energy, optimizer):
    layers, shape = conv_net(name)
    net = compare(layers, shape, energy, algorithm, x_momentum, optimizer)
    kinds = [g.kind.kind for g in net.groups]
    assert "conv" in kinds and "module" not in kinds, kinds
    if name in ("2d-maxpool-fused", "1d"):
        assert any(g.kind.kind == "conv" and g.K == 2 for g in net.groups), "equal conv layers form one group"


@pytest.mark.parametrize("channels_last", ["0", "1"])
@pytest.mark.parametrize("algorithm,x_momentum,energy,optimizer", MODES[::2],
                         ids=["-".join(map(str, m)) for m in MODES[::2]])
@pytest.mark.parametrize("name", ["2d-maxpool-fused", "2d-grouped-stack", "1d"])
def test_a_groups_convolutions_as_one_grouped_convolution_equal_the_reference(name, algorithm, x_momentum, energy,
                                                                             optimizer, channels_last, monkeypatch):
    """PCDIST_CONV_GROUPED=1: a group's K convolutions run as one, K times the groups (GPUs choose it where faster):
    every step equals the layer-by-layer reference, row-major and channels-last, and the groups do run grouped."""
    monkeypatch.setenv("PCDIST_CONV_GROUPED", "1")
    monkeypatch.setenv("PCDIST_CHANNELS_LAST", channels_last)
    layers, shape = conv_net(name)
    net = compare(layers, shape, energy, algorithm, x_momentum, optimizer)
    st = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=1).stage(4)
    assert [g.K for g in st.groups if getattr(g, "grouped", None) is not None] == \
        [g.K for g in net.groups if g.kind.kind == "conv" and g.K > 1] == ([3] if name == "2d-grouped-stack" else [2])


@pytest.mark.parametrize("channels_last", ["0", "1"])
def test_autos_timing_of_a_grouped_convolution_runs_once_per_shape(channels_last, monkeypatch):
    """PCDIST_CONV_GROUPED=auto times a group grouped against layer by layer once per shape (on a GPU, where it is
    used; its timing and its key run here on the host clock): the choice is kept, and a second call times nothing."""
    from pcdist.engine.layers import conv

    monkeypatch.setenv("PCDIST_CONV_GROUPED", "1")
    monkeypatch.setenv("PCDIST_CHANNELS_LAST", channels_last)
    layers, shape = conv_net("2d-grouped-stack")
    net = compare(layers, shape, "se", "pc", 0.0, "sgd")
    (g,) = [g for g in pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=1).stage(4).groups
            if getattr(g, "grouped", None) is not None]
    conv._GROUPED.clear()
    calls = []
    monkeypatch.setattr(conv, "timed", lambda fn, reps, device: (calls.append(device), fn(), float(len(calls)))[-1])
    first = g.grouped.faster(g.x2, g.d)
    assert calls == [g.x2.device] * 2 and first is True and len(conv._GROUPED) == 1  # 1 ms < 0.9 x 2 ms: grouped
    assert g.grouped.faster(g.x2, g.d) is first and len(calls) == 2, "a shape seen before is not timed again"


CL_CASES = [(name, *m) for name in CONV[:3] for m in MODES] + [("mixed", *MODES[0])]  # mixed: a module reads node 1


@pytest.mark.parametrize("name,algorithm,x_momentum,energy,optimizer", CL_CASES,
                         ids=["-".join(map(str, c)) for c in CL_CASES])
def test_channels_last_nodes_equal_the_reference(name, algorithm, x_momentum, energy, optimizer, monkeypatch):
    """With PCDIST_CHANNELS_LAST=1 the image nodes 2-D convolutions read are stored channels-last, and so are their
    groups' buffers and weight copies (refreshed after every weight change: iPC changes them at each inference
    step): the steps equal the reference as the row-major ones do. So does a dense layer reading a conv layer's
    channels-last output (its weight's rows copied into that order, its gradient back). A node read by a module
    layer (any code) stays row-major, as does every node of its run of equal shapes."""
    from pcdist.engine.nodes import is_channels_last

    monkeypatch.setenv("PCDIST_CHANNELS_LAST", "1")
    layers, shape = conv_net(name) if name != "mixed" else module_net(name)
    net = compare(layers, shape, energy, algorithm, x_momentum, optimizer, steps=1 if name == "mixed" else 3)
    st = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=1).stage(4)
    layouts = [is_channels_last(st.node(n)) for n in range(net.num_layers + 1)]
    # 2d-maxpool-fused: node 0 has one channel (row-major and channels-last at once)
    want = {"2d-maxpool-fused": [False, True, True, True, False],
            "2d-stride-avgpool": [True, True, True, False, False],
            "2d-dilated-grouped": [True, True, True, False],
            "mixed": [False] * 7}[name]  # node 1 is read by a module layer
    assert layouts == want


@pytest.mark.parametrize("algorithm,x_momentum,energy,optimizer", MODES, ids=["-".join(map(str, m)) for m in MODES])
@pytest.mark.parametrize("name", ["layernorm-linear", "residual-blocks", "mixed"])
def test_module_kind_equals_the_reference(name, algorithm, x_momentum, energy, optimizer):
    layers, shape = module_net(name)
    net = compare(layers, shape, energy, algorithm, x_momentum, optimizer)
    kinds = [g.kind.kind for g in net.groups]
    assert "module" in kinds, kinds
    if name == "residual-blocks":
        assert [g.K for g in net.groups] == [1, 3, 1], "the three identical blocks stack into one group"
    if name == "mixed":
        assert kinds == ["conv", "module", "dense", "residual", "module", "dense"]


@pytest.mark.parametrize("algorithm", ["pc", "ipc"])
def test_a_convolution_as_the_output_layer_predicts_images_as_the_reference(algorithm):
    """Images at the top (a conv decoder's last layer, nn.Conv2d given as a module): the module kind, equal to
    the reference's steps (it was refused, saying the output energy acts on a vector)."""
    torch.manual_seed(5)
    layers = [nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh()), nn.Conv2d(3, 2, 3, padding=1)]
    layers = [m.to(DT) for m in layers]
    net = pcdist.PCNetwork.from_layers(copy.deepcopy(layers), input_shape=(1, 4, 4))
    assert [g.kind.kind for g in net.groups] == ["conv", "module"]
    trainer = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.05), T=4, x_lr=0.1, algorithm=algorithm)
    ref = copy.deepcopy(layers)
    params = [p for m in ref for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    gen = torch.Generator().manual_seed(1)
    for B in (5, 3):
        x, y = torch.randn(B, 1, 4, 4, generator=gen, dtype=DT), torch.randn(B, 2, 4, 4, generator=gen, dtype=DT)
        stats = trainer.step(x, y)
        want, hs = pc_step(lambda l, h: ref[l - 1](h), 2, params, opt, x, y, 4, 0.1, 0.0, algorithm, "se")
        assert stats["energy"] == pytest.approx(want["energy"], abs=ATOL, rel=0)
        for a, b in zip(trainer.value_nodes(), hs):
            assert_close(a, b, atol=ATOL, rtol=0)
        for a, b in zip(net.to_layers().parameters(), params):
            assert_close(a.detach(), b.detach(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("algorithm,x_momentum", [("pc", 0.0), ("pc", 0.5), ("ipc", 0.0)])
def test_module_kind_on_linear_tanh_equals_the_dense_kind(algorithm, x_momentum):
    """The generic path (AnyModule) and the fused dense path compute the same steps to 1e-12."""
    torch.manual_seed(3)
    blocks = split_sequential(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                                            nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT))
    nets = [pcdist.PCNetwork.from_layers(copy.deepcopy(blocks), energy="ce"),
            pcdist.PCNetwork.from_layers([copy.deepcopy(blocks[0])] + [AnyModule(copy.deepcopy(m)) for m in blocks[1:]],
                                         energy="ce")]
    assert [g.kind.kind for g in nets[1].groups] == ["dense", "module", "module"]
    trainers = [pcdist.PCTrainer(n, torch.optim.SGD(n.parameters(), lr=0.05), T=4, x_lr=0.1, x_momentum=x_momentum,
                                 algorithm=algorithm) for n in nets]
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(6, 5, generator=gen, dtype=DT)
        y = torch.eye(3, dtype=DT)[torch.randint(0, 3, (6,), generator=gen)]
        a, b = (t.step(x, y) for t in trainers)
        assert a["energy"] == pytest.approx(b["energy"], abs=1e-12, rel=0)
        for p, q in zip(*(t.value_nodes() for t in trainers)):
            assert_close(p, q, atol=1e-12, rtol=0)
    for p, q in zip(*(n.to_sequential().parameters() for n in nets)):
        assert_close(p.detach(), q.detach(), atol=1e-12, rtol=0)


def test_a_module_vmap_cannot_run_runs_layer_by_layer_with_the_same_numbers():
    torch.manual_seed(5)
    layers = [m.to(DT) for m in (nn.Sequential(nn.Linear(5, 7), nn.Tanh()), Branchy(7), Branchy(7), nn.Linear(7, 4))]
    net = compare(layers, (5,), "se", "pc", 0.5, "sgd")
    trainer = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=2, x_lr=0.1)
    bound = [b for b in trainer.stage(4).groups if b.g.kind.kind == "module"]
    assert [b.K for b in bound] == [2] and not bound[0].batched, "the two blocks stack, and run looped"


def test_equal_module_layers_keep_their_own_buffers_and_settings():
    """Two Linear + BatchNorm (eval) + Tanh blocks with other running statistics stack into one group, each with
    its own statistics; two blocks that differ only in a plain attribute (a scale the repr does not show) do not
    stack. Either way the network computes what the modules do, before and after to_sequential."""
    class Scaled(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.lin, self.c = nn.Linear(6, 6), c

        def forward(self, h):
            return torch.tanh(self.c * self.lin(h))

    def block(mean, var):
        bn = nn.BatchNorm1d(6).eval()
        bn.running_mean.fill_(mean)
        bn.running_var.fill_(var)
        return nn.Sequential(nn.Linear(6, 6), bn, nn.Tanh())

    torch.manual_seed(0)
    x = torch.randn(5, 4)
    for middle, K in (([block(0.0, 1.0), block(3.0, 0.1)], 2), ([Scaled(1.0), Scaled(5.0)], 1)):
        layers = [nn.Sequential(nn.Linear(4, 6), nn.Tanh()), *middle, nn.Linear(6, 3)]
        net = pcdist.PCNetwork.from_layers(layers, input_shape=(4,))
        assert max(g.K for g in net.groups if g.kind.kind == "module") == K
        with torch.no_grad():
            assert_close(net(x), nn.Sequential(*layers)(x), atol=1e-6, rtol=0)
            assert_close(net.to_sequential()(x), nn.Sequential(*layers)(x), atol=1e-6, rtol=0)


def test_round_trip_of_a_conv_network():
    """from_sequential copies the weights; to_sequential gives back the same modules and outputs."""
    torch.manual_seed(4)
    seq = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1),
                        nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(16, 10, bias=False)).to(DT)
    net = pcdist.PCNetwork.from_sequential(seq, energy="ce", input_shape=(1, 8, 8))
    back = net.to_sequential()
    assert [type(m) for m in back] == [type(m) for m in seq]
    for p, q in zip(back.parameters(), seq.parameters()):
        assert torch.equal(p, q)
    x = torch.randn(3, 1, 8, 8, dtype=DT)
    assert_close(net(x), seq(x), atol=1e-13, rtol=0)


@pytest.mark.parametrize("build, message", [
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)),
     r"module 1 \(LayerNorm\) cannot be placed where a value node would go; .*PCNetwork.from_layers"),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Dropout(0.1), nn.Linear(4, 2)),
     r"module 2 \(Dropout\) cannot be placed where a value node would go"),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.ReLU(), nn.Linear(4, 2)),
     r"module 2 \(ReLU\): two activations in a row cannot be placed where a value node would go"),
    (lambda: nn.Sequential(nn.Flatten(), nn.ReLU(), nn.Linear(4, 2)), r"module 1 \(ReLU\) follows the nn.Flatten"),
])
def test_from_sequential_names_the_module_it_cannot_place(build, message):
    with pytest.raises(ValueError, match=message):
        pcdist.PCNetwork.from_sequential(build())


def test_from_sequential_explains_a_trailing_softmax_and_runs_other_elementwise_modules_as_modules():
    """A trailing Softmax is what energy='ce' applies itself (the output layer's u_L are the logits); SiLU is a
    fused activation (the dense kind); an elementwise module without a fused path (Hardswish) is not refused:
    its layer runs through the module kind, and a warning says so."""
    with pytest.raises(ValueError, match=r"^module 3 \(Softmax\) after the output layer: leave it out; energy='ce' "
                                         r"applies the softmax"):
        pcdist.PCNetwork.from_sequential(nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 3), nn.Softmax(-1)),
                                         energy="ce")
    seq = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 8), nn.Hardswish(), nn.Linear(8, 3)).double()
    with pytest.warns(UserWarning, match=r"Hardswish \(module 3\) is not among the fused activations .*; such a layer "
                                         r"runs through the module kind"):
        net = pcdist.PCNetwork.from_sequential(seq, energy="ce")
    assert [g.kind.kind for g in net.groups] == ["dense", "module", "dense"]
    x = torch.randn(5, 4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(net(x), seq(x), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match=r"the output layer must not be followed by an activation \(found Hardswish\)"):
        pcdist.PCNetwork.from_sequential(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.Hardswish()))


def test_an_unfused_activation_in_the_first_layer_runs_as_a_module_without_an_input_shape():
    """The warning's promise holds for layer 1 too: its nn.Linear tells the input node's width (it used to need
    input_shape, and from_sequential failed after the warning)."""
    seq = nn.Sequential(nn.Linear(4, 8), nn.SELU(), nn.Linear(8, 3)).double()
    with pytest.warns(UserWarning, match=r"SELU \(module 1\) is not among the fused activations"):
        net = pcdist.PCNetwork.from_sequential(seq, energy="ce")
    assert [g.kind.kind for g in net.groups] == ["module", "dense"] and net.node_shapes[0] == (4,)
    x = torch.randn(5, 4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(net(x), seq(x), atol=1e-12, rtol=0)
    for p, q in zip(net.to_sequential().parameters(), seq.parameters()):
        assert torch.equal(p, q)


def test_conv_networks_need_their_input_shape_and_a_flatten():
    seq = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 6 * 6, 3))
    with pytest.raises(ValueError, match="give input_shape"):
        pcdist.PCNetwork.from_sequential(seq)
    with pytest.raises(ValueError, match=r"reads the node of shape \[2, 6, 6\] with an nn.Linear: put nn.Flatten\(\)"):
        pcdist.PCNetwork.from_layers([nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()), nn.Linear(72, 3)],
                                     input_shape=(1, 8, 8))


@pytest.mark.parametrize("module, message", [
    (nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()), r"BatchNorm1d\) is in training mode"),
    (nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2), nn.Tanh()), r"Dropout\) draws a new mask at every inference step"),
])
def test_running_statistics_and_randomness_are_refused_in_training_mode(module, message):
    layers = [nn.Sequential(nn.Linear(3, 4), nn.Tanh()), module, nn.Linear(4, 2)]
    with pytest.raises(ValueError, match=message):
        pcdist.PCNetwork.from_layers(layers)
    module.eval()  # fixed statistics / the identity: a deterministic function of the node, allowed
    net = pcdist.PCNetwork.from_layers(layers)
    assert net.groups[1].kind.kind == "module"
    with torch.no_grad():
        x = torch.randn(3, 3)
        assert_close(net(x), nn.Sequential(*layers)(x))


def test_a_bad_channels_last_setting_is_refused_naming_the_allowed_ones(monkeypatch):
    """PCDIST_CHANNELS_LAST is auto, 0 or 1: anything else is an error naming the variable, not a silent default."""
    monkeypatch.setenv("PCDIST_CHANNELS_LAST", "yes")
    layers, shape = conv_net("2d-stride-avgpool")
    net = pcdist.PCNetwork.from_layers(layers, input_shape=shape)
    with pytest.raises(ValueError, match=r"PCDIST_CHANNELS_LAST='yes': allowed auto, 0, 1"):
        pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=2).stage(3)


def test_auto_stores_channels_last_on_a_gpu_only_where_its_convolutions_run_on_tensor_cores(monkeypatch):
    """PCDIST_CHANNELS_LAST=auto on a CUDA device (the rule alone: no GPU needed): channels-last for bfloat16
    convolutions and for float32 ones in TF32, row-major in IEEE float32 (where an H200 measured NHWC slower);
    on a CPU with oneDNN channels-last whatever TF32 says; 1 and 0 force it."""
    from pcdist.engine.layers.conv import channels_last_nodes
    from pcdist.engine.models import conv_specs
    from pcdist.engine.precision import set_tf32, tf32_convolutions

    specs = conv_specs((3, 8, 8), [(4, 3, 1, "max"), (5, 3, 1, None)], [], 3, "relu")
    L, gpu, f32, bf16 = len(specs), torch.device("cuda"), torch.float32, torch.bfloat16
    conv_nodes = frozenset({0, 1, 2})  # the image nodes the two convolutions read, and the dense layer's input
    if hasattr(torch.backends.cudnn, "conv"):  # torch's newer TF32 settings (fp32_precision)
        flags, attr = (torch.backends.cuda.matmul, torch.backends.cudnn.conv), "fp32_precision"
    else:  # an older torch has only the allow_tf32 switches
        flags, attr = (torch.backends.cuda.matmul, torch.backends.cudnn), "allow_tf32"
    # process-wide: restored after the test, torch's legacy setting first (set_tf32 writes it, and the newer
    # switches put back to "none" read it: left at "high", a later run's tf32_state would have read TF32 on)
    legacy, before = torch.get_float32_matmul_precision(), [getattr(f, attr) for f in flags]
    try:
        set_tf32(False)
        assert not tf32_convolutions()
        assert channels_last_nodes(specs, 1, L + 1, f32, gpu) == frozenset()
        assert channels_last_nodes(specs, 1, L + 1, f32, gpu, bf16) == conv_nodes  # precision="bf16"
        if torch.backends.mkldnn.is_available():
            assert channels_last_nodes(specs, 1, L + 1, f32, torch.device("cpu")) == conv_nodes
        monkeypatch.setenv("PCDIST_CHANNELS_LAST", "1")
        assert channels_last_nodes(specs, 1, L + 1, f32, gpu) == conv_nodes
        monkeypatch.setenv("PCDIST_CHANNELS_LAST", "auto")
        set_tf32(True)
        assert tf32_convolutions()
        assert channels_last_nodes(specs, 1, L + 1, f32, gpu) == conv_nodes
        assert channels_last_nodes(specs, 2, L + 1, f32, gpu) == frozenset()  # a layer slice: as sent
        monkeypatch.setenv("PCDIST_CHANNELS_LAST", "0")
        assert channels_last_nodes(specs, 1, L + 1, f32, gpu, bf16) == frozenset()
    finally:
        torch.set_float32_matmul_precision(legacy)
        for f, v in zip(flags, before):
            setattr(f, attr, v)


CL_OPTS = {"newton": dict(init="newton"), "backward-adam": dict(init="backward", value_optimizer="adam"),
           "ipc-heun": dict(algorithm="ipc", solver="heun"), "noise": dict(value_noise=0.02)}


@pytest.mark.parametrize("opts", list(CL_OPTS.values()), ids=list(CL_OPTS))
def test_channels_last_steps_follow_row_major_ones_in_every_init_and_solver(opts, monkeypatch):
    """Channels-last nodes (PCDIST_CHANNELS_LAST=1; float64, so that round-off stays round-off through the inits'
    solves): the inits near equilibrium (which read the nodes through the layers' own functions), a value
    optimizer, an ODE solver and value noise give the row-major run's weights and energies."""
    from pcdist.engine.models import conv_specs
    from pcdist.engine.nodes import is_channels_last

    def trained(mode: str):
        monkeypatch.setenv("PCDIST_CHANNELS_LAST", mode)
        net = pcdist.PCNetwork(conv_specs((3, 6, 6), [(4, 3, 1, "max"), (5, 3, 1, None)], [], 3, "tanh"), seed=2,
                               dtype=DT)
        tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.05), T=3, x_lr=0.1, noise_seed=1, **opts)
        gen = torch.Generator().manual_seed(3)
        energies = [tr.step(torch.randn(5, 3, 6, 6, generator=gen, dtype=DT),
                            torch.eye(3, dtype=DT)[torch.arange(5) % 3])["energy"] for _ in range(3)]
        layouts = [is_channels_last(tr.stage(5).node(n)) for n in range(4)]
        return energies, [p.detach().clone() for p in net.parameters()], layouts

    (e_cl, w_cl, l_cl), (e_rm, w_rm, l_rm) = trained("1"), trained("0")
    assert l_cl == [True, True, True, False] and l_rm == [False] * 4
    assert e_cl == pytest.approx(e_rm, rel=1e-10)
    for a, b in zip(w_cl, w_rm):
        assert_close(a, b, atol=ATOL, rtol=0)
