"""``zerograph.init_weights``: initialise a compiled (e.g. meta-built) model's shards so that the
full parameters are bitwise those an ordinary build with the same seed would have."""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ShardingError
from ..runtime.state import state_of
from ..shard.sharding import ROOT_INDEX, ParamLayout
from ..shard.trace_state import TRACE
from ..shard.uninitialised import UninitialisedTracker, versions
from .loading import local_rows

if TYPE_CHECKING:
    from ..runtime.runtime import Runtime

ModuleInit = Callable[[nn.Module], None]
T = TypeVar("T")


def reset_parameters(module: nn.Module) -> None:
    """The default per-module initialisation: ``module.reset_parameters()`` where defined (every
    ``torch.nn`` layer with parameters defines it and calls it from its ``__init__``)."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def init_weights(model: nn.Module, fn: ModuleInit | Iterable[ModuleInit] | None = None, *,
                 device: torch.device | str = "cpu") -> list[str]:
    """Initialise every shard of a compiled model, bitwise as an ordinary build would.

    ``fn(module)`` is called for every module of ``model`` in ``model.named_modules()`` order
    (pre-order: a module before its children, children in registration order), each seeing full,
    plain parameters; afterwards each rank keeps its own rows. ``fn=None`` calls
    ``reset_parameters()`` where a module defines it, which replays what the modules' constructors
    did: for a model built from standard ``torch.nn`` layers, registration order is construction
    order, so the same seed yields bitwise the same full parameters as building the model on the
    CPU (assumption: no module's ``__init__`` consumes random numbers after building its
    children, nor outside ``reset_parameters``). A model whose ``__init__`` adds its own passes
    after construction (as the GPT of ``zerograph.models.gpt`` does: ``self.apply(_init_weights)``,
    then a scaled init of the residual projections) is reproduced by giving those passes in
    order, ``fn=[reset_parameters, pass_2, pass_3]``: each is a full walk over the modules, as in
    the constructor. Buffers are the real ones (``reset_parameters`` may write running statistics);
    an ``fn`` may also re-assign a buffer of a meta-built model instead of writing into it, as
    torchtitan's ``init_weights`` does (``self.freqs_cis = self._precompute_freqs_cis()``): the new
    values are copied into the buffer ``compile`` allocated, which is put back and counts as written.

    How: per sharding unit, every rank materialises the unit's full parameters on ``device``
    (plain tensors swapped into the modules while ``fn`` runs), runs ``fn`` on the unit's modules
    with the process's RNG, then copies its own rows into its shard and drops the full tensors.
    All ranks draw the same random stream, so they compute identical full tensors; nothing is
    communicated for a parameter that holds no values yet (a fresh meta-built model), and
    parameters that already hold values are all-gathered first, so ``fn`` may read them.

    Cost: every rank spends the compute time of an ordinary init of the whole model (the random
    stream is sequential: it cannot be split by rows and stay bitwise); peak extra memory on
    ``device`` is one unit's full parameters (two when a module's tied parameter lives in another
    unit), plus one parameter's gather buffer on the shards' device. Communication: one
    ``all_gather_object`` of a few bytes per call (checks that ranks' RNG states agree), plus the
    all-gathers of already initialised parameters. A unit is materialised each time the walk
    enters it: the root unit of a transformer twice (embeddings first, final norm and head last).

    Rules for ``fn``: it writes parameters in place. Those of the module it is given are
    materialised before the call; one of another unit is materialised when ``fn`` reads it
    through its module's attribute (``self.layers[i].wq.weight``), so a whole-model init given
    for the root (torchtitan's ``model.init_weights()``) runs unit by unit, one such unit open at
    a time: a full tensor kept and written after ``fn`` read another unit's parameter reaches no
    shard and is refused. Writes that reach a shard directly (a root-level loop over
    ``model.blocks.parameters()``: those slots hold shards) would draw from DTensor's RNG instead
    and are refused. A parameter that no ``fn`` wrote stays uninitialised (NaN while
    materialised; it is not written back), and is returned.

    Args:
        model: a model returned by ``zerograph.compile``, e.g. built on the meta device.
        fn: a function of one module, or several run one after the other (each a whole walk);
            ``None``: ``reset_parameters``.
        device: where the full unit is materialised and ``fn`` runs. ``"cpu"`` (default) draws
            from the CPU generator, i.e. equals a model built on the CPU; a CUDA device is faster
            and equals a model built on that device.

    Returns:
        Names of the parameters and buffers of a meta-built model that still hold no values (empty
        when the model is fully initialised).

    Raises:
        ShardingError: ``model`` was not compiled by zerograph; ``fn`` draws random numbers but the
            ranks' RNG states differ (seed every rank alike first: ``torch.manual_seed(seed)``;
            raised before the first random value is written); ``fn`` wrote a shard directly, or a
            full tensor after its unit was put back; ``fn``
            re-assigned an empty buffer with another shape or dtype (or deleted it).

    Source: FSDP2's meta-device initialisation (``to_empty`` + ``reset_parameters``) and
    torchtitan's per-module ``init_weights``; DeepSpeed's ``zero.Init`` gathers-then-slices the same way.
    """
    passes = [reset_parameters] if fn is None else ([fn] if callable(fn) else list(fn))

    def every_module(walk: _UnitWalk) -> None:
        for init in passes:
            for mod in model.modules():
                walk.enter(mod)
                init(mod)
                walk.adopt_reassigned_buffers()
            walk.release_all()

    _with_units_materialised(model, torch.device(device), every_module)
    state = state_of(model)
    return state.uninitialised.pending() if state.uninitialised is not None else []


def init_whole_model(model: nn.Module, init: Callable[[], T]) -> T:
    """Run ``init()``, a whole-model initialisation such as torchtitan's ``model.init_weights()``
    (the root initialising every block's parameters through their modules' attributes), on a
    compiled model as ``init_weights`` runs ``fn``: each unit's parameters are materialised in
    full, on the shards' device, when ``init`` first reads one of them, and this rank's rows kept
    when it moves on to another unit (one unit open at a time), so the same seed gives the
    ordinary build's values, not one draw repeated on every rank. A compiled model's own
    ``init_weights`` method runs through this (``compiled_model``). Inside ``init_weights`` (an
    ``fn`` calling it) it just calls ``init()``. Returns what ``init()`` returns.

    Raises:
        ShardingError: as ``init_weights``; also when ``init`` wrote a parameter's full tensor after
            its unit had been put back (it held on to it while reading another unit's).

    Source: torchtitan's ``model.init_weights(buffer_device=...)`` after FSDP2's ``to_empty``.
    """
    if TRACE.init_read is not None:
        return init()
    result: list[T] = []

    def run(walk: _UnitWalk) -> None:
        result.append(init())
        walk.adopt_reassigned_buffers()
        walk.release_all()

    _with_units_materialised(model, _shards_device(model), run)
    return result[0]


def _with_units_materialised(model: nn.Module, device: torch.device, run: Callable[[_UnitWalk], None]) -> None:
    """``run(walk)`` with parameter attribute reads materialising their units (``_UnitWalk.read``);
    then every shard back in its module, and writes that missed the full tensors refused."""
    walk = _UnitWalk(model, state_of(model).runtime, device)
    try:
        with TRACE.scope(init_read=walk.read):
            run(walk)
    finally:  # on an error in fn: put every shard back, write nothing more
        walk.put_back()
    walk.refuse_direct_writes()


def _shards_device(model: nn.Module) -> torch.device:
    """The device of the model's shards (``init_whole_model`` draws there: an ordinary build on it)."""
    param = next(model.parameters(), None)
    return _local(param).device if param is not None else torch.device("cpu")


class _UnitWalk:
    """The units ``init_weights`` holds materialised as its walk goes through the modules: each
    open unit's full parameters stand in the modules for their shards, and each rank's rows of
    them are written back when the walk leaves the unit (``release``). Keys are the layouts'."""

    def __init__(self, model: nn.Module, runtime: Runtime, device: torch.device) -> None:
        self.runtime, self.device = runtime, device
        self.rows = local_rows(model)
        self.shard_of = {layout.key: p for p in model.parameters() for layout, _, _ in [self.rows[id(p)]]}
        self.layout_of = {layout.key: layout for layout, _, _ in self.rows.values()}
        self.key_of = {id(p): layout.key for p in model.parameters() for layout, _, _ in [self.rows[id(p)]]}
        self.holders: dict[int, list[tuple[nn.Module, str]]] = {}  # key -> every (module, attribute) holding it
        for mod in model.modules():
            for name, p in mod._parameters.items():
                if p is not None:
                    self.holders.setdefault(self.key_of[id(p)], []).append((mod, name))
        pending = _pending_keys(model, self.key_of)
        self.pending, self.rng_diverged = _agree(runtime.topology.world_group, pending, device)  # replicas too
        self.rng_start = _rng_state(device)
        self.written = {key: versions(p) for key, p in self.shard_of.items()}  # what our own copies leave
        self.direct: set[int] = set()  # keys whose shards fn wrote directly
        self.unit_of_module = _unit_of_modules(model, runtime.units)
        self.unit_roots = {id(model.get_submodule(u.name)) for u in runtime.units if u.index != ROOT_INDEX}
        self.unit_of_key = {key: u.index for u in runtime.units for key in u.keys}
        self.open_units: dict[int, dict[int, torch.Tensor]] = {}  # unit -> key -> full tensor (swapped in)
        self.needed: set[int] = set()  # the units of the module fn now runs for (enter)
        # full tensors put back, which fn may still hold: (a tensor sharing only the full tensor's
        # version counter, the version then, name); a write to the full tensor moves it
        self.put_back_fulls: list[tuple[torch.Tensor, int, str]] = []
        self.empty_buffers = _empty_buffer_slots(model, state_of(model).uninitialised)

    def enter(self, mod: nn.Module) -> None:
        """Open the units ``fn(mod)`` needs (``_units_needed``), releasing the other open ones."""
        needed = _units_needed(mod, self.unit_of_module, self.unit_roots, self.unit_of_key, self.key_of)
        if needed:  # else (no parameters in reach) keep what is open: no gather thrash
            self.needed = needed
            for unit in [u for u in self.open_units if u not in needed]:
                self.release(unit)
            for unit in sorted(needed - self.open_units.keys()):
                self.materialise(unit)

    def read(self, mod: nn.Module, name: str) -> torch.Tensor:
        """A parameter attribute read while ``fn`` runs (``TraceState.init_read``): the full
        tensor, its unit materialised first if closed (releasing the other units opened so, not
        those ``fn``'s module needs: one unit at a time beyond them)."""
        key = self.key_of.get(id(mod._parameters[name]))
        if key is not None and self.unit_of_key[key] not in self.open_units:
            for unit in [u for u in self.open_units if u not in self.needed]:
                self.release(unit)
            self.materialise(self.unit_of_key[key])
        return mod._parameters[name]

    def adopt_reassigned_buffers(self) -> None:
        if self.empty_buffers:
            self.empty_buffers = _adopt_reassigned_buffers(self.empty_buffers)

    def materialise(self, unit: int) -> None:
        """Swap full parameters of ``unit`` (gathered, or NaN while pending) into its modules."""
        fulls = {}
        for key in self.runtime.units[unit].keys:
            shard = self.shard_of[key]
            full = _full(shard, self.layout_of[key], self.runtime.topology.group, self.device, key in self.pending)
            param = nn.Parameter(full, requires_grad=shard.requires_grad)
            self.key_of[id(param)] = key  # the walk finds it where the shard was
            for mod, name in self.holders[key]:
                mod._parameters[name] = param
            fulls[key] = param
        self.open_units[unit] = fulls

    def release(self, unit: int) -> None:
        """Put ``unit``'s shards back and copy this rank's rows of what ``fn`` wrote into them."""
        if self.rng_diverged and not torch.equal(_rng_state(self.device), self.rng_start):  # every rank raises alike
            raise ShardingError("init_weights: fn draws random numbers but the ranks' random number generators "
                                "were in different states, so their rows would come from different streams; call "
                                "torch.manual_seed(seed) with the same seed on every rank before init_weights")
        # written directly before this release's own copies (checked now: a unit's shards may be
        # views of one flat buffer, flat.py, sharing one version counter that the copies move)
        keys = self.runtime.units[unit].keys
        self.direct.update(k for k in keys if versions(self.shard_of[k]) != self.written[k])
        for key, full in self.open_units.pop(unit).items():
            del self.key_of[id(full)]
            self.put_back_fulls.append((_version_tracker(full), full._version, self.layout_of[key].fqn))
            for mod, name in self.holders[key]:
                mod._parameters[name] = self.shard_of[key]
            if key in self.pending and full.is_floating_point() and _all_nan(full):
                continue  # no fn wrote it: it stays uninitialised (and NaN never reaches the shard)
            layout, start, stop = self.rows[id(self.shard_of[key])]
            with torch.no_grad():
                _local(self.shard_of[key]).copy_(full[start:stop] if layout.sharded else full)
            self.pending.discard(key)
        for key in keys:  # what this release wrote into one moved them all
            self.written[key] = versions(self.shard_of[key])

    def release_all(self) -> None:
        for unit in list(self.open_units):
            self.release(unit)
        self.refuse_stale_writes()

    def refuse_stale_writes(self) -> None:
        """Raise ``ShardingError`` when ``fn`` wrote a full tensor after its unit was put back (it
        kept it while reading another unit's parameters): the write reached no shard. Checked at
        the end of each walk (O(parameters)), not at each read."""
        stale = [name for tracker, version, name in self.put_back_fulls if tracker._version != version]
        if stale:
            raise ShardingError(
                f"init_weights: fn wrote {', '.join(stale[:5])} after reading a parameter of another sharding unit, "
                "when its unit's full tensors had been put back (one unit is materialised at a time), so the write "
                "reached no shard: read each parameter through its module's attribute just before writing it")

    def put_back(self) -> None:
        """Put every open unit's shards back in their modules, writing nothing (after an error in ``fn``)."""
        for fulls in self.open_units.values():
            for key in fulls:
                for mod, name in self.holders[key]:
                    mod._parameters[name] = self.shard_of[key]

    def refuse_direct_writes(self) -> None:
        """Raise ``ShardingError`` naming the parameters whose shards ``fn`` wrote directly."""
        self.direct.update(k for k, p in self.shard_of.items() if versions(p) != self.written[k])
        direct_names = [self.layout_of[k].fqn for k in sorted(self.direct)]
        if direct_names:
            raise ShardingError(
                f"init_weights: fn wrote the shards of {', '.join(direct_names[:5])} directly (reached through "
                "parameters() or _parameters of a module whose unit was not materialised, not through the module's "
                "attribute), so they hold DTensor random values, not an ordinary build's: write fn to initialise "
                "the module it is given, or reach each parameter through its module's attribute")


BufferSlot = tuple[str, nn.Module, str, torch.Tensor]  # (qualified name, module, attribute, the buffer compile made)


def _empty_buffer_slots(model: nn.Module, tracker: UninitialisedTracker | None) -> list[BufferSlot]:
    """Every place a buffer of a meta-built model that holds no values yet is registered."""
    if tracker is None:
        return []
    return [(f"{mod_name}.{name}" if mod_name else name, mod, name, buf)
            for mod_name, mod in model.named_modules(remove_duplicate=False)
            for name, buf in mod._buffers.items() if buf is not None and tracker.unwritten(buf)]


def _adopt_reassigned_buffers(slots: list[BufferSlot]) -> list[BufferSlot]:
    """Treat an empty buffer that ``fn`` re-assigned (``self.freqs_cis = ...``, torchtitan's
    ``init_weights``) instead of writing into as written: the new values are copied into the buffer
    ``compile`` allocated, which goes back in its place, so it keeps its device and stays shared
    with the other modules that hold it, and the uninitialised-tensor guard sees the write.
    Returns the slots still waiting.

    Raises ``ShardingError`` when the new tensor's shape or dtype differs from the buffer's: the
    model was built (and compiled) with the other one."""
    waiting = []
    for fqn, mod, name, buf in slots:
        new = mod._buffers.get(name)
        if new is buf:
            waiting.append((fqn, mod, name, buf))
            continue
        if new is None or new.shape != buf.shape or new.dtype != buf.dtype:
            got = "None" if new is None else f"{tuple(new.shape)} {new.dtype}"
            raise ShardingError(
                f"init_weights: fn re-assigned buffer {fqn!r} with {got}, but the model was built and compiled with "
                f"{tuple(buf.shape)} {buf.dtype}; build the model so that the buffer has its final shape and dtype "
                "(a re-assigned buffer of the same shape and dtype is copied into the compiled model's)")
        with torch.no_grad():
            buf.copy_(new)
        mod._buffers[name] = buf
    return waiting


def _version_tracker(full: torch.Tensor) -> torch.Tensor:
    """A tensor that shares ``full``'s version counter but not its storage (``detach`` shares both;
    assigning ``.data`` drops the storage and keeps the counter), so that it sees a write to
    ``full`` while ``fn`` holds it, and after, without keeping its memory alive."""
    tracker = full.detach()
    tracker.data = torch.empty(0, dtype=full.dtype)
    return tracker


def _local(shard: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return shard.to_local()


def _full(shard: torch.Tensor, layout: ParamLayout, group: dist.ProcessGroup, device: torch.device,
          empty: bool) -> torch.Tensor:
    """A new full tensor of the parameter on ``device``: NaN (or uninitialised, for integers)
    when ``empty``, else its values all-gathered from the ranks' shards."""
    if empty:
        full = torch.empty(layout.shape, dtype=layout.dtype, device=device)
        return full.fill_(math.nan) if full.is_floating_point() else full
    local = _local(shard)
    if not layout.sharded:
        return local.to(device, copy=True)
    padded = local.new_zeros((layout.chunk_rows, *layout.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = local.new_empty((layout.world_size * layout.chunk_rows, *layout.shape[1:]))
    dist.all_gather_single(gathered, padded, group=group)
    return gathered[: layout.shape[0]].to(device)  # a view of the fresh buffer, or a copy on ``device``


def _all_nan(full: torch.Tensor, block: int = 1 << 20) -> bool:
    """Whether every element is NaN (still as materialised), tested in blocks so that the test
    allocates 1 MiB of booleans at most, not one per element."""
    return all(bool(torch.isnan(part).all()) for part in full.detach().reshape(-1).split(block))


def _pending_keys(model: nn.Module, key_of: dict[int, int]) -> set[int]:
    """Keys of the parameters that hold no values yet (never written since a meta-built compile)."""
    tracker = state_of(model).uninitialised
    if tracker is None:
        return set()
    names = set(tracker.pending())
    return {key_of[id(p)] for n, p in model.named_parameters() if n in names}


def _rng_state(device: torch.device) -> torch.Tensor:
    state = torch.random.get_rng_state()
    return torch.cat([state, torch.cuda.get_rng_state(device)]) if device.type == "cuda" else state


def _agree(group: dist.ProcessGroup, pending: set[int], device: torch.device) -> tuple[set[int], bool]:
    """The union of the ranks' uninitialised keys (so all ranks gather alike), and whether the
    ranks' RNG states differ: then an ``fn`` that draws random numbers would give each rank's rows
    from another stream, which ``release`` refuses before writing (an ``fn`` that draws none, such
    as one computing buffers, is fine)."""
    digest = hashlib.sha256(_rng_state(device).numpy().tobytes()).hexdigest()
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (digest, sorted(pending)), group=group)
    return {key for _, keys in everyone for key in keys}, len({d for d, _ in everyone}) > 1


def _units_needed(mod: nn.Module, unit_of_module: dict[int, int], unit_roots: set[int],
                  unit_of_key: dict[int, int], key_of: dict[int, int]) -> set[int]:
    """The units to materialise while ``fn(mod)`` runs: those of every parameter under ``mod``,
    except for a module that holds several units (a model's root, its block list): then only its
    own unit's parameters under it, and the units of the parameters it owns directly (tied ones)."""
    subtree = {unit_of_key[key_of[id(p)]] for p in mod.parameters()}
    if any(id(sub) in unit_roots for sub in mod.modules() if sub is not mod):
        own = unit_of_module.get(id(mod), ROOT_INDEX)
        subtree = {u for u in subtree if u == own}
    return subtree | {unit_of_key[key_of[id(p)]] for p in mod._parameters.values() if p is not None}


def _unit_of_modules(model: nn.Module, units: list) -> dict[int, int]:
    """``id(module) -> unit index`` for the modules inside a non-root unit."""
    owner: dict[int, int] = {}
    for unit in units:
        if unit.index != ROOT_INDEX:
            for mod in model.get_submodule(unit.name).modules():
                owner.setdefault(id(mod), unit.index)
    return owner
