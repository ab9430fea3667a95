"""Logit parity of the packed JAX forward with Hugging Face transformers (PyTorch, float32).

Tiny random Qwen3-MoE (norm_topk_prob on/off, tied/untied embeddings) and Mixtral
(tied/untied) models are saved with ``save_pretrained``, loaded with
``moejax.checkpoint.load_hf_params`` + ``moejax.config.load_config``, packed with the real
packer, and compared position by position with each sequence run alone through torch.

Top-k routing is discontinuous, so the random models are made robust: norm weights are
perturbed (so a norm mix-up shows) and router weights are scaled ×20 so router logits are
well separated and float32 rounding cannot flip an expert choice. q/k projections (×4) and
expert weights (×2 each) are scaled up too, so attention and the MoE output weigh enough in
the logits for a mistake there to show (wrong rope theta, norm_topk_prob or routing moves
the logits by 3e-2 or more, against 1e-4 allowed and ~4e-7 measured). Seeds are fixed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="parity tests need torch: install the 'parity' extra (pip install -e .[parity])")
transformers = pytest.importorskip(
    "transformers",
    reason="parity tests need transformers: install the 'parity' extra (pip install -e .[parity])")

from moejax import checkpoint, model  # noqa: E402
from moejax.config import load_config  # noqa: E402
from moejax.model import ForwardOptions  # noqa: E402
from moejax.ops import PrefillOp  # noqa: E402
from moejax.packing import BucketPolicy, pack  # noqa: E402

from hf_parity import packed_outputs, parity_sequences, rel_err, rows_of  # noqa: E402
from hf_tiny_models import V, build_torch_model as _build_torch_model  # noqa: E402
LENGTHS = (5, 17, 9, 30)
POLICY = BucketPolicy(max_batch_tokens=64, min_block=8, min_positions=4, min_candidates=2)
F32_TOL = 1e-4
BF16_TOL = 2e-2


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _logits_per_impl(params, batch, cfg, attn_block, impls):
    return {impl: model.full_logits(params, batch, cfg, ForwardOptions(
        attn_block=attn_block, expert_impl=impl, tile_rows=4)) for impl in impls}


# ----------------------------------------------------------------------------- models
VARIANTS = {
    "qwen3-norm-untied": ("qwen3_moe", dict(norm_topk_prob=True, tie_word_embeddings=False), 0),
    "qwen3-nonorm-untied": ("qwen3_moe", dict(norm_topk_prob=False, tie_word_embeddings=False), 1),
    "qwen3-norm-tied": ("qwen3_moe", dict(norm_topk_prob=True, tie_word_embeddings=True), 2),
    "qwen3-nonorm-tied": ("qwen3_moe", dict(norm_topk_prob=False, tie_word_embeddings=True), 3),
    "mixtral-untied": ("mixtral", dict(tie_word_embeddings=False), 4),
    "mixtral-tied": ("mixtral", dict(tie_word_embeddings=True), 5),
}


def _sequences(seed: int) -> list[PrefillOp]:
    return parity_sequences(seed, V, LENGTHS)


@dataclasses.dataclass
class Fixture:
    name: str
    path: str
    cfg: object
    params: dict
    host: object                  # the single HostBatch of the packed sequences
    ref_logits: dict              # key -> [n, V] float64 torch logits of the sequence alone
    hf: object
    outputs: dict | None = None   # packed_outputs of the float32 params

    def run(self, params=None, cfg=None) -> dict:
        return jax.tree.map(np.asarray, packed_outputs(
            self.params if params is None else params, self.host.batch,
            self.cfg if cfg is None else cfg, self.host.options.attn_block))


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory) -> Fixture:
    return _make_fixture(request.param, tmp_path_factory)


_CACHE: dict[str, Fixture] = {}


def _make_fixture(name: str, tmp_path_factory) -> Fixture:
    if name in _CACHE:
        return _CACHE[name]
    kind, overrides, seed = VARIANTS[name]
    hf = _build_torch_model(kind, overrides, seed)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    cfg = load_config(path)
    assert cfg.model_type == kind
    assert cfg.tie_word_embeddings == overrides["tie_word_embeddings"]
    if kind == "qwen3_moe":
        assert cfg.norm_topk_prob == overrides["norm_topk_prob"]
    params = checkpoint.load_hf_params(path, cfg)
    assert ("lm_head" in params) != cfg.tie_word_embeddings
    seqs = _sequences(seed)
    hosts = pack(seqs, POLICY)
    assert len(hosts) == 1, "the test sequences should share one packed batch"
    host = hosts[0]
    assert host.options.attn_block == 32 and host.batch.tokens.shape[0] == 64
    refs = {}
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor(np.asarray(seq.token_ids, np.int64)[None])
            refs[seq.key] = hf(ids).logits[0].double().numpy()
    fixture = Fixture(name, str(path), cfg, params, host, refs, hf)
    fixture.outputs = fixture.run()
    _CACHE[name] = fixture
    return fixture


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Fixture:
    return _make_fixture("qwen3-norm-untied", tmp_path_factory)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Fixture:
    return _make_fixture("mixtral-tied", tmp_path_factory)


# ----------------------------------------------------------------------------- helpers
_rel_err, _rows_of = rel_err, rows_of


def _per_sequence(fx: Fixture, logits: np.ndarray) -> dict[str, np.ndarray]:
    return {seq.key: np.asarray(logits)[_rows_of(fx.host, i)]
            for i, seq in enumerate(fx.host.sequences)}


def _max_rel_err(fx: Fixture, logits: np.ndarray) -> float:
    per_seq = _per_sequence(fx, logits)
    return max(_rel_err(per_seq[key], fx.ref_logits[key]) for key in per_seq)


# ----------------------------------------------------------------------------- tests
def test_full_logits_match_torch_at_every_position(variant):
    fx = variant
    logits = fx.outputs["full_logits"]
    assert logits.shape == (64, V) and logits.dtype == np.float32 and np.isfinite(logits).all()
    err = _max_rel_err(fx, logits)
    assert err <= F32_TOL, f"{fx.name}: max relative error {err:.3g}"


def test_wrong_routing_is_detected(qwen3):
    """Negative control: the comparison is sensitive to routing. Relabelling the router's
    expert columns (cyclic shift) sends every token to other experts."""
    fx = qwen3
    params = dict(fx.params, layers=dict(fx.params["layers"]))
    params["layers"]["router"] = np.roll(fx.params["layers"]["router"], 1, axis=-1)
    err = _max_rel_err(fx, fx.run(params)["full_logits"])
    assert err > 100 * F32_TOL, f"misrouting every token changed logits by only {err:.3g}"


@pytest.mark.parametrize("full_vocab", [True, False], ids=["full_vocab", "columns"])
def test_forward_scoring_positions_match_torch(variant, full_vocab):
    fx = variant
    host = fx.host
    readout = fx.outputs["full_vocab" if full_vocab else "columns"]
    picked, lse = readout.logits, readout.lse
    assert picked.shape == host.batch.score_token_ids.shape and picked.dtype == np.float32
    if full_vocab:
        assert lse is not None and lse.shape == (host.batch.score_positions.shape[0],)
    else:
        assert lse is None
    checked = 0
    for seq, row in zip(host.sequences, host.rows):
        ref = fx.ref_logits[seq.key]
        scale = np.max(np.abs(ref))
        for j, (pos, ids) in enumerate(zip(seq.score_positions, seq.score_token_ids)):
            got = picked[row + j, :len(ids)]
            want = ref[pos, list(ids)]
            assert np.max(np.abs(got - want)) / scale <= F32_TOL, (seq.key, pos, got, want)
            if full_vocab:
                ref_lse = float(torch.logsumexp(torch.tensor(ref[pos]), dim=-1))
                assert abs(lse[row + j] - ref_lse) <= F32_TOL * max(1.0, abs(ref_lse)), \
                    (seq.key, pos, lse[row + j], ref_lse)
            checked += 1
    assert checked == sum(len(s.score_positions) for s in host.sequences) == 6


IMPLS = ("fused_tiles", "pallas", "gmm", "dense", "ragged_dot")


@pytest.fixture(scope="module")
def per_impl(qwen3) -> dict:
    fx = qwen3
    return jax.tree.map(np.asarray, _logits_per_impl(fx.params, fx.host.batch, fx.cfg,
                                                     fx.host.options.attn_block, IMPLS))


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_implementations_agree(qwen3, per_impl, impl):
    """tile_rows=4: many tiles per expert, and tiles cut at group ends."""
    fx = qwen3
    logits = per_impl[impl]
    err = _max_rel_err(fx, logits)
    assert err <= F32_TOL, f"{impl}: max relative error vs torch {err:.3g}"
    valid = np.asarray(fx.host.batch.segment_ids) >= 0
    baseline = fx.outputs["full_logits"]            # expert_impl="auto", default tile size
    assert _rel_err(logits[valid], baseline[valid]) <= 1e-5


@pytest.mark.parametrize("name", ["qwen3-norm-untied", "mixtral-tied"])
def test_bf16_close_to_float32_torch(name, tmp_path_factory):
    fx = _make_fixture(name, tmp_path_factory)
    params = checkpoint.load_hf_params(fx.path, fx.cfg, "bfloat16")
    assert params["embed"].dtype == np.dtype(jax.numpy.bfloat16)
    logits = fx.run(params)["full_logits"].astype(np.float64)
    per_seq = _per_sequence(fx, logits)
    err = max(_rel_err(per_seq[k], fx.ref_logits[k]) for k in per_seq)
    print(f"bf16 max relative error ({name}): {err:.4g}")
    for seq in fx.host.sequences:
        for pos in seq.score_positions:
            assert np.argmax(per_seq[seq.key][pos]) == np.argmax(fx.ref_logits[seq.key][pos]), \
                (name, seq.key, pos)
    assert err <= BF16_TOL, f"{name}: bf16 max relative error {err:.3g}"
