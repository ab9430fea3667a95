"""The AsyncMoE μ-queue runtime (``moejax.asyncmoe.runtime``) on the shipped demo model:
the greedy float32 tokens of the paged decode runtime under every scheduler, on 1 and 4
devices (stop tokens, one-token requests and staggered arrivals included); the
simulator, given the runtime's own routing and costs, predicts its batch sequence
exactly; the Generator and CLI options."""

from __future__ import annotations

import json

import jax
import pytest

from moejax.asyncmoe import simulator
from moejax.asyncmoe.runtime import MuQueueRuntime
from moejax.sequences import SequenceSpec

from mu_queue_fixtures import demo_case, resident_tokens

LENGTHS_NEW = [(5, 7), (20, 5), (9, 9), (3, 1), (12, 6), (31, 4)]


@pytest.fixture(scope="module")
def demo():
    cfg, params, specs, first = demo_case(LENGTHS_NEW, seed=0)
    # Request 2 stops at its third generated token (a stop id it produces).
    specs[2] = SequenceSpec(prompt=specs[2].prompt, max_new_tokens=9,
                            stop_token_ids=frozenset({first[2][2]}))
    want = resident_tokens(cfg, params, specs)
    assert len(want[2]) < 9 and want[2][-1] == first[2][2]
    return cfg, params, specs, want


@pytest.mark.parametrize("devices", [1, 4])
@pytest.mark.parametrize("scheduler", ["defrag", "most_tokens", "first_layer"])
def test_tokens_equal_the_decode_runtime(demo, devices, scheduler):
    cfg, params, specs, want = demo
    runtime = MuQueueRuntime(cfg, params, jax.devices()[:devices], scheduler=scheduler)
    outputs = runtime.generate(specs, arrivals=[0.0, 0.0, 3.0, 5.0, 11.0, 11.0])
    assert [o.token_ids for o in outputs] == want
    assert outputs[2].finish_reason == "stop" and outputs[0].finish_reason == "length"
    run = runtime.last_run
    assert run.leftover_queued == 0 and run.leftover_pooled == 0
    assert run.makespan_s > 0 and run.requests[3].token_times == ()   # ended at prefill
    # Every decode step of every request ran each block's attention once.
    attention = sum(b.size for b in run.batches if b.unit == -1)
    assert attention == cfg.num_layers * sum(len(t) - 1 for t in want)
    assert sorted({b.device for b in run.batches if b.unit >= 0}) == list(range(devices))
    assert all(o.decode_experts.shape == (cfg.num_layers, len(t) - 1, cfg.num_experts_per_tok)
               for o, t in zip(outputs, want))


def test_the_simulator_predicts_the_runtime_batches(demo):
    """The simulator replaying the runtime's own routing, with the runtime's virtual costs
    (one unit per execution, free transfers), runs exactly the same batches."""
    cfg, params, specs, _ = demo
    decoding = [s for s in specs if s.max_new_tokens > 1 and not s.stop_token_ids]
    runtime = MuQueueRuntime(cfg, params, jax.devices()[:2], scheduler="defrag")
    arrivals = [0.0, 1.0, 1.0, 4.0][:len(decoding)]
    outputs = runtime.generate(decoding, arrivals=arrivals)
    predicted = simulator.replay_outputs(
        outputs, [len(s.prompt) for s in decoding], arrivals, simulator.CostTables.uniform(), 2,
        cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, "defrag", cfg.hidden_size, 4)
    assert [b[:5] for b in predicted.batches] == [b[:5] for b in runtime.last_run.batches]
    assert len(predicted.batches) > 50


def test_generator_and_cli_options(demo, tmp_path):
    from serving import Generator, cli

    _, _, specs, want = demo
    requests = [{"id": i, "prompt_token_ids": list(s.prompt), "max_new_tokens": s.max_new_tokens,
                 "stop_token_ids": sorted(s.stop_token_ids)} for i, s in enumerate(specs)]
    gen = Generator("demo", dtype="float32", runtime="mu_queue", scheduler="first_layer",
                    devices=2)
    assert [r.token_ids for r in gen.generate(requests)] == want
    with pytest.raises(ValueError, match="a generation loop"):
        gen.start_loop()
    for bad, match in (({"scheduler": "defrag"}, "runtime='mu_queue'"),
                       ({"runtime": "mu_queue", "scheduler": "lifo"}, "scheduler must be"),
                       ({"runtime": "warp"}, "runtime must be"),
                       ({"runtime": "mu_queue", "backend": "offload"}, "does not take"),
                       ({"runtime": "mu_queue", "trace_experts": True}, "trace_experts")):
        with pytest.raises(ValueError, match=match):
            Generator("demo", **bad)
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    assert cli.main(["generate", str(path), "-o", str(out), "--model", "demo", "--dtype",
                     "float32", "--runtime", "mu_queue", "--scheduler", "defrag",
                     "--devices", "4"]) == 0
    assert [json.loads(line)["token_ids"] for line in out.read_text().splitlines()] == want
