"""Bytes moved per step, counted from the compiled programs (moejax.program_traffic and
``Backend.step_traffic``), held to what each backend's shapes imply, worked out here by
hand from the config and the batch (not from the counter)."""

from __future__ import annotations

import pytest

from backend_fixtures import small_workload
from moejax.backends import make_backend
from moejax.backends.base import padded_step
from moejax.program_traffic import (Traffic, UncountableProgram, array_bytes, collectives,
                                    program_traffic)

F32 = 4


@pytest.fixture(scope="module")
def work():
    return small_workload(shapes=1)     # one shape: its last layer runs at the rows alone


def counted(work, name: str, devices: int) -> Traffic:
    backend = make_backend(name, work.cfg, work.params, devices=devices)
    host = work.hosts[0]
    return backend.step_traffic(padded_step([host.batch] * backend.num_ranks,
                                            backend.num_ranks), host.options)


def sizes(work) -> dict[str, int]:
    cfg, batch = work.cfg, work.hosts[0].batch
    return {"L": cfg.num_layers, "E": cfg.num_experts, "d": cfg.hidden_size,
            "T": batch.tokens.shape[0], "P": batch.score_positions.shape[0],
            "k": cfg.num_experts_per_tok,
            "layer": 3 * cfg.num_experts * cfg.hidden_size * cfg.moe_intermediate_size * F32}


def ring(g: int, nbytes: float) -> float:
    return 2 * (g - 1) / g * nbytes


# ---------------------------------------------------------------------------- parser
MODULE = """HloModule m

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[2,16]{1,0} get-tuple-element(%p), index=1
  %g = f32[8,16]{1,0} all-gather(%x), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %g)
}

%cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %c = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %w = (s32[], f32[8,16]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %s = (bf16[4,16]{1,0}, bf16[4,16]{1,0}) all-reduce-start(%y), replica_groups=[2,2]<=[4], to_apply=%add
  %d = bf16[4,16]{1,0} all-reduce-done(%s)
  ROOT %r = f32[8,16]{1,0} all-to-all(%a), replica_groups={}, dimensions={0}
}
"""


def test_the_parser_counts_loops_async_halves_and_groups():
    found = {c.kind: c for c in collectives(MODULE, num_devices=4)}
    assert set(found) == {"all-gather", "all-reduce", "all-to-all"}
    gather = found["all-gather"]
    assert (gather.result_bytes, gather.group_size, gather.executions) == (8 * 16 * 4, 4, 5)
    assert gather.bytes_sent == 5 * 3 / 4 * 512
    reduce = found["all-reduce"]          # the -done half only, its group from the iota form
    assert (reduce.result_bytes, reduce.group_size, reduce.executions) == (4 * 16 * 2, 2, 1)
    assert reduce.bytes_sent == 128
    assert found["all-to-all"].group_size == 4                 # no groups: every device
    traffic = program_traffic(MODULE, 4, overlapped=("all-gather",))
    assert traffic == Traffic(critical=128 + 3 / 4 * 512, background=5 * 3 / 4 * 512)
    assert array_bytes("(f32[2,3]{1,0}, s8[5])") == 29


def test_a_collective_in_a_loop_of_unknown_count_is_refused():
    unknown = MODULE.replace(', backend_config={"known_trip_count":{"n":"5"}}', "")
    with pytest.raises(UncountableProgram, match="all-gather.*trip count"):
        collectives(unknown, 4)
    with pytest.raises(ValueError, match="unknown collective kinds"):
        program_traffic(MODULE, 4, overlapped=("all-gathr",))
    with pytest.raises(ValueError, match="no ENTRY"):
        collectives("%x = f32[] constant(0)", 4)


# ---------------------------------------------------------------------------- backends
def test_weight_moving_backends_move_their_expert_bytes_in_the_background(work):
    s = sizes(work)
    assert counted(work, "resident", 1) == Traffic()
    # offload: every layer's experts copied in from host memory, under the layer before.
    assert counted(work, "offload", 1) == Traffic(background=s["L"] * s["layer"])
    g = 4
    # async_ep: layer 0 is held whole; layers 1..L-1 are all-gathered a layer ahead.
    assert counted(work, "async_ep", g) == Traffic(
        background=(s["L"] - 1) * (g - 1) / g * s["layer"])
    # hybrid: every layer's shard copied in, and every layer all-gathered (layer 0 too).
    assert counted(work, "hybrid", g) == Traffic(
        background=s["L"] * ((g - 1) / g * s["layer"] + s["layer"] / g))


def test_row_moving_backends_move_rows_on_the_critical_path(work):
    s = sizes(work)
    rows, last_rows = s["T"] * s["d"] * F32, s["P"] * s["d"] * F32
    # tp and tp_ep: two all-reduces of the rows per layer (the last at the scoring rows).
    for name in ("tp", "tp_ep"):
        assert counted(work, name, 2) == Traffic(
            critical=2 * (s["L"] - 1) * ring(2, rows) + 2 * ring(2, last_rows)), name
    # pp: each of G micro-batches hands its hidden states on at G-1 stage boundaries.
    g = 3
    assert counted(work, "pp", g) == Traffic(critical=g * (g - 1) * rows / g)
    # sync_ep: two all-to-alls per layer carry at least the k routed copies of the rows
    # that leave the device (more: the buffers are padded to a capacity).
    g = 4
    sync = counted(work, "sync_ep", g)
    routed = 2 * (g - 1) / g * s["k"] * ((s["L"] - 1) * rows + last_rows)
    assert sync.background == 0 and routed <= sync.critical <= 4 * routed
    # dp_tp: every rank's rows all-gathered and the outputs reduce-scattered, per layer.
    dp_tp = counted(work, "dp_tp", g)
    both = 2 * (g - 1) * ((s["L"] - 1) * rows + last_rows)
    assert dp_tp.background == 0 and both <= dp_tp.critical <= 1.1 * both


def test_the_layer_loop_is_counted_by_its_trip_count(work):
    """A model with more layers moves proportionally more (the loop's count, not one body)."""
    import dataclasses

    from backend_fixtures import make_host_batches, make_params

    deeper = dataclasses.replace(work.cfg, num_layers=work.cfg.num_layers + 2)
    host = make_host_batches(deeper, 1)[0]
    backend = make_backend("async_ep", deeper, make_params(deeper), devices=2)
    traffic = backend.step_traffic(padded_step([host.batch] * 2, 2), host.options)
    layer = sizes(work)["layer"]
    assert traffic.background == (deeper.num_layers - 1) * layer / 2
