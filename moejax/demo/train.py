"""Train the demo model: ``python -m moejax.demo.train --out DIR``.

A small Qwen3-MoE (``moejax/demo/configs/demo.yaml``) learns next-token prediction on the corpus of
:mod:`moejax.demo.corpus` with optax AdamW (linear warm-up, cosine decay, global-norm
clipping), plus the Switch/Qwen load-balancing loss ``E * sum_e f_e * P_e`` (``f_e``: the
fraction of routed slots that chose expert ``e``, ``P_e``: its mean router probability),
so the router spreads tokens instead of collapsing onto a few experts.

Training runs in six stages (:func:`stages`), each a fresh AdamW run from the previous
stage's bfloat16 export: the mixed corpus, then task-heavy mixtures, then the sum checks,
then the option lookup that multiple choice needs. ``--start-stage stageN --init-dir DIR``
resumes from an export of the stage before.

The training forward (:func:`train_forward`) is the inference model itself
(``MoEDecoder.run_layers``, with the differentiable ``ragged_dot`` expert matmuls) over
rows of packed examples, observing the router probabilities at every layer for the
balance loss; a test checks it equals ``moejax.model.full_logits`` on the exported model.

Output: ``DIR/{config.json, tokenizer.json, model.safetensors}`` (the Hugging Face layout the
loader reads; weights stored in bfloat16 to keep the files small) and ``DIR/train_log.json``
(loss curve, held-out loss, per-domain expert usage). Same seed, same machine and JAX
version -> the same weights; float reductions may differ on other CPUs or versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from moejax import model as mdl
from moejax import moe
from moejax.attention_kinds import PackedCausal
from moejax.checkpoint import hf_tensor_plan
from moejax.config import ModelConfig, from_hf_dict
from moejax.demo import corpus
from moejax.param_layout import Params
from moejax.safetensors_io import write_safetensors


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings of one run (recorded in the log)."""

    steps: int = 950
    batch_rows: int = 16
    seq_len: int = 128
    peak_lr: float = 3e-3
    warmup_steps: int = 80
    final_lr_fraction: float = 0.05
    weight_decay: float = 0.05
    clip_norm: float = 1.0
    aux_coef: float = 0.01
    seed: int = 0
    log_every: int = 25
    eval_batches: int = 8
    # Stage 2 ("tasks"): from the stage-1 weights rounded to bfloat16 (what stage 1 exports),
    # a fresh AdamW run on a task-heavy mixture (corpus.TASK_MIXTURE) whose answer tokens
    # weigh ``answer_weight`` in the loss: stage 1 learns the sums but not yet to compare
    # them with a claimed result or an option list, and answers are one token in twenty.
    task_steps: int = 1000
    task_peak_lr: float = 1e-3
    answer_weight: float = 5.0
    # Stages 3 and 4 ("checks", corpus.CHECK_MIXTURE then corpus.CHOICE_MIXTURE): each from
    # the previous stage's bfloat16 export, a fresh short AdamW run.
    check_steps: int = 600
    check_peak_lr: float = 1e-3
    check_warmup_steps: int = 40
    # Stage 5 (corpus.LOOKUP_MIXTURE, the check stages' learning rate) and stage 6
    # (corpus.DRILL_MIXTURE): multiple choice needs the value -> letter lookup, which
    # choice items alone did not teach.
    lookup_steps: int = 1500
    drill_steps: int = 2000
    drill_peak_lr: float = 2e-3
    drill_warmup_steps: int = 100
    # The differentiable expert path: "ragged_dot" (the small demo was trained with it) or
    # "blocks" (moejax.grouped_gemm.swiglu_blocks: routed work only, 4.5x faster per step
    # at 32 experts on the 2-core CPU).
    expert_impl: str = "ragged_dot"
    # Stage 1's plain-text share over the non-math domains of an eight-domain corpus
    # (0: the share corpus.MIXTURE gives code, prose and data).
    text_share: float = 0.0
    # Stage 7 (corpus.MULTI_MIXTURE) and stage 8 (corpus.MULTI_DRILL_MIXTURE), at the
    # check stages' learning rate: only when > 0.
    multi_steps: int = 0
    multi_drill_steps: int = 0


# demo-e32 (moejax/demo/configs/demo-e32.yaml): the small demo's curriculum with a larger stage-1
# text share (routing structure is learnt from plain text of eight domains), fewer steps in
# the later stages, and the blocked expert path; about 70 minutes on the 2-core CPU.
TRAIN_DEFAULTS: dict[str, TrainConfig] = {
    "demo": TrainConfig(),
    "demo-e32": TrainConfig(steps=2500, task_steps=1000, check_steps=500, lookup_steps=1200,
                            drill_steps=1500, expert_impl="blocks", text_share=0.42,
                            multi_steps=1200, multi_drill_steps=1200),
}


# =========================================================================== batches
Item = list[int] | tuple[list[int], list[float]]


def pack_rows(token_lists: Iterator[Item], rows: int, seq_len: int, lookahead: int = 8
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pack whole examples (each at most ``seq_len`` tokens) into ``rows`` rows.

    An example that does not fit the current row waits in a queue of up to ``lookahead``
    examples while later, shorter ones fill the row (padding was a fifth of the tokens
    without it); what is still queued when the rows are full is dropped (the training
    streams are endless). Returns tokens, segment ids (-1 = padding; unique per example
    across the batch, so attention never crosses examples) and positions (restarting at 0
    per example, as a scoring request does), each ``[rows, seq_len]`` int32, and the loss
    weight of each token as a prediction target (``[rows, seq_len]`` float32; an item is a
    token list, weight 1, or a (tokens, weights) pair).
    """
    tokens = np.zeros((rows, seq_len), np.int32)
    segs = np.full((rows, seq_len), -1, np.int32)
    positions = np.zeros((rows, seq_len), np.int32)
    weights = np.zeros((rows, seq_len), np.float32)
    queue: list[tuple[list[int], list[float]]] = []
    exhausted, seg_id = False, 0
    for r in range(rows):
        used = 0
        while True:
            fits = next((i for i, (ids, _) in enumerate(queue) if used + len(ids) <= seq_len),
                        None)
            if fits is not None:
                ids, w = queue.pop(fits)
            elif len(queue) < lookahead and not exhausted:
                new = next(token_lists, None)
                if new is None:
                    exhausted = True
                else:
                    ids, w = new if isinstance(new, tuple) else (new, [1.0] * len(new))
                    queue.append((ids[:seq_len], w[:seq_len]))
                continue
            else:
                break
            tokens[r, used:used + len(ids)] = ids
            segs[r, used:used + len(ids)] = seg_id
            positions[r, used:used + len(ids)] = np.arange(len(ids))
            weights[r, used:used + len(ids)] = w
            used += len(ids)
            seg_id += 1
    return tokens, segs, positions, weights


def token_stream(tokenizer, examples: Iterator[corpus.Example], max_len: int = 1 << 30,
                 answer_weight: float = 1.0) -> Iterator[tuple[list[int], list[float]]]:
    """(token ids, loss weights) of each example's text, without special tokens (as requests
    are encoded), then end-of-text so the model learns where an answer stops. A task
    item's answer tokens weigh ``answer_weight``; one longer than ``max_len`` loses its
    beginning (its question and answer are at the end)."""
    eos = tokenizer.token_to_id("<|endoftext|>")
    for ex in examples:
        ids = tokenizer.encode(ex.text, add_special_tokens=False).ids + [eos]
        weights = [1.0] * len(ids)
        if ex.answer:
            n_answer = len(tokenizer.encode(ex.answer, add_special_tokens=False).ids)
            weights[-1 - n_answer:-1] = [answer_weight] * n_answer
            yield ids[-max_len:], weights[-max_len:]
        else:
            yield ids[:max_len], weights[:max_len]


# =========================================================================== forward
def _packed(tokens: jax.Array, segs: jax.Array, positions: jax.Array) -> mdl.PackedBatch:
    """Flatten [B, S] rows into the inference model's packed batch (no scoring rows)."""
    flat = lambda a: jnp.asarray(a).reshape(-1)
    empty = jnp.zeros((1,), jnp.int32)
    return mdl.PackedBatch(tokens=flat(tokens), positions=flat(positions),
                           segment_ids=flat(segs), score_positions=empty,
                           score_token_ids=empty[:, None])


def balance_loss(routing: moe.Routing, valid: jax.Array, cfg: ModelConfig
                 ) -> tuple[jax.Array, jax.Array]:
    """One layer's Switch/Qwen load-balancing loss over valid tokens, E · Σ_e f_e · P_e
    (1.0 when uniform; f_e, a count, carries no gradient, P_e, the mean router
    probability, does), and its top-k choice counts [E]. The layer driver's observation
    during training."""
    mask = valid.astype(jnp.float32)[:, None]
    n = jnp.maximum(mask.sum(), 1.0)
    chosen = jax.nn.one_hot(routing.experts, cfg.num_experts, dtype=jnp.float32).sum(axis=1)
    counts = jnp.sum(chosen * mask, axis=0)
    f = counts / (n * cfg.num_experts_per_tok)
    p_mean = jnp.sum(routing.probs * mask, axis=0) / n
    return cfg.num_experts * jnp.sum(f * p_mean), counts


def train_forward(params: Params, tokens: jax.Array, segs: jax.Array, positions: jax.Array,
                  cfg: ModelConfig, expert_impl: str = "ragged_dot"
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logits [B*S, V] of rows [B, S], mean balance loss over layers, counts [L, E].

    The inference model itself (``MoEDecoder.run_layers``: the same layer, attention kind
    and dispatcher as scoring), with ``ragged_dot`` or ``blocks`` experts because they
    are differentiable (the tiled kernels loop over dynamic bounds, which reverse-mode
    autodiff cannot do), and the balance loss observed at every layer.
    """
    batch = _packed(tokens, segs, positions)
    module = mdl.decoder(cfg, params)
    attn = PackedCausal.of(batch.positions, batch.segment_ids, tokens.shape[1])
    valid = batch.segment_ids >= 0
    x, _, _, (aux, counts) = module.run_layers(
        module.embed_tokens(batch.tokens), attn, module.local_dispatcher(expert_impl),
        observe=lambda layer, routing, _valid, _inputs: balance_loss(routing, valid, cfg))
    logits = module.vocab_logits(module.final(x))
    return logits, jnp.mean(aux), counts


def next_token_loss(logits: jax.Array, tokens: jax.Array, segs: jax.Array,
                    weights: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Summed cross-entropy of each token's successor within its example, and the count
    (both weighted by the successor's ``weights`` when given)."""
    b, s = tokens.shape
    logits = logits.reshape(b, s, -1)[:, :-1]
    targets = tokens[:, 1:]
    mask = ((segs[:, :-1] == segs[:, 1:]) & (segs[:, 1:] >= 0)).astype(jnp.float32)
    if weights is not None:
        mask = mask * weights[:, 1:]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * mask), jnp.sum(mask)


def loss_fn(params: Params, tokens, segs, positions, weights, cfg: ModelConfig,
            aux_coef: float, expert_impl: str = "ragged_dot"):
    """Weighted cross-entropy + aux_coef * balance loss; also the plain cross-entropy."""
    logits, aux, counts = train_forward(params, tokens, segs, positions, cfg, expert_impl)
    total, n = next_token_loss(logits, tokens, segs, weights)
    plain, count = next_token_loss(logits, tokens, segs)
    objective = total / jnp.maximum(n, 1.0) + aux_coef * aux
    return objective, (plain / jnp.maximum(count, 1.0), aux, counts)


# =========================================================================== optimiser
def make_optimizer(tc: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Clip, then AdamW with warm-up + cosine decay; norms are not decayed.

    A short run (a test) warms up over at most a fifth of its steps."""
    warmup = min(tc.warmup_steps, max(1, tc.steps // 5))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tc.peak_lr, warmup_steps=warmup,
        decay_steps=max(tc.steps, warmup + 1), end_value=tc.peak_lr * tc.final_lr_fraction)

    def decay_mask(params: Params) -> Any:
        return {key: ({n: not n.endswith("norm") for n in value} if key == "layers"
                      else not key.endswith("norm")) for key, value in params.items()}

    opt = optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay,
                                  mask=decay_mask))
    return opt, schedule


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """The model's seeded init, output projections scaled down by sqrt(2L) (GPT-2 style),
    so the residual stream starts small and deep updates stay stable."""
    params = mdl.init_params(cfg, seed=seed, scale=0.02)
    shrink = 1.0 / np.sqrt(2 * cfg.num_layers)
    for name in ("wo", "w_down"):
        params["layers"][name] = params["layers"][name] * np.float32(shrink)
    return jax.tree_util.tree_map(jnp.asarray, params)


# =========================================================================== evaluation
def held_out_loss(params: Params, cfg: ModelConfig, batches: Sequence[tuple],
                  expert_impl: str = "ragged_dot") -> float:
    """Token-weighted next-token cross-entropy over fixed held-out batches."""
    total, count = 0.0, 0.0
    for tokens, segs, positions, _ in batches:
        logits, _, _ = _eval_forward(params, tokens, segs, positions, cfg, expert_impl)
        t, n = next_token_loss(logits, tokens, segs)
        total, count = total + float(t), count + float(n)
    return total / max(count, 1.0)


_eval_forward = jax.jit(train_forward, static_argnums=(4, 5))


def expert_usage(params: Params, cfg: ModelConfig, tokenizer, src: corpus.Sources,
                 seed: int, rows: int = 16, seq_len: int = 128,
                 expert_impl: str = "ragged_dot") -> dict[str, list[list[float]]]:
    """Per domain of ``src``, the fraction of that domain's routed slots going to each
    expert, per layer ([L][E], rows sum to 1), over held-out plain text of the domain."""
    usage = {}
    for d, domain in enumerate(src.domains):
        rng = np.random.default_rng(seed + d)
        texts = (corpus.plain_example(src, domain, rng) for _ in iter(int, 1))
        batch = pack_rows(token_stream(tokenizer, texts, seq_len), rows, seq_len)
        _, _, counts = _eval_forward(params, *batch[:3], cfg, expert_impl)
        counts = np.asarray(counts)
        usage[domain] = (counts / counts.sum(axis=1, keepdims=True)).round(4).tolist()
    return usage


def usage_summary(usage: dict[str, list[list[float]]]) -> dict[str, Any]:
    """Per layer: each domain's most used expert and its share, and the share of
    routed slots the domain sends to experts that are its own top choice among domains."""
    domains = list(usage)
    arr = np.array([usage[d] for d in domains])                              # [D, L, E]
    layers = []
    for layer in range(arr.shape[1]):
        per = arr[:, layer]
        layers.append({d: {"top_expert": int(per[i].argmax()), "share": round(float(per[i].max()), 3)}
                       for i, d in enumerate(domains)})
    # Mean total-variation distance between two domains' expert distributions, per layer:
    # 0 = every domain uses the experts alike, 1 = disjoint experts.
    tv = [round(float(np.mean([0.5 * np.abs(arr[i, l] - arr[j, l]).sum()
                               for i in range(len(arr)) for j in range(i + 1, len(arr))])), 3)
          for l in range(arr.shape[1])]
    return {"top_expert_by_layer": layers, "mean_pairwise_tv_distance_by_layer": tv}


# =========================================================================== export
def params_to_hf(params: Params, cfg: ModelConfig, dtype: np.dtype) -> dict[str, np.ndarray]:
    """HF-named tensors (per-expert spelling) of ``params``: the loader's plan run backwards."""
    host = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), params)
    out = {}
    for slot in hf_tensor_plan(cfg, set()):
        (write,) = slot.writes
        leaf = host
        for key in write.key:
            leaf = leaf[key]
        # The plan's transforms (identity, or a swap of the last two axes) are involutions,
        # so the transform that loads a tensor also maps the param slice back. (Comparing
        # shapes instead would miss the swap of square matrices.)
        tensor = write.transform(leaf[write.index])
        if tensor.shape != slot.shape:
            raise RuntimeError(f"{slot.name}: param slice maps to {tensor.shape}, "
                               f"expected {slot.shape}")
        out[slot.name] = np.ascontiguousarray(tensor).astype(dtype)
    return out


def save_model_dir(out_dir: str, params: Params, hf_config: dict[str, Any], tokenizer,
                   notice: str) -> None:
    """Write config.json, tokenizer.json and model.safetensors (bfloat16) into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = from_hf_dict(hf_config)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(hf_config, fh, indent=2, sort_keys=True)
        fh.write("\n")
    write_safetensors(os.path.join(out_dir, "model.safetensors"),
                      params_to_hf(params, cfg, np.dtype(ml_dtypes.bfloat16)),
                      metadata={"format": "pt", "notice": notice})


# =========================================================================== training
def train(hf_config: dict[str, Any], tc: TrainConfig, tokenizer, src_train: corpus.Sources,
          src_eval: corpus.Sources, progress: bool = True, *, init: Params | None = None,
          mixture: dict[str, float] | None = None, answer_weight: float = 1.0,
          stream_seed: int | None = None) -> tuple[Params, dict[str, Any]]:
    """Run ``tc.steps`` steps from ``init`` (default: the seeded init) on ``mixture``
    (default :data:`corpus.MIXTURE`); returns the params and the log."""
    cfg = from_hf_dict(hf_config)
    params = init_params(cfg, tc.seed) if init is None else init
    seed = tc.seed if stream_seed is None else stream_seed
    opt, schedule = make_optimizer(tc)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, tokens, segs, positions, weights):
        grads, (ce, aux, counts) = jax.grad(loss_fn, has_aux=True)(
            params, tokens, segs, positions, weights, cfg, tc.aux_coef, tc.expert_impl)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ce, aux, optax.tree.norm(grads), counts

    train_tokens = token_stream(tokenizer, corpus.stream(src_train, seed, mixture), tc.seq_len,
                                answer_weight)
    eval_tokens = token_stream(tokenizer, corpus.stream(src_eval, seed + 1, mixture), tc.seq_len)
    eval_batches = [pack_rows(eval_tokens, tc.batch_rows, tc.seq_len) for _ in range(tc.eval_batches)]
    log: dict[str, Any] = {"curve": []}
    start, window = time.time(), []
    batch = pack_rows(train_tokens, tc.batch_rows, tc.seq_len)
    for i in range(tc.steps):
        params, opt_state, ce, aux, gnorm, counts = step(params, opt_state, *batch)
        # The step runs asynchronously: pack the next batch while it does.
        batch = pack_rows(train_tokens, tc.batch_rows, tc.seq_len) if i + 1 < tc.steps else None
        window.append((ce, aux))
        if (i + 1) % tc.log_every == 0 or i == 0 or i + 1 == tc.steps:
            ce_m, aux_m = np.mean([(float(c), float(a)) for c, a in window], axis=0)
            load = np.asarray(counts, np.float64)
            load = load / load.sum(axis=1, keepdims=True)
            entry = {"step": i + 1, "loss": round(float(ce_m), 4), "aux": round(float(aux_m), 4),
                     "lr": float(schedule(i)), "grad_norm": round(float(gnorm), 3),
                     "max_expert_load": round(float(load.max()), 3),
                     "elapsed_s": round(time.time() - start, 1)}
            log["curve"].append(entry)
            window = []
            if progress:
                print(json.dumps(entry), flush=True)
    log["train_seconds"] = round(time.time() - start, 1)
    log["final_train_loss"] = log["curve"][-1]["loss"]
    log["held_out_loss"] = round(held_out_loss(params, cfg, eval_batches, tc.expert_impl), 4)
    usage = expert_usage(params, cfg, tokenizer, src_eval, tc.seed + 100,
                         expert_impl=tc.expert_impl)
    log["expert_usage_by_domain"] = usage
    log["expert_usage_summary"] = usage_summary(usage)
    return params, log


def _bf16_round(params: Params) -> Params:
    """What a bfloat16 export and reload gives back (stage 2 starts from exactly that)."""
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16), jnp.float32),
        params)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One training stage: ``steps`` AdamW steps (fresh optimiser state, its own warm-up and
    cosine decay) on ``mixture``, from the previous stage's bfloat16 export (stage 1: from
    the seeded init). The stream seed is ``TrainConfig.seed + stream_offset``."""

    name: str
    mixture: dict[str, float]
    stream_offset: int
    steps: int
    peak_lr: float
    warmup_steps: int
    answer_weight: float


def stages(tc: TrainConfig, domains: tuple[str, ...] = corpus.DOMAINS) -> tuple[Stage, ...]:
    """Every stage of the demo's training, in order.

    1. the mixed corpus; 2. task-heavy (answer tokens weigh ``answer_weight``); 3-4. the
    sum checks (``corpus.CHECK_MIXTURE``, ``corpus.CHOICE_MIXTURE``); 5. the option lookup
    that multiple choice needs (``corpus.LOOKUP_MIXTURE``); 6. lookup drills at a higher
    learning rate (``corpus.DRILL_MIXTURE``); with ``tc.multi_steps``, 7. multi-selection
    (``corpus.MULTI_MIXTURE``, demo-e32); with ``tc.multi_drill_steps``, 8. multi drills
    (``corpus.MULTI_DRILL_MIXTURE``, demo-e32). Another domain set gets each mixture
    through ``corpus.for_domains`` (stage 1 with ``tc.text_share`` when set).
    """
    def mix(mixture: dict[str, float], text_share: float | None = None) -> dict[str, float]:
        return mixture if domains == corpus.DOMAINS else corpus.for_domains(
            mixture, domains, text_share)

    checks = dict(steps=tc.check_steps, peak_lr=tc.check_peak_lr,
                  warmup_steps=tc.check_warmup_steps, answer_weight=tc.answer_weight)
    checks_lr = {k: v for k, v in checks.items() if k != "steps"}
    plan = [
        Stage("stage1", mix(corpus.MIXTURE, tc.text_share or None), 0, tc.steps, tc.peak_lr,
              tc.warmup_steps, 1.0),
        Stage("stage2", mix(corpus.TASK_MIXTURE), 2, tc.task_steps, tc.task_peak_lr,
              tc.warmup_steps, tc.answer_weight),
        Stage("stage3", mix(corpus.CHECK_MIXTURE), 7, **checks),
        Stage("stage4", mix(corpus.CHOICE_MIXTURE), 8, **checks),
        Stage("stage5", mix(corpus.LOOKUP_MIXTURE), 9, tc.lookup_steps, tc.check_peak_lr,
              tc.check_warmup_steps, tc.answer_weight),
        Stage("stage6", mix(corpus.DRILL_MIXTURE), 10, tc.drill_steps, tc.drill_peak_lr,
              tc.drill_warmup_steps, tc.answer_weight),
    ]
    if tc.multi_steps > 0:
        plan.append(Stage("stage7", mix(corpus.MULTI_MIXTURE), 11, tc.multi_steps, **checks_lr))
    if tc.multi_drill_steps > 0:
        plan.append(Stage("stage8", mix(corpus.MULTI_DRILL_MIXTURE), 12, tc.multi_drill_steps,
                          **checks_lr))
    return tuple(plan)


def run_stage(stage: Stage, hf_config: dict[str, Any], tc: TrainConfig, tokenizer,
              src_train: corpus.Sources, src_eval: corpus.Sources, init: Params | None,
              progress: bool = True) -> tuple[Params, dict[str, Any]]:
    """Train one stage from ``init`` (None: the seeded init); returns the params rounded to
    bfloat16 (what the stage exports, and what the next stage starts from) and its log."""
    stage_tc = dataclasses.replace(tc, steps=stage.steps, peak_lr=stage.peak_lr,
                                   warmup_steps=stage.warmup_steps)
    if progress:
        print(f"# {stage.name}: {stage.steps} steps, peak lr {stage.peak_lr}", flush=True)
    params, log = train(hf_config, stage_tc, tokenizer, src_train, src_eval, progress,
                        init=init, mixture=stage.mixture, answer_weight=stage.answer_weight,
                        stream_seed=tc.seed + stage.stream_offset)
    return _bf16_round(params), log


STAGE_LOG_KEYS = ("curve", "train_seconds", "final_train_loss", "held_out_loss")


def params_digest(params: Params, cfg: ModelConfig) -> str:
    """sha256 of the bfloat16 HF tensors of ``params`` in the loader's order: what a
    twin generated later must reproduce."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(params_to_hf(params, cfg, np.dtype(ml_dtypes.bfloat16)).items()):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(tensor).view(np.uint16).tobytes())
    return digest.hexdigest()


def _stage_logs(init_dir: str, done: list[str]) -> dict[str, Any]:
    """The logs of the stages ``done`` recorded in ``init_dir/train_log.json``."""
    with open(os.path.join(init_dir, "train_log.json"), encoding="utf-8") as fh:
        earlier = json.load(fh)
    logs = {name: earlier[name] for name in done if name in earlier}
    if "stage1" in done and "stage1" not in logs:   # a stage-1-only export's log
        logs["stage1"] = earlier
    missing = [name for name in done if name not in logs]
    if missing:
        raise RuntimeError(f"{init_dir}/train_log.json has no log of {missing}")
    return logs


def run(out_dir: str, tc: TrainConfig, hf_config: dict[str, Any] | None = None,
        progress: bool = True, init_dir: str | None = None,
        start_stage: str = "stage1", model: str = "demo",
        stage_dir: str | None = None) -> dict[str, Any]:
    """Build the tokenizer and corpus of built-in model ``model``, train the stages from
    ``start_stage`` on, write the model dir and ``train_log.json``.

    Starting later than stage 1 needs ``init_dir``: an export of the stage before (its
    weights, and its ``train_log.json`` for the log of the stages it ran). With
    ``stage_dir`` every stage is exported to ``stage_dir/<stage>`` as it ends (with the
    logs so far), so a stopped run resumes from the last one.
    """
    from moejax import checkpoint as ck
    from moejax.demo import specs

    spec = specs.demo_model(model)
    domains = spec.domains
    plan = stages(tc, domains)
    names = [stage.name for stage in plan]
    if start_stage not in names:
        raise ValueError(f"unknown stage {start_stage!r}; the stages are {names}")
    if start_stage != names[0] and init_dir is None:
        raise ValueError(f"starting at {start_stage} needs init_dir (the export of "
                         f"{names[names.index(start_stage) - 1]})")
    hf_config = hf_config or specs.demo_config_dict(model)
    tokenizer = specs.build_demo_tokenizer(hf_config["vocab_size"], tc.seed, domains=domains)
    specs.check_tokenizer(tokenizer, hf_config)
    src_train, src_eval = corpus.sources("train", domains), corpus.sources("eval", domains)
    cfg = from_hf_dict(hf_config)
    params, logs = None, {}
    if start_stage != names[0]:
        if ck.load_tokenizer(init_dir).to_str() != tokenizer.to_str():
            raise RuntimeError(f"{init_dir} was trained with another tokenizer")
        _, loaded, _ = ck.load_model_dir(init_dir, "float32")
        params = jax.tree_util.tree_map(jnp.asarray, loaded)
        logs = _stage_logs(init_dir, names[:names.index(start_stage)])
    for stage in plan[names.index(start_stage):]:
        params, logs[stage.name] = run_stage(stage, hf_config, tc, tokenizer, src_train,
                                             src_eval, params, progress)
        if stage_dir is not None:
            export = os.path.join(stage_dir, stage.name)
            save_model_dir(export, params, hf_config, tokenizer, spec.notice)
            with open(os.path.join(export, "train_log.json"), "w", encoding="utf-8") as fh:
                json.dump({**logs, "train_config": dataclasses.asdict(tc),
                           "corpus": {"domains": list(domains)}}, fh, indent=1)
    save_model_dir(out_dir, params, hf_config, tokenizer, spec.notice)
    last = logs[names[-1]]
    log = {"model_name": model, "train_config": dataclasses.asdict(tc), "model": hf_config,
           "parameters": int(sum(np.size(a) for a in jax.tree_util.tree_leaves(params))),
           "routed_experts_active": f"{cfg.num_experts_per_tok} of {cfg.num_experts}",
           "init": {"seed": tc.seed,
                    "bf16_sha256": params_digest(init_params(cfg, tc.seed), cfg)},
           "corpus": corpus.corpus_fingerprint(domains),
           "mixture": {stage.name: stage.mixture for stage in plan},
           "stages": {stage.name: {"steps": stage.steps, "peak_lr": stage.peak_lr,
                                   "warmup_steps": stage.warmup_steps,
                                   "answer_weight": stage.answer_weight,
                                   "stream_seed": tc.seed + stage.stream_offset,
                                   "tokens_seen": stage.steps * tc.batch_rows * tc.seq_len,
                                   "train_seconds": logs[stage.name]["train_seconds"]}
                      for stage in plan},
           "platform": {"python": platform.python_version(), "jax": jax.__version__,
                        "machine": platform.machine(), "device": jax.devices()[0].device_kind,
                        "cpu_count": os.cpu_count()},
           "stage1": {k: v for k, v in logs["stage1"].items()
                      if k in STAGE_LOG_KEYS or k.startswith("expert")},
           **{name: {k: v for k, v in logs[name].items() if k in STAGE_LOG_KEYS}
              for name in names[1:]},
           "train_seconds": round(sum(logs[name]["train_seconds"] for name in names), 1),
           "tokens_seen": sum(stage.steps for stage in plan) * tc.batch_rows * tc.seq_len,
           "final_train_loss": last["final_train_loss"],
           "held_out_loss_stage1_mixture": logs["stage1"]["held_out_loss"],
           "held_out_loss_stage2_mixture": logs["stage2"]["held_out_loss"],
           "held_out_loss": last["held_out_loss"],
           "expert_usage_by_domain": last["expert_usage_by_domain"],
           "expert_usage_summary": last["expert_usage_summary"]}
    with open(os.path.join(out_dir, "train_log.json"), "w", encoding="utf-8") as fh:
        json.dump(log, fh, indent=1)
        fh.write("\n")
    return log


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moejax.demo.train", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output model directory")
    ap.add_argument("--model", default="demo", choices=sorted(TRAIN_DEFAULTS),
                    help="which built-in model to train (its shape, corpus and defaults)")
    ap.add_argument("--start-stage", default="stage1",
                    help="first stage to train (stage1 ... stage6; demo-e32 also has stage7 "
                         "and stage8); later ones need --init-dir")
    ap.add_argument("--init-dir", default=None,
                    help="the export of the stage before --start-stage (weights and train_log.json)")
    ap.add_argument("--stage-dir", default=None,
                    help="export every stage here as it ends (resume with --init-dir DIR/stageN)")
    for field in dataclasses.fields(TrainConfig):
        kind = type(getattr(TrainConfig(), field.name))
        ap.add_argument("--" + field.name.replace("_", "-"), type=kind, default=None,
                        help=f"default: the model's ({field.name} of TRAIN_DEFAULTS)")
    args = ap.parse_args(argv)
    defaults = TRAIN_DEFAULTS[args.model]
    tc = TrainConfig(**{f.name: (getattr(args, f.name) if getattr(args, f.name) is not None
                                 else getattr(defaults, f.name))
                        for f in dataclasses.fields(TrainConfig)})
    log = run(args.out, tc, init_dir=args.init_dir, start_stage=args.start_stage,
              model=args.model, stage_dir=args.stage_dir)
    print(f"done in {log['train_seconds']} s: train loss {log['final_train_loss']}, "
          f"held-out loss {log['held_out_loss']}; wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
