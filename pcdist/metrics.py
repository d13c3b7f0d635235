"""Metrics sinks: metrics.jsonl, wandb (offline by default), a progress bar and plots.

Only the logging rank gets a ``RunLogger``; every other rank gets a ``NullLogger``
with the same methods, so call sites never branch on the rank. wandb is imported
lazily and only when asked for.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

__all__ = ["RunLogger", "NullLogger", "make_logger", "read_metrics"]


class NullLogger:
    """The logger of ranks that do not log: accepts everything, writes nothing."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def progress(self, step: int, text: str = "") -> None:
        pass

    def log_trace(self, trace: list[list[float]]) -> None:
        pass

    def close(self) -> None:
        pass


class RunLogger(NullLogger):
    """Writes every logged dict as one JSON line (with ``step``) and mirrors it to wandb."""

    def __init__(self, run_dir: Path, config: dict, logger_cfg, max_steps: int, progress: str):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        import yaml

        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.history: list[dict] = []
        self.trace: list[list[float]] | None = None
        self._wandb = None
        if logger_cfg.name == "wandb" and logger_cfg.mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, name=logger_cfg.run_name,
                                     mode=logger_cfg.mode, dir=str(self.run_dir), config=config, resume="allow",
                                     id=_run_id(self.run_dir))
        show = progress == "on" or (progress == "auto" and sys.stderr.isatty())
        self._bar = None
        if show:
            from tqdm import tqdm

            self._bar = tqdm(total=max_steps, desc="train", dynamic_ncols=True)

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step, **metrics}
        self.history.append(row)
        self._file.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def progress(self, step: int, text: str = "") -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix_str(text, refresh=True)

    def log_trace(self, trace: list[list[float]]) -> None:
        """Per-layer energies at each inference step of one batch (for the plot)."""
        self.trace = trace

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._file.close()
        try:
            self.plot()
        finally:
            if self._wandb is not None:
                self._wandb.finish()

    def plot(self) -> None:
        """accuracy_energy.png (over training) and inference_energy.png (over inference steps)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = read_metrics(self.run_dir / "metrics.jsonl")
        tr = [(r["step"], r["train/energy"]) for r in rows if "train/energy" in r]
        va = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
        fig, ax1 = plt.subplots(figsize=(6, 4))
        if tr:
            ax1.plot(*zip(*tr), color="tab:orange", label="train energy")
            ax1.set_yscale("log")
        ax1.set_xlabel("step")
        ax1.set_ylabel("train energy F", color="tab:orange")
        ax2 = ax1.twinx()
        if va:
            ax2.plot(*zip(*va), "o-", color="tab:blue", label="val accuracy")
        ax2.set_ylabel("validation accuracy", color="tab:blue")
        ax1.set_title("training")
        fig.tight_layout()
        fig.savefig(self.run_dir / "accuracy_energy.png", dpi=110)
        plt.close(fig)
        if self.trace:
            fig, ax = plt.subplots(figsize=(6, 4))
            steps = range(len(self.trace))
            for l in range(len(self.trace[0])):
                ax.plot(steps, [t[l] for t in self.trace], label=f"layer {l + 1}")
            ax.set_yscale("symlog", linthresh=1e-6)
            ax.set_xlabel("inference step")
            ax.set_ylabel("batch-mean layer energy")
            ax.set_title("energy per layer during inference (one batch, final weights)")
            if len(self.trace[0]) <= 12:
                ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(self.run_dir / "inference_energy.png", dpi=110)
            plt.close(fig)


def _run_id(run_dir: Path) -> str:
    """A wandb run id stable for a run directory, so a resumed run continues the same wandb run."""
    f = run_dir / "wandb_run_id"
    if f.is_file():
        return f.read_text().strip()
    rid = os.urandom(6).hex()
    f.write_text(rid)
    return rid


def make_logger(is_logging: bool, run_dir: Path, config: dict, logger_cfg, max_steps: int, progress: str):
    return RunLogger(run_dir, config, logger_cfg, max_steps, progress) if is_logging else NullLogger()


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
