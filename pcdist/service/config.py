"""A run's config composed, before any process group exists: from ``conf/`` and the user's overrides to a
validated ``Config`` (the dataclasses, their docstrings and ``validate`` are in schema.py; their names are
re-exported here).

The defaults live in ``conf/`` (shipped inside the package as ``pcdist/conf``): the
command line (``train.py``, ``pcdist-train``) and ``pcdist.train(dict)`` both compose
it with Hydra (``compose``, ``make_config``), so both start from the same values.
``load_config`` merges the composed config onto the schema's dataclasses (an unknown key or a
wrong type names the key) and validates it. ``passed_settings`` says which keys the user's
overrides set (what a resume applies); ``check_overrides``, ``groups`` and ``did_you_mean`` check
the command line's overrides against the known keys and groups; ``network_options`` is what the
network takes from pc.*.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError, RunError, did_you_mean
from .schema import (BP, DATASETS, PYTHON_DATA, PYTHON_MODEL, RESUME, ROOT_DATASETS, Config, DataConfig,
                     LoggerConfig, ModelConfig, OptimConfig, ParallelConfig, PCConfig, TrainerConfig, config_keys,
                     check_combination, num_layers, validate)

__all__ = ["Config", "ModelConfig", "num_layers", "DataConfig", "PCConfig", "OptimConfig", "ParallelConfig",
           "TrainerConfig", "LoggerConfig", "CONF_DIR", "compose", "composition_error", "make_config", "load_config",
           "validate", "check_combination", "absolute_data_paths", "absolute_path", "DATA_PATHS", "DATASETS",
           "ROOT_DATASETS", "config_keys", "did_you_mean",
           "check_overrides", "groups", "passed_settings", "choice_keys", "flat", "command", "PYTHON_DATA",
           "PYTHON_MODEL", "BP", "RESUME"]


def _conf_dir() -> Path:
    """The shipped config groups: ``pcdist/conf`` in an installed wheel, ``conf/`` beside the package in a checkout."""
    package = Path(__file__).resolve().parent.parent  # pcdist/
    return package / "conf" if (package / "conf" / "config.yaml").is_file() else package.parent / "conf"


CONF_DIR = _conf_dir()


GROUPS = ("model", "data", "pc", "optim", "parallel", "trainer", "logger", "experiment")
"""The config groups of conf/config.yaml's defaults list."""

SCHEMA = "pcdist_schema"
"""conf/config.yaml's first default: schema.py's dataclasses as Hydra's schema, so every key exists
(and is typed) while Hydra composes, and ``key=value`` overrides any documented key, also one that
no file of the chosen group spells out."""


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA, node=Config)


_register_schema()


def compose(overrides: Iterable[str] = ()) -> DictConfig:
    """conf/ composed by Hydra with command-line overrides (``["data=mnist", "optim.lr=0.01"]``), as
    ``train.py`` sees it (without the ``hydra`` section). Works inside another Hydra app too."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from hydra.errors import HydraException

    problem = check_overrides(CONF_DIR, list(overrides))
    if problem:
        raise ConfigError(problem)
    outer = GlobalHydra.instance().hydra  # a running Hydra app: set aside, then restored
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose("config", overrides=list(overrides))
    except HydraException as e:
        raise composition_error(e) from e
    finally:
        GlobalHydra.instance().clear()
        if outer is not None:
            GlobalHydra.instance().initialize(outer)


def composition_error(e: Exception) -> ConfigError:
    """Hydra's refusal of an override (a value of the wrong type for its key, checked against the
    schema while composing) as one line naming the key, as ``load_config`` names it."""
    cause = e.__cause__ if e.__cause__ is not None else e
    key = getattr(cause, "full_key", None)
    if key:
        return key_error(key, str(cause).split("\n")[0].strip())
    return ConfigError(" ".join(str(e).split()))


def key_error(key: str, msg: str) -> ConfigError:
    """OmegaConf's refusal at ``key`` as one line: a value its (known) key cannot take (``model.dims[2]``: an item
    of a list), else a key there is not."""
    if re.sub(r"(\[\d+\])+$", "", key) in config_keys():
        return ConfigError(f"invalid value for config key {key}: {msg}")
    return ConfigError(f"invalid config key {key}: {msg}{did_you_mean(key, config_keys())}")


def make_config(cfg: Any = None) -> Config:
    """The validated Config of a run, on top of conf/'s defaults.

    A DictConfig is taken as composed already. A list is the command line's overrides
    (``["optim=sgd", "optim.lr=0.01"]``). A dict (or None) is merged onto ``compose()``; a
    string value for a group selects that group's file and a dotted key sets one value, as on
    the command line: ``{"optim": "sgd", "optim.lr": 0.01, "trainer": {"max_steps": 100}}`` is
    ``train.py optim=sgd optim.lr=0.01 trainer.max_steps=100``.
    """
    if isinstance(cfg, DictConfig):
        return load_config(cfg)
    if isinstance(cfg, (list, tuple)):
        return load_config(compose([_of_hydra(o.lstrip("+~").partition("=")[0], o.partition("=")[2], o)
                                    for o in cfg]))
    if cfg is not None and not isinstance(cfg, dict):
        raise ConfigError(f"pcdist.train needs a dict, a list of overrides or an omegaconf DictConfig as its config, "
                          f"got {type(cfg).__name__}")
    cfg = dict(cfg or {})
    if isinstance(cfg.get("hydra"), dict):  # {"hydra": {"run": {"dir": ...}}}: as its dotted keys
        cfg.update({f"hydra.{k}": v for k, v in flat(cfg.pop("hydra")).items()})
    for key in [k for k in cfg if k == "hydra" or k.startswith(("hydra.", "hydra/"))]:
        run_dir = _of_hydra(key, cfg.pop(key)).partition("=")[2]
        if cfg.get("run_dir") not in (None, run_dir):
            raise ConfigError(f"{key} and run_dir name two directories for one run; give run_dir alone")
        cfg["run_dir"] = run_dir
    fields = {f.name for f in dataclasses.fields(Config)}
    sections = {f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.type) or
                (isinstance(f.type, str) and f.type.endswith("Config"))}
    for k, v in cfg.items():  # ({"trainer": 5}: "invalid config key ?"; {"model": ["mlp"]}: omegaconf's type error)
        if k in sections and not isinstance(v, (dict, DictConfig)) and not (k in GROUPS and isinstance(v, str)):
            what = "a dict of its keys" + (f", or the name of an option of conf/{k}/" if k in GROUPS else "")
            raise ConfigError(f"pcdist.train's config: {k} takes {what}, not the {type(v).__name__} {v!r}")
    unknown = [f"{k}={v}" for k, v in cfg.items() if "." not in k and k not in fields and k not in GROUPS
               and isinstance(v, str)]
    problem = unknown and check_overrides(CONF_DIR, unknown)  # a mistyped group: the command line's own hint
    if problem:
        raise ConfigError(problem)
    choices = [f"{k}={cfg.pop(k)}" for k in list(cfg) if k in GROUPS and isinstance(cfg[k], str)]
    dotted = {k: cfg.pop(k) for k in list(cfg) if "." in k}
    base = OmegaConf.create(OmegaConf.to_container(compose(choices)))  # untyped: unknown keys are named by
    # load_config, against the dataclasses, as the command line's are
    merged = OmegaConf.merge(base, cfg)
    for key, value in dotted.items():
        OmegaConf.update(merged, key, value, merge=True)
    return load_config(merged)


def _of_hydra(key: str, value, given: str | None = None) -> str | None:
    """An override of pcdist.train's config (``given``, its ``key``, its ``value``) as pcdist reads it: Hydra's
    settings are the command line's own, where pcdist.train would drop them without a word (a resume with
    hydra.run.dir=... started a new run elsewhere); hydra.run.dir is the run's directory, run_dir, and any other is
    one line."""
    if key == "hydra.run.dir":
        return f"run_dir={value}"
    if key == "hydra" or key.startswith(("hydra.", "hydra/")):
        raise ConfigError(f"{key}: Hydra's settings are read by the command line (train.py, python -m pcdist), not by "
                          f"pcdist.train; from Python the run's directory is run_dir, and a sweep a loop over calls")
    return given


ONE_READER = {"data.val_fraction": "digits", "data.synthetic_train": "synthetic", "data.synthetic_val": "synthetic"}
"""Data keys that one data set alone reads (the others' splits and sizes are their files')."""


def read_settings(path: Path, what: str) -> dict:
    """A run's config.yaml (``path``) as data: ``safe_load``, so no YAML tag builds anything; a RunError naming the
    file, then ``what`` (the way on), where it is not YAML or holds no mapping of settings."""
    import yaml

    try:
        saved = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise RunError(f"{path} is damaged ({type(e).__name__}: {' '.join(str(e).split())[:200]}): {what}") from None
    if not isinstance(saved, dict) or not saved:
        held = "no settings" if not saved else f"a {type(saved).__name__}"
        raise RunError(f"{path} holds {held}: {what}")
    return saved


def flat(d: dict, prefix: str = "") -> dict:
    """{"trainer": {"max_steps": 5}} -> {"trainer.max_steps": 5} (lists are values)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _text(value: Any) -> str:
    """A value as the command line writes it: 132, [64,32,10], null, true."""
    import json

    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def passed_settings(cfg: Any) -> dict[str, str] | None:
    """The config keys the user's ``cfg`` sets, each with the override that sets it (as the command
    line writes it: ``trainer.max_steps=132``, ``experiment=mupc_digits``); None for a config composed
    already (a DictConfig), which may set any key. A group choice sets the keys its file changes
    from the defaults, and for a group that is a config section (``model=cnn``) all of its keys."""
    if isinstance(cfg, DictConfig):
        return None
    if cfg is None:
        return {}
    if isinstance(cfg, dict):
        choices = [f"{k}={v}" for k, v in cfg.items() if k in GROUPS and isinstance(v, str)]
        rest = {k: v for k, v in cfg.items() if not (k in GROUPS and isinstance(v, str))}
        keys = {k: f"{k}={_text(v)}" for k, v in flat(rest).items()}
        order = [f"{k}={v}" if k in GROUPS and isinstance(v, str) else k for k, v in cfg.items()]
    else:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        choices, keys, order = [], {}, list(cfg)
        for o in OverridesParser.create().parse_overrides(list(cfg)):
            key = o.key_or_group
            if key in groups():
                choices.append(o.input_line)
            elif key.split(".")[0].split("/")[0] != "hydra":
                known = [k for k in config_keys() if key == k or key.startswith(k + ".")]  # model.dims.0: model.dims
                keys[known[0] if known else key] = o.input_line
    for choice in choices:
        for k in choice_keys(choice):
            keys.setdefault(k, choice)

    def position(text: str) -> int:  # where the override stands in the user's cfg (a dict: its top-level key)
        return next((i for i, o in enumerate(order)
                     if text == o or text.startswith(f"{o}.") or text.startswith(f"{o}=")), len(order))

    return dict(sorted(keys.items(), key=lambda kv: position(kv[1])))


@functools.lru_cache(maxsize=None)
def choice_keys(choice: str) -> tuple[str, ...]:
    """The keys a group choice (``model=cnn``) sets: every key of its group's section, and any other its file
    changes from the defaults. A file that holds its section only (no ``@package`` line, no defaults list:
    ``logger=none``, ``optim=sgd``) sets that section's keys alone, read from the schema; any other is composed
    with and without the choice. An experiment also sets every key its file writes and those of the group
    choices its defaults list makes, equal to the defaults or not (``pc.prior_precision: 1.0``: passed again on
    a resume, the whole preset comes back, not the part that differs from conf/). Cached: the same choice always
    sets the same keys."""
    group, option = choice.split("=", 1)
    if not re.fullmatch(r"\w+", group) or not re.fullmatch(r"[\w.-]+", option) or ".." in option:
        return ()  # not a choice of conf/ (a crafted attempt file's "model=../../x"): no file outside it is read
    path = CONF_DIR / group / f"{option}.yaml"
    text = path.read_text() if path.is_file() else "@package"
    if group != "experiment" and "@package" not in text and not re.search(r"^defaults\s*:", text, re.M):
        return tuple(k for k in config_keys() if k.split(".")[0] == group)
    default = _defaults()
    chosen = flat(OmegaConf.to_container(compose([choice]), resolve=True))
    keys = [k for k, v in chosen.items() if k.split(".")[0] == group or default.get(k, v) != v or k not in default]
    if group == "experiment":
        body = OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}
        written = set(flat({k: v for k, v in body.items() if k != "defaults"}))
        for entry in body.get("defaults", []):
            for name, option in (entry.items() if isinstance(entry, dict) else ()):
                name = name.replace("override", "").strip().lstrip("/")
                if (CONF_DIR / name).is_dir():
                    written |= set(choice_keys(f"{name}={option}"))
        keys += [k for k in chosen if k in written and k not in keys]
    return tuple(keys)


@functools.lru_cache(maxsize=1)
def _defaults() -> dict:
    """conf/'s defaults, flat (``choice_keys`` compares a composed choice with them)."""
    return flat(OmegaConf.to_container(compose([]), resolve=True))


def literal(tree: Any) -> Any:
    """A config read from a run directory (or a Config's own values), as data: every ``${`` in its strings
    escaped, so that OmegaConf gives back the same strings and never resolves them (``${oc.env:TOKEN}`` in a
    folder one was sent would read one's environment). pcdist writes configs resolved, so its own hold none."""
    if isinstance(tree, str):
        return re.sub(r"(\\*)\$\{", lambda m: "\\" * (2 * len(m.group(1)) + 1) + "${", tree)
    if isinstance(tree, dict):
        return {k: literal(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [literal(v) for v in tree]
    return tree


def load_config(cfg: Any) -> Config:
    """A validated Config from a DictConfig/dict (unknown keys and wrong types name the key; each key's range: how
    the keys go together is checked on the config a launch trains with, ``check_combination``)."""
    base = OmegaConf.structured(Config)
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    cfg = {k: v for k, v in (cfg or {}).items() if k not in ("hydra", "experiment")}
    try:
        merged = OmegaConf.merge(base, cfg)
        conf = OmegaConf.to_object(merged)  # (a typed key holding text, "${...}" kept as text, fails here)
    except Exception as e:  # omegaconf's ConfigKeyError / ValidationError carry the full key
        raise key_error(getattr(e, "full_key", None) or "?", str(e).split("\n")[0].strip()) from e
    validate(conf)
    return conf


DATA_PATHS = ("data.path", "data.root")
"""Where the data is: a run records them as absolute paths (``absolute_data_paths``)."""


def absolute_path(path: str) -> str:
    """``path`` (``~`` expanded) as the absolute path it names from this folder."""
    return os.path.abspath(os.path.expanduser(path))


def absolute_data_paths(c: Config) -> None:
    """``data.path`` and ``data.root`` as the absolute paths they name from this folder: a resume or evaluate
    started in another folder reads the same files, not that folder's files of the same name."""
    for key in DATA_PATHS:
        name = key.split(".")[1]
        if getattr(c.data, name) is not None:
            setattr(c.data, name, absolute_path(getattr(c.data, name)))


def network_options(c: Config) -> dict:
    """The network's energy beyond its output energy, as PCNetwork takes it: the precisions and the prior
    of a free h_0 (pc.prior_mean auto: uniform for a label node in generative mode, else zero)."""
    from ..engine.layers.prior import Prior

    mean = c.pc.prior_mean if c.pc.prior_mean != "auto" else ("uniform" if c.pc.mode == "generative" else "zero")
    return {"precision": c.pc.precision, "prior": Prior(float(c.pc.prior_precision), mean)}


_PC_READERS = {
    "latent_dim": ("pc.mode=unsupervised", lambda pc: pc.mode == "unsupervised"),
    "prior_precision": ("a free h_0: pc.mode=generative or unsupervised", lambda pc: pc.mode != "supervised"),
    "prior_mean": ("a free h_0: pc.mode=generative or unsupervised", lambda pc: pc.mode != "supervised"),
    "eval_T": ("the generative and unsupervised tests", lambda pc: pc.mode != "supervised"),
    "eval_solver": ("the generative and unsupervised tests", lambda pc: pc.mode != "supervised"),
    "eval_tol": ("pc.eval_solver=adaptive", lambda pc: pc.mode != "supervised" and pc.eval_solver == "adaptive"),
    "precision_decay": ("pc.precision_schedule=top_down", lambda pc: pc.precision_schedule == "top_down"),
    "diagnostics_every": ("pc.diagnostics=true", lambda pc: pc.diagnostics),
}
"""pc.* keys that only some runs read: key -> (what reads it, whether this run's pc.* settings do)."""


def unread(section, readers: dict) -> list[str]:
    """The keys of a config section (``c.pc``, ``c.data``) set off their defaults that this run does not read:
    ``readers`` maps a key to whether the section's settings read it (the notes below say them, not refuse them,
    as sweeps over modes or data sets share them)."""
    default = type(section)()
    return [k for k, reads in readers.items() if getattr(section, k) != getattr(default, k) and not reads(section)]


def unread_pc_note(c: Config) -> str | None:
    """The one line for pc.* keys set off their defaults that this run does not read (pc.latent_dim in a
    supervised run)."""
    said = [f"pc.{k}={getattr(c.pc, k)} (read by {_PC_READERS[k][0]})"
            for k in unread(c.pc, {k: reads for k, (_, reads) in _PC_READERS.items()})]
    if not said:
        return None
    return f"note: this run does not read {', '.join(said)}"


def given_keys(overrides: list[str]) -> list[str]:
    """The keys (``optim.lr``) the overrides a run was given (``optim.lr=0.01``, ``+x=1``, ``~x``) set, in order."""
    return list(dict.fromkeys(o.lstrip("+~").partition("=")[0] for o in overrides))


def backprop_note(c: Config, overrides: list[str]) -> str | None:
    """The one line for PC's inference settings given for a backprop run (pc.algorithm=bp reads none of them: its
    twin shares its PC run's settings, so they are said, not refused; a preset's go unsaid)."""
    if c.pc.algorithm != "bp":
        return None
    said = [f"{k}={getattr(c.pc, k[3:])}" for k in given_keys(overrides)
            if k.startswith("pc.") and k not in ("pc.algorithm", "pc.mode") and hasattr(c.pc, k[3:])]
    if not said:
        return None
    return f"note: pc.algorithm=bp trains by backprop and does not read {', '.join(said)} (PC's inference settings)"


def groups(conf_dir: Path = CONF_DIR) -> dict[str, list[str]]:
    """Config group -> its options (conf/<group>/<option>.yaml)."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(conf_dir.iterdir()) if d.is_dir()}


def check_overrides(conf_dir: Path, overrides: list[str]) -> str | None:
    """The first problem with command-line overrides as one line, or None.

    A key that is not in the config gets a did-you-mean from the known keys and groups (Hydra
    itself would advise appending it with ``+key``, which the structured config then refuses);
    a group option that does not exist lists the options.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        return f"cannot read the override: {' '.join(str(e).split())}"
    keys, options = config_keys(), groups(conf_dir)
    for o in parsed:
        key = o.key_or_group
        if o.is_delete() or key.split(".")[0].split("/")[0] == "hydra" or o.package:
            continue
        if key in options:
            for v in override_values(o):  # each of a sweep's too (model=mlp,cnnn: Hydra's report of its search path)
                if not isinstance(v, str):  # null, a number, a list: Hydra's own traceback
                    shown = o.input_line.split("=", 1)[1] if "=" in o.input_line else v
                    return (f"{key}={shown}: a config group takes the name of one of its options (options: "
                            f"{', '.join(options[key])}){'; leave it out for none' if key == 'experiment' else ''}")
                if v not in options[key]:
                    return (f"{key}={v}: no such option in conf/{key}/ (options: {', '.join(options[key])})"
                            f"{did_you_mean(v, options[key])}")
            continue
        if key in keys:
            if o.is_add():
                return f"config key {key} already exists: set it with {key}=... (without +, which adds a new key)"
            continue
        if any(key.startswith(k + ".") for k in keys):  # an element of a list-valued key, e.g. model.dims.0
            continue
        hint = did_you_mean(key, keys)
        group = [] if "." in key else difflib.get_close_matches(key, list(options), n=1, cutoff=0.6)
        if group:  # a name without a dot near a group's (optimm=sgd): the group, not one of its keys (optim.name)
            value = o.input_line.split("=", 1)[1] if "=" in o.input_line else "..."
            hint = f"; did you mean the config group {group[0]}={value}?"
        return f"unknown config key {key}{hint} ({command()} --help lists every key and group)"
    return None


def override_values(o) -> list:
    """An override's value, or the values it sweeps over where they can be listed (choice, range, a list; glob's
    where the override has Hydra's config loader), else none (an interval's are drawn, not listed)."""
    if not o.is_sweep_override():
        return [o.value()]
    try:
        return list(o.sweep_string_iterator())
    except Exception:  # noqa: BLE001 - an interval(...), or glob(...) without a config loader
        return []


def run_dir_override(run_dir) -> str:
    """``hydra.run.dir=<run_dir>`` as Hydra reads it back: in quotes where the path holds what its grammar
    would take apart (``a,b`` a sweep, ``[1]`` a list, spaces at the ends), a quote or a backslash before one
    escaped (Hydra's rule). As one shell word: ``shlex.quote`` it."""
    text = str(run_dir)
    if re.fullmatch(r"[\w./:@+~%-]+", text):
        return f"hydra.run.dir={text}"
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    escaped = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped)
    return f"hydra.run.dir='{escaped}'"


def command() -> str:
    """How this process was started, for the hints in messages: ``python -m pcdist``, ``pcdist-train``, or
    ``python train.py`` (also from Python, where the command line to name is the checkout's)."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    if argv0.name == "__main__.py" and argv0.parent.name == "pcdist":
        return "python -m pcdist"
    if argv0.name == "pcdist-train":
        return "pcdist-train"
    return "python train.py"


