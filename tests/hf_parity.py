"""Hugging Face's own implementation reads a model directory and computes our logits."""

from __future__ import annotations

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
