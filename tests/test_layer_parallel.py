"""Layer- and data-parallel runs on real processes (gloo) equal the single-process run.

Each rank owns a slice of layers and only trades boundary tensors with its
neighbours (and keeps a replica of the upstream neighbour's last node, which must stay
bit-for-bit equal to the original); the data axis splits the batch. The maths must not change: value
nodes, weights and energies after several steps must equal one process to 1e-9
(float64), for P in {2, 3, 4}, a 2 x 2 data x layer mesh and uneven splits, for MLPs (dense
layers), μPC networks (residual layers), a conv network ([C, H, W] boundary messages) and a
network mixing every kind; and in every mode of PC (generative, unsupervised with a learned
prior, a free top node), with precisions, a precision schedule, the bce energy and value noise.
"""

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import pcdist
from pcdist.engine.layers.prior import Prior
from pcdist.engine.network import split_sequential
from pcdist.engine.schedules import top_down
from pcdist.distributed.parallel import Parallel, ParallelDims, init_distributed
from reference import Gate
from spawn import run

DT = torch.float64


@dataclass(frozen=True)
class Case:
    dims: tuple
    layer: int
    data: int = 1
    algorithm: str = "pc"
    energy: str = "se"
    x_momentum: float = 0.0
    micro_batches: int = 1
    optimizer: str = "sgd"
    steps: int = 3
    B: int = 8
    T: int = 4
    init: str = "ff"
    prepost: bool = True  # gloo's early receives; False: one batch_isend_irecv per step (NCCL's way)
    mupc: str | None = None  # the activation of a μPC network with dims = (d_in, width, depth, d_out)
    net: str | None = None  # "conv" or "mixed": the network of ``layers_of`` (dims unused)
    bottom: str = "clamped"  # "free" (h_0 inferred, with its prior) or "onehot" (a label at h_0: generative)
    top: str = "clamped"  # "free": h_L inferred
    prior: tuple = (1.0, "zero")  # (precision, mean) of a free h_0
    precision: float | tuple | None = None
    schedule: float | None = None  # the decay of a top_down precision schedule
    noise: float = 0.0
    compile: str = "none"  # "graph": the capturable core (device-side skip and learning rates), eager on a CPU
    skip: float | None = None  # skip_above; step 1's target is then scaled by 1e3, so that step diverges
    value_optimizer: str = "sgd"  # issue 30: the value optimizers and solvers
    solver: str = "euler"
    x_lr: float = 0.1


def pc_kwargs(case):
    """The network's energy and the trainer's schedule, noise, skip and compile mode of a case."""
    net = dict(energy=case.energy, precision=case.precision, prior=Prior(*case.prior))
    trainer = dict(precision_schedule=None if case.schedule is None else top_down(case.schedule),
                   value_noise=case.noise, noise_seed=3, compile=case.compile, skip_above=case.skip,
                   value_optimizer=case.value_optimizer, solver=case.solver)
    return net, trainer


CASES = {
    "P2-pc-se-momentum": Case((6, 8, 8, 8, 8, 4), layer=2, x_momentum=0.5, micro_batches=2),
    "P4-ipc-ce": Case((6, 8, 8, 8, 8, 8, 4), layer=4, algorithm="ipc", energy="ce", optimizer="adamw"),
    "D2xP2-pc-ce": Case((6, 8, 8, 8, 4), layer=2, data=2, energy="ce", optimizer="adamw", x_momentum=0.3),
    "D2xP2-ipc-se": Case((6, 8, 8, 8, 4), layer=2, data=2, algorithm="ipc", micro_batches=3),
    "P2-deeppcr-init": Case((6, 8, 8, 8, 8, 8, 4), layer=2, micro_batches=2, init="deeppcr"),
    "P2-ipc-one-batch-exchange": Case((6, 8, 8, 8, 8, 4), layer=2, algorithm="ipc", x_momentum=0.5, prepost=False),
    "uneven-7-over-3": Case((6, 8, 8, 5, 5, 5, 7, 4), layer=3, algorithm="ipc", energy="se", micro_batches=3,
                            x_momentum=0.5),
    "mupc-P2-pc-se": Case((6, 8, 8, 4), layer=2, mupc="relu", micro_batches=2),
    "mupc-P4-ipc-ce-momentum": Case((6, 8, 10, 4), layer=4, algorithm="ipc", energy="ce", x_momentum=0.5,
                                    optimizer="adamw", mupc="tanh"),
    "mupc-D2xP2-pc-ce": Case((6, 8, 6, 4), layer=2, data=2, energy="ce", optimizer="adamw", mupc="gelu",
                             micro_batches=2),
    "mupc-uneven-7-over-3-deeppcr": Case((6, 8, 7, 4), layer=3, x_momentum=0.3, mupc="tanh", init="deeppcr",
                                         micro_batches=3),
    "conv-P2-pc-se": Case((), layer=2, net="conv", micro_batches=2),
    "conv-P3-ipc-ce-momentum": Case((), layer=3, net="conv", algorithm="ipc", energy="ce", x_momentum=0.5,
                                    optimizer="adamw"),
    "conv-D2xP2-pc-ce": Case((), layer=2, data=2, net="conv", energy="ce", micro_batches=2),
    "mixed-P2-pc-se-momentum": Case((), layer=2, net="mixed", x_momentum=0.5),
    "mixed-P3-ipc-ce": Case((), layer=3, net="mixed", algorithm="ipc", energy="ce", micro_batches=3),
    # The modes of PC: which ends are free, priors, precisions, energies, noise.
    "generative-P2-pc-momentum": Case((6, 8, 8, 8, 5), layer=2, bottom="onehot", x_momentum=0.5, micro_batches=2),
    "generative-P3-ipc-precision": Case((6, 8, 8, 8, 8, 5), layer=3, bottom="onehot", algorithm="ipc",
                                        precision=2.0, optimizer="adamw"),
    "generative-D2xP2-bce-noise": Case((6, 8, 8, 8, 5), layer=2, data=2, bottom="onehot", energy="bce", noise=0.05),
    # unequal local batches (7 rows over two data ranks: 4 and 3), each weighted by its size: the gradients, energies,
    # skip vote and noise rows of iPC with value noise and a skip
    "D2xP2-uneven-batch-ipc-noise-skip": Case((6, 8, 8, 8, 4), layer=2, data=2, algorithm="ipc", B=7, noise=0.05,
                                              optimizer="adamw", skip=1e3),
    "unsupervised-P2-learned-prior-noise": Case((6, 8, 8, 8, 5), layer=2, bottom="free", prior=(0.5, "learned"),
                                                noise=0.05, micro_batches=2),
    "unsupervised-P3-ipc-schedule": Case((6, 8, 8, 8, 8, 5), layer=3, bottom="free", algorithm="ipc",
                                         schedule=0.3, x_momentum=0.5),
    "unsupervised-D2xP2-learned-prior": Case((6, 8, 8, 8, 5), layer=2, data=2, bottom="free",
                                             prior=(1.0, "learned"), optimizer="adamw", noise=0.02),
    "unsupervised-D2xP2-fixed-prior": Case((6, 8, 8, 5), layer=2, data=2, bottom="free", energy="bce"),  # no prior
    # parameters: a group of none in the data axis's gradient buckets
    "free-top-P2-precision-schedule": Case((6, 8, 8, 8, 5), layer=2, top="free", precision=(0.5, 2.0, 1.5, 1.0),
                                           schedule=0.5, noise=0.05),
    "mupc-unsupervised-P3": Case((6, 8, 7, 4), layer=3, mupc="tanh", bottom="free", prior=(1.0, "learned"),
                                 noise=0.02, micro_batches=2),
    "conv-unsupervised-P3-image-prior": Case((), layer=3, net="conv", bottom="free", prior=(0.5, "uniform"),
                                             x_momentum=0.5),
    "mixed-unsupervised-D2xP2-bce": Case((), layer=2, data=2, net="mixed", bottom="free", energy="bce",
                                         prior=(1.0, "learned"), noise=0.02),
    # The capturable core: learning rates from the device, a diverged update skipped by every rank alike
    # (only the last slice sees the diverged target), boundary exchanges as host calls between its segments.
    "graph-core-P2-skip": Case((6, 8, 8, 8, 4), layer=2, compile="graph", skip=1e3, optimizer="adamw-fused",
                               micro_batches=2),
    "graph-core-D2xP2-ipc-skip-noise": Case((6, 8, 8, 8, 4), layer=2, data=2, algorithm="ipc", compile="graph",
                                            skip=1e3, optimizer="sgd-fused", noise=0.02, x_momentum=0.5),
    "skip-masked-restore-P3": Case((6, 8, 8, 8, 8, 4), layer=3, skip=1e3, optimizer="sgd", energy="ce"),
    # Issue 30: the value optimizers and solvers; the replica of each boundary node takes its owner's step.
    "nesterov-P2": Case((6, 8, 8, 8, 8, 4), layer=2, value_optimizer="nesterov", x_momentum=0.6, micro_batches=2),
    "adam-P3-ce": Case((6, 8, 8, 8, 8, 8, 4), layer=3, energy="ce", value_optimizer="adam", x_lr=0.02),
    "adamw-D2xP2-ipc": Case((6, 8, 8, 8, 4), layer=2, data=2, algorithm="ipc", value_optimizer="adamw", x_lr=0.03,
                            optimizer="adamw"),
    "heun-P2-ipc-one-batch-exchange": Case((6, 8, 8, 8, 8, 4), layer=2, algorithm="ipc", solver="heun",
                                           prepost=False),
    "rk4-P4-ce": Case((6, 8, 8, 8, 8, 8, 4), layer=4, energy="ce", solver="rk4"),
    "mupc-heun-P3": Case((6, 8, 7, 4), layer=3, mupc="tanh", solver="heun", micro_batches=2),
    "conv-adam-P2": Case((), layer=2, net="conv", value_optimizer="adam", x_lr=0.02),
    "mixed-rk4-D2xP2-unsupervised": Case((), layer=2, data=2, net="mixed", solver="rk4", bottom="free",
                                         prior=(1.0, "learned")),
    "unsupervised-adam-P3": Case((6, 8, 8, 8, 8, 5), layer=3, bottom="free", value_optimizer="adam", x_lr=0.02),
}


def layers_of(name):
    """(one module per PC layer, input shape) of the conv and mixed-kind networks."""
    torch.manual_seed(11)
    if name == "conv":
        seq = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
                            *[m for _ in range(3) for m in (nn.Conv2d(3, 3, 3, padding=1), nn.ReLU())],
                            nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Tanh(),
                            nn.Flatten(), nn.Linear(16, 6), nn.Tanh(), nn.Linear(6, 4))
        return split_sequential(seq.to(DT)), (1, 8, 8)
    layers = [nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU()), Gate(2), Gate(2),
              nn.Sequential(nn.Flatten(), nn.Linear(32, 6), nn.Tanh()), pcdist.ResidualLinear(6, 6, "tanh", scale=0.4),
              pcdist.ResidualLinear(6, 6, "tanh", scale=0.4), nn.Linear(6, 4)]
    return [m.to(DT) for m in layers], (1, 4, 4)


def specs_of(case):
    if case.net is not None:
        layers, shape = layers_of(case.net)
        return list(pcdist.PCNetwork.from_layers(layers, input_shape=shape).specs)
    if case.mupc is None:
        return pcdist.mlp_specs(case.dims)
    d_in, width, depth, d_out = case.dims
    return pcdist.mupc_specs(d_in, width, depth, d_out, case.mupc)


def make_optimizer(case, params):
    fused = case.optimizer.endswith("-fused")
    if case.optimizer.startswith("sgd"):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=fused)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01, fused=fused)


def batches(case):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(case.steps):
        specs = specs_of(case)
        d_in, d_out = specs[0].in_shape, specs[-1].out_features
        x = torch.randn(case.B, *d_in, generator=g, dtype=DT)
        y = torch.eye(d_out, dtype=DT)[torch.randint(0, d_out, (case.B,), generator=g)]
        if case.bottom == "onehot":  # generative: a label at h_0, data at h_L
            x = torch.eye(d_in[0], dtype=DT)[torch.randint(0, d_in[0], (case.B,), generator=g)]
            y = torch.rand(case.B, d_out, generator=g, dtype=DT)
        elif case.bottom == "free" or case.energy == "bce":  # unsupervised: data in [0, 1] at h_L
            y = torch.rand(case.B, d_out, generator=g, dtype=DT)
        if case.skip is not None and len(out) == 1:
            y = y * 1e3
        out.append((None if case.bottom == "free" else x, None if case.top == "free" else y))
    return out


def rows_of(t, rows):
    return None if t is None else t[rows]


def initial_state(case):
    if case.net is not None:
        layers, shape = layers_of(case.net)
        return pcdist.PCNetwork.from_layers(layers, input_shape=shape, **pc_kwargs(case)[0]).layer_state_dict()
    net = pcdist.PCNetwork(specs_of(case), dtype=DT, seed=7, **pc_kwargs(case)[0])
    return net.layer_state_dict()


def single_process(case):
    net_kw, tr_kw = pc_kwargs(case)
    net = pcdist.PCNetwork(specs_of(case), dtype=DT, init=False, **net_kw)
    net.load_layer_state_dict(initial_state(case))
    tr = pcdist.PCTrainer(net, make_optimizer(case, net.parameters()), T=case.T, x_lr=case.x_lr,
                          x_momentum=case.x_momentum, algorithm=case.algorithm, init=case.init, **tr_kw)
    stats, nodes = [], []
    for x, y in batches(case):
        stats.append(tr.step(x, y))
        nodes.append(tr.value_nodes())
    if case.skip is not None:
        assert tr.skipped_updates == (case.steps if case.algorithm == "pc" else case.steps * case.T) // case.steps, \
            "the diverged step's updates (and only those) are skipped"
    return net.layer_state_dict(), stats, nodes


def worker(rank, world, case, out_dir):
    init_distributed(timeout_s=60)
    specs = specs_of(case)
    par = Parallel.from_mesh(ParallelDims(case.data, case.layer), specs, micro_batches=case.micro_batches, timeout_s=60)
    assert par.prepost, "gloo (CPU) runs post receives a step ahead by default"
    par.prepost = case.prepost
    net_kw, tr_kw = pc_kwargs(case)
    net = pcdist.PCNetwork(specs, layers=par.layers, dtype=DT, init=False, **net_kw)
    net.load_layer_state_dict(initial_state(case))
    tr = pcdist.PCTrainer(net, make_optimizer(case, net.parameters()), T=case.T, x_lr=case.x_lr,
                          x_momentum=case.x_momentum, algorithm=case.algorithm, parallel=par, init=case.init, **tr_kw)
    rows = torch.tensor_split(torch.arange(case.B), case.data)[par.data_rank]
    stats, nodes = [], []
    for x, y in batches(case):
        tr.optimizer.zero_grad()  # grads set to None between steps must not detach them from the buckets
        stats.append(tr.step(rows_of(x, rows), rows_of(y, rows), global_batch=case.B))
        nodes.append(tr.value_nodes())
    torch.save({"layers": par.layers, "rows": rows, "state": net.layer_state_dict(), "stats": stats,
                "nodes": nodes, "logging": par.is_logging, "eager": list(tr.runner.eager.values()),
                "skipped": tr.skipped_updates}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.parametrize("name", list(CASES))
def test_parallel_run_equals_single_process(name, tmp_path):
    case = CASES[name]
    world = case.layer * case.data
    run(worker, world, case, str(tmp_path), timeout=180)
    ref_state, ref_stats, ref_nodes = single_process(case)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    covered = set()
    for res in results:
        a, b = res["layers"]
        for key, val in res["state"].items():  # weights: every rank holds its layers, equal to one process
            torch.testing.assert_close(val, ref_state[key], atol=1e-9, rtol=0, msg=key)
            covered.add(key)
        # value nodes h_{a-1} .. h_{b-1} of this rank's rows (h_{a-1}: h_0 or the replica)
        for step in range(case.steps):
            for i, n in enumerate(range(a - 1, b)):
                torch.testing.assert_close(res["nodes"][step][i], ref_nodes[step][n][res["rows"]], atol=1e-9, rtol=0,
                                           msg=f"step {step} node {n}")
    assert covered == set(ref_state), "the slices must cover every layer exactly"
    # The replica of h_{a-1} on rank r+1 is updated from the same tensors in the same order
    # as the owner's node on rank r: the two are bit-for-bit equal after every step.
    for rows in {tuple(res["rows"].tolist()) for res in results}:
        chain = sorted((res for res in results if tuple(res["rows"].tolist()) == rows), key=lambda res: res["layers"])
        for up, down in zip(chain, chain[1:]):
            for step in range(case.steps):
                assert torch.equal(up["nodes"][step][-1], down["nodes"][step][0]), (
                    f"step {step}: replica of node {down['layers'][0] - 1} differs from its owner's")
    logging = [res for res in results if res["logging"]]
    assert len(logging) == 1, "exactly one rank gathers the stats"
    for got, want in zip(logging[0]["stats"], ref_stats):
        assert abs(got["energy"] - want["energy"]) < 1e-9
        assert abs(got.get("prior_energy", 0.0) - want.get("prior_energy", 0.0)) < 1e-9
        torch.testing.assert_close(torch.tensor(got["layer_energies"]), torch.tensor(want["layer_energies"]),
                                   atol=1e-9, rtol=0)
    others = [res for res in results if not res["logging"]]
    assert all(s == {} for res in others for s in res["stats"])
    assert all(res["eager"] == [] for res in results), "the capturable core reads nothing on the host"
    if case.skip is not None:
        assert len({res["skipped"] for res in results}) == 1, "every rank skips the same updates"
    # The split really happened: every rank owns fewer layers than the whole (P > 1 cases).
    assert all(res["layers"][1] - res["layers"][0] < len(specs_of(case)) for res in results)
    if case.net is not None:
        kinds = {g.kind.kind for g in pcdist.PCNetwork(specs_of(case), dtype=DT).groups}
        assert kinds >= ({"conv", "dense"} if case.net == "conv" else {"conv", "module", "dense", "residual"}), kinds
    if name.startswith("mupc-uneven"):
        assert len({res["layers"][1] - res["layers"][0] for res in results}) > 1, "the split is uneven"


INFER_CASES = {"P2": (2, 1), "P3": (3, 1), "D2xP2": (2, 2)}
ADAPTIVE_TOL = 1e-4


def infer_worker(rank, world, layer, data, out_dir):
    """Inference at test time on a layer split: infer (gathered), classify, reconstruct, generate."""
    from pcdist.engine.modes import classify, generate, reconstruct

    init_distributed(timeout_s=60)
    specs = pcdist.mlp_specs([5, 8, 8, 8, 6], "tanh")
    par = Parallel.from_mesh(ParallelDims(data, layer), specs, timeout_s=60)
    net = pcdist.PCNetwork(specs, layers=par.layers, dtype=DT, seed=4, prior=Prior(0.5, "uniform"))
    tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=6, x_lr=0.1, parallel=par, noise_seed=2)
    g = torch.Generator().manual_seed(9)
    y = torch.rand(8, 6, generator=g, dtype=DT)
    rows = torch.tensor_split(torch.arange(8), data)[par.data_rank]
    got = {"nodes": tr.infer(None, y[rows], noise=0.1, global_batch=8), "labels": classify(tr, y[rows]),
           "adaptive": tr.infer(None, y[rows], solver="adaptive", tol=ADAPTIVE_TOL),
           "heun": tr.infer(None, y[rows], solver="heun"),
           "recon": reconstruct(tr, y[rows]),
           "gen": generate(tr, torch.eye(5, dtype=DT)[[0, 1, 2, 3, 4, 0, 1, 2]][rows])}
    if par.is_logging:
        torch.save(got, f"{out_dir}/logging.pt")
    else:
        assert all(v is None for v in got.values()), "only the logging rank gets the results"


@pytest.mark.parametrize("name", list(INFER_CASES))
def test_inference_at_test_time_on_a_layer_split_equals_one_process(name, tmp_path):
    """trainer.infer (nodes gathered onto the logging rank, value noise included; Heun and the adaptive solver,
    whose accepted and rejected steps are decided from one all-reduced error norm) and the modes' tests
    (classify, reconstruct, generate) on P layer ranks and a 2 x 2 mesh give one process's results."""
    from pcdist.engine.modes import classify, generate, reconstruct

    layer, data = INFER_CASES[name]
    run(infer_worker, layer * data, layer, data, str(tmp_path), timeout=180)
    got = torch.load(tmp_path / "logging.pt", weights_only=True)
    specs = pcdist.mlp_specs([5, 8, 8, 8, 6], "tanh")
    net = pcdist.PCNetwork(specs, dtype=DT, seed=4, prior=Prior(0.5, "uniform"))
    tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=6, x_lr=0.1, noise_seed=2)
    y = torch.rand(8, 6, generator=torch.Generator().manual_seed(9), dtype=DT)
    want = {"nodes": tr.infer(None, y, noise=0.1), "labels": classify(tr, y),
            "adaptive": tr.infer(None, y, solver="adaptive", tol=ADAPTIVE_TOL),
            "heun": tr.infer(None, y, solver="heun"),
            "recon": reconstruct(tr, y),
            "gen": generate(tr, torch.eye(5, dtype=DT)[[0, 1, 2, 3, 4, 0, 1, 2]])}
    assert len(got["nodes"]) == len(want["nodes"]) == 5
    for key in ("nodes", "heun", "adaptive"):  # the adaptive solver's steps are decided on every rank alike
        for a, b in zip(got[key], want[key]):
            torch.testing.assert_close(a, b, atol=1e-9, rtol=0, msg=key)
    assert torch.equal(got["labels"], want["labels"])
    torch.testing.assert_close(got["recon"], want["recon"], atol=1e-9, rtol=0)
    torch.testing.assert_close(got["gen"], want["gen"], atol=1e-9, rtol=0)
