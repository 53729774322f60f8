"""Exceptions a user can cause. Internal invariants use ``assert`` instead."""


class ZeroGraphError(Exception):
    """Base class of every error zerograph raises on purpose."""


class ConfigError(ZeroGraphError, ValueError):
    """An argument or ``Config`` field is out of range (e.g. ``stage=4``)."""


class ShardingError(ZeroGraphError):
    """The model cannot be sharded as asked (mixed devices, 0-d parameters, ...)."""


class ProcessGroupError(ZeroGraphError):
    """The process group does not fit the launch (size mismatch, not initialised)."""


class UnshardedParameterError(ZeroGraphError):
    """An optimizer was given the model's original, full parameters after ``compile``."""


class PassError(ZeroGraphError):
    """A graph pass broke an invariant; the message names the pass and those run before it."""
