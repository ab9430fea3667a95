"""Speculative expert prefetch on demo-e32 and its untrained twin (issue 18).

Inputs: the reference traces of ``benchmarks/expert_traces.py`` (``--traces DIR``,
written there when missing; ``--quick`` writes small ones to a temporary folder). Every
4th request is held out (``moejax.prefetch.train.split_requests``); the default vectors
and the estimator are fitted on the others, and every figure below is measured on the
held-out ones.

Per model (the twin's keys end in ``_twin``):

* ``recall_<p>``: recall@k of predictor p of layer j's top-k from layer j - 1, over the
  held-out decode tokens, averaged over layers j >= 2 (``recall_<p>_layer<j>`` per layer,
  j >= 1). Predictors: router, quasi, estimator, hybrid (``moejax.prefetch.predictors``,
  the code the runtime calls), the floors random, popularity, previous, and oracle (1).
* ``estimator_params``, ``estimator_training_tokens``, ``estimator_train_seconds``,
  ``hybrid_layers``, ``defaults_bytes``.

Trained model only (the twin has no task skill to keep):

* ``accuracy_<mode>_<p>``: held-out task accuracy through generation (the demo corpus's
  domain, yes/no, true/false and multiple-choice items, eval split), exact mode
  (= resident) and each speculative predictor. The demo's answers are one token, which
  prefill alone would produce; so each prompt's last two tokens (the cue, " Answer:" or
  "false?") are cut, and an item is right when the greedy tokens regenerate the cue and
  then start with the labelled answer (the answer comes from the second decode step).
  ``accuracy_whole_prompt``: the usual reading (whole prompt, the first token).
* ``token_agreement_<p>``: greedy tokens of speculative decode equal to exact decode's,
  over ``--new-tokens`` continuations of held-out prompts, and
  ``tokens_before_divergence_<p>``: how many come before the first difference;
  ``exact_equals_resident`` (1: exact prefetch gave resident decode's tokens everywhere).
* At batch 1 (the seed's regime), on the same held-out continuations:
  ``bytes_per_token_<config>`` (expert bytes copied per decode token) and ``tpot_<config>``
  (measured here, ms; on CPU host and device memory are one, so this shows overheads only)
  for ondemand (copy after routing), layer_window (every expert of the next layer),
  exact_<p>, speculative_<p> and oracle.
* Modelled H100 TPOT (Qwen3-30B-A3B-shaped experts, k = 8, the demo's per-layer recall):
  copy time per expert from the H2D rate in docs/PERF.md (22.7 ms per 1.2 GB layer),
  compute per layer = the measured per-active-expert time of the H100 cost file x k
  (``--compute-model expert``; ``layer`` adds its per-layer fixed term), overlap per the
  seed's Eq. 1 (a prefetch hides min(t_copy, t_compute) of the previous layer; exact mode
  then copies its misses). ``tpot_prefetch_over_ondemand_modelled`` is speculative decode
  with the estimator (the seed's Est-PF) over on-demand; ``tpot_<config>_modelled_ms``.

    python -m benchmarks.expert_prefetch [--quick] [--json PATH] [--traces DIR]
        [--steps N] [--new-tokens N] [--items N] [--seed N]
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from benchmarks.lib.cli import bench_parser, parse_args, run_shape
from benchmarks.lib.compiles import timed_pass
from benchmarks.lib.meta import finish_run
from benchmarks.lib.reference_traces import reference_traces
from moejax.asyncmoe import costs
from moejax.model_shape import QWEN3_30B_A3B
from moejax.prefetch import step_model

MODEL = "demo-e32"
FULL = dict(per_domain=64, prompt_tokens=64, trace_new_tokens=32, steps=2000, items=24,
            new_tokens=32, prompts=16)
QUICK = dict(per_domain=2, prompt_tokens=32, trace_new_tokens=8, steps=60, items=2,
             new_tokens=8, prompts=2)
TASKS = ("domain_question", "arithmetic_yes_no", "arithmetic_claim", "multiple_choice")
COMPUTED = ("router", "quasi", "estimator", "hybrid")
FLOORS = ("random", "popularity", "previous")
GPU_COST = Path(costs.H100_FIT_FILE)
# The Qwen3-30B-A3B shape is moejax.model_shape's and the H100's measured host -> device
# rate (22.7 ms per 1.21 GB layer, docs/PERF.md) moejax.asyncmoe.costs': one definition each.
CUE_TOKENS = 2    # prompt tokens cut from each task item (" Answer" ":", "false" "?")


# ----------------------------------------------------------------------------- recall
def decode_recall(cfg: Any, params: Any, fitted: dict[str, Any], decode: Any, seed: int
                  ) -> dict[str, np.ndarray]:
    """Per predictor (the computed ones, the floors and the oracle), recall@k per layer
    [L] over ``decode`` (replayed decode tokens: ``replay.LayerStates``)."""
    from moejax.prefetch import predictors

    hybrid = tuple(int(j) for j in fitted["meta"]["hybrid_layers"].split(",") if j)
    tables = predictors.make_tables(cfg, fitted["defaults"].defaults, fitted["params"], hybrid)
    per_layer: dict[str, np.ndarray] = {}
    for kind in COMPUTED:
        predicted = predictors.predict_states(kind, cfg, params["layers"], tables,
                                              decode.residual, decode.experts, decode.weights)
        per_layer[kind] = predictors.recall_at_k(predicted, decode.experts)
    for kind in FLOORS:
        predicted = predictors.floor_predictions(kind, decode.experts, decode.request,
                                                 fitted["defaults"].counts, seed)
        per_layer[kind] = predictors.recall_at_k(predicted, decode.experts)
    per_layer["oracle"] = predictors.recall_at_k(decode.experts, decode.experts)
    return per_layer


def checked_replay(cfg: Any, params: Any, requests: list[Any]) -> Any:
    """``requests`` (traced) replayed together -> their tokens' ``replay.LayerStates``,
    held to the trace (the replay must route as the traced run did)."""
    from moejax.prefetch import replay

    states = replay.replay(cfg, params, requests)
    replay.check_against_trace(states, requests)
    return states


def recall_figures(cfg: Any, params: Any, fitted: dict[str, Any], heldout: list[Any],
                   seed: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    states = checked_replay(cfg, params, heldout)
    decode = states.take(states.decode)
    per_layer = decode_recall(cfg, params, fitted, decode, seed)
    out: dict[str, Any] = {"heldout_decode_tokens": decode.num_tokens}
    for kind, values in per_layer.items():
        out[f"recall_{kind}"] = float(np.mean(values[2:]))
        for j in range(1, cfg.num_layers):
            out[f"recall_{kind}_layer{j}"] = float(values[j])
    return out, per_layer


# ----------------------------------------------------------------------------- decode
class Decoding:
    """One model's offload runners, by (prefetch, mode), over one scheduler setup."""

    def __init__(self, cfg: Any, params: Any, files: list[str], batch: int):
        self.cfg, self.params, self.files, self.batch = cfg, params, files, batch
        self.runners: dict[tuple[str, str], Any] = {}

    def runner(self, prefetch: str, mode: str) -> Any:
        from moejax.decode.programs import StepOptions
        from moejax.decode.factory import make_runner

        key = (prefetch, mode)
        if key not in self.runners:
            self.runners[key] = make_runner("offload", self.cfg, self.params, dtype="float32",
                                            opts=StepOptions(), prefetch=prefetch,
                                            prefetch_mode=mode, prefetch_files=self.files)
        return self.runners[key]

    def generate(self, prefetch: str, mode: str, prompts: list[list[int]], new_tokens: int,
                 batch: int | None = None, timed: str | None = None
                 ) -> tuple[list[list[int]], Any, float]:
        """Greedy tokens of every prompt, the runner's stats, decode ms per token (a
        counted timed pass named ``timed`` when given)."""
        from moejax.sequences import SequenceSpec
        from moejax.core.continuous import Scheduler, SchedulerOptions

        runner = self.runner(prefetch, mode)
        options = SchedulerOptions(max_batch_size=batch or self.batch, max_prefill_tokens=256,
                                   step="layerwise", record_steps=True)
        scheduler = Scheduler(runner, 64 * (batch or self.batch), options)
        runner.reset_stats()
        seqs = [scheduler.submit(SequenceSpec(prompt=tuple(p), max_new_tokens=new_tokens)) for p in prompts]
        with timed_pass(timed) if timed else contextlib.nullcontext():
            scheduler.run_until_idle()
        decode = [r for r in scheduler.step_records
                  if r.prefill_sequences == 0 and r.decode_sequences > 0]
        ms = 1000 * sum(r.seconds for r in decode) / max(
            sum(r.decode_sequences for r in decode), 1)
        return [list(s.output.token_ids) for s in seqs], runner.stats, ms


def task_items(count: int, seed: int) -> list[Any]:
    from moejax.demo import corpus

    src = corpus.sources("eval", corpus.DOMAINS_E32)
    return [item for i, task in enumerate(TASKS)
            for item in corpus.task_items(src, task, count, seed + 1000 + i)]


def accuracy(tokens: list[list[int]], items: list[Any], cues: list[list[int]],
             tokenizer: Any) -> float:
    """Items whose greedy tokens regenerate the cut cue, then start with the answer."""
    right = [ids[:len(cue)] == cue and tokenizer.decode(ids[len(cue):]).startswith(item.answer)
             for ids, item, cue in zip(tokens, items, cues)]
    return float(np.mean(right))


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """The fraction of positions where the tokens equal the reference's."""
    return float(np.mean([np.mean(np.asarray(a) == np.asarray(b))
                          for a, b in zip(tokens, reference)]))


def common_prefix(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """The mean number of leading tokens equal to the reference's (greedy decode diverges
    for good after one different token, so this is where speculation first changed one)."""
    lengths = []
    for a, b in zip(tokens, reference):
        same = np.asarray(a[:len(b)]) == np.asarray(b[:len(a)])
        lengths.append(len(same) if same.all() else int(np.argmin(same)))
    return float(np.mean(lengths))


def decode_figures(dec: Decoding, tokenizer: Any, prompts: list[list[int]],
                   shape: dict[str, Any], seed: int) -> dict[str, Any]:
    """Accuracy, token agreement, bytes and TPOT (trained model)."""
    out: dict[str, Any] = {}
    items = task_items(shape["items"], seed)
    full = [tokenizer.encode(item.prompt, add_special_tokens=False).ids for item in items]
    # The demo's answers are one token: the prompt's last CUE_TOKENS tokens are cut, so the
    # answer comes from a decode step (with the whole prompt prefill alone would give it).
    item_prompts = [ids[:-CUE_TOKENS] for ids in full]
    cues = [ids[-CUE_TOKENS:] for ids in full]
    answer_tokens = CUE_TOKENS + max(len(tokenizer.encode(item.answer, add_special_tokens=False).ids)
                                     for item in items)
    resident = resident_tokens(dec, item_prompts + prompts, answer_tokens, shape["new_tokens"],
                               len(item_prompts))
    exact_items, _, _ = dec.generate("quasi", "exact", item_prompts, answer_tokens)
    out["accuracy_exact"] = accuracy(exact_items, items, cues, tokenizer)
    out["accuracy_resident"] = accuracy(resident[0], items, cues, tokenizer)
    same = exact_items == resident[0]
    for kind in COMPUTED:
        spec_items, _, _ = dec.generate(kind, "speculative", item_prompts, answer_tokens)
        out[f"accuracy_speculative_{kind}"] = accuracy(spec_items, items, cues, tokenizer)
    whole, _, _ = dec.generate("none", "exact", full, 1)
    out["accuracy_whole_prompt"] = accuracy(whole, items, [[] for _ in items], tokenizer)
    out["accuracy_items"] = len(items)
    # Batch 1: bytes and time per decode token, and agreement with exact decode.
    configs = [("ondemand", "none", "exact"), ("layer_window", "layer", "exact")]
    configs += [(f"exact_{k}", k, "exact") for k in COMPUTED]
    configs += [(f"speculative_{k}", k, "speculative") for k in COMPUTED]
    configs += [("oracle", "oracle", "exact")]
    for name, prefetch, mode in configs:
        dec.generate(prefetch, mode, prompts[:1], 2, batch=1)     # compile outside the clock
        tokens, stats, ms = dec.generate(prefetch, mode, prompts, shape["new_tokens"], batch=1,
                                         timed=f"tpot_{name}")
        if mode == "exact":
            same = same and tokens == resident[1]
        else:
            out[f"token_agreement_{prefetch}"] = agreement(tokens, resident[1])
            out[f"tokens_before_divergence_{prefetch}"] = common_prefix(tokens, resident[1])
        runner = dec.runner(prefetch, mode)
        figures = stats.as_dict(runner.expert_bytes)
        out[f"bytes_per_token_{name}"] = figures["bytes_per_token"]
        out[f"tpot_{name}"] = ms
    out["exact_equals_resident"] = int(same)
    out["expert_bytes"] = dec.runner("none", "exact").expert_bytes
    return out


def resident_tokens(dec: Decoding, prompts: list[list[int]], answer_tokens: int,
                    new_tokens: int, num_items: int) -> tuple[list[list[int]], list[list[int]]]:
    """Resident (experts on the device) greedy tokens: the reference of exact mode."""
    from moejax.decode.programs import StepOptions
    from moejax.decode.factory import make_runner
    from moejax.sequences import SequenceSpec
    from moejax.core.continuous import Scheduler, SchedulerOptions

    runner = make_runner("resident", dec.cfg, dec.params, dtype="float32", opts=StepOptions())
    out = []
    for group, count, batch in ((prompts[:num_items], answer_tokens, dec.batch),
                                (prompts[num_items:], new_tokens, 1)):
        scheduler = Scheduler(runner, 64 * batch, SchedulerOptions(
            max_batch_size=batch, max_prefill_tokens=256, step="fused"))
        seqs = [scheduler.submit(SequenceSpec(prompt=tuple(p), max_new_tokens=count)) for p in group]
        scheduler.run_until_idle()
        out.append([list(s.output.token_ids) for s in seqs])
    return out[0], out[1]


# ----------------------------------------------------------------------------- modelled
def h100_compute_per_layer(path: Path, compute_model: str) -> float:
    """Seconds of one Qwen3-30B-shaped layer at batch 1 (k = 8 active experts) from the
    H100 cost file's batch-8 fit: a_s per active expert (+ t0_s per layer with
    ``compute_model="layer"``)."""
    cost = step_model.expert_cost_from_file(path, batch=1, compute_model=compute_model)
    return cost.layer_seconds(QWEN3_30B_A3B.top_k)


def modelled_tpot(recall: dict[str, np.ndarray], num_layers: int, compute: float
                  ) -> dict[str, float]:
    """Modelled TPOT (ms) per config, the seed's Eq. 1 overlap (module docstring)."""
    shape = QWEN3_30B_A3B
    copy = shape.top_k * shape.expert_bytes / costs.H100_H2D_BPS
    spill = max(0.0, copy - compute)    # the part of a prefetch the previous layer cannot hide

    def total(recall_per_layer: np.ndarray | None, exact: bool) -> float:
        seconds = compute + copy                                   # layer 0: on demand
        for j in range(1, num_layers):
            if recall_per_layer is None:
                seconds += compute + copy
            else:
                misses = (1.0 - recall_per_layer[j]) * copy if exact else 0.0
                seconds += compute + spill + misses
        return 1000 * seconds

    out = {"ondemand": total(None, True), "oracle": total(recall["oracle"], True)}
    for kind in COMPUTED:
        out[f"exact_{kind}"] = total(recall[kind], True)
        out[f"speculative_{kind}"] = total(recall[kind], False)
    out["copy_ms_per_layer"] = 1000 * copy
    out["compute_ms_per_layer"] = 1000 * compute
    return out


# ----------------------------------------------------------------------------- driver
def fit_and_save(cfg: Any, params: Any, requests: list[Any], *, model: str, steps: int,
                 seed: int, files: Sequence[str]) -> dict[str, Any]:
    """The default vectors and estimator trained on ``requests`` of ``model``
    (``train.train_estimator``), saved to ``files`` (defaults, estimator) for the runners
    that load them -> the fitted dict."""
    from moejax.prefetch import defaults, estimator, train

    fitted = train.train_estimator(cfg, params, requests, model=model, steps=steps, seed=seed)
    defaults.save(files[0], fitted["defaults"])
    estimator.save(files[1], fitted["config"], fitted["params"], fitted["meta"])
    return fitted


def run_model(suffix: str, trace: Any, shape: dict[str, Any], tmp: str, args: Any
              ) -> dict[str, Any]:
    from moejax.prefetch import train

    name = MODEL if not suffix else f"{MODEL}-init"
    cfg, params = train.load_model(name)
    training, heldout = train.split_requests(trace.requests)
    files = [os.path.join(tmp, f"defaults{suffix}.npz"), os.path.join(tmp, f"est{suffix}.npz")]
    fitted = fit_and_save(cfg, params, training, model=name, steps=shape["steps"],
                          seed=args.seed, files=files)
    meta = fitted["meta"]
    out: dict[str, Any] = {"estimator_params": meta["param_count"],
                           "estimator_training_tokens": meta["training_tokens"],
                           "estimator_train_rows": meta["train_rows"],
                           "estimator_train_seconds": meta["train_seconds"],
                           "hybrid_layers": meta["hybrid_layers"],
                           "hybrid_threshold": meta["hybrid_threshold"],
                           "defaults_bytes": os.path.getsize(files[0]),
                           "train_requests": len(training), "heldout_requests": len(heldout)}
    recall, per_layer = recall_figures(cfg, params, fitted, heldout, args.seed)
    out.update(recall)
    modelled = modelled_tpot(per_layer, cfg.num_layers,
                             h100_compute_per_layer(GPU_COST, args.compute_model))
    for key, value in modelled.items():
        out[f"tpot_{key}_modelled_ms" if not key.endswith("_per_layer") else f"h100_{key}"] = value
    out["tpot_prefetch_over_ondemand_modelled"] = (modelled["speculative_estimator"]
                                                   / modelled["ondemand"])
    out["tpot_exact_prefetch_over_ondemand_modelled"] = (modelled["exact_estimator"]
                                                         / modelled["ondemand"])
    out["tpot_bound_over_ondemand_modelled"] = modelled["oracle"] / modelled["ondemand"]
    if not suffix:
        from moejax import checkpoint
        from serving.api import resolve_model_dir

        tokenizer = checkpoint.load_model_dir(resolve_model_dir(name)[0], "float32")[2]
        prompts = [list(map(int, r.prompt_token_ids)) for r in heldout[:shape["prompts"]]]
        out.update(decode_figures(Decoding(cfg, params, files, batch=8), tokenizer, prompts,
                                  shape, args.seed))
    return out


def report(figures: dict[str, Any], num_layers: int) -> None:
    kinds = (*COMPUTED, *FLOORS, "oracle")
    for suffix, label in (("", MODEL), ("_twin", f"{MODEL}-init (twin)")):
        print(f"\n{label}: recall@k per layer (held-out decode tokens; mean over layers >= 2)")
        for kind in kinds:
            layers = " ".join(f"{figures[f'recall_{kind}_layer{j}{suffix}']:.3f}"
                              for j in range(1, num_layers))
            print(f"  {kind:<11} {layers}   mean {figures[f'recall_{kind}{suffix}']:.3f}")
    print(f"\naccuracy through generation ({figures['accuracy_items']} items, cue cut; whole "
          f"prompt {figures['accuracy_whole_prompt']:.3f}): exact "
          f"{figures['accuracy_exact']:.3f} (resident {figures['accuracy_resident']:.3f}); "
          + ", ".join(f"speculative {k} {figures[f'accuracy_speculative_{k}']:.3f}"
                      for k in COMPUTED))
    print("token agreement with exact decode (tokens before the first difference): "
          + ", ".join(f"{k} {figures[f'token_agreement_{k}']:.3f} "
                      f"({figures[f'tokens_before_divergence_{k}']:.1f})" for k in COMPUTED))
    print("batch 1: expert KiB copied per token / TPOT ms here (CPU):")
    for name in ("ondemand", "layer_window", *(f"exact_{k}" for k in COMPUTED),
                 *(f"speculative_{k}" for k in COMPUTED), "oracle"):
        print(f"  {name:<22} {figures[f'bytes_per_token_{name}'] / 1024:9.1f} KiB "
              f"{figures[f'tpot_{name}']:7.2f} ms")
    print(f"modelled H100 TPOT over on-demand: speculative estimator "
          f"{figures['tpot_prefetch_over_ondemand_modelled']:.3f} (twin "
          f"{figures['tpot_prefetch_over_ondemand_modelled_twin']:.3f}), exact estimator "
          f"{figures['tpot_exact_prefetch_over_ondemand_modelled']:.3f}, bound "
          f"{figures['tpot_bound_over_ondemand_modelled']:.3f} (seed: 0.86-0.91 on PCIe 4)")
    print(f"exact mode equals resident: {bool(figures['exact_equals_resident'])}; "
          f"estimator {figures['estimator_params']} params, "
          f"{figures['estimator_training_tokens']} training rows seen, "
          f"{figures['estimator_train_seconds']:.1f} s; {figures['seconds']:.0f} s")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, quick_help="small traces (2 requests per domain), 60 "
                          "training steps, 2 items per task, 8-token continuations",
                          traces=True)
    parser.add_argument("--steps", type=int, help="estimator training steps (default 2000)")
    parser.add_argument("--items", type=int, help="accuracy items per task (default 24)")
    parser.add_argument("--new-tokens", type=int, help="continuation length (default 32)")
    parser.add_argument("--compute-model", choices=("expert", "layer"), default="expert",
                        help="modelled H100 compute per layer: k x the per-expert time "
                             "(default) or plus the cost file's per-layer term")
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(parser, argv)
    shape = run_shape(args, QUICK, FULL, ("steps", "items", "new_tokens"))
    started = time.perf_counter()
    figures: dict[str, Any] = {"model": MODEL, "compute_model": args.compute_model,
                               "quick": int(args.quick), **{f"shape_{k}": v
                                                            for k, v in shape.items()}}
    with tempfile.TemporaryDirectory(prefix="moejax-prefetch-") as tmp:
        traces = reference_traces(MODEL, tmp if args.quick else args.traces, shape, args.seed,
                                  new_tokens_key="trace_new_tokens")
        for suffix, trace in traces.items():
            for key, value in run_model(suffix, trace, shape, tmp, args).items():
                figures[f"{key}{suffix}"] = value
    figures["seconds"] = time.perf_counter() - started
    report(figures, traces[""].num_layers)
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
