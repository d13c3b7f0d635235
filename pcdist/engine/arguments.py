"""The engine's settings and what each allows, written once: ``PCTrainer(T=0)`` and the service's ``pc.T=0``
are refused by the same rule, each in its caller's words (``T (inference steps) must be an integer >= 1, got 0``;
``config pc.T=0 is invalid: allowed an integer >= 1``)."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Callable, NamedTuple

from ..errors import ConfigError

__all__ = ["ALGORITHMS", "ENV_SWITCHES", "INITS", "NEAR_EQUILIBRIUM", "RULES", "Rule", "check", "check_env",
           "env_choice", "finite"]

ALGORITHMS = ("pc", "ipc")
INITS = ("ff", "deeppcr", "newton", "newton_cr", "backward")
"""The value-node inits: ``ff`` (feed-forward), ``deeppcr`` (the same chain by parallel cyclic reduction),
``newton`` (the linearised equilibrium, low-rank), ``newton_cr`` (the same by cyclic reduction), ``backward``
(one backward chain, scaled)."""
NEAR_EQUILIBRIUM = ("newton", "newton_cr", "backward")
"""The inits that start the hidden nodes near the inference equilibrium, not at the feed-forward values (one layer
slice: engine/equilibrium.py)."""


ENV_SWITCHES = {
    "PCDIST_NATIVE": ("1", "0"),  # the CPU kernels (pcdist/engine/native.py)
    "PCDIST_TRACE": ("1", "0"),  # a module layer's traced calls (pcdist/engine/layers/graph.py)
    "PCDIST_TRITON": ("1", "0"),  # the Triton kernels on GPUs (pcdist/engine/chain.py, errorpass.py)
    "PCDIST_GEMM": ("auto", "torch", "triton"),  # a dense group's batched products (pcdist/engine/gemm.py)
    "PCDIST_CHANNELS_LAST": ("auto", "0", "1"),  # image nodes' memory layout (pcdist/engine/layers/conv.py)
    "PCDIST_CONV_GROUPED": ("auto", "0", "1"),  # a conv group's convolutions as one (the same file)
}
"""The engine's environment switches and the values each allows (the first: its default)."""


def env_choice(name: str, allowed: tuple[str, ...] | None = None) -> str:
    """The environment variable ``name`` (default ``allowed[0]``; ``allowed``: ENV_SWITCHES[name] by default), or a
    ConfigError (a ValueError; the command line prints it as one line) naming it and what it allows."""
    allowed = allowed or ENV_SWITCHES[name]
    value = os.environ.get(name, allowed[0])
    if value not in allowed:
        raise ConfigError(f"environment variable {name}={value!r}: allowed {', '.join(allowed)} "
                         f"(unset: {allowed[0]})")
    return value


def check_env() -> None:
    """Every engine switch set in the environment holds a value it allows, else a ConfigError naming it: checked
    when a trainer is made (and by the service's launch checks), not at the first step that reads one."""
    for name in ENV_SWITCHES:
        env_choice(name)


def finite(x: Any) -> bool:
    """A finite real number: int, float or a numpy scalar (not a bool)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def whole(x: Any) -> bool:
    """An integer: int or a numpy integer (not a bool)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


class Rule(NamedTuple):
    """A setting's test (``ok``), the words for what it allows and what the setting is (for the API's message)."""

    ok: Callable[[Any], bool]
    allowed: str
    what: str

    def check(self, name: str, value: Any) -> Any:
        """``value``, or a ValueError naming the setting (``what``, else ``name``), what it allows and the value."""
        if not self.ok(value):
            raise ValueError(f"{self.what or name} must be {self.allowed}, got {value!r}")
        return value


RULES = {
    "T": Rule(lambda v: whole(v) and v >= 1, "an integer >= 1", "T (inference steps)"),
    "x_lr": Rule(lambda v: finite(v) and v > 0, "a finite number > 0", "x_lr (value-node learning rate)"),
    "x_momentum": Rule(lambda v: finite(v) and 0 <= v < 1, "a number in [0, 1)", "x_momentum"),
    "algorithm": Rule(lambda v: v in ALGORITHMS, "one of " + ", ".join(ALGORITHMS), "algorithm"),
    "init": Rule(lambda v: v in INITS, "one of " + ", ".join(INITS), "init (the value-node init)"),
    "value_noise": Rule(lambda v: finite(v) and v >= 0, "a finite number >= 0",
                        "value noise (the temperature tau)"),
    "skip_above": Rule(lambda v: v is None or (finite(v) and v >= 0), "None or a finite number >= 0",
                       "skip_above (the energy above which an update is skipped)"),
    "noise_seed": Rule(whole, "an integer", "noise_seed"),
    "precision_schedule": Rule(lambda v: v is None or callable(v), "None or a callable factor(layer, t, num_layers)",
                               "precision_schedule"),
}
"""Each engine setting's rule, by its ``PCTrainer`` argument name (the service's key is ``pc.<name>``)."""


def check(name: str, value: Any) -> Any:
    """``value`` if ``RULES[name]`` allows it, else a ValueError in the API's words."""
    return RULES[name].check(name, value)
