"""Exceptions a user can cause, and the warnings zerograph issues. Internal invariants use ``assert`` instead."""


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


class ModelChangedError(ZeroGraphError):
    """The model's parameters changed after ``compile`` in a way the captured graphs cannot follow:
    a parameter added or replaced, or its ``requires_grad`` flipped. Raised at the next forward."""


class ScheduleMismatchError(ZeroGraphError, RuntimeError):
    """Ranks were about to run different communication schedules (different collectives, sizes,
    dtypes or units). Raised on every rank, before the first collective of the diverging graph."""


class CollectiveError(ZeroGraphError, RuntimeError):
    """A collective failed or timed out: a peer rank probably died, or stopped calling the model."""


class CollectiveBufferError(CollectiveError):
    """The collectives' debug mode (``ZEROGRAPH_DEBUG_COLLECTIVES=1``) found a collective's input or
    output buffer written, read, freed or released by something else between the collective's
    issue and its wait, or a collective never waited; the message names the collective and the buffer."""


class DumpError(ZeroGraphError):
    """The dump (``ZEROGRAPH_DUMP`` / ``Config(dump_dir=)``) cannot be written where asked, or a
    folder given to ``zerograph inspect`` is not a readable dump; the message names the file."""


class PoolCorruptionError(ZeroGraphError, RuntimeError):
    """The buffer pool's debug mode (``ZEROGRAPH_DEBUG_POOL=1``) found a pooled comm buffer written
    after its graph released it: an asynchronous collective still writing, or a tensor that
    outlived its graph while sharing the slot's memory."""



class TemplateUnavailable(ZeroGraphError):
    """A kind of unit could not be traced as a unit template (``Config.unit_templates``); its
    units now run inline. Raised out of Dynamo's trace (the one way out of it) to the compiled
    forward, which takes it as a fallback (``compiled_model.FellBack``) and traces the model again;
    it never reaches the user."""


class HeldGradientsError(ZeroGraphError, RuntimeError):
    """An optimizer step over parameters whose gradients a ``no_sync`` backward still holds (never
    reduced into ``.grad``): the step would leave those micro-batches out. The message names the
    parameters and the fix."""


class TemplateFallbackError(ZeroGraphError):
    """Under ``Config(strict_templates=True)``: a unit left the template fast path (it would run
    inline, or as an island); the message names the unit's kind and the reason. For CI that must
    not lose the fast path without a word; the default logs each reason once per kind instead
    (``zerograph.explain``, ``zerograph.stats``)."""


class UnitPathError(ZeroGraphError, RuntimeError):
    """A unit kind was asked to move to a path its current one does not lead to
    (``templates.unit_paths.TRANSITIONS``: from a template toward eager, never back). A bug in
    zerograph, not in the model; the message names the kind, both paths and the reason given."""


class DynamicShapeTrace(TemplateUnavailable):
    """A unit template met a dynamic shape: the compiled forward traces the model again with every
    templated unit inline, for this trace only (``shard.trace_state.TraceState.inline_every_unit``)."""


class ZeroGraphWarning(UserWarning):
    """Base class of every warning zerograph issues (``warnings.warn``); filter it as a whole with
    ``warnings.filterwarnings("ignore", category=zerograph.ZeroGraphWarning)``."""


class UnitSizeWarning(ZeroGraphWarning):
    """At stage 3 one sharding unit (the root included) holds more than a quarter of the model's
    parameters although it holds repeated blocks that could be units of their own; the message
    names the ``Config(unit_classes=...)`` that splits it (``zerograph.shard.units``)."""


class SyncedForHooksWarning(ZeroGraphWarning):
    """Gradient sync was off (``no_sync``, ``set_requires_gradient_sync(False)``) for a forward of
    a model with a tensor hook (``register_hook`` or ``register_post_accumulate_grad_hook``) on a
    trainable parameter: its backward reduced its gradients anyway, so that the hooks saw what
    eager shows them (``compiled_model.grad_mode_for``); the message names the parameters."""
