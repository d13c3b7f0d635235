"""Metrics sinks: metrics.jsonl, wandb (offline by default), progress lines or a bar, and plots.

Only the logging rank gets a ``RunLogger``; every other rank gets a ``NullLogger``
with the same methods, so call sites never branch on the rank. wandb is imported
lazily and only when asked for.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

from ..errors import ConfigError, RunError, printable

__all__ = ["RunLogger", "NullLogger", "make_logger", "read_metrics", "truncate_jsonl", "check_logger",
           "progress_line", "plot_training", "plot_inference", "plot_heatmap"]


def check_logger(logger_cfg) -> None:
    """A logger that cannot start is a config error, found before any process group exists:
    wandb not installed, or ``logger.mode=online`` without a wandb login (checked without a prompt)."""
    if logger_cfg.name != "wandb" or logger_cfg.mode == "disabled":
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("logger=wandb needs the wandb package: pip install wandb, or use logger=none")
    if logger_cfg.mode != "online":
        return
    import wandb

    try:
        logged_in = wandb.login(prompt=False, verify=False)
    except TypeError:  # wandb < 0.22 has no prompt=; wandb.init reports a missing login itself
        return
    if not logged_in:
        raise ConfigError("logger.mode=online needs a wandb login: run `wandb login` or set WANDB_API_KEY; or keep "
                          "logger.mode=offline (the default; `wandb sync` the run's wandb/ folder later) or use "
                          "logger=none")


def progress_line(step: int, max_steps: int, energy: float | None = None, accuracy: float | None = None,
                  samples_per_s: float | None = None, reconstruction: float | None = None,
                  first_step_s: float | None = None) -> str:
    """``step 110/660  energy 0.1234  accuracy 0.9412  1532 samples/s`` (fields that are known; the
    generative and unsupervised modes add ``reconstruction_mse``); the first step of an attempt, when it is
    not a logged one: ``step 1/660  first step 0.84 s (with warm-up)``."""
    parts = [f"step {step}/{max_steps}"]
    if first_step_s is not None:
        parts.append(f"first step {first_step_s:.2f} s (with warm-up)")
    if energy is not None:
        parts.append(f"energy {energy:.4g}")
    if accuracy is not None:
        parts.append(f"accuracy {accuracy:.4f}")
    if reconstruction is not None:
        parts.append(f"reconstruction_mse {reconstruction:.4g}")
    if samples_per_s is not None:
        parts.append(f"{samples_per_s:.0f} samples/s")
    return "  ".join(parts)


class NullLogger:
    """The logger of ranks that do not log: accepts everything, writes nothing."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def progress(self, step: int, energy: float | None = None, accuracy: float | None = None,
                 samples_per_s: float | None = None, reconstruction: float | None = None,
                 first_step_s: float | None = None) -> None:
        pass

    def log_trace(self, trace: list[list[float]]) -> None:
        pass

    def say(self, line: str) -> None:
        pass

    def record(self, line: str) -> None:
        pass

    def log_images(self, images: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class RunLogger(NullLogger):
    """Writes every logged dict as one JSON line (with ``step``) and mirrors it to wandb.

    Progress goes to ``train.log`` always, and to the terminal as a bar (``progress=on``, or
    ``auto`` on an interactive terminal) or as the same lines on stdout (``auto`` where no
    terminal shows a bar: SLURM, nohup, docker logs); ``off`` keeps the terminal quiet.
    """

    def __init__(self, run_dir: Path, config: dict, logger_cfg, max_steps: int, progress: str,
                 network: list[dict] | None = None):
        self.run_dir = Path(run_dir)
        self.network = network
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._train_log = open(self.run_dir / "train.log", "a", buffering=1)
        import yaml

        replace_file(self.run_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False))  # (never half a file)
        self.config = config
        self.plots = logger_cfg.plots  # draw the pictures at close (logger.plots)
        self.max_steps = max_steps
        self.history: list[dict] = []
        self.trace: list[list[float]] | None = None
        self._wandb = None
        if logger_cfg.name == "wandb" and logger_cfg.mode != "disabled":
            import wandb

            # quiet: no banner, and no ~30-line history and summary when the run finishes (metrics.jsonl,
            # train.log and the plots hold them); wandb's warnings and errors still show.
            self._wandb = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, name=logger_cfg.run_name,
                                     mode=logger_cfg.mode, dir=str(self.run_dir), config=config, resume="allow",
                                     id=_run_id(self.run_dir), settings=wandb.Settings(quiet=True))
        tty = sys.stderr.isatty()
        self._lines = progress == "auto" and not tty
        self._bar = None
        self._accuracy: float | None = None
        if progress == "on" or (progress == "auto" and tty):
            from tqdm import tqdm

            self._bar = tqdm(total=max_steps, desc="train", dynamic_ncols=True)

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step, **metrics}
        self.history.append(row)
        self._file.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def progress(self, step: int, energy: float | None = None, accuracy: float | None = None,
                 samples_per_s: float | None = None, reconstruction: float | None = None,
                 first_step_s: float | None = None) -> None:
        """One line for a logged or evaluated step (accuracy only where evaluated), and for the first step of
        an attempt (so that a slow run shows at once that it trains); the bar shows the latest accuracy
        throughout."""
        line = progress_line(step, self.max_steps, energy, accuracy, samples_per_s, reconstruction, first_step_s)
        self._to_train_log(line)
        if self._lines:
            print(line, flush=True)
        if self._bar is not None:
            self._accuracy = accuracy if accuracy is not None else self._accuracy
            fields = [f"F={energy:.4g}" if energy is not None else "",
                      f"acc={self._accuracy:.4f}" if self._accuracy is not None else ""]
            self._bar.n = step
            self._bar.set_postfix_str(" ".join(f for f in fields if f), refresh=True)

    def say(self, line: str) -> None:
        """A line about the run (mesh, new run or resume, the end): on stdout and in train.log."""
        line = printable(line, keep="\n")  # names read from the run folder: never a control sequence
        self._to_train_log(line)
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def _to_train_log(self, line: str) -> None:
        self._train_log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}  {line}\n")

    def record(self, line: str) -> None:
        """A line said elsewhere (the run's end on stderr, by the command line or the caller), in train.log too."""
        try:
            self._to_train_log(printable(line, keep="\n"))
            self._train_log.flush()
        except (OSError, ValueError, RuntimeError):  # (closed, a full disk, a write it interrupts: said anyway)
            pass

    def log_trace(self, trace: list[list[float]]) -> None:
        """Per-layer energies at each inference step of one batch (for the plots)."""
        self.trace = trace

    def log_images(self, images: dict, step: int) -> None:
        """Pictures the run drew into its directory ({name: path}), to wandb as images."""
        if self._wandb is not None and images:
            import wandb

            self._wandb.log({f"images/{name}": wandb.Image(str(path)) for name, path in images.items()}, step=step)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._file.close()
        self._train_log.close()
        try:
            if self.plots:
                self.plot()
        except OSError as e:  # a full or read-only disk: the run's record is whole; an error being raised stays it
            where = f": {e.filename}" if e.filename else ""
            print(f"warning: the run's pictures were not drawn ({e.strerror or e}{where}); metrics.jsonl and the "
                  f"checkpoints are complete", file=sys.stderr, flush=True)
        finally:
            if self._wandb is not None:
                self._wandb.finish()

    def plot(self) -> None:
        """accuracy_energy.png (over training), inference_energy.png and inference_heatmap.png (per
        layer over the inference steps of one batch)."""
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        what = _describe(self.config, self.network)
        _save(plot_training(rows, what), self.run_dir / "accuracy_energy.png")
        if self.trace:
            _save(plot_inference(self.trace, what), self.run_dir / "inference_energy.png")
            _save(plot_heatmap(self.trace, what), self.run_dir / "inference_heatmap.png")


def _describe(config: dict, network: list[dict] | None = None) -> str:
    """What trained, for the plots' titles: ``digits, 3 layers 64-128-128-10: 2 x dense gelu, dense; pc T=20``
    from the layers' signatures (``network``: one per layer, as ``LayerKind.signature()`` gives them), else
    from the config's model.dims."""
    pc, data = config.get("pc", {}), config.get("data", {}).get("name", "?")
    run = f"{pc.get('algorithm', 'pc')} T={pc.get('T', '?')}"
    if network:
        return f"{data}, {describe_network(network)}; {run}"
    m = config.get("model", {})
    dims = m.get("dims") or []
    return f"{data}, {'-'.join(map(str, dims))} {m.get('activation', '')} ({len(dims) - 1} layers), {run}"


def describe_network(signatures: list[dict]) -> str:
    """``64 layers 64-128(x63)-10: residual identity, 63 x residual relu``: the number of
    layers, the value nodes' shapes (repeats counted) and each run of layers of one kind and activation."""
    nodes = [_shape(signatures[0].get("in"))] + [_shape(s.get("out")) for s in signatures]
    kinds = _runs([_kind(s) for s in signatures], " x ")
    return f"{len(signatures)} layer{'s' * (len(signatures) > 1)} {'-'.join(_runs(nodes, '', suffix=True))}: " \
           f"{', '.join(kinds)}"


def _shape(shape) -> str:
    return "x".join(map(str, shape)) if isinstance(shape, (list, tuple)) else str(shape)


def _kind(sig: dict) -> str:
    """``dense gelu``, ``conv1d gelu max-pool``, ``residual relu``, or a module layer's kind."""
    kind = sig.get("kind", "?")
    if kind == "conv":
        kind = f"conv{len(sig.get('in', [])) - 1}d"
    pool = f" {sig['pool']}-pool" if sig.get("pool") not in (None, "none") else ""
    act = sig.get("activation")
    return f"{kind}{f' {act}' if act else ''}{pool}"


def _runs(items: list[str], sep: str, suffix: bool = False) -> list[str]:
    """Consecutive repeats counted: ``2 x dense gelu`` (or, ``suffix``, ``128(x2)``)."""
    out: list[list] = []
    for item in items:
        if out and out[-1][0] == item:
            out[-1][1] += 1
        else:
            out.append([item, 1])
    if suffix:  # 64-128-128-10, but 64-128(x63)-10
        return [f"{item}(x{n})" if n > 2 else "-".join([item] * n) for item, n in out]
    return [f"{n}{sep}{item}" if n > 1 else item for item, n in out]


def subplots(*grid: int, figsize: tuple[float, float], margins: tuple[float, float, float, float] | None = None,
             **kw):
    """A figure and its axes, as ``pyplot.subplots`` gives them, from matplotlib's object interface (no
    pyplot: nothing global to close, and its import would cost each run half a second). ``margins``:
    (left, right, top, bottom) in inches, fixed, in place of ``tight_layout`` (which measures every label
    of the figure: a tenth of a second per picture, paid by every run for the plots it ends with)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    if margins is not None:
        (w, h), (left, right, top, bottom) = figsize, margins
        fig.subplots_adjust(left=left / w, right=1 - right / w, top=1 - top / h, bottom=bottom / h)
    return fig, fig.subplots(*grid, **kw)


def plain_log_labels(axis) -> None:
    """Tick labels of a log or symlog axis as plain numbers (``0.001``, ``0.3``, ``1e-05``), not matplotlib's
    default mathtext (``$10^{-3}$``), whose parser costs each process a quarter of a second to build. Which
    ticks get a label is matplotlib's own choice (``LogFormatter``: the decades, and minor ticks where the
    axis spans too few decades)."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def _num_to_string(self, x, vmin, vmax):
            return f"{x:.3g}"

    axis.set_major_formatter(Plain())
    if axis.get_scale() == "log":
        axis.set_minor_formatter(Plain(labelOnlyBase=False))


def replace_file(path: str | Path, content) -> Path:
    """Write ``path`` anew: ``content`` (str, bytes, or a function given the open binary file) goes into a file
    of a fresh name beside it, which is then renamed into place. So a reader never sees half a file, and a link
    that stood at ``path`` (a run folder one was sent, with ``compare.png -> ~/.bashrc``) is replaced, never
    written through."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # O_EXCL: never through a link, never shared
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def tight_layout(fig) -> None:
    """``fig.tight_layout()`` of a figure whose texts are final (it draws them: ``literal_texts`` first)."""
    literal_texts(fig)
    fig.tight_layout()


def literal_texts(fig) -> None:
    """Every text of ``fig`` drawn as it is written, never read as mathtext: a $ in a name from a run folder (a
    setting, a job's folder) ended the drawing in the parser's traceback, or was drawn as math."""
    from matplotlib.text import Text

    for text in fig.findobj(Text):
        text.set_parse_math(False)


def _save(fig, path: Path) -> None:
    """The figure as a PNG (its texts literal), its axes' titles also kept as the file's Title (readable without
    looking)."""
    literal_texts(fig)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    replace_file(path, lambda f: fig.savefig(f, format="png", dpi=110,
                                             metadata={"Title": " | ".join(titles)} if titles else None))


def plot_training(rows: list[dict], what: str = ""):
    """Validation accuracy (left axis, fixed [0, 1]) and training energy (right axis, log) over training."""
    def points(key: str) -> list:  # (a value that is not a number, in a row of a folder one was sent: left out)
        return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))
                and not isinstance(r[key], bool)]

    tr, va = points("train/energy"), points("val/accuracy")
    key = "val/accuracy" if va or not any("val/reconstruction_mse" in r for r in rows) else "val/reconstruction_mse"
    va = va or points(key)  # unsupervised: the reconstruction error
    name = "validation accuracy" if key == "val/accuracy" else "validation reconstruction error (per pixel)"
    fig, acc = subplots(figsize=(7, 4.2), margins=(0.75, 0.85, 0.4, 0.55))
    if va:
        acc.plot(*zip(*va), "o-", color="tab:blue", label=name)
    if key == "val/accuracy":
        acc.set_ylim(0.0, 1.0)
    acc.set_xlabel("training step")
    acc.set_ylabel(name, color="tab:blue")
    energy = acc.twinx()
    if tr:
        energy.plot(*zip(*tr), color="tab:orange", label="training energy F")
        if all(e > 0 for _, e in tr):
            energy.set_yscale("log")
            plain_log_labels(energy.yaxis)
    energy.set_ylabel("training energy F (batch mean)", color="tab:orange")
    final = ""
    if va:
        value = f"accuracy {va[-1][1]:.4f}" if key == "val/accuracy" else f"reconstruction error {va[-1][1]:.4g}"
        final = f"; final {value} at step {va[-1][0]}"
    acc.set_title(f"Training: {what}{final}", fontsize=9)
    return fig


def _zero_layers(trace: list[list[float]]) -> list[int]:
    return [l + 1 for l in range(len(trace[0])) if all(t[l] == 0 for t in trace)]


def plot_inference(trace: list[list[float]], what: str = ""):
    """One line per layer over the inference steps: a legend up to 10 layers, else colours from a
    sequential map with a colour bar (layer 1 dark, layer L bright); layers that stay exactly 0
    are named in the title (on the symlog axis they lie on 0)."""
    import matplotlib as mpl

    L, steps = len(trace[0]), range(len(trace))
    fig, ax = subplots(figsize=(7, 4.2), margins=(0.8, 0.25, 0.5, 0.55))
    cmap = mpl.colormaps["viridis"]
    colour = (lambda l: f"C{l}") if L <= 10 else (lambda l: cmap(l / (L - 1)))
    for l in range(L):
        ax.plot(steps, [t[l] for t in trace], color=colour(l), label=f"layer {l + 1}", lw=1.2)
    ax.set_yscale("symlog", linthresh=_linthresh(trace))
    plain_log_labels(ax.yaxis)
    ax.xaxis.set_major_locator(mpl.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("inference step (0: after the feed-forward init)")
    ax.set_ylabel("batch-mean layer energy")
    if L <= 10:
        ax.legend(fontsize=7, ncol=2)
    else:
        bar = fig.colorbar(mpl.cm.ScalarMappable(mpl.colors.Normalize(1, L), cmap), ax=ax)
        bar.set_label("layer")
    zero = _zero_layers(trace)
    note = f"; exactly 0 throughout: layer{'s' * (len(zero) > 1)} {_ranges(zero)}" if zero else ""
    ax.set_title(f"Energy per layer during inference (one batch, final weights)\n{what}{note}", fontsize=9)
    return fig


def heatmap_values(trace: list[list[float]]):
    """[layers, steps] log10 energies with exact zeros masked (the heat map's image)."""
    import numpy as np

    e = np.asarray(trace, dtype=float).T
    return np.ma.masked_where(e <= 0, np.log10(np.where(e > 0, e, 1.0)))


def plot_heatmap(trace: list[list[float]], what: str = ""):
    """Layer x inference-step heat map of log10 energy; exact zeros in grey. Readable at any depth."""
    import matplotlib as mpl

    L, T1 = len(trace[0]), len(trace)
    cmap = mpl.colormaps["magma"].with_extremes(bad="lightgrey")
    fig, ax = subplots(figsize=(7, min(9.0, 3.0 + 0.12 * L)), margins=(0.6, 0.2, 0.5, 0.55))
    img = ax.imshow(heatmap_values(trace), aspect="auto", cmap=cmap, interpolation="nearest",
                    extent=(-0.5, T1 - 0.5, L + 0.5, 0.5))
    fig.colorbar(img, ax=ax).set_label("log10 batch-mean layer energy")
    ax.xaxis.set_major_locator(mpl.ticker.MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(mpl.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("inference step (0: after the feed-forward init)")
    ax.set_ylabel("layer")
    ax.set_title(f"Energy per layer and inference step (one batch, final weights; grey: exactly 0)\n{what}",
                 fontsize=9)
    return fig


def _linthresh(trace: list[list[float]]) -> float:
    """The symlog axis's linear range: below the smallest positive energy, so every positive value is on the
    log part."""
    pos = [e for t in trace for e in t if e > 0]
    return 10 ** math.floor(math.log10(min(pos))) if pos else 1e-6


def _ranges(layers: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, start = [], None
    for i, l in enumerate(layers):
        start = l if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != l + 1:
            out.append(f"{start}-{l}" if l > start else f"{l}")
            start = None
    return ", ".join(out)


def _run_id(run_dir: Path) -> str:
    """A wandb run id stable for a run directory, so a resumed run continues the same wandb run."""
    f = run_dir / "wandb_run_id"
    if f.is_file():
        return f.read_text().strip()
    rid = os.urandom(6).hex()
    f.write_text(rid)
    return rid


def make_logger(is_logging: bool, run_dir: Path, config: dict, logger_cfg, max_steps: int, progress: str,
                network: list[dict] | None = None):
    """The logging rank's RunLogger (``network``: the layers' signatures, for the plots' titles); a NullLogger
    elsewhere."""
    return RunLogger(run_dir, config, logger_cfg, max_steps, progress, network) if is_logging else NullLogger()


def truncate_jsonl(path: str | Path, keep) -> int:
    """Keep the rows of a JSON-lines file for which ``keep(row)`` holds (a line cut short by a crash is
    dropped), rewritten to a temporary name and renamed; returns how many rows were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = [line for line in path.read_bytes().decode(errors="replace").splitlines() if line.strip()]
    kept = [line for line in lines if _keeps(line, keep)]
    if len(kept) < len(lines):
        tmp = path.with_name(path.name + ".part")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return len(lines) - len(kept)


def _keeps(line: str, keep) -> bool:
    try:
        return bool(keep(json.loads(line)))
    except ValueError:
        return False


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl file; a last line cut short (a run killed while writing it, a full disk) is
    left out, as a resume drops it; a damaged line before it (not JSON, not a row with its step) is a RunError
    naming the file and the line."""
    with open(path, "rb") as f:
        lines = f.read().splitlines()
    rows = []
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            line = raw.decode()  # (bytes that are not UTF-8: a damaged line, as JSON that does not parse)
            row = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if n == len(lines):
                break
            why = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8 text"
            raise RunError(f"{path}: line {n} is not a JSON row ({why}); pcdist writes whole rows: mend or remove "
                           f"that line") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row["step"], bool):
            raise RunError(f"{path}: line {n} is not a row of a logged step (an object with an integer \"step\"); "
                           f"pcdist writes no other: mend or remove that line")
        rows.append(row)
    return rows
