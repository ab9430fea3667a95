"""The μ-queue runtime's batched transport (``moejax.asyncmoe.runtime``, issue 44): on 4 and
8 CPU devices it gives the greedy tokens, routing and batch sequence of the former
per-token transport (``transport="per_token"``) and the tokens of the resident decode
runtime; a batch's inputs move with one ``device_put`` per source device, not per token."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from moejax.asyncmoe import runtime as mu_runtime
from moejax.asyncmoe.runtime import MuQueueRuntime

from mu_queue_fixtures import demo_case

LENGTHS_NEW = [(7, 6), (18, 5), (4, 8), (25, 3), (11, 6)]
ARRIVALS = [0.0, 0.0, 2.0, 4.0, 4.0]


@pytest.fixture(scope="module")
def demo():
    return demo_case(LENGTHS_NEW, seed=1)


@pytest.mark.parametrize("devices", [4, 8])
def test_batched_transport_gives_the_per_token_transports_tokens(demo, devices, monkeypatch):
    cfg, params, specs, want = demo
    runs, puts = {}, {}
    real_put = jax.device_put
    for transport in ("per_token", "batched"):
        runtime = MuQueueRuntime(cfg, params, jax.devices()[:devices], scheduler="defrag",
                                 transport=transport)
        count = puts[transport] = []           # the run's device_put calls
        monkeypatch.setattr(mu_runtime.jax, "device_put",
                            lambda x, *a, _c=count, **k: _c.append(1) or real_put(x, *a, **k))
        outputs = runtime.generate(specs, arrivals=ARRIVALS)
        monkeypatch.undo()
        assert [o.token_ids for o in outputs] == want, transport
        runs[transport] = (runtime, outputs)
    (old, old_out), (new, new_out) = runs["per_token"], runs["batched"]
    assert [b[:5] for b in new.last_run.batches] == [b[:5] for b in old.last_run.batches]
    for a, b in zip(old_out, new_out):
        np.testing.assert_array_equal(a.decode_experts, b.decode_experts)
        np.testing.assert_allclose(a.decode_weights, b.decode_weights, rtol=1e-6)
    # No per-token transfer: at most one device_put per source device per batch, plus the
    # attention and head batches' own (paged batch, sampling), the prefill and the pool.
    batches = new.last_run.batches
    assert len(puts["batched"]) <= sum(min(b.size * cfg.num_experts_per_tok, devices)
                                       for b in batches) + 2 * len(batches) + len(specs)
    assert len(puts["batched"]) < len(puts["per_token"])


def test_gather_keeps_row_order_across_devices():
    devices = jax.devices()[:3]
    executor = mu_runtime.ModelExecutor.__new__(mu_runtime.ModelExecutor)
    executor.devices, executor._constants = list(devices), {}
    rng = np.random.default_rng(0)
    arrays = [jax.device_put(rng.standard_normal((r, 5)).astype(np.float32), devices[d])
              for r, d in ((4, 0), (2, 1), (8, 1), (1, 2), (2, 0))]
    refs = [mu_runtime._Row(arrays[a], row) for a, row in
            ((2, 7), (0, 1), (1, 0), (3, 0), (2, 2), (4, 1), (0, 3), (1, 1), (2, 0))]
    want = np.stack([np.asarray(r.array)[r.row] for r in refs])
    for device in range(3):
        out = executor._gather(refs, device, 16)
        assert out.devices() == {devices[device]} and out.shape == (16, 5)
        np.testing.assert_array_equal(np.asarray(out)[:len(refs)], want)
        np.testing.assert_array_equal(np.asarray(out)[len(refs):], 0)
    dst = [3 * i % 16 for i in range(len(refs))]
    out = np.asarray(executor._gather(refs, 1, 16, dst))
    np.testing.assert_array_equal(out[dst], want)


def test_transport_must_be_known(demo):
    cfg, params, _, _ = demo
    with pytest.raises(ValueError, match="transport must be one of"):
        MuQueueRuntime(cfg, params, jax.devices()[:1], transport="bulk")
