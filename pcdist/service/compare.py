"""``python -m pcdist compare RUN_DIRS... | SWEEP_DIR``: the runs' differing settings and final metrics in
one table, and their validation curves on one plot.

A sweep directory (``--multirun``, Hydra's Optuna sweeper) holds one run directory per job
(``0/``, ``1/``, ...); it is expanded into them. Settings are the keys of each run's
``config.yaml``; a key is shown where the runs disagree on it. Where the runs differ in
``trainer.seed``, the runs of equal other settings form a group, and a second table gives each
group's mean ± sample standard deviation over its seeds (``groups``). ``--csv`` and ``--json``
write the same figures for other programs.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path

from ..errors import RunError, printable
from .metrics import _save, read_metrics, replace_file, subplots, tight_layout
from .config import flat, read_settings

__all__ = ["compare", "find_runs", "format_table", "format_groups", "write_csv", "write_json", "SEED", "METRICS"]

_NOT_SETTINGS = {"run_dir"}
SEED = "trainer.seed"
METRICS = ("val/accuracy", "val/accuracy(best)", "val/reconstruction_mse", "train/energy", "step_s", "x_lr(auto)")
"""The final metrics of a run that compare shows (and averages over seeds); x_lr(auto): the step pc.x_lr=auto
chose."""
SOMETIMES = ("val/reconstruction_mse", "x_lr(auto)")
"""Metrics shown only where a run has them (generative and unsupervised runs; runs of pc.x_lr=auto)."""


def find_runs(paths) -> list[Path]:
    """Run directories among ``paths``: each a run directory, or a folder of them (a sweep)."""
    runs: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise RunError(f"{p} is not a directory; give run directories or a sweep directory")
        own = [p] if (p / "config.yaml").is_file() else []  # (a run and a sweep's runs in one folder: both shown)
        inner = sorted((q for q in p.iterdir() if (q / "config.yaml").is_file()),
                       key=lambda q: (not q.name.isdigit(), int(q.name) if q.name.isdigit() else 0, q.name))
        if not own and not inner:
            raise RunError(f"{p} is neither a run directory (no config.yaml) nor a sweep directory (no run "
                           f"directories in it)")
        runs.extend(own + inner)
    if not runs:
        raise RunError("no run directories given")
    return runs


def _numbers(rows: list[dict], key: str) -> list[float]:
    """The rows' values of ``key`` that are numbers (a hand-edited row's text is left out, as a missing value)."""
    return [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]


def _summary(rows: list[dict]) -> dict:
    acc, mse = _numbers(rows, "val/accuracy"), _numbers(rows, "val/reconstruction_mse")
    energy, step_s = _numbers(rows, "train/energy"), _numbers(rows, "perf/step_s")
    return {"step": max((r["step"] for r in rows), default=0), "val/accuracy": acc[-1] if acc else None,
            "val/accuracy(best)": max(acc) if acc else None, "val/reconstruction_mse": mse[-1] if mse else None,
            "train/energy": energy[-1] if energy else None,
            "step_s": statistics.median(step_s) if step_s else None}


def _config(run: Path) -> dict:
    """A run's settings (its config.yaml), flattened; a RunError naming the file where it is damaged."""
    return flat(read_settings(run / "config.yaml", "mend it or leave this run out of the comparison"))


def _chosen_x_lr(run: Path, config: dict) -> float | None:
    """The value step a run of ``pc.x_lr=auto`` chose (its x_lr.json), else None: a result of the run, as its
    accuracy is (runs of other seeds may choose other steps; a seed group of them averaged it without a word)."""
    if config.get("pc.x_lr") != "auto" or not (run / "x_lr.json").is_file():
        return None
    try:
        chosen = json.loads((run / "x_lr.json").read_text()).get("x_lr")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return None
    return chosen if isinstance(chosen, (int, float)) and not isinstance(chosen, bool) else None


def compare(paths, plot: str | Path | None = None) -> dict:
    """The runs under ``paths``: {"runs": [...], "settings": [differing keys], "rows": [per run: its
    settings and final metrics]}; draws the validation curves into ``plot`` (default: compare.png in
    the sweep directory, or in the current directory for several run directories)."""
    runs = find_runs(paths)
    configs = [_config(r) for r in runs]
    keys = sorted({k for c in configs for k in c} - _NOT_SETTINGS)
    differing = [k for k in keys if len({repr(c.get(k)) for c in configs}) > 1]
    histories = [read_metrics(r / "metrics.jsonl") if (r / "metrics.jsonl").is_file() else [] for r in runs]
    rows = [{"run": str(r), **{k: c.get(k) for k in differing}, **_summary(h), "x_lr(auto)": _chosen_x_lr(r, c)}
            for r, c, h in zip(runs, configs, histories)]
    if plot is None:
        single = [Path(p) for p in paths]
        plot = (single[0] if len(single) == 1 and not (single[0] / "config.yaml").is_file() else Path(".")) / \
            "compare.png"
    _plot(runs, histories, rows, differing, Path(plot))
    return {"runs": [str(r) for r in runs], "settings": differing, "rows": rows, "groups": over_seeds(rows, differing),
            "plot": str(plot)}


def over_seeds(rows: list[dict], differing: list[str]) -> list[dict]:
    """Where the runs differ in trainer.seed: per group of runs with equal other settings, its settings, the
    seeds, and each metric's mean and sample standard deviation over them (None for one seed); else []."""
    if SEED not in differing:
        return []
    keys = [k for k in differing if k != SEED]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(repr(row.get(k)) for k in keys), []).append(row)
    out = []
    for members in groups.values():
        group = {**{k: members[0].get(k) for k in keys}, "seeds": [m.get(SEED) for m in members], "n": len(members)}
        for metric in ("step", *METRICS):
            values = [m[metric] for m in members if m.get(metric) is not None]
            group[f"{metric} mean"] = statistics.fmean(values) if values else None
            group[f"{metric} std"] = statistics.stdev(values) if len(values) > 1 else None
        out.append(group)
    return out


def _label(row: dict, differing: list[str]) -> str:
    parts = [f"{k.split('.')[-1]}={row[k]:.3g}" if isinstance(row[k], float) else f"{k.split('.')[-1]}={_cell(row[k])}"
             for k in differing[:4]]
    return ", ".join(parts) or _cell(Path(row["run"]).name)


def _plot(runs, histories, rows, differing, path: Path) -> None:
    fig, ax = subplots(figsize=(7.5, 4.5))
    for r, h, row in zip(runs, histories, rows):
        va = [(m["step"], m["val/accuracy"]) for m in h if _numbers([m], "val/accuracy")]
        if va:
            ax.plot(*zip(*va), "o-", ms=3, label=f"{Path(r).name}: {_label(row, differing)}")
    ax.set_xlabel("training step")
    ax.set_ylabel("validation accuracy")
    drawn = f"{len(ax.lines)} of {len(runs)} runs (the others logged no val/accuracy)" if len(ax.lines) < len(runs) \
        else f"{len(runs)} runs"
    ax.set_title(drawn + (f"; differing: {', '.join(differing[:6])}" if differing else ""), fontsize=9)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    tight_layout(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    _save(fig, path)


def _cell(v) -> str:
    """A value as the terminal table shows it: what a run folder holds is text, so a control character in it
    (an escape sequence, say) is shown escaped, never sent to the terminal."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return printable(v)


def _csv_value(v):
    """A value as a CSV cell: a string that a spreadsheet would take for a formula (=, +, -, @ first) starts
    with a ' (a run folder's text is data), None is empty."""
    if v is None:
        return ""
    if isinstance(v, str) and v[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + v
    return v


def _columns(result: dict) -> list[str]:
    """The per-run table's columns: the run, its differing settings, its final metrics."""
    shown = [m for m in METRICS if m not in SOMETIMES or any(r.get(m) is not None for r in result["rows"])]
    return ["run", *result["settings"], "step", *shown]


def _aligned(cols: list[str], cells: list[list[str]]) -> str:
    cols = [printable(c) for c in cols]  # (a column is a setting's key: a run folder's text too)
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, cells)])


def format_table(result: dict) -> str:
    """The comparison as an aligned text table, one run per line."""
    cols = _columns(result)
    return _aligned(cols, [[_cell(row.get(c)) for c in cols] for row in result["rows"]])


def _mean_std(group: dict, metric: str) -> str:
    mean, std = group[f"{metric} mean"], group[f"{metric} std"]
    if mean is None:
        return "-"
    return _cell(mean) if std is None else f"{mean:.4g} ± {std:.2g}"


def format_groups(result: dict) -> str:
    """Mean ± standard deviation over seeds, one group of equal other settings per line ("" without seeds)."""
    if not result["groups"]:
        return ""
    keys = [k for k in result["settings"] if k != SEED]
    metrics = [m for m in METRICS if any(g[f"{m} mean"] is not None for g in result["groups"])]
    cols = [*keys, "seeds", *(f"{m} (mean ± std)" for m in metrics)]
    cells = [[_cell(g[k]) for k in keys] + [",".join(map(_cell, g["seeds"]))] + [_mean_std(g, m) for m in metrics]
             for g in result["groups"]]
    return _aligned(cols, cells)


def write_csv(result: dict, path: str | Path) -> list[Path]:
    """The per-run table as CSV at ``path`` and, where the runs differ in seed, the groups' means and standard
    deviations beside it (``<stem>_seeds.csv``); returns the files written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = [_csv(path, _columns(result), result["rows"])]
    if result["groups"]:
        cols = list(result["groups"][0])
        rows = [{**g, "seeds": " ".join(map(str, g["seeds"]))} for g in result["groups"]]  # (each cell guarded)
        written.append(_csv(path.with_name(f"{path.stem}_seeds{path.suffix or '.csv'}"), cols, rows))
    return written


def _csv(path: Path, cols: list[str], rows: list[dict]) -> Path:
    out = io.StringIO(newline="")
    w = csv.writer(out)
    w.writerow([_csv_value(c) for c in cols])
    for row in rows:
        w.writerow([_csv_value(row.get(c)) for c in cols])
    return replace_file(path, out.getvalue())


def write_json(result: dict, path: str | Path) -> Path:
    """The whole comparison (runs, differing settings, per-run rows, groups over seeds) as JSON at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return replace_file(path, json.dumps(result, indent=1))
