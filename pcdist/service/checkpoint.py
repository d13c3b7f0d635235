"""Checkpoints keyed by global layer index: atomic, checksummed, resumable on any split.

Layout of one checkpoint (``run_dir/checkpoints/step-00000200/``)::

    layers-0001-0005.pt   weights and optimizer state of layers 1..4, from the rank owning them
    layers-0005-0009.pt   ...
    meta.pt               step, data position, scheduler state, RNG state, model shape
    manifest.json         sha256 of every file above (written last)

Every file is written to a temporary name and renamed; the checkpoint is written
into ``step-XXXXXXXX.tmp/`` and renamed once complete, so a crash mid-write never
damages an earlier checkpoint. Loading uses ``torch.load(weights_only=True)`` and
checks the manifest; a damaged newest checkpoint is skipped (``newest_valid`` says which and why).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ..engine.network import PCNetwork, legacy_signature
from ..distributed.parallel import barrier
from ..errors import CheckpointError, printable
from .config import read_settings
from .metrics import replace_file

__all__ = ["save_checkpoint", "latest_checkpoint", "newest_valid", "load_checkpoint", "CheckpointError"]


def _atomic_save(obj, path: Path, dump=torch.save) -> None:
    """``dump(obj, file)`` (torch.save) to a temporary name, fsync, rename (``replace_file``); a failed write (disk
    full) leaves nothing behind."""
    def save(f) -> None:
        dump(obj, f)
        f.flush()
        os.fsync(f.fileno())

    try:
        replace_file(path, save)
    except Exception as e:
        raise CheckpointError(f"writing {path} failed (disk full?): {e}") from e


def _fsync_dir(path: Path) -> None:
    """The directory's entries (new names, renames) on disk; where a filesystem cannot sync a directory, nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _layer_optimizer_state(net: PCNetwork, optimizer: torch.optim.Optimizer) -> dict:
    """Optimizer state sliced per global layer: {"layers.l.weight": {"exp_avg": slice k of the stacked state}}."""
    out = {}
    for g in net.groups:
        for name, p in g.named_parameters():
            state = optimizer.state.get(p, {})
            for k, l in enumerate(g.layers):
                out[f"layers.{l}.{name}"] = {
                    s: (v[k].clone() if torch.is_tensor(v) and v.dim() > 0
                        else (v.clone() if torch.is_tensor(v) else v))
                    for s, v in state.items()
                }
    return out


def _load_layer_optimizer_state(net: PCNetwork, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Rebuild the stacked optimizer state of the owned groups from per-layer slices.

    Goes through ``optimizer.load_state_dict``, which puts every state tensor where this
    optimizer keeps it (e.g. the step count on the GPU for fused AdamW, on the CPU otherwise).
    """
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    state = {}
    for g in net.groups:
        for name, p in g.named_parameters():
            per_layer = [saved.get(f"layers.{l}.{name}", {}) for l in g.layers]
            if not per_layer[0] or id(p) not in index:
                continue
            state[index[id(p)]] = {
                s: torch.stack([pl[s] for pl in per_layer]) if torch.is_tensor(v) and v.dim() > 0 else v
                for s, v in per_layer[0].items()
            }
    sd = optimizer.state_dict()
    sd["state"] = state
    optimizer.load_state_dict(sd)


STEP_DIR = re.compile(r"step-\d{8,}")
"""A checkpoint's folder name (``step-{step:08d}``); nothing else in checkpoints/ is read as one."""


def save_checkpoint(run_dir: str | Path, step: int, net: PCNetwork, optimizer: torch.optim.Optimizer,
                    meta: dict, keep: int, writer: bool, leader: bool, group=None) -> Path:
    """Write checkpoint ``step`` collectively; ``writer``: this rank writes its layers;
    ``leader``: this rank writes meta + manifest, publishes and prunes. Returns the path."""
    ckdir = Path(run_dir) / "checkpoints"
    final, tmp = ckdir / f"step-{step:08d}", ckdir / f"step-{step:08d}.tmp"
    distributed = dist.is_available() and dist.is_initialized()
    if leader:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a read-only folder, a full disk: one line (the run's peers are told, and stop)
            raise CheckpointError(f"writing the checkpoint {final} failed: cannot make {tmp}: {e.strerror or e} "
                                  f"(a read-only or full disk?)") from e
    if distributed:
        barrier("the checkpoint barrier", group)
    if writer:
        state = {"layers": net.layer_state_dict(), "optimizer": _layer_optimizer_state(net, optimizer)}
        _atomic_save(state, tmp / f"layers-{net.first:04d}-{net.stop:04d}.pt")
    if distributed:
        barrier("the checkpoint barrier", group)
    if leader:
        _atomic_save(meta, tmp / "meta.pt")
        files = sorted(p.name for p in tmp.iterdir() if not p.name.endswith(".part"))
        gap = _gap(files, net.num_layers)
        if gap is not None:  # (a shared filesystem whose listing missed a peer's file): never published
            raise CheckpointError(f"writing the checkpoint {final} failed: {gap}")
        manifest = {"step": step, "layers": net.num_layers, "files": {n: _sha256(tmp / n) for n in files}}
        _atomic_save(manifest, tmp / "manifest.json", lambda m, f: f.write(json.dumps(m, indent=1).encode()))
        _fsync_dir(tmp)  # its files' names on disk before it is published
        try:
            _remove(final)
            os.replace(tmp, final)
        except OSError as e:
            raise CheckpointError(f"publishing the checkpoint {final} failed: {e.strerror or e}") from e
        _fsync_dir(ckdir)  # published on disk before an older checkpoint is pruned (a power loss between: one stays)
        # keep the newest `keep` up to this step; those after it (damaged ones a resume skipped) stay until
        # the run writes their steps again: pruning never removes what it has just written
        for old in [k for k in _checkpoints(ckdir) if _step_of(k) <= step][:-keep]:
            _remove(old)
        # the leftovers of writes that failed or were killed (a step not written again, after a resume on another
        # split, say, stayed for good): the run directory is this launch's alone, and every writer is done
        for stale in [*ckdir.glob("step-*.tmp"), *ckdir.glob(".step-*.removed-*")]:
            shutil.rmtree(stale, ignore_errors=True)
    if distributed:
        barrier("the checkpoint barrier", group)
    return final


def _remove(checkpoint: Path) -> None:
    """Remove a checkpoint folder at once for its readers (a ``pcdist.load`` of the running run): renamed out of
    the checkpoints' names first, then deleted; removed in place, a reader met it half gone and called it damaged."""
    gone = checkpoint.with_name(f".{checkpoint.name}.removed-{os.getpid()}")
    try:
        os.replace(checkpoint, gone)
    except FileNotFoundError:
        return
    shutil.rmtree(gone, ignore_errors=True)


LAYER_FILE = re.compile(r"layers-(\d{4,})-(\d{4,})\.pt")
"""A layer slice's file of a checkpoint: layers-<first>-<stop>.pt, layers first .. stop - 1."""


def _gap(files, num_layers: int | None) -> str | None:
    """What the layer files of a checkpoint leave out of layers 1 .. ``num_layers`` (None: as many as they
    reach), or None where they cover them all, once each."""
    slices = sorted((int(m.group(1)), int(m.group(2))) for f in files if (m := LAYER_FILE.fullmatch(f)))
    at = 1
    for first, stop in slices:
        if first != at:
            return (f"layers {at}..{first - 1} have no file" if first > at else
                    f"layers {first}..{min(stop, at) - 1} are in two files")
        at = stop
    if num_layers is not None and at != num_layers + 1:
        return f"layers {at}..{num_layers} have no file" if at <= num_layers else f"{at - 1} layers, not {num_layers}"
    return None if slices else "no layer file"


def set_aside(skipped: list[tuple[Path, str]]) -> None:
    """The damaged checkpoints a resume skipped (``newest_valid``), renamed ``step-<N>.damaged`` (``.damaged-2``
    where a damaged copy of that step was set aside before) once the run continues: kept for a look, but never
    again one of the ``ckpt_keep`` newest (a good older one would be pruned in its place) nor met by a later
    resume."""
    for path, _ in skipped:
        if path.is_dir():
            aside, n = path.with_name(path.name + ".damaged"), 1
            while aside.exists():
                n += 1
                aside = path.with_name(f"{path.name}.damaged-{n}")
            os.replace(path, aside)


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[1])


def _checkpoints(ckdir: Path) -> list[Path]:
    if not ckdir.is_dir():
        return []
    return sorted((p for p in ckdir.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)), key=_step_of)


def _verify(path: Path) -> None:
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no manifest.json (incomplete checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except Exception as e:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({e})") from e
    if not isinstance(files, dict) or not all(isinstance(k, str) and k == Path(k).name and k not in ("", ".", "..")
                                              and isinstance(v, str) for k, v in files.items()) \
            or not isinstance(manifest.get("layers"), (int, type(None))):
        raise CheckpointError(f"{manifest_path}: unreadable manifest (files is not a mapping of file names to "
                              f"digests, or layers not a number)")
    unlisted = sorted(f.name for f in path.glob("layers-*.pt") if f.name not in files)
    if unlisted:  # (loaded, they would override the checked layers)
        raise CheckpointError(f"{path}: {', '.join(unlisted)} not listed in the manifest (added after the checkpoint "
                              f"was written)")
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} listed in the manifest is missing")
        if _sha256(f) != digest:
            raise CheckpointError(f"{f}: checksum mismatch (truncated or corrupted)")
    gap = _gap(files, manifest.get("layers"))  # (checkpoints from before the manifest kept the layer count: None)
    if gap is not None:
        raise CheckpointError(f"{manifest_path}: {gap}")


def newest_valid(run_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint whose files match its manifest (None if there is none), and the newer ones
    skipped as damaged, newest first, each with why (``"layers-0001-0004.pt: checksum mismatch ..."``)."""
    for _ in range(3):  # a checkpoint removed while it was read (the run pruned it): not damaged, listed again
        skipped, gone = [], False
        for path in reversed(_checkpoints(Path(run_dir) / "checkpoints")):
            try:
                _verify(path)
                return path, skipped
            except CheckpointError as e:
                if gone := not path.is_dir():
                    break
                skipped.append((path, printable(str(e).replace(f"{path}/", "").replace(f"{path}: ", ""))))
        if not gone:
            break
    return None, skipped


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint whose files match its manifest; damaged ones are skipped with a warning, at every call
    (Python shows a warning once per line of code: a second load of the run fell back silently)."""
    path, skipped = newest_valid(run_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("always", UserWarning)
        for bad, why in skipped:
            warnings.warn(f"skipping damaged checkpoint {bad}: {why}", stacklevel=2)
    return path


def _describe(signature) -> str:
    """A model signature in one line: "dense 64->128 gelu, 2 x dense 128->128 gelu, dense 128->10 None"."""
    if not isinstance(signature, list) or not all(isinstance(s, dict) for s in signature):
        return repr(signature)
    runs: list[list] = []
    for s in signature:
        if runs and runs[-1][1] == s:
            runs[-1][0] += 1
        else:
            runs.append([1, s])
    return ", ".join(("" if n == 1 else f"{n} x ")
                     + f"{s.get('kind')} {s.get('in')}->{s.get('out')} {s.get('activation')}"
                     for n, s in runs)


def read_pt(path: Path) -> dict:
    """One file of a checkpoint, read with torch.load's ``weights_only`` (tensors, numbers, strings: it refuses
    any code a pickle names); a file it cannot read is a CheckpointError naming the file, in one line."""
    try:
        found = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        text = str(e)
        if text.startswith("Weights only load failed"):  # a pickle naming code: torch's advice to load it anyway
            # (weights_only=False, "arbitrary code execution") is left out, its reason kept
            said = [p.strip() for p in text.split("\n\n")[1:] if p.strip() and "documentation" not in p]
            text = f"it names code to run, which pcdist never runs: {said[0] if said else 'not weights'}"
        why = " ".join(text.split()[:40]) or type(e).__name__
        raise CheckpointError(f"{path} cannot be read as a checkpoint file pcdist wrote ({why})") from e
    if not isinstance(found, dict):
        raise CheckpointError(f"{path} holds a {type(found).__name__}, not a checkpoint file pcdist wrote")
    return found


def read_meta(checkpoint: Path) -> dict:
    """A checkpoint's meta.pt (``read_pt``), checked as far as a resume and ``pcdist.load`` read it: its step a
    whole number >= 0, the run's settings (where it keeps them) a mapping; else a CheckpointError naming the file."""
    path = Path(checkpoint) / "meta.pt"
    meta = read_pt(path)
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path} holds no step (a whole number >= 0; found {step!r:.40}): not a checkpoint "
                              f"file pcdist wrote")
    if meta.get("config") is not None and not isinstance(meta["config"], dict):
        raise CheckpointError(f"{path} holds settings that are a {type(meta['config']).__name__}, not a mapping: "
                              f"not a checkpoint file pcdist wrote")
    return meta


def saved_config(run_dir: Path, meta: dict) -> dict | None:
    """The run's settings as its checkpoint keeps them (``read_meta``), else as its config.yaml does (checkpoints
    written before they kept them), else None; a config.yaml that is not YAML or not a mapping is a RunError naming
    it. Read as data: no YAML tag builds anything (``safe_load``)."""
    if meta.get("config") is not None:
        return meta["config"]
    path = Path(run_dir) / "config.yaml"
    return read_settings(path, "not the run's settings as pcdist wrote them") if path.is_file() else None


def _layer_files(path: Path) -> list[Path]:
    """The layer files of a checkpoint as its manifest lists them (``_verify`` refuses any other beside them)."""
    try:
        listed = json.loads((path / "manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e})") from e
    return [path / name for name in sorted(listed) if name.startswith("layers-")]


def load_checkpoint(path: str | Path, net: PCNetwork, optimizer: torch.optim.Optimizer | None) -> dict:
    """Load the owned layers (and their optimizer state) from any split; returns the meta dict."""
    path = Path(path)
    meta = read_pt(path / "meta.pt")
    saved = meta.get("model")
    saved = legacy_signature(saved) or saved  # checkpoints from before layer kinds: [dims, activations]
    if saved != net.signature():
        raise CheckpointError(f"{path} was written by a different model: {_describe(saved)}; "
                              f"this run has {_describe(net.signature())}")
    layers, opt_state = {}, {}
    try:
        for f in _layer_files(path):
            part = read_pt(f)
            layers.update(part["layers"])
            opt_state.update(part["optimizer"])
        net.load_layer_state_dict(layers)
        if optimizer is not None:
            _load_layer_optimizer_state(net, optimizer, opt_state)
    except (KeyError, ValueError, TypeError) as e:  # a file of the right format missing what the model needs
        raise CheckpointError(f"{path} does not hold this model's layers: {e.args[0] if e.args else e}") from e
    return meta
