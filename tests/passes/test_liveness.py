"""``liveness.timeline`` on hand-built graphs: gathered parameters and full gradients are live
from the node that allocates them to their last read, and nothing is left live at the end."""
from tests.passes.graphs import aten, collectives, gathered_forward, reduced_backward
from zerograph.graph.vocab import WAIT
from zerograph.kernels.ops import UNPACK_GATHERED
from zerograph.passes.liveness import storage_root, timeline
from zerograph.passes.prefetch import prefetch
from zerograph.policies import SchedulePolicy

UNIT_BYTES = 2 * (2 * 4 + 2) * 4  # one unit's gathered buffer (and its unpacked copy): 20 fp32; its send buffer: half


def _live(tl, name: str, role: str) -> int:
    return tl.live[tl.names.index(name)].get(role, 0)


def test_gathered_buffer_lives_to_its_copy_out_and_the_copy_to_its_last_use():
    b, gm, ctx = gathered_forward(2)
    tl = timeline(gm.graph)
    (first_unpack, _) = gm.graph.find_nodes(op="call_function", target=UNPACK_GATHERED)
    assert _live(tl, first_unpack.name, "gather") == 2 * UNIT_BYTES  # the gathered buffer and its copy-out
    first_matmul = gm.graph.find_nodes(op="call_function", target=aten.addmm.default)[0]
    assert _live(tl, first_matmul.name, "gather") == UNIT_BYTES  # read by the unit's last use
    assert _live(tl, first_matmul.next.name, "gather") == 0  # and freed right after it
    assert tl.peak(("gather",)) == 2 * UNIT_BYTES
    assert tl.live[-1].get("gather", 0) == 0 and not tl.saved


def test_prefetch_adds_the_next_units_gather_in_flight():
    b, gm, ctx = gathered_forward(3, schedule=SchedulePolicy(prefetch_depth=1))
    prefetch(gm, ctx)
    # one unit's unpacked parameters in use, the next one's send buffer and gathered buffer in flight
    assert timeline(gm.graph).peak(("gather",)) == UNIT_BYTES + UNIT_BYTES // 2 + UNIT_BYTES


def test_full_gradients_die_at_the_copy_in_and_the_send_buffer_at_the_wait():
    b, gm, ctx = reduced_backward(2)
    tl = timeline(gm.graph)
    reduction = collectives(gm)[0]
    pack = reduction.args[0]
    full_bytes = sum(storage_root(g).meta["val"].numel() * 4 for g in pack.args[0])  # the unit's full gradients
    assert full_bytes == (4 * 4 + 4) * 4
    assert _live(tl, pack.name, "full_grad") == full_bytes  # read by the copy-in
    assert _live(tl, pack.next.name, "full_grad") == 0  # then freed (ZeRO-2: as soon as reduced)
    (wait,) = reduction.users
    assert wait.target is WAIT
    send = pack.meta["val"].numel() * 4
    assert _live(tl, wait.name, "reduce") >= send  # the process group holds the send buffer until the wait
    (div,) = wait.users  # the next node: the mean, a new buffer, while the send buffer is freed
    assert wait.next is div
    assert _live(tl, div.name, "reduce") - _live(tl, wait.name, "reduce") == div.meta["val"].numel() * 4 - send
    assert tl.live[-1].get("full_grad", 0) == 0


def test_a_saved_gathered_parameter_stays_live_to_the_end():
    b, gm, ctx = gathered_forward(2)
    t = gm.graph.find_nodes(op="call_function", target=aten.t.default)[0]
    output = gm.graph.output_node()
    output.args = ((*output.args[0], t.args[0]),)
    tl = timeline(gm.graph)
    assert tl.saved == {t.args[0].name: ("gather", UNIT_BYTES)}  # the unpacked copy, counted once
    assert tl.live[-1]["gather"] == UNIT_BYTES
