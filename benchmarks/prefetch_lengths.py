"""Expert prefetch against prompt length, 1K-64K: the seed's own operating points (issue 44).

The seed (speculating-experts-prefetch) measures TPOT at batch 1 over prompts of 1K, 4K,
16K and 64K tokens: a longer context reads more KV in every layer's attention, so the
next layer's expert copy hides under more compute. Here, per length:

* Recall, measured on demo-e32 (or its untrained twin, ``--model demo-e32-init``;
  max_context 2048) at the same fractions of its context: 1K, 4K, 16K, 64K -> 1/64, 1/16,
  1/4 and 1 of it (32, 128, 512, 2048 tokens). Each request runs ``context`` tokens: a
  prompt of ``context - new_tokens`` held-out corpus tokens (domains in turn), then
  ``new_tokens`` greedy tokens (EOS ignored; ``serving.Generator`` with expert tracing),
  so its decode steps attend to up to ``context - 1`` tokens and the last point fills the
  demo's whole context (the generator runs one request at a time, prefilling 64 tokens a
  step: two step shapes whatever the length). The demo was trained on 128-token rows
  (``moejax.demo.train.TrainConfig.seq_len``): the longer points ask it to route at
  positions it never trained at, as a long prompt asks of a deployed model. The
  predictors (router, quasi, estimator, hybrid: ``moejax.prefetch.predictors``) are
  fitted as ``benchmarks/expert_prefetch.py`` fits them
  (``moejax.prefetch.train.train_estimator``: default vectors and estimator), once, on
  other requests of 128 tokens (the demo's training length), and measured on the decode
  tokens of every length (``recall_<p>_<len>``: recall@k averaged over the predicted
  layers 1..L-1; floors random, popularity, previous too). The four lengths' requests are
  replayed together (``moejax.prefetch.replay``: packed into attention blocks of the
  longest's size, so one compiled program) and held to their traces. ``best_predictor``:
  the computed predictor of the highest recall averaged over the four lengths;
  ``recall_best_<len>`` its recall.
* The step model (``moejax.prefetch.step_model``) at Qwen3-30B-A3B shape on the H100 at
  the seed's context (1024 ... 65536 tokens), ``--batch`` (default 1), the best
  predictor's measured recall at that length: per mode (ondemand, exact, speculative)
  ``copy_exposed_ms_<len>_<mode>``, ``copy_hidden_ms_...``, ``attention_ms_...``,
  ``expert_ms_...``, ``total_ms_...`` (= ``tpot_ms_<len>_<mode>_modelled``), and
  ``prefetch_tpot_over_ondemand_<len>_modelled`` (exact / on-demand) and
  ``..._modelled_speculative``.
* ``--measure``: measured TPOT (ms) of the offload decode runners on demo-e32 at batch 1
  at the shortest and longest demo contexts (``measured_tpot_ms_<len>_<config>``:
  ``ondemand`` = ``OffloadRunner``, ``exact`` / ``speculative`` = ``PrefetchRunner``
  with the best predictor) and their ratios; ``measured_platform`` names where it ran
  (on CPU host and device memory are one, so the figures show overheads, not copies).
  Both lengths decode on one KV pool sized for the longest.

``--quick`` (under a minute on a 2-core CPU) shrinks only the sample, not the points: the
same four lengths and contexts, the same predictors and step model, but 1 fitting request
per domain (8, not 128), 2 requests per length (not 16), 8 new tokens (not 16: 7 decode
tokens per request), 60 estimator training steps (not 2000) and, with ``--measure``, 1
prompt per length (not 2). Its recall figures rest on 14 decode tokens per length, so
they are noisy (a smoke run, not a result); the full run's are the figures to quote.

    python -m benchmarks.prefetch_lengths [--quick] [--json PATH] [--batch N]
        [--requests N] [--new-tokens N] [--steps N] [--compute-model expert|layer]
        [--measure] [--seed N]
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from benchmarks.expert_prefetch import (COMPUTED, GPU_COST, MODEL, checked_replay,
                                        decode_recall, fit_and_save)
from benchmarks.lib.cli import bench_parser, parse_args, run_shape
from benchmarks.lib.compiles import timed_pass
from benchmarks.lib.meta import finish_run
from moejax.model_shape import QWEN3_30B_A3B
from moejax.prefetch import step_model

# The seed's prompt lengths (its Section 5.1.1), by the names the keys carry.
LENGTHS = {"1k": 1024, "4k": 4096, "16k": 16384, "64k": 65536}
BREAKDOWN = ("copy_exposed_ms", "copy_hidden_ms", "attention_ms", "expert_ms", "total_ms")
FULL = dict(fit_per_domain=16, requests=16, new_tokens=16, steps=2000, measure_prompts=2)
QUICK = dict(fit_per_domain=1, requests=2, new_tokens=8, steps=60, measure_prompts=1)
# The traces are generated one request at a time, host-driven layer by layer, prefilled
# in 64-token steps: every step is then one of two shapes (a 64-token prefill chunk or one
# decode token) whatever the prompt's length, and each shape compiles a few small
# per-layer programs. Batching requests of four lengths compiled a fused step per batch
# and prefill size met (six in the quick run, most of its time); the greedy tokens and
# their routing are the model's either way (``replay.check_against_trace`` holds the
# replay to them).
GENERATE_OPTIONS = dict(max_batch_size=1, step="layerwise", max_prefill_tokens=64)
KV_BLOCK_TOKENS = 16     # the paged KV pool's block (``GeneratorOptions``)
# --measure prefills in 64-token steps too: both lengths' prompts then run the same
# prefill program (the prefill is not timed; only decode steps are).
MEASURE_PREFILL_TOKENS = 64


def demo_contexts(max_context: int, new_tokens: int) -> dict[str, int]:
    """The demo's context per length: the same fraction of ``max_context`` as the length
    is of 64K. Raises ValueError when the model's context is too short for four distinct
    contexts that each hold a prompt token and ``new_tokens`` generated ones. (Any
    length replays: ``replay.replay_block`` picks an attention block that holds it.)"""
    longest = LENGTHS["64k"]
    contexts = {tag: max_context * tokens // longest for tag, tokens in LENGTHS.items()}
    short = [tag for tag, c in contexts.items() if c <= new_tokens]
    if short:
        raise ValueError(f"max_context={max_context} is too short: the {short} points get "
                         f"contexts {[contexts[t] for t in short]}, no room for a prompt and "
                         f"{new_tokens} new tokens (at least {longest // 1024 * (new_tokens + 1)}"
                         f" context tokens are needed)")
    return contexts


# ----------------------------------------------------------------------------- traces
class Tracer:
    """Greedy decode with expert tracing on one ``serving.Generator``, prompts of the
    demo corpus's held-out texts."""

    def __init__(self, model: str):
        from moejax.demo import corpus
        from serving import Generator
        from serving.api import resolve_model_dir
        from serving.requests import TokenizerAdapter

        from benchmarks.lib.reference_traces import model_domains

        model_dir, _ = resolve_model_dir(model)
        self.model = model
        self.domains = model_domains(model, model_dir)
        self.tokenizer = TokenizerAdapter.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.source = corpus.sources("eval", tuple(self.domains))
        self.generator = Generator(model, dtype="float32", trace_experts=True,
                                   **GENERATE_OPTIONS)

    def prompts(self, count: int, length: int, seed: int) -> list[list[int]]:
        """``count`` prompts of exactly ``length`` tokens, request i from domain i mod D."""
        from benchmarks.lib.reference_traces import domain_prompts

        rng = np.random.default_rng(seed)
        return [domain_prompts(self.source, self.tokenizer, self.domains[i % len(self.domains)],
                               1, length, rng)[0] for i in range(count)]

    def trace_sets(self, sets: list[list[list[int]]], new_tokens: int) -> list[Any]:
        """One ``moejax.traces.Trace`` per set of prompts, ``new_tokens`` greedy tokens each
        (every set in one generate call)."""
        from moejax import traces

        prompts = [p for group in sets for p in group]
        requests = [{"id": i, "prompt_token_ids": p, "max_new_tokens": new_tokens,
                     "stop_token_ids": []} for i, p in enumerate(prompts)]
        results = self.generator.generate(requests)
        failed = [r for r in results if r.error is not None]
        if failed:
            raise RuntimeError(f"request {failed[0].id}: {failed[0].error}")
        out, start = [], 0
        for group in sets:
            out.append(traces.from_results(results[start:start + len(group)], group,
                                           [None] * len(group), config=self.generator.config,
                                           router_inputs=False, model=self.model))
            start += len(group)
        return out


# ----------------------------------------------------------------------------- recall
def mean_recall(per_layer: dict[str, np.ndarray]) -> dict[str, float]:
    """Each predictor's recall@k averaged over the predicted layers 1..L-1."""
    return {kind: float(np.mean(values[1:])) for kind, values in per_layer.items()}


def replay_lengths(cfg: Any, params: Any, traces: list[Any]) -> list[Any]:
    """Every length's requests replayed together (one attention block, the longest's, so
    one compiled program for all lengths), held to their traces -> each length's decode
    tokens' ``replay.LayerStates``, in the order of ``traces``."""
    requests = [req for trace in traces for req in trace.requests]
    states = checked_replay(cfg, params, requests)
    out, start = [], 0
    for trace in traces:
        end = start + len(trace.requests)
        out.append(states.take(states.decode & (states.request >= start)
                               & (states.request < end)))
        start = end
    return out


def best_predictor(recall: dict[str, dict[str, float]]) -> str:
    """The computed predictor of the highest recall averaged over the lengths."""
    return max(COMPUTED, key=lambda kind: np.mean([recall[tag][kind] for tag in recall]))


# ----------------------------------------------------------------------------- modelled
def modelled_figures(recall: dict[str, float], batch: int, compute_model: str
                     ) -> dict[str, float]:
    """Per length: every mode's step breakdown and TPOT at the given recall."""
    cost = step_model.expert_cost_from_file(GPU_COST, batch, compute_model)
    out: dict[str, float] = {}
    for tag, context in LENGTHS.items():
        steps = step_model.step_breakdowns(QWEN3_30B_A3B, step_model.H100, cost,
                                           context, recall[tag], batch)
        for mode, step in steps.items():
            for name, value in step.as_ms().items():
                out[f"{name}_{tag}_{mode}"] = value
            out[f"tpot_ms_{tag}_{mode}_modelled"] = 1000 * step.total_s
        ondemand = steps["ondemand"].total_s
        out[f"prefetch_tpot_over_ondemand_{tag}_modelled"] = steps["exact"].total_s / ondemand
        out[f"prefetch_tpot_over_ondemand_{tag}_modelled_speculative"] = (
            steps["speculative"].total_s / ondemand)
    return out


# ----------------------------------------------------------------------------- measured
def decode_ms(runner: Any, prompts: list[list[int]], context: int, new_tokens: int,
              timed: str | None) -> float:
    """Greedy decode of ``prompts`` one at a time (batch 1), a KV pool of one
    ``context``-token sequence: ms per decode token."""
    from moejax.core.continuous import Scheduler, SchedulerOptions
    from moejax.sequences import SequenceSpec

    options = SchedulerOptions(max_batch_size=1, max_prefill_tokens=MEASURE_PREFILL_TOKENS,
                               step="layerwise", record_steps=True)
    scheduler = Scheduler(runner, context // KV_BLOCK_TOKENS + 8, options)
    for prompt in prompts:
        scheduler.submit(SequenceSpec(prompt=tuple(prompt), max_new_tokens=new_tokens))
    with timed_pass(timed) if timed else contextlib.nullcontext():
        scheduler.run_until_idle()
    decode = [r for r in scheduler.step_records
              if r.prefill_sequences == 0 and r.decode_sequences > 0]
    return 1000 * sum(r.seconds for r in decode) / max(
        sum(r.decode_sequences for r in decode), 1)


def measured_figures(cfg: Any, params: Any, files: list[str], predictor: str,
                     prompts: dict[str, list[list[int]]], contexts: dict[str, int],
                     new_tokens: int) -> dict[str, Any]:
    """TPOT of OffloadRunner and PrefetchRunner (exact, speculative) at each given length.
    Every length runs on one KV pool, the longest's (as one server's would): the step
    programs then compile once per runner, not once per length (a compile in a timed pass
    is counted in ``compiles_in_timed_passes``)."""
    import jax

    from moejax.decode.factory import make_runner
    from moejax.decode.programs import StepOptions

    configs = {"ondemand": {}, "exact": dict(prefetch=predictor, prefetch_mode="exact"),
               "speculative": dict(prefetch=predictor, prefetch_mode="speculative")}
    out: dict[str, Any] = {"measured_platform": jax.default_backend(),
                           "measured_predictor": predictor}
    pool_context = max(contexts[tag] for tag in prompts)
    shortest = min(prompts, key=contexts.__getitem__)
    for name, options in configs.items():
        extra = dict(options, prefetch_files=files) if options else {}
        runner = make_runner("offload", cfg, params, dtype="float32", opts=StepOptions(),
                             **extra)
        # One untimed pass compiles every program the timed ones run (one pool, 64-token
        # prefill steps, batch-1 decode: the same shapes at every length).
        decode_ms(runner, prompts[shortest][:1], pool_context, 2, None)
        for tag, group in prompts.items():
            out[f"measured_tpot_ms_{tag}_{name}"] = decode_ms(
                runner, group, pool_context, new_tokens, f"measured_{tag}_{name}")
    for tag in prompts:
        out[f"measured_demo_context_{tag}"] = contexts[tag]
        for mode in ("exact", "speculative"):
            out[f"measured_prefetch_tpot_over_ondemand_{tag}_{mode}"] = (
                out[f"measured_tpot_ms_{tag}_{mode}"] / out[f"measured_tpot_ms_{tag}_ondemand"])
    return out


# ----------------------------------------------------------------------------- driver
def fit_predictors(cfg: Any, params: Any, requests: list[Any], steps: int, seed: int,
                   tmp: str, model: str = MODEL
                   ) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    """Default vectors and estimator fitted on ``requests`` of ``model``, saved for the
    runners -> (fitted, files, figures)."""
    files = [os.path.join(tmp, "defaults.npz"), os.path.join(tmp, "estimator.npz")]
    fitted = fit_and_save(cfg, params, requests, model=model, steps=steps, seed=seed,
                          files=files)
    meta = fitted["meta"]
    figures = {"fit_requests": len(requests), "estimator_params": meta["param_count"],
               "estimator_training_tokens": meta["training_tokens"],
               "estimator_train_seconds": meta["train_seconds"],
               "hybrid_layers": meta["hybrid_layers"]}
    return fitted, files, figures


def run(args: Any, shape: dict[str, Any]) -> dict[str, Any]:
    from moejax.demo.train import TrainConfig
    from moejax.prefetch import train

    cfg, params = train.load_model(args.model)
    contexts = demo_contexts(cfg.max_context, shape["new_tokens"])
    new_tokens = shape["new_tokens"]
    # The predictors are fitted on requests of the demo's training length.
    fit_context = TrainConfig().seq_len
    figures: dict[str, Any] = {"demo_max_context": cfg.max_context, "batch": args.batch,
                               "fit_context": fit_context}
    tracer = Tracer(args.model)
    prompts = {tag: tracer.prompts(shape["requests"], context - new_tokens,
                                   seed=20_000 + 100 * args.seed + i)
               for i, (tag, context) in enumerate(contexts.items())}
    fit_prompts = tracer.prompts(shape["fit_per_domain"] * len(tracer.domains),
                                 fit_context - new_tokens, seed=10_000 + args.seed)
    fit_trace, *length_traces = tracer.trace_sets([fit_prompts, *prompts.values()], new_tokens)
    with tempfile.TemporaryDirectory(prefix="moejax-prefetch-lengths-") as tmp:
        fitted, files, fit = fit_predictors(cfg, params, fit_trace.requests, shape["steps"],
                                            args.seed, tmp, args.model)
        figures.update(fit)
        recall: dict[str, dict[str, float]] = {}
        decodes = replay_lengths(cfg, params, length_traces)
        for (tag, context), decode in zip(contexts.items(), decodes):
            # the four lengths share one replay, so one compiled program
            recall[tag] = mean_recall(decode_recall(cfg, params, fitted, decode, args.seed))
            figures[f"demo_context_{tag}"] = context
            figures[f"demo_prompt_tokens_{tag}"] = context - new_tokens
            figures[f"decode_tokens_{tag}"] = decode.num_tokens
            for kind, value in recall[tag].items():
                figures[f"recall_{kind}_{tag}"] = value
        best = best_predictor(recall)
        figures["best_predictor"] = best
        for tag in LENGTHS:
            figures[f"recall_best_{tag}"] = recall[tag][best]
        figures.update(modelled_figures({tag: recall[tag][best] for tag in LENGTHS},
                                        args.batch, args.compute_model))
        if args.measure:
            ends = {tag: prompts[tag][:shape["measure_prompts"]] for tag in ("1k", "64k")}
            figures.update(measured_figures(cfg, params, files, best, ends, contexts,
                                            new_tokens))
    return figures


def report(figures: dict[str, Any]) -> None:
    print(f"{figures['model']} recall@k (layers 1..L-1) by length; best predictor "
          f"{figures['best_predictor']}:")
    for tag in LENGTHS:
        kinds = " ".join(f"{k} {figures[f'recall_{k}_{tag}']:.3f}"
                         for k in (*COMPUTED, "popularity", "previous"))
        print(f"  {tag:>3} (demo context {figures[f'demo_context_{tag}']:>5}): {kinds}")
    print(f"modelled H100, Qwen3-30B-A3B, batch {figures['batch']}: per step ms "
          f"(copy exposed / hidden / attention / experts / total)")
    for tag in LENGTHS:
        for mode in step_model.MODES:
            row = " / ".join(f"{figures[f'{name}_{tag}_{mode}']:7.2f}" for name in BREAKDOWN)
            print(f"  {tag:>3} {mode:<11} {row}")
        print(f"      exact / on-demand {figures[f'prefetch_tpot_over_ondemand_{tag}_modelled']:.3f}"
              f", speculative / on-demand "
              f"{figures[f'prefetch_tpot_over_ondemand_{tag}_modelled_speculative']:.3f}")
    if "measured_platform" in figures:
        print(f"measured TPOT on {figures['measured_platform'].upper()} (demo-e32, batch 1):")
        for tag in ("1k", "64k"):
            row = ", ".join(f"{m} {figures[f'measured_tpot_ms_{tag}_{m}']:.2f} ms"
                            for m in step_model.MODES)
            print(f"  {tag} (demo context {figures[f'measured_demo_context_{tag}']}): {row}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, quick_help="1 fitting request per domain, 2 requests "
                          "per length, 8 new tokens, 60 estimator training steps")
    parser.add_argument("--batch", type=int, default=1,
                        help="decode batch of the modelled step (default 1, the seed's)")
    parser.add_argument("--requests", type=int, help="requests per length (default 16)")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per request "
                                                       "(default 16)")
    parser.add_argument("--steps", type=int, help="estimator training steps (default 2000)")
    parser.add_argument("--compute-model", choices=step_model.COMPUTE_MODELS, default="expert",
                        help="modelled expert compute per layer: the per-active-expert "
                             "term (default) or plus the cost file's per-layer term")
    parser.add_argument("--measure", action="store_true",
                        help="also time the offload runners at the shortest and longest "
                             "lengths (a GPU run; on CPU the figures are labelled so)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=(MODEL, f"{MODEL}-init"), default=MODEL,
                        help=f"the trained demo ({MODEL}, default) or its untrained twin "
                             f"({MODEL}-init: same shape, initial weights)")
    args = parse_args(parser, argv)
    shape = run_shape(args, QUICK, FULL, ("requests", "new_tokens", "steps"))
    for key in ("requests", "new_tokens", "steps"):
        if shape[key] < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {shape[key]}")
    try:        # the cost file has fits up to some batch: refuse a larger one now
        step_model.expert_cost_from_file(GPU_COST, args.batch, args.compute_model)
    except ValueError as exc:
        parser.error(f"--batch {args.batch}: {exc}")
    started = time.perf_counter()
    figures: dict[str, Any] = {"model": args.model, "compute_model": args.compute_model,
                               "quick": int(args.quick),
                               **{f"shape_{k}": v for k, v in shape.items()}}
    figures.update(run(args, shape))
    figures["seconds"] = time.perf_counter() - started
    report(figures)
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
