"""A μ-queue decoder (``moejax.asyncmoe.decoder``) as one decoder of a prefill→decode
pipeline: its requests are prefilled by the pipeline's prefill stage, their prompt
blocks copied into its pool, and decoded by AsyncMoE's runtime in whole calls. Greedy
and seeded-sampling tokens must equal one resident decoder's (the runtime continues
each request from prefill's first token with the continuous scheduler's sampling
counters); a bad μ-queue option is refused with both parts named.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from moejax.asyncmoe.decoder import MuQueueDecoder
from moejax.asyncmoe.runtime import MuQueueRuntime, Prefilled
from moejax.core.paged_plan import SequenceState
from moejax.kv import empty_pool
from moejax.sequences import SequenceOutput, SequenceSpec
from serving import Generator
from serving.pipeline_config import PipelineConfig, PipelineError

from mu_queue_fixtures import demo_model

LENGTHS = (5, 40, 17, 33, 9, 24)
NEW_TOKENS = (6, 4, 7, 3, 5, 6)
# Requests 1 and 2 sample (seeded): round robin sends one of them to each decoder.
SAMPLED = {1: (0.8, 0.9, 7), 2: (1.0, 0.95, 123)}
SMALL = {"dtype": "float32", "max_prefill_tokens": 32, "max_batch_size": 2,
         "compilation_cache": "off"}


def _requests() -> list[dict]:
    rng = np.random.default_rng(11)
    requests = []
    for i, (n, m) in enumerate(zip(LENGTHS, NEW_TOKENS)):
        request = {"id": i, "prompt_token_ids": [int(t) for t in rng.integers(3, 1000, n)],
                   "max_new_tokens": m, "stop_token_ids": []}
        if i in SAMPLED:
            request["temperature"], request["top_p"], request["seed"] = SAMPLED[i]
        requests.append(request)
    return requests


def _tokens(gen: Generator) -> list[list[int]]:
    results = gen.generate(_requests())
    assert [r.error for r in results] == [None] * len(LENGTHS)
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def resident() -> list[list[int]]:
    tokens = _tokens(Generator("demo", **SMALL))
    assert [len(t) for t in tokens] == list(NEW_TOKENS)
    return tokens


def _check_mu_queue_decoded(gen: Generator, index: int, devices: list) -> None:
    """The pool is empty, and decoder ``index`` is a μ-queue decoder on ``devices`` that
    really decoded requests (its calls' batches), among them a sampled one."""
    pool = gen.scheduler
    assert pool.occupancy() == 0 and not pool.busy
    decoder = pool.decoders[index]
    assert isinstance(decoder, MuQueueDecoder) and decoder.runner.name == "mu_queue"
    assert decoder.runtime.devices == devices
    decoded = {seq_id for record in decoder.step_records for seq_id in record.decode_ids}
    routed = {route.seq_id for route in pool.routes if route.decoder == index}
    assert decoded == routed and len(decoded) >= 2
    assert decoded & set(SAMPLED)                    # seq ids follow submission order here
    assert decoder.stats["adopted"] == len(decoded)
    assert len(decoder.runtime.last_run.batches) > 0
    assert decoder.decode_expert_tokens is not None
    # Its decode steps: one per token after prefill's (each feeds the token before it),
    # k experts per layer each.
    steps = sum(NEW_TOKENS[i] - 1 for i in decoded)
    cfg = decoder.runtime.cfg
    np.testing.assert_array_equal(decoder.decode_expert_tokens.sum(axis=1),
                                  [steps * cfg.num_experts_per_tok] * cfg.num_layers)


def test_a_mu_queue_decoder_beside_a_resident_one_gives_the_resident_tokens(resident):
    gen = Generator("demo", pipeline={
        "routing": "round_robin",
        "decoders": [{"placement": "resident"},
                     {"placement": "mu_queue", "devices": 2}]}, **SMALL)
    assert _tokens(gen) == resident
    assert gen.scheduler.stats()["routed"] == [3, 3]
    _check_mu_queue_decoded(gen, 1, jax.devices()[1:3])
    # The pool precompiles beside it: the μ-queue decoder's step programs take the
    # shapes of a call's batches (none ahead), the hand-off copies into its staging pool.
    assert gen.scheduler.decoders[1].precompile() == 0
    assert gen.scheduler.precompile() > 0


def test_an_async_ep_prefill_stage_feeding_a_disaggregated_mu_queue_decoder(resident):
    gen = Generator("demo", pipeline={
        "routing": "round_robin",
        "prefill": {"backend": "async_ep", "devices": 2},
        "decoders": [{"placement": "mu_queue", "devices": 2, "first_device": 2,
                      "scheduler": "most_tokens", "attention_devices": [0]},
                     {"placement": "resident"}]}, **SMALL)
    assert _tokens(gen) == resident
    _check_mu_queue_decoded(gen, 0, jax.devices()[2:4])
    runtime = gen.scheduler.decoders[0].runtime
    assert runtime.placement.attention_devices == (0,)


def _prefilled_state(seq_id: int, prompt: int, new: int) -> SequenceState:
    """A sequence as a prefill stage hands it off: its prompt computed, its first token
    sampled."""
    rng = np.random.default_rng(seq_id)
    spec = SequenceSpec(prompt=tuple(int(t) for t in rng.integers(3, 200, prompt)),
                        max_new_tokens=new)
    return SequenceState(seq_id, spec, None, output=SequenceOutput([int(rng.integers(3, 200))],
                                                                   "length"),
                         computed=prompt, handed_off=True)


def test_the_mu_queue_decoder_admits_what_one_call_can_hold():
    """Capacity (``room_to_adopt``): at most max_batch_size sequences per call, and the
    blocks of their whole lengths within the per-rank pool; adoption copies the prompt's
    blocks to staging at once (held until the call), a step runs every adopted sequence
    to its end and reports each one's new tokens, its last event carrying the output; a
    cancelled one finishes without running."""
    cfg, params = demo_model()
    runtime = MuQueueRuntime(cfg, params, jax.devices()[:2], blocks_per_rank=4)
    decoder = MuQueueDecoder(runtime, 4, 2)
    source = empty_pool(cfg, 8, runtime.executor.dtype, jax.devices()[4])
    a, b = _prefilled_state(0, 20, 4), _prefilled_state(1, 9, 6)      # 2 and 1 blocks
    c, d = _prefilled_state(2, 30, 4), _prefilled_state(3, 3, 2)      # 3 and 1 blocks
    assert decoder.room_to_adopt(a) and not decoder.busy
    decoder.adopt(a, source, [5, 6])
    assert not decoder.room_to_adopt(c)                  # 2 + 3 blocks > 4
    with pytest.raises(ValueError, match="no room for sequence 2"):
        decoder.adopt(c, source, [0, 1])
    decoder.adopt(b, source, [7])
    assert not decoder.room_to_adopt(d)                  # 4 blocks fit, a third row not
    assert decoder.occupancy() == 3 and decoder.running == [a, b] and decoder.busy
    assert not a.handed_off and len(a.blocks) == 2
    events = decoder.step()
    assert decoder.occupancy() == 0 and not decoder.busy and decoder.running == []
    for seq in (a, b):
        mine = [e for e in events if e.sequence is seq]
        assert [t for e in mine for t in e.token_ids] == seq.output.token_ids[1:]
        assert len(seq.output.token_ids) == seq.spec.max_new_tokens
        assert [e.output for e in mine] == [None] * (len(mine) - 1) + [seq.output]
        assert seq.finished and seq.output.finish_reason == "length" and seq.blocks == []
    assert decoder.step_records[-1].decode_ids == (0, 1)
    assert len(runtime.last_run.batches) > 0
    decoder.adopt(d, source, [2])
    d.cancelled = True
    events = decoder.step()
    assert [(e.sequence, e.token_ids, e.output.finish_reason) for e in events] == [
        (d, [], "cancelled")]
    assert decoder.occupancy() == 0 and len(decoder.step_records) == 1


def test_a_failed_call_leaves_its_sequences_for_drain(monkeypatch):
    """A ``generate`` call that raises leaves its sequences adopted (their staging blocks
    held): the pool's drain() after the failed step finds them, frees their blocks and
    returns them, so the generation loop gives each its error (none waits forever)."""
    cfg, params = demo_model()
    runtime = MuQueueRuntime(cfg, params, jax.devices()[:2], blocks_per_rank=4)
    decoder = MuQueueDecoder(runtime, 4, 2)
    source = empty_pool(cfg, 8, runtime.executor.dtype, jax.devices()[4])
    a, b = _prefilled_state(0, 20, 4), _prefilled_state(1, 9, 6)      # 2 and 1 blocks
    decoder.adopt(a, source, [5, 6])
    decoder.adopt(b, source, [7])

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(runtime, "generate", fail)
    with pytest.raises(RuntimeError, match="boom"):
        decoder.step()
    assert decoder.running == [a, b] and decoder.occupancy() == 3
    assert decoder.drain() == [a, b]
    assert decoder.running == [] and decoder.occupancy() == 0
    assert decoder.paged.allocator.num_available == 4
    assert a.blocks == [] and b.blocks == []


def test_a_failed_mu_queue_call_gives_every_request_of_a_loop_its_error(monkeypatch):
    """A generation loop over a pipeline whose μ-queue decoder's call raises: every
    request gets an error result naming the failure (none waits forever) and the pool
    holds nothing after."""
    gen = Generator("demo", pipeline={"decoders": [{"placement": "mu_queue", "devices": 2}]},
                    **SMALL)
    decoder = gen.scheduler.decoders[0]

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(decoder.runtime, "generate", fail)
    loop = gen.start_loop()
    results, done = {}, threading.Event()

    def on_event(event):
        if event.result is not None:
            results[event.index] = event.result
            if len(results) == 2:
                done.set()

    try:
        for index, request in enumerate(_requests()[:2]):
            loop.submit(request, on_event, index)
        assert done.wait(120), f"only {sorted(results)} of 2 requests got a result"
    finally:
        loop.close()
    for result in results.values():
        assert result.finish_reason == "error"
        assert result.error == "generation failed: RuntimeError: boom"
    assert gen.scheduler.occupancy() == 0 and not gen.scheduler.busy


def test_a_run_of_prefilled_requests_continues_a_run_that_prefilled_them():
    """``generate(prefilled=...)``: requests whose prompts' blocks are another pool's
    (here: the pools a first run left, whose prompt blocks still hold the prompts) and
    whose first token is that run's give that run's tokens and decode routing (greedy
    and seeded sampling: the counters continue from 1)."""
    cfg, params = demo_model()
    rng = np.random.default_rng(3)
    specs = [SequenceSpec(prompt=tuple(int(t) for t in rng.integers(3, 200, n)),
                          max_new_tokens=m, temperature=temp, top_p=0.9, seed=seed)
             for n, m, temp, seed in [(21, 5, 0.0, 0), (9, 6, 0.9, 41), (34, 4, 0.7, 5)]]
    first = MuQueueRuntime(cfg, params, jax.devices()[:2])
    want = first.generate(specs)
    executor = first.executor
    given = []
    for i, spec in enumerate(specs):
        seq = executor.sequences[i]
        given.append(Prefilled(executor.kv[seq.rank], [int(b) for b in seq.blocks],
                               want[i].token_ids[0]))
    # On two other devices, in the other order: the copies cross devices.
    second = MuQueueRuntime(cfg, params, jax.devices()[2:4][::-1])
    got = second.generate(specs, prefilled=given)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.decode_experts, w.decode_experts)
    assert not second.executor.full               # no prefill ran: no whole params put
    with pytest.raises(ValueError, match=r"prefilled has 1 entries for 3 requests"):
        second.generate(specs, prefilled=given[:1])
    short = [Prefilled(given[2].source, given[2].blocks[:1], given[2].first_token)]
    with pytest.raises(ValueError, match=r"34 prompt tokens needs 3 source blocks, got 1"):
        second.generate(specs[2:], prefilled=short)
    with pytest.raises(ValueError, match=r"blocks_per_rank=None, the decoder num_blocks=8"):
        MuQueueDecoder(second, 8, 2)


@pytest.mark.parametrize("decoder, message", [
    ({"placement": "mu_queue", "scheduler": "fifo"},
     r"decoders\[0\] \(placement 'mu_queue'\).scheduler must be one of \('defrag', "
     r"'most_tokens', 'first_layer'\), got 'fifo'"),
    ({"placement": "mu_queue", "devices": 2, "step": "fused"},
     r"decoders\[0\] \(placement 'mu_queue'\): placement 'mu_queue' forms its own batches"
     r".*not step='fused'"),
    ({"placement": "mu_queue", "devices": 2, "attention_devices": [0, 2]},
     r"decoders\[0\] \(placement 'mu_queue'\).attention_devices must be distinct device "
     r"indices in \[0, devices=2\), got \[0, 2\]"),
    ({"placement": "mu_queue", "devices": 2, "replicas": 3},
     r"decoders\[0\] \(placement 'mu_queue'\).replicas must be an integer in "
     r"\[1, devices=2\], got 3"),
    ({"placement": "mu_queue", "replica_routing": "nearest"},
     r"decoders\[0\] \(placement 'mu_queue'\).replica_routing must be one of"),
    ({"placement": "mu_queue", "router": "metro"},
     r"decoders\[0\] \(placement 'mu_queue'\) does not take router \(router: placement "
     r"sync_ep\); it takes scheduler, attention_devices, replicas, replica_routing"),
    ({"placement": "mu_queue", "devices": 0},
     r"decoders\[0\] \(placement 'mu_queue'\).devices must be a positive integer"),
])
def test_a_bad_mu_queue_option_is_refused_by_name(decoder, message):
    with pytest.raises(PipelineError, match=message):
        PipelineConfig.from_dict({"decoders": [decoder]})


def test_a_mu_queue_decoder_stage_from_a_table():
    config = PipelineConfig.from_dict({"decoders": [
        {"placement": "resident"},
        {"placement": "mu_queue", "devices": 3, "scheduler": "first_layer",
         "attention_devices": [0], "replicas": 2, "replica_routing": "round_robin"}]})
    stage = config.decoders[1]
    assert stage.options == {"scheduler": "first_layer", "attention_devices": [0],
                             "replicas": 2, "replica_routing": "round_robin"}
    assert config.device_indices(8) == ((0,), [(0,), (1, 2, 3)])


def test_a_replica_routing_alias_the_runtime_takes_is_accepted():
    """``replica_routing`` is checked by the runtime's own check, aliases included."""
    config = PipelineConfig.from_dict({"decoders": [
        {"placement": "mu_queue", "devices": 2, "replicas": 2, "replica_routing": "even"}]})
    assert config.decoders[0].options["replica_routing"] == "even"
