"""Tiny random Hugging Face MoE models shared by the parity tests (scoring and generation).

Top-k routing is discontinuous, so the random models are made robust: norm weights are
perturbed (so a norm mix-up shows) and router weights are scaled ×20 so router logits are
well separated and float32 rounding cannot flip an expert choice. q/k projections (×4) and
expert weights (×2 each) are scaled up too, so attention and the MoE output weigh enough
in the logits for a mistake there to show. Import only after ``pytest.importorskip`` of
torch and transformers.
"""

from __future__ import annotations

import torch
import transformers

V, D, L, HEADS, KV_HEADS, HEAD_DIM, E, K, F = 128, 32, 2, 4, 2, 8, 8, 2, 16


def hf_config(kind: str, **overrides):
    """A ``Qwen3MoeConfig`` (kind "qwen3_moe") or ``MixtralConfig`` of the tiny shape."""
    common = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts_per_tok=K,
                  max_position_embeddings=128)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(num_experts=E, moe_intermediate_size=F,
                                           intermediate_size=2 * F, **common, **overrides)
    return transformers.MixtralConfig(num_local_experts=E, intermediate_size=F, rope_theta=1e5,
                                      **common, **overrides)


CLASSES = {("qwen3_moe", "lm"): transformers.Qwen3MoeForCausalLM,
           ("mixtral", "lm"): transformers.MixtralForCausalLM,
           ("qwen3_moe", "classifier"): transformers.Qwen3MoeForSequenceClassification,
           ("mixtral", "classifier"): transformers.MixtralForSequenceClassification}


def build_torch_model(kind: str, overrides: dict, seed: int, head: str = "lm"):
    """The seeded tiny model in eval mode, with the robustness scalings above; ``head``
    "classifier": its ``*ForSequenceClassification`` (a score head over num_labels)."""
    torch.manual_seed(seed)
    hf = CLASSES[kind, head](hf_config(kind, **overrides)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                param.mul_(20.0)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                # Default init (std 0.02) gives nearly uniform attention without qk-norm;
                # sharper scores make position/mask/rope mistakes visible for Mixtral too.
                param.mul_(4.0)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # Make the MoE output a sizeable part of the residual stream (×8 overall).
                param.mul_(2.0)
    if overrides.get("tie_word_embeddings"):
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


def word_tokenizer():
    """"t0" .. "t127" as whole words: ids map to text and back (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok
