"""ELDR — expert-locality-aware routing of decode requests — on ``demo-e32`` and its
untrained twin, in one run (issue 17).

Inputs: the reference traces of ``benchmarks/expert_traces.py`` (``--traces DIR``:
``DIR/demo-e32.npz`` and ``DIR/demo-e32-init.npz``, 64 held-out requests per domain ×
8 domains, 64-token prompts, 32 greedy tokens, router inputs; written there first when
missing; ``--quick`` writes small ones to a temporary folder). Each trace is split by
request: even indices calibrate (IDF, layer selection, K-means), odd ones evaluate
(ρ, the real runs, the simulated arrivals), so no figure is measured on the requests the
fit saw. Every figure comes for the trained model, its untrained twin (``_twin``), and
with signatures shuffled across requests (``_shuffled``: the router is shown another
request's prompt counts — the noise floor).

1. **Signature quality**: ρ = Spearman(cos-dist of signatures, cos-dist of decode
   activation vectors) over ALL pairs of evaluation requests, for Count·IDF over the
   fitted layers (``rho_count_idf``), Count·IDF over every layer, the router's softmax
   probabilities summed over the prompt (from the traces' router inputs and the model's
   router weights), and binary firing.
2. **Real part**: ``serving.Generator(decoders=K)`` with K = 4 decoders on 4 CPU
   devices, each running at most ``--batch`` (8) requests, the evaluation requests (in a
   seeded random order) arriving on one Poisson schedule counted in pool steps (the same
   for every policy; K·load·batch/D̄ per step, D̄ the decode tokens per request, so each
   decoder holds about ``--load`` (0.75) × batch requests): Random, RR, JSQ, P2C, the
   domain oracle, ELDR at τ ∈ {0, 0.1, 1}, and ELDR shown shuffled counts. Measured:
   distinct experts per decoder step (per layer, averaged over steps), the same against
   randomly mixed batches of the same sizes (``same_batch_locality``: 1 − Σ active /
   Σ mixed(batch), which takes out the effect of batch sizes on a per-step average),
   load imbalance (max/mean decode tokens per decoder), tokens/s, the route time of each
   request, and that every policy gave the same tokens.
3. **CPU cost model**: t = t0 + Σ_l (a·active_l + b·batch) fitted by least squares to
   the real part's decode steps (each decoder's step timed alone: the pool steps its
   decoders one after another).
4. **Simulated part** (``moejax.eldr.simulator``: the runtime's own policy objects):
   K = 8, 16, 24 decoders of at most ``--sim-max-batch`` (4 × batch) running requests
   (so batches grow rather than queue: a queue flushed at a step boundary starts its
   requests' decode positions together, and aligned positions share experts, which would
   pass for locality), ``--sim-requests``
   arrivals drawn (with replacement) from the evaluation requests, Poisson at the rate
   that keeps about load × batch running per decoder (Little's law with the step time of
   a mixed batch), each request replaying its traced decode expert ids. TPOT p50/p99 per
   policy under two cost models: the CPU fit above, and a Qwen3-30B-A3B-shaped MoE layer
   timed on a GPU (``benchmarks/eldr_cost.py``; ``--gpu-cost FILE``, default
   ``benchmarks/data/eldr_cost_h100_qwen3-30b-a3b.json`` when present). Reductions are
   against the best of Random/RR/JSQ/P2C; the clustering ablation runs ELDR (τ = 0.1)
   on a plain K-means fit.

Headline JSON keys (issue 17): ``active_experts_reduction_vs_rr`` (real, ELDR τ = 0.1 vs
RR: 1 − ELDR/RR), ``tpot_p50_reduction_vs_best_baseline`` and ``..._p99_...`` (simulated,
K = ``--headline-k``, the GPU cost model when there is one, else the CPU fit; 1 −
ELDR/best), ``rho_count_idf``, ``rho_softmax``, ``rho_binary``,
``balanced_over_plain_kmeans_tpot_p99`` (p99 of ELDR on the balanced fit over p99 on the
plain fit: < 1 means balancing helps the tail), ``route_us`` (ELDR's choose(), raw counts
to decoder, median over the evaluation requests), ``tau1_matches_jsq`` (1 when τ = 1
chose exactly what JSQ chose, in the real run and in every simulation). Each also with
``_twin`` and, where it applies, ``_shuffled``; per-K, per-cost and per-policy figures
under longer names.

    python -m benchmarks.eldr [--quick] [--json PATH] [--traces DIR] [--decoders 4]
        [--batch 8] [--load 0.75] [--sim-max-batch N] [--sim-requests N] [--headline-k 16]
        [--gpu-cost FILE] [--gpu-fit NAME] [--seed N]
"""

from __future__ import annotations

import argparse
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
from benchmarks.lib.timing import median
from moejax.asyncmoe import costs  # (no JAX)
from moejax.eldr.policies import HandOff, Policy, make_policy  # (no JAX)

HOST_DEVICES = 8        # the real runs need several CPU devices
MODEL = "demo-e32"
FULL = dict(per_domain=64, prompt_tokens=64, new_tokens=32, sim_requests=4000,
            ks=(8, 16, 24), real_requests=None, decoders=4, batch=8, max_prefill_tokens=512)
QUICK = dict(per_domain=2, prompt_tokens=32, new_tokens=8, sim_requests=300, ks=(8,),
             real_requests=8, decoders=2, batch=4, max_prefill_tokens=128)
GPU_COST = Path(costs.H100_FIT_FILE)
BASELINES = ("random", "round_robin", "jsq", "p2c")
TAUS = (0.0, 0.1, 1.0)


# ----------------------------------------------------------------------------- inputs
def model_of(suffix: str) -> str:
    return MODEL if not suffix else f"{MODEL}-init"


def router_and_fingerprint(name: str) -> tuple[Any, np.ndarray, str]:
    """(config, router weights [L, d, E] float32, fingerprint) of a built-in model."""
    from moejax import checkpoint
    from moejax.eldr import fitfile
    from serving.api import resolve_model_dir

    cfg, params, _ = checkpoint.load_model_dir(resolve_model_dir(name)[0], "float32")
    router = np.asarray(params["layers"]["router"], np.float32)
    return cfg, router, fitfile.model_fingerprint(cfg, router)


def split(num_requests: int) -> tuple[np.ndarray, np.ndarray]:
    """Calibration (even) and evaluation (odd) request indices."""
    return np.arange(0, num_requests, 2), np.arange(1, num_requests, 2)


# ----------------------------------------------------------------------------- ρ
def rho_figures(trace: Any, counts: Any, fit: Any, router: np.ndarray, eval_idx: np.ndarray,
                seed: int) -> dict[str, float]:
    """ρ of each signature kind over every pair of evaluation requests."""
    from moejax.eldr import signature as sig

    prefill, profiles = counts.prefill[eval_idx], sig.decode_profiles(
        counts.decode[eval_idx], counts.decode_tokens[eval_idx])
    ranks = sig.profile_ranks(profiles)
    all_layers = tuple(range(trace.num_layers))
    offsets = trace.arrays["prompt_offsets"]
    inputs = trace.arrays["prefill_router_inputs"]
    prob_sums = np.stack([sig.router_probability_sums(inputs[:, offsets[i]:offsets[i + 1]],
                                                      router) for i in eval_idx])
    count_idf = fit.signature(prefill)
    shuffled = count_idf[np.random.default_rng(seed).permutation(len(eval_idx))]
    return {"rho_count_idf": sig.rho_against(count_idf, ranks),
            "rho_count_idf_all_layers": sig.rho_against(
                sig.signatures(prefill, fit.idf, all_layers), ranks),
            "rho_softmax": sig.rho_against(sig.softmax_signatures(prob_sums), ranks),
            "rho_binary": sig.rho_against(sig.binary_signatures(prefill), ranks),
            "rho_count_idf_shuffled": sig.rho_against(shuffled, ranks)}


def route_time_us(fit: Any, prefill: np.ndarray, seed: int) -> float:
    """Median host time of ELDR's choose() (raw counts -> decoder), in µs."""
    policy = make_policy("eldr", fit.num_decoders, fit=fit, tau=0.1)
    rng = np.random.default_rng(seed)
    loads = rng.integers(0, 8, (len(prefill), fit.num_decoders)).tolist()
    times = []
    with timed_pass("eldr_choose"):
        for _ in range(3):
            for counts, load in zip(prefill, loads):
                start = time.perf_counter()
                policy.choose(HandOff(counts=counts), load)
                times.append(time.perf_counter() - start)
    return 1e6 * median(times)


# ----------------------------------------------------------------------------- policies
class ShownCounts(Policy):
    """The noise floor for a runtime policy: ``inner`` is shown the prompt counts of
    another request (from ``pool``, in a seeded random order) instead of the request's
    own."""

    reads_counts = True

    def __init__(self, inner: Policy, pool: np.ndarray, seed: int):
        super().__init__(inner.num_decoders)
        self.name = f"{inner.name}_shuffled"
        self.inner, self.pool = inner, pool
        self._order = np.random.default_rng(seed).permutation(len(pool))
        self._next = 0

    def _choose(self, request: HandOff, loads: np.ndarray) -> int:
        shown = self.pool[self._order[self._next % len(self.pool)]]
        self._next += 1
        return self.inner.choose(HandOff(counts=shown, domain=request.domain), loads.tolist())


def policies(k: int, fit: Any, plain_fit: Any, domains: Sequence[str], seed: int
             ) -> dict[str, Policy]:
    """Every routed configuration by label (fresh objects: some keep state).
    ``eldr_shuffled`` is plain ELDR (τ = 0.1): the caller shows it other requests'
    counts (:class:`ShownCounts` in the runtime, ``signatures_of`` in the simulator)."""
    out = {name: make_policy(name, k, seed=seed) for name in BASELINES}
    out["domain"] = make_policy("domain", k, domains=domains)
    for tau in TAUS:
        out[f"eldr_tau{tau:g}"] = make_policy("eldr", k, fit=fit, tau=tau)
    if plain_fit is not None:
        out["eldr_plain_kmeans"] = make_policy("eldr", k, fit=plain_fit, tau=0.1)
    out["eldr_shuffled"] = make_policy("eldr", k, fit=fit, tau=0.1)
    return out


# ----------------------------------------------------------------------------- real part
def arrival_steps(n: int, per_step: float, seed: int) -> np.ndarray:
    """The pool step at which each of ``n`` requests arrives: a Poisson process of
    ``per_step`` arrivals per step."""
    gaps = np.random.default_rng(seed).exponential(1.0 / per_step, n)
    return np.floor(np.cumsum(gaps) - gaps[0]).astype(int)


def real_run(name: str, policy: Any, requests: list[dict[str, Any]], steps: np.ndarray,
             batch: int, max_prefill_tokens: int) -> dict[str, Any]:
    """One policy on ``decoders`` decoders over the fixed arrival schedule. Every pool
    precompiles outside the clock, so no timed step compiles: the first of each program
    set compiles (a policy that reads prompt counts gets a prefill engine that keeps the
    signature cache, whose step programs also write expert counts), the others find the
    programs compiled and only run each once on padding."""
    from serving import Generator

    gen = Generator(name, dtype="float32", decoders=policy.num_decoders, routing=policy,
                    max_batch_size=batch, max_prefill_tokens=max_prefill_tokens,
                    precompile=True)
    pool = gen.scheduler
    specs = [gen.parse(r, i) for i, r in enumerate(requests)]
    seqs: list[Any] = []
    with timed_pass(f"real_{type(policy).__name__}_{os.path.basename(name)}"):
        start = time.perf_counter()
        step = 0
        while len(seqs) < len(specs) or pool.busy:
            while len(seqs) < len(specs) and steps[len(seqs)] <= step:
                seqs.append(pool.submit(specs[len(seqs)]))
            pool.step()
            step += 1
        seconds = time.perf_counter() - start
    records = [(d, r) for d, dec in enumerate(pool.decoders) for r in dec.step_records
               if r.active_experts is not None]
    tokens_per_decoder = np.zeros(len(pool.decoders))
    for d, r in records:
        tokens_per_decoder[d] += r.decode_sequences
    generated = sum(len(s.output.token_ids) for s in seqs)
    return {"active": float(np.mean([r.active_experts.mean() for _, r in records])),
            "batch": float(np.mean([r.decode_sequences for _, r in records])),
            "step_active": np.array([r.active_experts.mean() for _, r in records]),
            "step_batch": np.array([r.decode_sequences for _, r in records]),
            "load_imbalance": float(tokens_per_decoder.max() / tokens_per_decoder.mean()),
            "tokens_per_s": generated / seconds, "seconds": seconds,
            "route_us_runtime": 1e6 * float(np.mean([r.seconds for r in pool.routes])),
            "choices": [route.decoder for route in sorted(pool.routes, key=lambda r: r.seq_id)],
            "tokens": [list(s.output.token_ids) for s in seqs],
            "steps": [(r.active_experts, r.decode_sequences, r.seconds) for _, r in records
                      if r.prefill_sequences == 0]}


def fit_step_costs(steps: list[tuple[np.ndarray, int, float]]) -> dict[str, float]:
    """t = t0 + Σ_l (a·active_l + b·batch) over measured decode steps, non-negative: per
    layer that is t/L = t0 + a·mean_l(active_l) + b·batch, ``eldr_cost.fit_cost``'s form
    -> per-layer t0, a, b (seconds), R² and the step count."""
    from benchmarks.eldr_cost import fit_cost

    layers = len(steps[0][0])
    fit = fit_cost([s[0].mean() for s in steps], [s[1] for s in steps],
                   [s[2] / layers for s in steps], non_negative=True)
    return {"t0_s": fit["t0"], "a_s": fit["a"], "b_s": fit["b"], "r2": fit["r2"],
            "steps": len(steps)}


def gpu_cost_model(path: str, fit_name: str, num_layers: int) -> Any:
    """One fit of a GPU cost model file (per layer t0_s, a_s, b_s; ``fit_name`` one of
    its ``fits``, or "top" for its top-level fit): a coefficient the fit left below zero
    (noise: decode time does not shrink with work) counts as 0, said aloud."""
    import json

    from moejax.eldr import simulator

    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if fit_name != "top":
        fits = data.get("fits", {})
        if fit_name not in fits:
            raise SystemExit(f"{path}: no fit {fit_name!r} (it has {sorted(fits)} and 'top')")
        data = fits[fit_name]
    for key in simulator.COST_KEYS:
        if data[key] < 0:
            print(f"{path}: {key} = {data[key]:.3g} s < 0 (fit noise), taken as 0")
    t0, a, b = (max(float(data[key]), 0.0) for key in simulator.COST_KEYS)
    return simulator.CostModel.from_per_layer(t0, a, b, num_layers)


# ----------------------------------------------------------------------------- simulation
def typical_union(requests: list[Any], batch: int, rng: np.random.Generator,
                  samples: int = 200) -> np.ndarray:
    """Mean distinct experts per layer [L] of ``batch`` random requests at a random
    decode step each (what a step of a mixed batch activates)."""
    num_layers, num_experts = requests[0].num_layers, requests[0].num_experts
    totals = np.zeros(num_layers)
    for _ in range(samples):
        chosen = np.zeros((num_layers, num_experts), bool)
        for i in rng.choice(len(requests), batch):
            ids = requests[i].decode_experts
            chosen[np.arange(num_layers)[:, None], ids[:, rng.integers(ids.shape[1])]] = True
        totals += chosen.sum(axis=1)
    return totals / samples


def mixed_unions(requests: list[Any], max_batch: int, rng: np.random.Generator
                 ) -> np.ndarray:
    """[max_batch + 1]: at index b the distinct experts per layer (averaged over layers) a
    step of b randomly mixed requests activates (:func:`typical_union`); 0 at b = 0."""
    return np.array([0.0] + [float(typical_union(requests, b, rng).mean())
                             for b in range(1, max_batch + 1)])


def same_batch_locality(active: np.ndarray, batch: np.ndarray, mixed: np.ndarray) -> float:
    """1 − Σ_steps active / Σ_steps mixed[batch]: how many fewer experts the steps
    activated than randomly mixed batches of the same sizes would (0: no locality; this
    takes out the batch-size effect that per-step averages carry)."""
    return 1.0 - float(np.sum(active)) / float(np.sum(mixed[np.asarray(batch, int)]))


def simulate_all(requests: list[Any], k: int, configs: dict[str, Any], cost: Any,
                 batch: int, load: float, n: int, seed: int, max_batch: int
                 ) -> dict[str, Any]:
    """Every configuration on one arrival trace of ``n`` requests for ``k`` decoders of at
    most ``max_batch`` running requests each, arriving at the rate that keeps about
    ``load`` × ``batch`` running per decoder."""
    from moejax.eldr import simulator

    rng = np.random.default_rng(seed)
    drawn = [requests[i] for i in rng.choice(len(requests), n)]
    mean_tokens = float(np.mean([r.decode_tokens for r in drawn]))
    target = load * batch
    step = cost.step_seconds(typical_union(requests, max(1, round(target)), rng), target)
    arrivals = simulator.poisson_arrivals(
        n, simulator.rate_for_batch(target, k, mean_tokens, step), seed)
    shuffled = simulator.shuffled_signatures(drawn, seed)
    return {label: simulator.simulate(drawn, arrivals, policy, num_decoders=k, cost=cost,
                                      max_batch_size=max_batch,
                                      signatures_of=shuffled if label == "eldr_shuffled"
                                      else None)
            for label, policy in configs.items()}


def reduction(value: float, reference: float) -> float:
    """1 - value / reference (positive: ``value`` is that much lower)."""
    return 1.0 - value / reference


# ----------------------------------------------------------------------------- one model
def run_model(suffix: str, trace: Any, args: argparse.Namespace, shape: dict[str, Any],
              gpu_cost: Any) -> dict[str, Any]:
    from moejax import demo
    from moejax.eldr import fitting, simulator

    name = model_of(suffix)
    domains = demo.demo_model(MODEL).domains
    cfg, router, fingerprint = router_and_fingerprint(name)
    counts = fitting.trace_counts(trace)
    if counts.num_requests != len(trace):
        raise SystemExit(f"{name}: the reference trace has errored requests; rewrite it")
    calib, evaluate = split(counts.num_requests)
    if shape["real_requests"]:
        evaluate = evaluate[np.linspace(0, len(evaluate) - 1, shape["real_requests"]).astype(int)]

    def fit_for(k: int, clustering: str = "balanced") -> Any:
        return fitting.fit_counts(counts.prefill[calib], counts.decode[calib],
                                  counts.decode_tokens[calib], k, fingerprint=fingerprint,
                                  model=name, top_k=counts.top_k, clustering=clustering,
                                  seed=args.seed)

    figures: dict[str, Any] = {}
    k_real = args.decoders
    fit_real = fit_for(k_real)
    figures["fit_layers"] = list(fit_real.layers)
    figures.update(rho_figures(trace, counts, fit_real, router, evaluate, args.seed))
    figures["route_us"] = route_time_us(fit_real, counts.prefill[evaluate], args.seed)
    print(f"[{name}] layers {list(fit_real.layers)}  ρ count·IDF {figures['rho_count_idf']:.3f}"
          f" (all layers {figures['rho_count_idf_all_layers']:.3f}), softmax "
          f"{figures['rho_softmax']:.3f}, binary {figures['rho_binary']:.3f}, shuffled "
          f"{figures['rho_count_idf_shuffled']:.3f}; route {figures['route_us']:.1f} µs")

    # Real part: the evaluation requests in a seeded random order (the trace lists them
    # domain by domain; arriving so, even round robin would batch one domain at a time).
    arrival_order = np.random.default_rng(args.seed).permutation(evaluate)
    offsets = trace.arrays["prompt_offsets"]
    prompts = [trace.arrays["prompt_token_ids"][offsets[i]:offsets[i + 1]].tolist()
               for i in arrival_order]
    new_tokens = np.diff(trace.arrays["generated_offsets"])[arrival_order]
    requests = [{"id": int(i), "prompt_token_ids": p, "max_new_tokens": int(n),
                 "stop_token_ids": [], "domain": counts.domains[i]}
                for i, p, n in zip(arrival_order, prompts, new_tokens)]
    per_step = k_real * args.load * args.batch / float(np.mean(new_tokens))
    steps = arrival_steps(len(requests), per_step, args.seed)
    configs = policies(k_real, fit_real, None, domains, args.seed)
    # Shown in an order of its own (seed + 1): the arrival order is permutation(seed).
    configs["eldr_shuffled"] = ShownCounts(configs["eldr_shuffled"], counts.prefill[evaluate],
                                           args.seed + 1)
    sim_requests = simulator.requests_from_trace(trace, evaluate)
    mixed = mixed_unions(sim_requests, max(args.batch, args.sim_max_batch),
                         np.random.default_rng(args.seed))
    real = {}
    for label, policy in configs.items():
        real[label] = r = real_run(name, policy, requests, steps, args.batch,
                                   max_prefill_tokens=shape["max_prefill_tokens"])
        r["same_batch"] = same_batch_locality(r["step_active"], r["step_batch"], mixed)
        figures[f"real_same_batch_locality_{label}"] = r["same_batch"]
        print(f"[{name}] real K={k_real} {label:18s} active/layer {r['active']:.2f}  "
              f"batch {r['batch']:.2f}  vs mixed at that batch {100 * r['same_batch']:+.1f} %  "
              f"imbalance {r['load_imbalance']:.2f}  {r['tokens_per_s']:.0f} tok/s  "
              f"route {r['route_us_runtime']:.0f} µs")
        figures[f"real_active_experts_{label}"] = r["active"]
        figures[f"real_mean_batch_{label}"] = r["batch"]
        figures[f"real_load_imbalance_{label}"] = r["load_imbalance"]
        figures[f"real_tokens_per_s_{label}"] = r["tokens_per_s"]
    rr = real["round_robin"]["active"]
    figures["active_experts_reduction_vs_rr"] = reduction(real["eldr_tau0.1"]["active"], rr)
    figures["active_experts_reduction_vs_rr_shuffled"] = reduction(
        real["eldr_shuffled"]["active"], rr)
    figures["active_experts_reduction_vs_rr_domain_oracle"] = reduction(
        real["domain"]["active"], rr)
    figures["route_us_runtime"] = real["eldr_tau0.1"]["route_us_runtime"]
    figures["same_batch_locality"] = real["eldr_tau0.1"]["same_batch"]
    figures["same_batch_locality_shuffled"] = real["eldr_shuffled"]["same_batch"]
    figures["same_batch_locality_domain_oracle"] = real["domain"]["same_batch"]
    reference_tokens = real["round_robin"]["tokens"]
    figures["tokens_identical_across_policies"] = int(all(
        r["tokens"] == reference_tokens for r in real.values()))
    tau1_real = real["eldr_tau1"]["choices"] == real["jsq"]["choices"]
    cpu = fit_step_costs([s for r in real.values() for s in r["steps"]])
    figures.update({f"cpu_cost_{key}": value for key, value in cpu.items()})
    print(f"[{name}] CPU step cost per layer: t0 {1e6 * cpu['t0_s']:.1f} µs, a "
          f"{1e6 * cpu['a_s']:.2f} µs/expert, b {1e6 * cpu['b_s']:.2f} µs/row "
          f"(R² {cpu['r2']:.2f}, {cpu['steps']} steps)")

    # Simulated part.
    costs = {"cpu": simulator.CostModel.from_per_layer(cpu["t0_s"], cpu["a_s"], cpu["b_s"],
                                                      cfg.num_layers)}
    if gpu_cost is not None:
        costs["gpu"] = gpu_cost_model(gpu_cost, args.gpu_fit, cfg.num_layers)
        figures.update({f"gpu_cost_{key}": getattr(costs["gpu"], key) / (
            1 if key != "t0" else cfg.num_layers) for key in ("t0", "a", "b")})
    tau1_sim = True
    for k in shape["ks"]:
        fit_k, plain_k = fit_for(k), fit_for(k, "plain")
        for cost_name, cost in costs.items():
            configs = policies(k, fit_k, plain_k, domains, args.seed)
            results = simulate_all(sim_requests, k, configs, cost, args.batch, args.load,
                                   shape["sim_requests"], args.seed,
                                   args.sim_max_batch)
            tau1_sim &= bool(np.array_equal(results["eldr_tau1"].decoder,
                                            results["jsq"].decoder))
            best50 = min(results[b].tpot_p50 for b in BASELINES)
            best99 = min(results[b].tpot_p99 for b in BASELINES)
            tag = f"k{k}_{cost_name}"
            for label, res in results.items():
                figures[f"sim_tpot_p50_ms_{label}_{tag}"] = 1e3 * res.tpot_p50
                figures[f"sim_tpot_p99_ms_{label}_{tag}"] = 1e3 * res.tpot_p99
                figures[f"sim_active_experts_{label}_{tag}"] = res.mean_active_experts
                figures[f"sim_mean_batch_{label}_{tag}"] = float(res.step_batch.mean())
                figures[f"sim_same_batch_locality_{label}_{tag}"] = same_batch_locality(
                    res.step_active.mean(axis=1), res.step_batch, mixed)
            for label in ("eldr_tau0.1", "eldr_shuffled", "domain", "eldr_tau0"):
                key = "" if label == "eldr_tau0.1" else f"_{label.replace('eldr_', '')}"
                figures[f"tpot_p50_reduction_vs_best_baseline{key}_{tag}"] = reduction(
                    results[label].tpot_p50, best50)
                figures[f"tpot_p99_reduction_vs_best_baseline{key}_{tag}"] = reduction(
                    results[label].tpot_p99, best99)
            figures[f"balanced_over_plain_kmeans_tpot_p99_{tag}"] = (
                results["eldr_tau0.1"].tpot_p99 / results["eldr_plain_kmeans"].tpot_p99)
            print(f"[{name}] sim K={k} {cost_name}: batch RR "
                  f"{results['round_robin'].step_batch.mean():.1f} ELDR "
                  f"{results['eldr_tau0.1'].step_batch.mean():.1f}, TPOT p50 ELDR "
                  f"{1e3 * results['eldr_tau0.1'].tpot_p50:.3f} ms vs best baseline "
                  f"{1e3 * best50:.3f} ms ({100 * figures[f'tpot_p50_reduction_vs_best_baseline_{tag}']:+.1f} %"
                  f" reduction; shuffled "
                  f"{100 * figures[f'tpot_p50_reduction_vs_best_baseline_shuffled_{tag}']:+.1f} %,"
                  f" oracle {100 * figures[f'tpot_p50_reduction_vs_best_baseline_domain_{tag}']:+.1f} %)"
                  f", p99 {100 * figures[f'tpot_p99_reduction_vs_best_baseline_{tag}']:+.1f} %, "
                  f"active {results['eldr_tau0.1'].mean_active_experts:.2f} vs RR "
                  f"{results['round_robin'].mean_active_experts:.2f}")
    figures["tau1_matches_jsq"] = int(tau1_real and tau1_sim)
    head = f"k{args.headline_k if args.headline_k in shape['ks'] else shape['ks'][0]}_" + (
        "gpu" if "gpu" in costs else "cpu")
    figures["headline"] = head
    for key in ("tpot_p50_reduction_vs_best_baseline", "tpot_p99_reduction_vs_best_baseline",
                "tpot_p50_reduction_vs_best_baseline_shuffled",
                "tpot_p99_reduction_vs_best_baseline_shuffled",
                "balanced_over_plain_kmeans_tpot_p99"):
        figures[key] = figures[f"{key}_{head}"]
    return figures


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, quick_help="small traces (2 requests per domain, 8 new "
                          "tokens), 2 decoders, 300 simulated arrivals, K = 8 only",
                          traces=True)
    parser.add_argument("--decoders", type=int,
                        help="decoders in the real part (default 4; --quick 2)")
    parser.add_argument("--batch", type=int,
                        help="max_batch_size of every decoder, real and simulated "
                             "(default 8; --quick 4)")
    parser.add_argument("--sim-max-batch", type=int,
                        help="max_batch_size of a simulated decoder (default 4 x --batch: "
                             "batches grow instead of queueing, as on a serving decoder "
                             "whose batch limit lies far above its operating point; "
                             "--sim-max-batch 8 queues at the real part's limit)")
    parser.add_argument("--load", type=float, default=0.75,
                        help="arrivals keep about load x batch requests running per "
                             "decoder (default 0.75)")
    parser.add_argument("--sim-requests", type=int, help="simulated arrivals per run")
    parser.add_argument("--headline-k", type=int, default=16,
                        help="the simulated pool size of the headline TPOT figures")
    parser.add_argument("--gpu-cost", default=str(GPU_COST) if GPU_COST.is_file() else None,
                        help="a GPU cost model (benchmarks/eldr_cost.py --cost-out)")
    parser.add_argument("--gpu-fit", default="fused_tiles_given",
                        help="which fit of the GPU cost file: fused_tiles_given (default: "
                             "the expert path that is fastest at decode batches, each layer's "
                             "weights given apart; R² 0.9998), one of its other 'fits', or "
                             "'top'")
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(parser, argv, host_devices=HOST_DEVICES)
    shape = run_shape(args, QUICK, FULL, ("sim_requests",))
    args.decoders = args.decoders or shape["decoders"]
    args.batch = args.batch or shape["batch"]
    args.sim_max_batch = args.sim_max_batch or 4 * args.batch
    started = time.perf_counter()
    figures: dict[str, Any] = {"model": MODEL, "decoders_real": args.decoders,
                               "batch": args.batch, "load": args.load,
                               "sim_max_batch": args.sim_max_batch,
                               "sim_ks": list(shape["ks"]),
                               "sim_requests": shape["sim_requests"],
                               "gpu_cost": args.gpu_cost or "",
                               "gpu_fit": args.gpu_fit if args.gpu_cost else ""}
    with tempfile.TemporaryDirectory(prefix="moejax-eldr-") as tmp:
        traces = reference_traces(MODEL, tmp if args.quick else args.traces, shape, args.seed)
        figures["requests"] = len(traces[""])
        for suffix, trace in traces.items():
            for key, value in run_model(suffix, trace, args, shape, args.gpu_cost).items():
                figures[f"{key}{suffix}"] = value
    figures["seconds"] = time.perf_counter() - started
    print(f"\nELDR vs RR, distinct experts per decode step: "
          f"{100 * figures['active_experts_reduction_vs_rr']:.1f} % fewer (twin "
          f"{100 * figures['active_experts_reduction_vs_rr_twin']:.1f} %, shuffled "
          f"{100 * figures['active_experts_reduction_vs_rr_shuffled']:.1f} %)")
    print(f"simulated TPOT p50 vs best load balancer ({figures['headline']}): "
          f"{100 * figures['tpot_p50_reduction_vs_best_baseline']:.1f} % lower (twin "
          f"{100 * figures['tpot_p50_reduction_vs_best_baseline_twin']:.1f} %, shuffled "
          f"{100 * figures['tpot_p50_reduction_vs_best_baseline_shuffled']:.1f} %)")
    print(f"ρ count·IDF {figures['rho_count_idf']:.3f} > binary {figures['rho_binary']:.3f}: "
          f"{figures['rho_count_idf'] > figures['rho_binary']}; τ=1 == JSQ: "
          f"{figures['tau1_matches_jsq']}; route {figures['route_us']:.1f} µs; "
          f"{figures['seconds']:.0f} s")
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
