"""ConfigError: a configuration value that cannot work, named by its key.

Raised before any process group or work exists (``pcdist.service.config``, ``ParallelDims``,
``pcdist.train``); ``train.py`` prints it as one line and exits with status 2. It is a
ValueError, so code that catches ValueError keeps working.
"""


class ConfigError(ValueError):
    """A config key (or mesh factor) has a value that cannot work; the message names it."""


class PeerError(RuntimeError):
    """A point-to-point exchange or a collective with other ranks failed or timed out."""
