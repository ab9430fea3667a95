"""Hugging Face's own implementation reads a model directory and computes our logits."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from moejax import checkpoint as ck


def assert_transformers_agrees(model_dir: str, text: str, tol: float = 2e-3) -> None:
    """``transformers.AutoModelForCausalLM`` loads ``model_dir`` with no missing or extra
    tensors, and its float32 logits over ``text`` equal ``moejax.model.full_logits``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from moejax import model as mdl

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    cfg, params, tokenizer = ck.load_model_dir(model_dir, "float32")
    ids = tokenizer.encode(text).ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    n = len(ids)
    batch = mdl.PackedBatch(tokens=np.array(ids, np.int32), positions=np.arange(n, dtype=np.int32),
                            segment_ids=np.zeros(n, np.int32), score_positions=np.zeros(1, np.int32),
                            score_token_ids=np.zeros((1, 1), np.int32))
    ours = np.asarray(mdl.full_logits(params, batch, cfg, mdl.ForwardOptions(attn_block=n)))
    assert logits.shape == (n, cfg.vocab_size)
    np.testing.assert_allclose(ours, logits, atol=tol, rtol=tol)


# --------------------------------------------------------------------- packed-batch parity
def parity_sequences(seed: int, vocab: int, lengths, low: int = 0):
    """``moejax.ops.PrefillOp`` s of the given lengths (token ids in [low, vocab)):
    sequence 1 scores three positions with ragged candidate lists, the others their
    last position; all ask for the full vocabulary."""
    from moejax.ops import PrefillOp

    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        positions = (n - 1,) if i != 1 else (0, n // 2, n - 1)
        cands = tuple(tuple(int(c) for c in rng.choice(vocab, size=1 + (j + i) % 3,
                                                       replace=False))
                      for j in range(len(positions)))
        out.append(PrefillOp(key=f"s{i}", token_ids=rng.integers(low, vocab, n).astype(np.int32),
                             score_positions=positions, score_token_ids=cands,
                             full_vocab=True))
    return out


def packed_outputs(params, batch, cfg, attn_block: int) -> dict:
    """Every packed-batch output a parity test reads, in one compiled program (XLA shares
    the forward's hidden states): full logits, and the scoring forward with the full
    vocabulary and with candidate columns only."""
    return _PACKED_OUTPUTS(params, batch, cfg, attn_block)


def _packed_outputs(params, batch, cfg, attn_block):
    import dataclasses

    from moejax import model as mdl

    opts = mdl.ForwardOptions(attn_block=attn_block)
    return {"full_logits": mdl.full_logits(params, batch, cfg, opts),
            "full_vocab": mdl.score_readout(params, batch, cfg,
                                            dataclasses.replace(opts, full_vocab=True)),
            "top_k": mdl.score_readout(params, batch, cfg,
                                       dataclasses.replace(opts, full_vocab=True, top_k=TOP_K)),
            "columns": mdl.score_readout(params, batch, cfg,
                                         dataclasses.replace(opts, full_vocab=False))}


TOP_K = 4     # the most likely ids the top-k readout is checked for


_PACKED_OUTPUTS = jax.jit(_packed_outputs, static_argnums=(2, 3))


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|, in float64."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def rows_of(host, index: int) -> np.ndarray:
    """Flat rows of sequence ``index`` of a packed ``host`` batch, ordered by position
    (checked: one row per token, positions 0..n-1, the sequence's tokens)."""
    seg = np.asarray(host.batch.segment_ids)
    pos = np.asarray(host.batch.positions)
    rows = np.nonzero(seg == index)[0]
    rows = rows[np.argsort(pos[rows], kind="stable")]
    n = len(host.sequences[index].token_ids)
    assert len(rows) == n and np.array_equal(pos[rows], np.arange(n))
    np.testing.assert_array_equal(np.asarray(host.batch.tokens)[rows],
                                  host.sequences[index].token_ids)
    return rows
