"""How every rank of a checkpoint's ``save`` or ``load`` fails together (checkpoint.py's guarantees).

Each check runs on every rank; its problem (text, or ``None``) is gathered from all of them and
every rank raises the same ``CheckpointError`` when any found one (``agree``), so no rank waits
for a peer that gave up. A step's ``OSError`` or ``CheckpointError`` becomes text to agree on
(``attempt``), and the failures of the layer below (DCP's ``CheckpointException``, a dead peer in
a collective) become zerograph's (``dcp_call``, ``gather``: ``CollectiveError``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..errors import CollectiveError, ZeroGraphError
from ..runtime.runtime import is_communication_failure
from ..runtime.state import state_of


class CheckpointError(ZeroGraphError):
    """A checkpoint directory is missing, was never completed, is corrupt, does not fit the model,
    or a save was refused (the target holds something else, or the ranks disagree)."""


def group_of(model: nn.Module) -> dist.ProcessGroup:
    """The group a checkpoint of ``model`` is collective over; ``ShardingError`` for a model zerograph
    did not compile, ``ProcessGroupError`` for a destroyed group."""
    runtime = state_of(model).runtime
    runtime.topology.check_group()
    return runtime.topology.world_group  # every rank of the mesh (hybrid sharding: replicas write once, DCP dedups)


def gather(group: dist.ProcessGroup, value: Any, what: str) -> list[Any]:
    """Every rank's ``value`` (picklable), in group rank order."""
    values: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(values, value, group=group)
    except (RuntimeError, dist.DistError) as exc:
        raise CollectiveError(f"rank {dist.get_rank(group)}: checkpoint: {what} failed: a peer rank probably "
                              f"died or stopped calling save/load; check the other ranks' logs. Cause: "
                              f"{type(exc).__name__}: {exc}") from exc
    return values


def agree(group: dist.ProcessGroup, problem: str | None, what: str) -> None:
    """Raise on every rank when any rank found ``problem`` (its text, or ``None``)."""
    raise_first(gather(group, problem, what))


def raise_first(problems: list[str | None]) -> None:
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if failed:
        problem = failed[0][1]
        where = f" (seen by ranks {[r for r, _ in failed]})" if len(problems) > 1 else ""
        raise CheckpointError(f"{problem}{where}")


def attempt(step: Callable[[], Any]) -> Any:
    """``step()``; an ``OSError`` or ``CheckpointError`` becomes its text, so the ranks can agree on it."""
    try:
        return step()
    except CheckpointError as exc:
        return str(exc)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def dcp_call(step: Callable[[], None], what: str) -> None:
    """Run a DCP save or load; its failures become zerograph's, with the cause chained."""
    try:
        step()
    except dcp.CheckpointException as exc:  # a BaseException: DCP gathered every rank's failure
        causes = [pair[0] for pair in exc.failures.values() if isinstance(pair, tuple) and pair]
        if causes and all(is_communication_failure(c) for c in causes):
            raise CollectiveError(f"{what} failed: a peer rank probably died. Cause: {exc}") from exc
        if causes and all(isinstance(c, CheckpointError) for c in causes):  # ours, raised inside DCP: its text
            raise CheckpointError(f"{what} failed on ranks {sorted(exc.failures)}: {causes[0]}") from exc
        raise CheckpointError(f"{what} failed on ranks {sorted(exc.failures)}: {exc}") from exc
    except (RuntimeError, dist.DistError) as exc:
        if is_communication_failure(exc):
            raise CollectiveError(f"{what} failed: a peer rank probably died or stopped calling save/load; "
                                  f"check the other ranks' logs. Cause: {type(exc).__name__}: {exc}") from exc
        raise
    except OSError as exc:
        raise CheckpointError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
