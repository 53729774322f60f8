"""What a templated unit carries: its ``UnitRecord``, stored on the module under ``UNIT_ATTR``.

``templates.kinds.install_unit_templates`` writes it once per unit; the unit's forward
(``templates.kinds._templated_forward``, traced by Dynamo on every call), its island
(``unit_islands.run_island``), its trace (``unit_trace``) and its template key (``template_keys``)
read it. A record is frozen: a unit that leaves its flat shard gets a new one
(``dataclasses.replace``).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from ..shard.flat import FlatShard

UNIT_ATTR = "_zerograph_unit"  # the module attribute holding a templated unit's ``UnitRecord``


@dataclasses.dataclass(frozen=True, eq=False)
class UnitRecord:
    """One templated unit's place in its kind and where its tensors sit.

    A slot is ``(submodule, attribute name)``: the template's primals are put there for a trace,
    and the shards are read from there for a call. Compared by identity (``eq=False``): the
    modules and the flat shard have no value equality worth paying for."""

    kind: int  # the unit kind's registry key (``registry.unit_kind``)
    param_slots: tuple[tuple[nn.Module, str], ...]  # each distinct parameter, ``named_parameters`` order
    buffer_slots: tuple[tuple[nn.Module, str], ...]  # each buffer, ``named_buffers`` order
    keys: tuple[int, ...]  # each parameter slot's marker key (the ``zerograph::unshard`` it reads)
    modules: tuple[nn.Module, ...]  # ``unit.modules()``; mode bit ``i`` is submodule ``i``'s training flag
    flat: FlatShard | None  # the unit's flat shard (``flat.py``), or ``None``: a shard per parameter
