"""The schema of a run's config: one dataclass per group (``ModelConfig`` ... ``LoggerConfig``, ``Config``),
a docstring under every key (``config_keys`` reads them for ``--help``), a ``check`` under each group's keys
that refuses their values out of range (the message names the key and what is allowed), and ``validate``,
which runs them and checks what spans groups. The defaults mirror ``conf/``'s (a test keeps
them equal), so ``Config()`` is the default run too. Composing it with Hydra, the overrides and the command
line's help are in config.py.

The checks read the engine's registries (activations, energies, solvers, ...) where they run: this module
imports no torch, so the command line refuses a mistyped key, a value of the wrong type and answers
``--help`` without loading torch (~0.5 s instead of ~2: tests/test_cli.py checks that torch stays out)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Optional


from ..errors import ConfigError


DATASETS = ("digits", "synthetic", "mnist", "fashion_mnist", "cifar10", "cifar100", "arrays", "signals")
ROOT_DATASETS = ("mnist", "fashion_mnist", "cifar10", "cifar100")
"""The data sets read from the standard files in data.root."""
PYTHON_DATA = "python"
LAYOUTS = ("auto", "channels_first")  # data.layout
"""data.name of a run whose data was passed to ``pcdist.train(cfg, data=...)``."""
PYTHON_MODEL = "python"
"""model.name of a run whose layers were passed to ``pcdist.train(cfg, layers=...)``."""
RESUME = ("auto", "never", "require")
BP = "bp"
"""pc.algorithm of the backprop twin (pcdist/service/backprop.py)."""


@dataclass
class ModelConfig:
    name: str = "mlp"
    """mlp (Linear + activation layers of widths model.dims), mupc (a μPC residual network of
    model.depth layers of width model.width), cnn (conv layers of model.channels, then dense
    model.head), vgg (PCX's VGG-5 / VGG-7, model.variant) or deconv (a conv decoder for images at
    h_L: a dense layer, then upsampling + conv layers of model.channels, for pc.mode=generative or
    unsupervised); mupc, cnn, vgg and deconv take their input and output shapes from the data."""
    dims: list[int] = field(default_factory=lambda: [64, 128, 128, 10])
    """mlp: widths input, hidden..., output. Must match the data (input features, classes)."""
    width: int = 128
    """mupc: width N of the hidden layers."""
    depth: int = 32
    """mupc: number of weight layers L (>= 2): an input layer, L - 2 residual layers, an output layer.
    python (layers passed to pcdist.train(cfg, layers=...)): their number, set by pcdist.train."""
    activation: str = "gelu"
    """Hidden activation (mupc: the phi applied to each residual layer's input): tanh, relu, leaky_relu,
    gelu, hard_tanh, sigmoid, identity, silu, softplus, elu, mish."""
    energy: str = "ce"
    """Output energy: se (squared error), ce (cross-entropy), bce (Bernoulli with logits: data in [0, 1]) or
    zero (no output energy, PCX's zero_energy)."""
    init: str = "default"
    """mlp: weight init, default (nn.Linear's) or orthogonal (orthogonal W, zero bias; for deep plain MLPs)."""
    channels: list[int] = field(default_factory=lambda: [32, 64])
    """cnn: output channels of each conv layer (one PC layer each: conv, activation, pooling); deconv: of each
    upsampling conv layer (each doubles the height and width)."""
    kernel_size: int = 3
    """cnn: kernel size of every conv layer (strides model.stride, padding model.padding: by default 1 and "same"
    for odd sizes). Conv2d layers on images [C, H, W], Conv1d on signals [C, L]."""
    pool: list[str] = field(default_factory=lambda: ["max", "max"])
    """cnn: pooling after each conv layer, 2 x 2 stride 2 (2 stride 2 on signals): max, avg or none (one entry per
    layer)."""
    head: list[int] = field(default_factory=list)
    """cnn: widths of the dense hidden layers between the flattened conv output and the output layer."""
    variant: str = "vgg5"
    """vgg: vgg5 or vgg7, PCX's (pcdist/engine/models.py), for 3 x 32 x 32 images."""
    stride: list[int] = field(default_factory=list)
    """cnn: stride of each conv layer (one entry per layer; empty: 1 for every layer)."""
    padding: list[int] = field(default_factory=list)
    """cnn: zero padding of each conv layer (one entry per layer; empty: model.kernel_size // 2, "same" for odd
    kernels at stride 1)."""


    def check(self) -> None:
        """Refuse a value out of its key's range (the chosen model's own checks: its ``Model.check``)."""
        from ..engine.activations import ACTIVATIONS
        from ..engine.energies import ENERGIES
        from ..engine.layers.dense import INITS as DENSE_INITS

        _check(len(self.dims) >= 2 and all(x >= 1 for x in self.dims), "model.dims", self.dims,
               "a list of at least two widths >= 1")
        _check(self.width >= 1, "model.width", self.width, "an integer >= 1")
        _check(self.depth >= 2, "model.depth", self.depth, "an integer >= 2 (input and output layers)")
        _check(self.init in DENSE_INITS, "model.init", self.init, ", ".join(DENSE_INITS))
        _check(len(self.channels) >= 1 and all(x >= 1 for x in self.channels), "model.channels", self.channels,
               "a list of at least one channel count >= 1")
        _check(self.kernel_size >= 1, "model.kernel_size", self.kernel_size, "an integer >= 1")
        _check(all(p in ("max", "avg", "none") for p in self.pool), "model.pool", self.pool,
               "a list of max, avg, none")
        _check(all(x >= 1 for x in self.head), "model.head", self.head, "a list of widths >= 1")
        for key, vals, low in (("model.stride", self.stride, 1), ("model.padding", self.padding, 0)):
            _check(all(v >= low for v in vals), key, vals, f"a list of integers >= {low}, one per conv layer")
        _check(self.variant in ("vgg5", "vgg7"), "model.variant", self.variant, "vgg5, vgg7")
        _check(self.activation in ACTIVATIONS, "model.activation", self.activation, ", ".join(ACTIVATIONS))
        _check(self.energy in ENERGIES, "model.energy", self.energy, ", ".join(ENERGIES))


@dataclass
class DataConfig:
    name: str = "digits"
    """digits (bundled, no download), synthetic, signals (generated 1-D signals [1, 64], ten motifs at random
    positions: pcdist/service/signals.py), mnist, fashion_mnist, cifar10, cifar100, arrays (your own, data.path)."""
    root: Optional[str] = None
    """Folder with the dataset's standard files (mnist, fashion_mnist, cifar10, cifar100)."""
    path: Optional[str] = None
    """arrays: an .npz holding x_train, y_train, x_val, y_val (loaded into memory), or a folder of
    x_train.npy, y_train.npy, x_val.npy, y_val.npy (memory-mapped, streamed by DataLoader workers).
    x: [N, features], [N, C, L] (1-D signals: model=cnn builds Conv1d layers) or [N, C, H, W], float or integer
    (uint8 is scaled to [0, 1]); y: integer class ids."""
    signal: bool = False
    """arrays: read x of shape [N, L] as 1-D signals of one channel, [N, 1, L] (for model=cnn's Conv1d layers);
    false: [N, L] are feature vectors."""
    layout: str = "auto"
    """Your own image or signal samples (data=arrays, or data given from Python), which conv models read
    channels-first ([C, H, W], [C, L]): auto refuses those that look channels-last (a last axis of at most 4,
    below the others: [H, W, C], [L, C]) with the transpose that mends them; channels_first reads them as given
    (signals [16, 3]: 16 channels of length 3)."""
    num_classes: Optional[int] = None
    """arrays: number of classes; None: the largest label + 1."""
    num_workers: int = 2
    """Streamed data (an arrays folder, torch Datasets): DataLoader worker processes per rank (0: load in the
    training process)."""
    prefetch_factor: int = 4
    """Streamed data: batches each worker loads ahead."""
    val_fraction: float = 0.2
    """digits: held-out fraction (fixed stratified split)."""
    synthetic_train: int = 2048
    """synthetic: number of training samples from the random teacher network."""
    synthetic_val: int = 512
    """synthetic: number of validation samples."""
    normalize: bool = False
    """Standardise every input channel by the training set's mean and standard deviation (in-memory data; a
    channel constant in training keeps a std of 1)."""
    augment: bool = False
    """Images: random crops after 4 pixels of zero padding and random horizontal flips of every training
    batch (PCX's CIFAR augmentation), drawn from (trainer.seed, step)."""


    def check(self) -> None:
        """Refuse a value out of its key's range."""
        _check(self.name in DATASETS or self.name == PYTHON_DATA, "data.name", self.name, ", ".join(DATASETS))
        _check(self.layout in LAYOUTS, "data.layout", self.layout, ", ".join(LAYOUTS))
        _check(self.num_classes is None or self.num_classes >= 1, "data.num_classes", self.num_classes,
               "null or an integer >= 1")
        _check(self.num_workers >= 0, "data.num_workers", self.num_workers, "an integer >= 0")
        _check(self.prefetch_factor >= 1, "data.prefetch_factor", self.prefetch_factor, "an integer >= 1")
        _check(0.0 < self.val_fraction < 1.0, "data.val_fraction", self.val_fraction, "a fraction in (0, 1)")
        _check(self.synthetic_train >= 1, "data.synthetic_train", self.synthetic_train, "an integer >= 1")
        _check(self.synthetic_val >= 1, "data.synthetic_val", self.synthetic_val, "an integer >= 1")

    def check_reads(self) -> None:
        """Refuse a key the chosen data set does not read (``check_combination``)."""
        if self.path is not None and self.name != "arrays":
            raise ConfigError(f"config data.path={self.path} is read by data=arrays only, but the data is {self.name}: "
                              f"add data=arrays (or leave out data.path)")
        if self.root is not None and self.name not in ROOT_DATASETS:
            raise ConfigError(f"config data.root={self.root} is read by data={', '.join(ROOT_DATASETS)} only, but the "
                              f"data is {self.name}: choose one of them (or leave out data.root; your own arrays: "
                              f"data=arrays data.path=...)")
        _check(self.num_classes is None or self.name in ("arrays", PYTHON_DATA), "data.num_classes", self.num_classes,
               f"null with data={self.name} (it has its own classes; data.num_classes is read by data=arrays)")
        _check(not self.signal or self.name == "arrays", "data.signal", self.signal,
               f"false with data={self.name} (it reads data=arrays' [N, L] inputs as one-channel signals)")


@dataclass
class PCConfig:
    T: int = 20
    """Inference steps per batch (>= 1)."""
    x_lr: Any = "auto"
    """Value-node learning rate (> 0), or auto: in supervised runs the largest of 1, 0.5, 0.2, 0.1, ... 0.001
    whose inference energy falls at every step and whose weight update stays within cos 0.99 of backprop's
    gradient at every layer on the first two batches (printed, and kept in the run directory's x_lr.json);
    0.1 in the other modes (docs/solvers.md)."""
    x_momentum: float = 0.0
    """Value-node momentum in [0, 1), reset every batch (pc.value_optimizer sgd: heavy ball; nesterov)."""
    value_optimizer: str = "sgd"
    """The value step: sgd (with pc.x_momentum), nesterov (needs pc.x_momentum > 0), adam or adamw (decay 0.01),
    state reset every batch (docs/solvers.md)."""
    solver: str = "euler"
    """Inference as an ODE: euler (the value optimizer's step), heun (2nd order, 2 evaluations a step) or rk4
    (4th order, 4); pc.T counts solver steps (docs/solvers.md)."""
    eval_solver: Optional[str] = None
    """The solver of the generative and unsupervised tests' inference: euler, heun, rk4 or adaptive (Heun steps
    of a size set by pc.eval_tol, to the time pc.eval_T x pc.x_lr); null: pc.solver."""
    eval_tol: float = 1e-3
    """The adaptive solver's tolerance on each step's error, relative to 1 + |h| (> 0)."""
    algorithm: str = "pc"
    """pc (one weight step per batch), ipc (a weight step at every inference step) or bp (the backprop
    twin: the same network, data, optimizer, schedule and seed trained by autograd on the output energy
    of the feed-forward pass; one process)."""
    init: str = "ff"
    """Value-node init: ff (feed-forward pass), deeppcr (fused groups solved by DeepPCR), or near the equilibrium
    of inference (supervised, one layer slice): newton (Newton's step, low-rank), newton_cr (the same step by
    cyclic reduction) or backward (one backward chain, scaled) (docs/solvers.md)."""
    mode: str = "supervised"
    """supervised (h_0 = data, h_L = label; test: feed-forward), generative (h_0 = label, h_L = data; test:
    classification by inference, val/accuracy, and reconstruction) or unsupervised (h_0 = a free latent of
    pc.latent_dim with its prior, h_L = data; test: reconstruction, val/reconstruction_mse)."""
    latent_dim: int = 10
    """unsupervised: width of the free latent h_0."""
    prior_precision: float = 1.0
    """pi_0 of a free h_0's prior 0.5 pi_0 ||h_0 - m_0||^2 (>= 0; 0 only where something else fixes the scale:
    weight decay in unsupervised training)."""
    prior_mean: str = "auto"
    """m_0: zero, uniform (1/width, a label node's init), learned (a parameter) or auto (uniform for generative,
    zero for unsupervised)."""
    precision: Any = None
    """Layers' precisions pi_l weighing their errors: null (all 1), a number (every hidden layer) or a list of
    one number >= 0 per layer."""
    precision_schedule: str = "none"
    """none or top_down (layers switched on from the top over the inference steps, pcdist.top_down; it acts after
    pc.init=backward/newton/newton_cr or under value noise: after the feed-forward init it changes nothing)."""
    precision_decay: float = 0.1
    """top_down: a layer's precision factor per layer below the error front, in [0, 1]."""
    eval_T: Optional[int] = None
    """Inference steps of the generative and unsupervised tests (null: pc.T)."""
    value_noise: float = 0.0
    """MCPC: the temperature tau of the Langevin noise h += sqrt(2 x_lr tau) xi in every training step's
    inference (>= 0; 0: none)."""
    diagnostics: bool = False
    """Compare PC with backprop every pc.diagnostics_every steps on the step's batch (pcdist.diagnose; supervised
    only): energy per layer at every inference step, cos and norm ratio of PC's weight update against backprop's
    gradient per layer, value change against activation scale; logged as diag/* in metrics.jsonl and wandb,
    drawn in diagnostics_*.png, and a warning with the likely fix when inference is unstable
    (docs/fidelity.md). Off: no cost."""
    diagnostics_every: Optional[int] = None
    """Steps between diagnostics (>= 1; null: trainer.eval_every); the first is taken before the first update."""


    def check(self) -> None:
        """Refuse a value out of its key's range, or pc.* values that do not go together."""
        from ..engine.arguments import ALGORITHMS, RULES, finite as _finite
        from ..engine.inference import SOLVERS
        from ..engine.layers.prior import PRIOR_MEANS
        from ..engine.modes import MODES
        from ..engine.schedules import PRECISION_SCHEDULES
        from ..engine.values import VALUE_OPTIMIZERS

        for name in ("T", "x_momentum", "init", "value_noise"):  # the engine's rules (engine/arguments.py)
            _check(RULES[name].ok(getattr(self, name)), f"pc.{name}", getattr(self, name), RULES[name].allowed)
        _check(self.x_lr == "auto" or RULES["x_lr"].ok(self.x_lr), "pc.x_lr", self.x_lr,
               f"{RULES['x_lr'].allowed} or auto")
        _check(self.value_optimizer in VALUE_OPTIMIZERS, "pc.value_optimizer", self.value_optimizer,
               ", ".join(VALUE_OPTIMIZERS))
        _check(self.value_optimizer != "nesterov" or self.x_momentum > 0, "pc.x_momentum", self.x_momentum,
               "a number in (0, 1) with pc.value_optimizer=nesterov")
        _check(not self.value_optimizer.startswith("adam") or self.x_momentum == 0, "pc.x_momentum", self.x_momentum,
               f"0 with pc.value_optimizer={self.value_optimizer} (Adam keeps its own averages)")
        _check(self.solver in SOLVERS, "pc.solver", self.solver,
               ", ".join(SOLVERS) + " (adaptive: pc.eval_solver only)")
        _check(self.eval_solver is None or self.eval_solver in (*SOLVERS, "adaptive"), "pc.eval_solver",
               self.eval_solver, "null, " + ", ".join((*SOLVERS, "adaptive")))
        for key, solver in (("pc.solver", self.solver), ("pc.eval_solver", self.eval_solver or "euler")):
            _check(solver == "euler" or self.value_optimizer == "sgd" and self.x_momentum == 0, key, solver,
                   f"euler with pc.value_optimizer={self.value_optimizer} pc.x_momentum={self.x_momentum} "
                   "(heun, rk4 and adaptive integrate the plain gradient flow)")
        _check(self.solver == "euler" or not self.value_noise, "pc.solver", self.solver, "euler with pc.value_noise > "
               "0 (MCPC's Langevin step is an Euler-Maruyama step; the tests' inference, pc.eval_solver, runs "
               "without the noise)")
        _check(_finite(self.eval_tol) and self.eval_tol > 0, "pc.eval_tol", self.eval_tol, "a finite number > 0")
        _check(self.algorithm in (*ALGORITHMS, BP), "pc.algorithm", self.algorithm, ", ".join((*ALGORITHMS, BP)))
        _check(self.init in ("ff", "deeppcr") or self.mode == "supervised", "pc.init", self.init,
               f"ff or deeppcr with pc.mode={self.mode} (the inits near equilibrium need both ends clamped)")
        _check(self.mode in MODES, "pc.mode", self.mode, ", ".join(MODES))
        _check(self.mode == "supervised" or self.algorithm != BP, "pc.algorithm", self.algorithm,
               f"pc or ipc with pc.mode={self.mode} (the backprop twin trains the supervised feed-forward map)")
        _check(self.latent_dim >= 1, "pc.latent_dim", self.latent_dim, "an integer >= 1")
        _check(_finite(self.prior_precision) and self.prior_precision >= 0, "pc.prior_precision", self.prior_precision,
               "a finite number >= 0")
        _check(self.prior_mean in PRIOR_MEANS + ("auto",), "pc.prior_mean", self.prior_mean,
               ", ".join(PRIOR_MEANS + ("auto",)))
        _check(self.precision is None or _finite(self.precision) and self.precision >= 0
               or isinstance(self.precision, list) and all(_finite(v) and v >= 0 for v in self.precision),
               "pc.precision", self.precision, "null, a number >= 0 or a list of numbers >= 0 (one per layer)")
        hidden = [] if self.precision is None else (self.precision[:-1] if isinstance(self.precision, list)
                                                     else [self.precision])
        _check(self.init in ("ff", "deeppcr") or all(p > 0 for p in hidden), "pc.init", self.init,
               f"ff or deeppcr with pc.precision={self.precision} (the inits near equilibrium need every hidden "
               "layer's precision > 0)")
        _check(self.precision_schedule in PRECISION_SCHEDULES, "pc.precision_schedule", self.precision_schedule,
               ", ".join(PRECISION_SCHEDULES))
        _check(_finite(self.precision_decay) and 0 <= self.precision_decay <= 1, "pc.precision_decay",
               self.precision_decay, "a number in [0, 1]")
        _check(self.eval_T is None or self.eval_T >= 1, "pc.eval_T", self.eval_T, "null or an integer >= 1")
        _check(self.diagnostics_every is None or self.diagnostics_every >= 1, "pc.diagnostics_every",
               self.diagnostics_every, "null (trainer.eval_every) or an integer >= 1")
        _check(not self.diagnostics or (self.mode == "supervised" and self.algorithm != BP), "pc.diagnostics",
               self.diagnostics, f"false with pc.mode={self.mode} pc.algorithm={self.algorithm} (the diagnostics "
               f"compare a supervised PC run with backprop)")


@dataclass
class OptimConfig:
    name: str = "adamw"
    """adamw or sgd."""
    lr: float = 2e-3
    """Peak weight learning rate (> 0)."""
    weight_decay: float = 1e-4
    """Decoupled (adamw) or L2 (sgd) weight decay (>= 0)."""
    momentum: float = 0.9
    """sgd: momentum in [0, 1)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """adamw: (beta1, beta2), each in [0, 1)."""
    warmup_steps: int = 22
    """Linear warm-up training steps (>= 0) before the cosine decay (under pc.algorithm=ipc, T weight steps each)."""
    schedule: str = "cosine"
    """cosine (warm-up then cosine decay to final_lr_ratio) or constant (warm-up then flat)."""
    final_lr_ratio: float = 0.0
    """cosine: final LR as a fraction of lr, in [0, 1]."""


    def check(self) -> None:
        """Refuse a value out of its key's range."""
        from ..engine.arguments import finite as _finite

        _check(self.name in ("adamw", "sgd"), "optim.name", self.name, "adamw, sgd")
        _check(_finite(self.lr) and self.lr > 0, "optim.lr", self.lr, "a finite number > 0")
        _check(_finite(self.weight_decay) and self.weight_decay >= 0, "optim.weight_decay", self.weight_decay,
               "a number >= 0")
        _check(_finite(self.momentum) and 0 <= self.momentum < 1, "optim.momentum", self.momentum, "a number in [0, 1)")
        _check(len(self.betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in self.betas), "optim.betas", self.betas,
               "two numbers in [0, 1)")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "an integer >= 0")
        _check(self.schedule in ("cosine", "constant"), "optim.schedule", self.schedule, "cosine, constant")
        _check(_finite(self.final_lr_ratio) and 0 <= self.final_lr_ratio <= 1, "optim.final_lr_ratio",
               self.final_lr_ratio, "[0, 1]")


@dataclass
class ParallelConfig:
    layer: Optional[int] = None
    """Ranks on the layer axis (each owns a contiguous slice of layers); null: world size / data."""
    data: int = 1
    """Ranks on the data axis (each gets a shard of every batch). layer x data = world size."""
    backend: str = "auto"
    """auto (nccl on CUDA, gloo on CPU), nccl or gloo."""
    micro_batches: int = 4
    """Micro-batches of the pipelined feed-forward init (>= 1)."""
    timeout_s: float = 300.0
    """Seconds before a silent peer turns into an error (> 0)."""


    def check(self) -> None:
        """Refuse a value out of its key's range (parallel.layer against the model's layers: ``validate``)."""
        from ..engine.arguments import finite as _finite

        _check(self.layer is None or self.layer >= 1, "parallel.layer", self.layer, "null or an integer >= 1")
        _check(self.data >= 1, "parallel.data", self.data, "an integer >= 1")
        _check(self.backend in ("auto", "nccl", "gloo"), "parallel.backend", self.backend, "auto, nccl, gloo")
        _check(self.micro_batches >= 1, "parallel.micro_batches", self.micro_batches, "an integer >= 1")
        _check(_finite(self.timeout_s) and self.timeout_s > 0, "parallel.timeout_s", self.timeout_s,
               "a number of seconds > 0")


@dataclass
class TrainerConfig:
    max_steps: int = 660
    """Training steps (batches) in all (>= 1); the LR schedule spans them."""
    epochs: Optional[int] = None
    """If set, overrides max_steps: epochs x (training samples // batch_size) steps. Passing trainer.max_steps
    while it is set (on the same command line, by a preset, or in the run being resumed) is refused: set
    trainer.epochs=null to count steps."""
    stop_at: Optional[int] = None
    """Stop (with a checkpoint) after this step; a later run in the same directory resumes."""
    batch_size: int = 64
    """Global batch size (>= 1, at least parallel.data)."""
    eval_every: int = 66
    """Validate every N steps and at the end (>= 1)."""
    log_every: int = 11
    """Gather and log the training energy every N steps (>= 1)."""
    ckpt_every: int = 220
    """Write a checkpoint every N steps and at the end (>= 1)."""
    ckpt_keep: int = 3
    """Checkpoints kept on disk (>= 1)."""
    seed: int = 0
    """Seed of the weights (per global layer), data order and everything else."""
    max_energy: float = 1e9
    """Divergence threshold: a batch energy above this (or not finite) is divergence."""
    on_divergence: str = "stop"
    """stop (error naming step, layer, value; checked where the host reads the energies: every log_every steps and
    before each checkpoint, so the step named is the first of those at or after the divergence) or skip (every step,
    on the device: drop that weight update and count it)."""
    device: str = "auto"
    """auto (cuda:LOCAL_RANK if available, else cpu), cpu or cuda."""
    dtype: str = "float32"
    """float32 or float64 (the master weights under precision=bf16: float32)."""
    precision: str = "fp32"
    """fp32, tf32 (TF32 matmuls and convolutions on GPUs) or bf16 (matmuls and convolutions on bfloat16
    operands; float32 value nodes, errors, master weights and optimizer state): docs/gpu.md."""
    compile: str = "auto"
    """auto (graph on CUDA devices, none on CPUs), graph (each stage's step captured once as CUDA
    graphs and replayed; on a CPU the same core runs eagerly) or none (eager): docs/gpu.md."""
    threads: int = 0
    """torch threads per rank on CPU; 0: OMP_NUM_THREADS if set, else cores / ranks on this machine."""
    progress: str = "auto"
    """auto (a bar on an interactive terminal, else a line per logged step on stdout), on (bar),
    off (train.log only)."""


    def check(self) -> None:
        """Refuse a value out of its key's range (trainer.batch_size against parallel.data: ``validate``)."""
        from ..engine.arguments import finite as _finite
        from ..engine.capture import COMPILE
        from ..engine.precision import PRECISIONS

        for key in ("max_steps", "batch_size", "eval_every", "log_every", "ckpt_every", "ckpt_keep"):
            _check(getattr(self, key) >= 1, f"trainer.{key}", getattr(self, key), "an integer >= 1")
        _check(self.epochs is None or self.epochs >= 1, "trainer.epochs", self.epochs, "null or an integer >= 1")
        _check(self.stop_at is None or self.stop_at >= 1, "trainer.stop_at", self.stop_at, "null or an integer >= 1")
        _check(self.on_divergence in ("stop", "skip"), "trainer.on_divergence", self.on_divergence, "stop, skip")
        _check(_finite(self.max_energy) and self.max_energy > 0, "trainer.max_energy", self.max_energy,
               "a finite number > 0")
        _check(self.device in ("auto", "cpu", "cuda"), "trainer.device", self.device, "auto, cpu, cuda")
        _check(self.dtype in ("float32", "float64"), "trainer.dtype", self.dtype, "float32, float64")
        _check(self.precision in PRECISIONS, "trainer.precision", self.precision, ", ".join(PRECISIONS))
        _check(self.precision != "bf16" or self.dtype == "float32", "trainer.dtype", self.dtype,
               "float32 under trainer.precision=bf16 (its float32 master weights)")
        _check(self.compile in COMPILE, "trainer.compile", self.compile, ", ".join(COMPILE))
        _check(0 <= self.threads <= 1024, "trainer.threads", self.threads, "an integer from 0 (automatic) to 1024 "
               "(torch crashes on tens of thousands)")
        _check(-2**63 <= self.seed < 2**63, "trainer.seed", self.seed, "a 64-bit integer (-2**63 to 2**63 - 1)")
        _check(self.progress in ("auto", "on", "off"), "trainer.progress", self.progress, "auto, on, off")


@dataclass
class LoggerConfig:
    name: str = "wandb"
    """wandb or none (metrics.jsonl is always written)."""
    mode: str = "offline"
    """wandb mode: offline (files in the run directory), online, disabled."""
    project: str = "pcdist"
    """wandb project."""
    entity: Optional[str] = None
    """wandb entity (team or user); None: your default."""
    run_name: Optional[str] = None
    """wandb run name; None: wandb picks one."""
    plots: bool = True
    """Draw the run's pictures: accuracy_energy.png, inference_energy.png and inference_heatmap.png when it
    ends or stops, pc.diagnostics' diagnostics_energy.png and diagnostics_cosine.png, and the generative and
    unsupervised modes' samples.png / reconstructions.png at each evaluation. false: none (metrics.jsonl holds
    the numbers); for many short runs, such as a sweep's jobs, where each costs a tenth of a CPU-second and
    a process half a second more to load matplotlib."""

    def check(self) -> None:
        """Refuse a value out of its key's range."""
        _check(self.name in ("wandb", "none"), "logger.name", self.name, "wandb, none")
        _check(self.mode in ("offline", "online", "disabled"), "logger.mode", self.mode, "offline, online, disabled")
        if self.name == "wandb":  # wandb's rule for names (it raised after the run directory was made)
            for key, name in (("logger.project", self.project), ("logger.entity", self.entity)):
                _check(name is None or (0 < len(str(name)) <= 128 and not set(str(name)) & set("/\\#?%:")), key,
                       name, "a name of 1-128 characters without / \\ # ? % :")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pc: PCConfig = field(default_factory=PCConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run_dir: Optional[str] = None
    """Where the run writes; train.py sets it to Hydra's run directory. None: a new directory
    runs/<date>/<time>-<id>, unique per launch (pcdist/service/rundir.py)."""
    resume: str = "auto"
    """A run directory that holds a checkpoint: auto (resume it), never (refuse: start a new directory),
    require (refuse to start fresh: the directory must hold a checkpoint)."""


def num_layers(c: Config) -> int:
    """The model's number of PC layers (weight layers), the most ranks the layer axis can have."""
    from .models import model_of  # the registry reads this module's Config: imported when called

    return model_of(c).num_layers(c.model)


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"config {key}={value!r} is invalid: allowed {allowed}")


def validate(c: Config) -> None:
    """Raise ConfigError naming the first key whose value is out of range: each group's own keys (its dataclass's
    ``check``; the model's: its ``Model.check`` in pcdist/service/models.py), then what spans groups."""
    from .models import MODELS, model_of  # the registry reads this module's Config

    m = c.model
    _check(m.name in MODELS or m.name == PYTHON_MODEL, "model.name", m.name, ", ".join(MODELS))
    for group in (m, c.data, c.pc, c.optim, c.parallel, c.trainer, c.logger):
        group.check()
    model_of(c).check(m)
    _check(c.resume in RESUME, "resume", c.resume, ", ".join(RESUME))


def check_combination(c: Config) -> None:
    """Raise ConfigError naming the first key that does not go with the others: a data key the data set does not
    read, what spans groups (the model and the mode, the precisions and the layers, the mesh and the batch). Run
    on the config a launch will train with: on a resume, the run's own settings with what the launch changes (a
    moved data.root for an MNIST run is checked against data=mnist, not against conf/'s default digits)."""
    from .models import model_of, modes_allowed  # the registry reads this module's Config

    m, pc, o, p, t = c.model, c.pc, c.optim, c.parallel, c.trainer
    model = model_of(c)
    c.data.check_reads()
    _check(not isinstance(pc.precision, list) or len(pc.precision) == num_layers(c), "pc.precision", pc.precision,
           f"a number or one number per layer ({num_layers(c)})")
    _check(pc.mode in model.modes, "model.name", m.name,
           f"{modes_allowed(pc.mode)} with pc.mode={pc.mode} ({model.wrong_mode})")
    _check(pc.mode != "unsupervised" or pc.prior_precision > 0 or o.weight_decay > 0, "pc.prior_precision",
           pc.prior_precision, "> 0 in unsupervised training without optim.weight_decay (nothing else fixes the scale "
           "of the latent: W grows while h_0 shrinks)")
    _check(pc.prior_mean != "learned" or pc.mode == "unsupervised", "pc.prior_mean", pc.prior_mean,
           f"auto, uniform or zero with pc.mode={pc.mode} (training clamps h_0 there, so a learned prior mean would "
           f"never train)")
    _check(pc.mode == "supervised" or m.energy != "ce", "model.energy", m.energy,
           f"se, bce or zero with pc.mode={pc.mode}: data sit at h_L (ce is for labels there)")
    _check(pc.mode != "supervised" or m.energy != "zero", "model.energy", m.energy,
           "se or ce with pc.mode=supervised (zero leaves the clamped labels without an energy: nothing to learn from)")
    _check(p.layer is None or p.layer <= num_layers(c), "parallel.layer", p.layer,
           f"at most the number of layers ({num_layers(c)}, from {model.layers_key})")
    _check(t.batch_size >= p.data, "trainer.batch_size", t.batch_size, f"at least parallel.data ({p.data})")


def config_keys() -> dict[str, str]:
    """Every config key (``trainer.max_steps``) and its documentation: the docstring written
    under its field in this file."""
    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    docs = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for a, b in zip(cls.body, cls.body[1:]):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                    and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
                docs[cls.name, a.target.id] = " ".join(b.value.value.split())
    keys = {}

    def walk(cls, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            sub = globals().get(f.type) if isinstance(f.type, str) else f.type
            if dataclasses.is_dataclass(sub):
                walk(sub, f"{prefix}{f.name}.")
            else:
                keys[prefix + f.name] = docs.get((cls.__name__, f.name), "")

    walk(Config, "")
    return keys
