"""Prefill scoring throughput on CPU: moejax vs the Hugging Face `transformers` reference.

One Qwen3-MoE config (default: hidden 512, 8 layers, 32 experts, top-4), one set of
random weights written once as a HF checkpoint and loaded by both sides, the same
prompts, the same thread count. The reference runs as a `transformers` user would:
padded batches in input order, ``model(input_ids, attention_mask)``, scores read
at each prompt's last position. moejax runs ``serving.Scorer.score`` on the same
token ids (packed batches, LM head only at the scoring positions). Both are
warmed up first (moejax compiles its bucketed shapes; torch runs one batch),
then timed over the whole workload (best of ``--repeats`` passes, alternating
between the two engines), and the candidate log-probs are compared.

``--family`` picks the model family (default ``qwen3_moe``): the same shape built with
that family's own transformers config class (its attention, routing, shared experts and
dense layers as :data:`FAMILIES` describes), compared the same way.

    python -m benchmarks.prefill_cpu [--quick] [--family F] [--json PATH]

JSON keys: family, moejax_tokens_per_s, transformers_tokens_per_s, speedup_vs_transformers,
max_abs_logprob_diff, label_agreement, tokens, requests, threads.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np

from benchmarks.lib.cli import bench_parser, parse_args, run_shape
from benchmarks.lib.meta import finish_run
from benchmarks.lib.tables import print_table
from benchmarks.lib.timing import timed_call

FULL = dict(hidden=512, layers=8, experts=32, top_k=4, moe_intermediate=256, heads=8,
            kv_heads=4, head_dim=64, vocab=4096, requests=64, min_len=64, max_len=512,
            hf_batch=8)
QUICK = dict(hidden=128, layers=2, experts=8, top_k=2, moe_intermediate=64, heads=4,
             kv_heads=2, head_dim=32, vocab=1024, requests=16, min_len=16, max_len=128,
             hf_batch=8)


# family -> (transformers config class, causal-LM class, what the family adds). Every
# family gets the shape above: hidden d, layers, heads / kv heads, head_dim, vocab, E
# experts, top-k, expert width f. Dense MLPs are 4d wide for Qwen3-MoE (as before
# --family existed: the default model is unchanged) and 4f elsewhere, as is Qwen2-MoE's
# shared expert; DeepSeek's shared expert is f wide.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  "q/k norm per head, softmax top-k renormalised"),
    "qwen3_moe_dense": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        "qwen3_moe with a dense first layer (mlp_only_layers=[0])"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "softmax over the top-k logits"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              "q/k norm over all heads, top-k not renormalised"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  "q/k/v biases, a sigmoid-gated shared expert"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    "MLA (q LoRA), sigmoid group-limited routing with a score correction, "
                    "a shared expert, a dense first layer"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    "MLA (no q LoRA), softmax group-limited routing, a shared expert, a "
                    "dense first layer"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                "attention sinks and biases, alternating sliding-window layers (window: a "
                "quarter of the longest prompt), biased router and experts, clamped SwiGLU"),
}


def family_config(family: str, shape: dict):
    """The transformers config of ``family`` at ``shape``."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    d, f = shape["hidden"], shape["moe_intermediate"]
    common = dict(vocab_size=shape["vocab"], hidden_size=d, num_hidden_layers=shape["layers"],
                  num_attention_heads=shape["heads"], num_experts_per_tok=shape["top_k"],
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    gqa = dict(num_key_value_heads=shape["kv_heads"])
    e = shape["experts"]
    if family in ("qwen3_moe", "qwen3_moe_dense"):
        extra = dict(mlp_only_layers=[0]) if family == "qwen3_moe_dense" else {}
        kwargs = dict(gqa, head_dim=shape["head_dim"], num_experts=e, moe_intermediate_size=f,
                      intermediate_size=4 * d, norm_topk_prob=True,
                      max_position_embeddings=4096, **extra)
    elif family == "mixtral":
        kwargs = dict(gqa, head_dim=shape["head_dim"], num_local_experts=e, intermediate_size=f,
                      max_position_embeddings=4096)
    elif family == "olmoe":          # head_dim = hidden / heads
        kwargs = dict(gqa, num_experts=e, intermediate_size=f, max_position_embeddings=4096)
    elif family == "qwen2_moe":      # head_dim = hidden / heads
        kwargs = dict(gqa, num_experts=e, moe_intermediate_size=f, intermediate_size=4 * f,
                      shared_expert_intermediate_size=4 * f, qkv_bias=True,
                      max_position_embeddings=4096)
    elif family in ("deepseek_v3", "deepseek_v2"):
        h = shape["head_dim"]
        kwargs = dict(num_key_value_heads=shape["heads"], kv_lora_rank=d // 4,
                      qk_nope_head_dim=h, qk_rope_head_dim=h // 2, v_head_dim=h,
                      n_routed_experts=e, moe_intermediate_size=f, n_shared_experts=1,
                      first_k_dense_replace=1, intermediate_size=4 * f, n_group=4,
                      topk_group=2, max_position_embeddings=4096)
        if family == "deepseek_v3":
            kwargs.update(q_lora_rank=d // 2, routed_scaling_factor=2.5, norm_topk_prob=True)
        else:
            kwargs.update(q_lora_rank=None, topk_method="group_limited_greedy")
    else:                            # gpt_oss: its own YaRN RoPE and 131072 context
        kwargs = dict(gqa, head_dim=shape["head_dim"], num_local_experts=e,
                      intermediate_size=f, sliding_window=max(4, shape["max_len"] // 4),
                      attention_bias=True)
    return getattr(transformers, FAMILIES[family][0])(**common, **kwargs)


def build_checkpoint(shape: dict, out_dir: str, seed: int = 0, family: str = "qwen3_moe") -> None:
    """A random ``family`` model written with `save_pretrained`, plus a tokenizer.json."""
    import torch
    import transformers

    config = family_config(family, shape)
    torch.manual_seed(seed)
    getattr(transformers, FAMILIES[family][1])(config).save_pretrained(out_dir)
    from moejax.demo import ensure_demo_model  # any tokenizer.json will do: inputs are token ids

    shutil.copy(os.path.join(ensure_demo_model(), "tokenizer.json"), out_dir)


def make_requests(shape: dict, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(shape["min_len"], shape["max_len"] + 1, size=shape["requests"])
    return [{"id": i, "prompt_token_ids": rng.integers(0, shape["vocab"], n).tolist(),
             "candidate_token_ids": [[int(a)], [int(b)]]}
            for i, (n, a, b) in enumerate(zip(lengths, rng.integers(0, shape["vocab"], len(lengths)),
                                              rng.integers(0, shape["vocab"], len(lengths))))]


def transformers_pass(model_dir: str, requests: list[dict], batch: int):
    """A function running the whole workload once through `transformers`; it returns
    [N, 2] candidate log-probs (normalised over the candidates)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def batches():
        for start in range(0, len(requests), batch):
            chunk = requests[start:start + batch]
            width = max(len(r["prompt_token_ids"]) for r in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, r in enumerate(chunk):   # right padding, as a tokenizer call would give
                ids[row, :len(r["prompt_token_ids"])] = torch.tensor(r["prompt_token_ids"])
                mask[row, :len(r["prompt_token_ids"])] = 1
            yield chunk, ids, mask

    def run_once() -> np.ndarray:
        scores = []
        with torch.inference_mode():
            for chunk, ids, mask in batches():
                logits = model(input_ids=ids, attention_mask=mask).logits
                for row, r in enumerate(chunk):
                    last = logits[row, len(r["prompt_token_ids"]) - 1]
                    cand = last[[c[0] for c in r["candidate_token_ids"]]].double()
                    scores.append(torch.log_softmax(cand, dim=0).numpy())
        return np.stack(scores)

    with torch.inference_mode():                            # warm-up
        _, ids, mask = next(batches())
        model(input_ids=ids, attention_mask=mask)
    return run_once


def moejax_pass(model_dir: str, requests: list[dict]):
    """A function running the workload once through `serving.Scorer` (compiled during a
    warm-up pass here) and returning [N, 2] log-probs; plus the scorer, for its stats."""
    from serving import Scorer

    scorer = Scorer(model_dir, dtype="float32", compilation_cache="auto")

    def run_once() -> np.ndarray:
        results = scorer.score(requests, progress=False)
        bad = [r.error for r in results if r.error]
        if bad:
            raise RuntimeError(f"moejax returned errors: {bad[:3]}")
        return np.array([r.logprobs for r in results])

    run_once()                                              # warm-up: compiles every shape
    return run_once, scorer


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, quick_help="small shapes, under a minute",
                          repeats_help="timed passes per engine, alternating; the best is kept "
                                       "(default 3, 1 with --quick)")
    parser.add_argument("--family", choices=list(FAMILIES), default="qwen3_moe",
                        help="model family (default qwen3_moe)")
    parser.add_argument("--requests", type=int, help="override the number of prompts")
    args = parse_args(parser, argv)
    shape = run_shape(args, QUICK, FULL, ("requests",))

    import torch

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)   # XLA's CPU backend uses every core as well
    requests = make_requests(shape)
    tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    repeats = args.repeats or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(shape, tmp, family=args.family)
        moejax_once, scorer = moejax_pass(tmp, requests)
        hf_once = transformers_pass(tmp, requests, shape["hf_batch"])
        t_moejax, t_hf = float("inf"), float("inf")
        for _ in range(repeats):   # alternate, so both see the same background load
            t, lp_moejax = timed_call(moejax_once, label="moejax")
            t_moejax = min(t_moejax, t)
            t, lp_hf = timed_call(hf_once, label="transformers")
            t_hf = min(t_hf, t)
    stats = scorer.engine.stats
    extra = {"compiled_shapes": stats.compiles,
             "padding_fraction": stats.padded_tokens / max(1, stats.padded_tokens + stats.real_tokens)}
    figures = {
        "family": args.family,
        "moejax_tokens_per_s": tokens / t_moejax,
        "transformers_tokens_per_s": tokens / t_hf,
        "speedup_vs_transformers": t_hf / t_moejax,
        "max_abs_logprob_diff": float(np.abs(lp_moejax - lp_hf).max()),
        "label_agreement": float(np.mean(lp_moejax.argmax(1) == lp_hf.argmax(1))),
        "tokens": tokens, "requests": len(requests), "threads": threads, "repeats": repeats,
        **extra,
    }
    print(f"prefill scoring (best of {repeats} alternating passes), {args.family} d={shape['hidden']} L={shape['layers']} "
          f"E={shape['experts']} k={shape['top_k']}, {len(requests)} prompts of "
          f"{shape['min_len']}-{shape['max_len']} tokens ({tokens} tokens), {threads} threads, f32")
    print_table([("engine", -14, lambda row: row[0]), ("seconds", 10, lambda row: f"{row[1]:.2f}"),
                 ("tokens/s", 12, lambda row: f"{tokens / row[1]:.0f}")],
                [("moejax", t_moejax), ("transformers", t_hf)], rule="")
    print(f"speedup_vs_transformers = {figures['speedup_vs_transformers']:.2f}x  "
          f"(max |Δ logprob| = {figures['max_abs_logprob_diff']:.2e}, "
          f"label agreement = {figures['label_agreement']:.3f})")
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
