"""A tiny model, packed batches and reference outputs shared by the backend tests.

Every backend is held to the single-device ``resident`` forward (``model.forward``)
on the same batches: f32, max relative error ≤ 1e-5.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from moejax import model
from moejax.backends.base import Backend, padded_step, plan_steps
from moejax.config import ModelConfig
from moejax.ops import PrefillOp
from moejax.packing import BucketPolicy, HostBatch, pack

F32_TOL = 1e-5

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=128, hidden_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                  qk_norm=True, rms_norm_eps=1e-6, rope_theta=10000.0, max_context=256,
                  tie_word_embeddings=False)


def make_params(cfg: ModelConfig = CFG, seed: int = 0) -> dict:
    """Random params with a scale that makes routing and logits far from uniform."""
    return model.init_params(cfg, seed=seed, scale=0.15)


def make_sequences(cfg: ModelConfig = CFG, seed: int = 1, count: int = 24) -> list[PrefillOp]:
    """Sequences of 3–60 tokens; every third scores many positions (so some batches run the
    last layer on all rows, others only at the scoring rows), some need the full vocab."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        n = int(rng.integers(3, 61))
        tokens = rng.integers(2, cfg.vocab_size, n).astype(np.int32)
        positions = list(range(n)) if i % 3 == 0 else [n - 1]
        ids = [rng.integers(0, cfg.vocab_size, int(rng.integers(1, 4))).tolist() for _ in positions]
        out.append(PrefillOp(key=i, token_ids=tokens, score_positions=positions,
                             score_token_ids=ids, full_vocab=i % 4 == 1))
    return out


def make_host_batches(cfg: ModelConfig = CFG, seed: int = 1, max_batch_tokens: int = 64
                      ) -> list[HostBatch]:
    policy = BucketPolicy(max_batch_tokens=max_batch_tokens, min_block=32)
    return pack(make_sequences(cfg, seed), policy)


def reference_outputs(cfg: ModelConfig, params: dict, hosts: list[HostBatch]
                      ) -> list[model.VocabReadout]:
    """The scoring forward on one device, per batch, as NumPy."""
    forward = jax.jit(model.score_readout, static_argnames=("cfg", "opts"))
    return [jax.device_get(forward(params, h.batch, cfg=cfg, opts=h.options)) for h in hosts]


def run_backend(backend: Backend, hosts: list[HostBatch]) -> list[model.VocabReadout]:
    """Every batch through ``backend`` in steps of its rank count, outputs in batch order."""
    outputs: list = [None] * len(hosts)
    for step in plan_steps([h.shape_key for h in hosts], backend.num_ranks):
        batches = padded_step([hosts[i].batch for i in step], backend.num_ranks)
        results = backend.step(batches, hosts[step[0]].options)
        for i, out in zip(step, results):
            outputs[i] = jax.device_get(out)
    return outputs


def max_rel_err(got: list[model.VocabReadout], want: list[model.VocabReadout],
                hosts: list[HostBatch]) -> float:
    """Max relative error over the real (non-padding) score rows of every batch (logits,
    log-sum-exp and top logits where computed; the top ids must be equal)."""
    worst = 0.0
    for g, w, host in zip(got, want, hosts):
        rows = sum(len(s.score_positions) for s in host.sequences)
        pairs = [(g.logits[:rows], w.logits[:rows])]
        if w.lse is not None:
            pairs.append((g.lse[:rows], w.lse[:rows]))
        if w.top_ids is not None:
            np.testing.assert_array_equal(g.top_ids[:rows], w.top_ids[:rows])
            pairs.append((g.top_logits[:rows], w.top_logits[:rows]))
        for a, b in pairs:
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            worst = max(worst, float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)))
    return worst


@dataclasses.dataclass
class Workload:
    cfg: ModelConfig
    params: dict
    hosts: list
    reference: list


def workload(cfg: ModelConfig = CFG, seed: int = 0) -> Workload:
    params = make_params(cfg, seed)
    hosts = make_host_batches(cfg, seed + 1)
    return Workload(cfg, params, hosts, reference_outputs(cfg, params, hosts))


def two_shape_hosts(hosts: list[HostBatch], shapes: int = 2) -> list[HostBatch]:
    """The batches of two shapes only (each compile costs seconds on CPU): the commonest
    shape whose last layer runs at the scoring rows alone, and (``shapes=2``) the
    commonest whose last layer runs on every row with the vocabulary log-sum-exp."""
    def commonest(pred):
        keys = [h.shape_key for h in hosts if pred(h)]
        return max(set(keys), key=keys.count)

    rows_only = commonest(lambda h: model.last_layer_at_rows_only(h.batch))
    full = commonest(lambda h: not model.last_layer_at_rows_only(h.batch) and h.options.full_vocab)
    keep = (rows_only, full)[:shapes]
    return [h for h in hosts if h.shape_key in keep]


def small_workload(cfg: ModelConfig = CFG, seed: int = 0, shapes: int = 2) -> Workload:
    """:func:`workload` restricted to :func:`two_shape_hosts` (for multi-device backends)."""
    params = make_params(cfg, seed)
    hosts = two_shape_hosts(make_host_batches(cfg, seed + 1), shapes)
    return Workload(cfg, params, hosts, reference_outputs(cfg, params, hosts))
