"""Expert specialization by domain, and how well prefill routing predicts decode routing.

The measurements of the ELDR seed (``shared/seeds/eldr-expert-locality-decode-routing.txt``)
that decide whether expert-locality routing can pay off on a model, and the one the
prefetch issue starts from:

1. **Distinct experts per decode step, same-domain vs mixed batch.** A decode step of a
   batch of N requests runs one token per request; per layer it must load every expert that
   any of those N tokens picked (its top-k). For each domain of the model's corpus
   (``moejax.demo.corpus``, held-out split: code, prose, math, data for ``demo``; the eight
   of ``DOMAINS_E32`` for ``demo-e32``) ``--per-domain`` requests are decoded greedily for
   ``--new-tokens`` tokens with expert tracing (``benchmarks/expert_traces.py``'s code, or
   its files with ``--traces DIR``); a token's routing does not depend on its batch-mates,
   so the experts a batch *would* activate at step t are the union of its members' traced
   top-k ids at step t. Batches are drawn ``--batches`` times: same-domain (N distinct
   requests of one domain) and mixed (N/D of each of the D domains, the remainder from
   random distinct domains). Distinct experts are averaged over layers, steps and batches;
   ``reduction = 1 - same / mixed`` (ELDR: 17-21% fewer for task domains). The headline is
   N = ``--batch`` (8: with 32 experts top-4 a batch of 8 random tokens activates about 21
   of 32); the sweep over ``--batch-sizes`` (2, 4, 8, 16) is printed and kept. The same
   statistic over prompt tokens at the same position (``*_prefill_positions``) is printed
   too; over whole prompts a batch's union is nearly all E experts for any composition
   (``prefill_union_*``).

2. **Prefill-decode correlation.** Per request, Pearson's r between its per-(layer, expert)
   prefill counts and its decode counts (``moejax.expert_trace.expert_counts``, flattened [L, E]),
   averaged over requests (ELDR: 0.70-0.92). Part of that is just each layer's global expert
   popularity, shared by every request, so it is printed beside the same r against the
   decode counts of *another* request of the same domain and of a *different* domain (the
   noise floor: the correlation popularity alone gives), and a *centered* r (each count
   vector minus the mean over all requests, as usage fractions) that keeps only what is
   specific to the request. Two more forms are printed beside it: the *sampling ceiling*
   (the r a request would reach if its decode slots were drawn from its own prefill usage:
   a request decodes far fewer tokens than E x L cells, so sampling noise alone keeps r
   below 1) and the *domain aggregate* (each domain's summed prefill counts against its
   summed decode counts, the workload-level form closer to ELDR's per-expert figure).

3. **Next-layer predictability** (``next_layer_recall_router_baseline``, per layer l):
   recall@k of applying layer l+1's router to layer l's router input (its normed
   residual) against the experts layer l+1 really chose, over decode tokens (and prefill
   tokens, ``_prefill``); chance is k/E. Needs router inputs in the traces.

4. **Usage divergence per domain and layer** (``usage_divergence_{domain}_layer{l}``): the
   total-variation distance between a domain's expert usage (decode tokens) and that of
   all other domains pooled; plus the mean TV distance between two domains
   (``usage_tv_between_domains_*``) beside that between two halves of one domain.

Every figure is computed for the model AND its untrained twin (a built-in model's
``demo-e32-init``; for a model directory the training script's seeded init with the seed
in its ``train_log.json``, written to a temporary directory in bfloat16 like the trained
weights), on the same prompts, and beside a **noise floor**: each domain's requests split
into two random halves used as if they were two domains -- the reduction of a half-A batch
against a half-A + half-B batch (should be ~0), and the per-layer TV distance between two
halves of one domain. Routing differences that the untrained model shows too come from
token statistics, not training; differences not above the halves' floor are sampling noise.

Prompts: held-out texts of one domain joined by newlines and cut to exactly
``--prompt-tokens`` tokens (so every domain has the same prompt length and the model
continues a text of its domain). Decoding ignores EOS (``stop_token_ids=[]``) so that every
request has ``--new-tokens`` steps to align; the share of requests that generated EOS is
printed (after it the model starts a new text, which can leave the domain), and the
correlation is also given over each request's decode tokens before its first EOS only
(``prefill_decode_correlation_before_eos``; requests whose first token is EOS left out).

    python -m benchmarks.expert_specialization [--quick] [--json PATH]
        [--model demo|demo-e32|DIR] [--traces DIR] [--per-domain N] [--prompt-tokens N]
        [--new-tokens N] [--batch N] [--batch-sizes 2,4,8,16] [--batches N] [--seed N]

JSON keys (flat; every key also exists with the suffix ``_untrained`` for the twin):
same_domain_expert_reduction, same_domain_expert_reduction_noise_floor,
same_domain_expert_reduction_{domain}, distinct_experts_same_domain, distinct_experts_mixed,
same_domain_expert_reduction_b{N}, same_domain_expert_reduction_noise_floor_b{N},
same_domain_expert_reduction_prefill_positions(_noise_floor),
prefill_union_distinct_same_domain, prefill_union_distinct_mixed,
prefill_decode_correlation, prefill_decode_correlation_noise_floor (another request of a
different domain), prefill_decode_correlation_other_same_domain,
prefill_decode_correlation_centered, prefill_decode_correlation_centered_noise_floor,
prefill_decode_correlation_before_eos, prefill_decode_correlation_{domain},
prefill_decode_correlation_sampling_ceiling, prefill_decode_correlation_domain_aggregate
(and ``_noise_floor``),
usage_tv_between_domains_{prefill,decode}, usage_tv_between_halves_{prefill,decode} (and
``_layer{l}``), usage_divergence_{domain} (and ``_layer{l}``, ``_prefill``),
next_layer_recall_router_baseline (and ``_layer{l}``, ``_prefill``),
next_layer_recall_chance, eos_fraction; plus the run's settings.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from benchmarks.lib import reference_traces as expert_traces
from benchmarks.lib.cli import bench_parser, parse_args, run_shape
from benchmarks.lib.meta import finish_run

FULL = dict(per_domain=64, prompt_tokens=64, new_tokens=32, batches=400)
QUICK = dict(per_domain=16, prompt_tokens=32, new_tokens=16, batches=200)


# ------------------------------------------------------------------------------ statistics
def distinct_per_layer(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Distinct expert ids per layer: ``ids`` [..., L, n, k] (n tokens' top-k) -> [..., L]."""
    ids = np.asarray(ids)
    hit = (ids[..., None] == np.arange(num_experts)).any(axis=(-3, -2))     # [..., L, E]
    return hit.sum(axis=-1)


def batch_step_distinct(traces: np.ndarray, batches: np.ndarray, num_experts: int
                        ) -> np.ndarray:
    """Per batch, the distinct experts per (step, layer) averaged over steps and layers.

    ``traces`` [R, L, S, k]: every request's top-k ids at S aligned steps; ``batches``
    [B, N]: request indices of each batch. Step t of a batch activates, per layer, the union
    of its members' ids at step t. Returns [B].
    """
    members = np.asarray(traces)[np.asarray(batches)]            # [B, N, L, S, k]
    per_step = np.moveaxis(members, 1, 3)                        # [B, L, S, N, k]
    per_step = np.moveaxis(per_step, 1, 2)                       # [B, S, L, N, k]
    return distinct_per_layer(per_step, num_experts).mean(axis=(1, 2))


def union_distinct(traces: np.ndarray, batches: np.ndarray, num_experts: int) -> np.ndarray:
    """Per batch, distinct experts per layer over ALL steps of all members (a prefill
    batch's union), averaged over layers: [B]."""
    members = np.asarray(traces)[np.asarray(batches)]            # [B, N, L, S, k]
    b, n, layers, s, k = members.shape
    flat = np.moveaxis(members, 1, 2).reshape(b, layers, n * s, k)
    return distinct_per_layer(flat, num_experts).mean(axis=1)


def same_domain_batches(pool: Sequence[int], size: int, count: int,
                        rng: np.random.Generator) -> np.ndarray:
    """``count`` batches [count, size] of ``size`` distinct requests drawn from ``pool``."""
    pool = np.asarray(pool)
    if size > len(pool):
        raise ValueError(f"a batch of {size} needs at least {size} requests, got {len(pool)}")
    return np.stack([rng.choice(pool, size, replace=False) for _ in range(count)])


def mixed_batches(groups: Sequence[Sequence[int]], size: int, count: int,
                  rng: np.random.Generator) -> np.ndarray:
    """``count`` batches of ``size`` requests spread as evenly as possible over ``groups``
    (``size // G`` from each group, the remainder from distinct random groups)."""
    g = len(groups)
    rows = []
    for _ in range(count):
        take = np.full(g, size // g)
        take[rng.choice(g, size % g, replace=False)] += 1
        rows.append(np.concatenate([rng.choice(np.asarray(groups[j]), take[j], replace=False)
                                    for j in range(g) if take[j]]))
    return np.stack(rows)


def reduction(same: float, mixed: float) -> float:
    """``1 - same / mixed``: the share of a mixed batch's experts a same-domain batch saves."""
    return 1.0 - same / mixed


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson's r of two arrays, flattened (nan when either is constant)."""
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    a, b = a - a.mean(), b - b.mean()
    denom = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / denom) if denom > 0 else float("nan")


def usage_fractions(counts: np.ndarray) -> np.ndarray:
    """Counts [..., L, E] -> fractions per layer (rows sum to 1)."""
    counts = np.asarray(counts, np.float64)
    return counts / counts.sum(axis=-1, keepdims=True)


def paired_correlations(prefill: np.ndarray, decode: np.ndarray, pairing: Sequence[int]
                        ) -> np.ndarray:
    """r between request i's prefill counts and request ``pairing[i]``'s decode counts:
    [R] (``pairing = range(R)``: each request against itself)."""
    return np.array([pearson(prefill[i], decode[j]) for i, j in enumerate(pairing)])


def other_pairing(domains: Sequence[int], rng: np.random.Generator, same_domain: bool
                  ) -> np.ndarray:
    """For each request a random OTHER request of the same domain (``same_domain``) or of a
    different domain."""
    domains = np.asarray(domains)
    out = np.empty(len(domains), np.int64)
    for i, d in enumerate(domains):
        mask = (domains == d) if same_domain else (domains != d)
        mask[i] = False
        choices = np.flatnonzero(mask)
        if not len(choices):
            raise ValueError(f"request {i} has no other request to pair with")
        out[i] = rng.choice(choices)
    return out


def tv_distance(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Total-variation distance per layer of two usage distributions [L, E] -> [L]."""
    return 0.5 * np.abs(np.asarray(p) - np.asarray(q)).sum(axis=-1)


def halves(pool: Sequence[int], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random split of ``pool`` into two disjoint halves (sizes differ by at most one)."""
    perm = rng.permutation(np.asarray(pool))
    return perm[:len(perm) // 2], perm[len(perm) // 2:]


# ------------------------------------------------------------------------------ analysis
def locality_figures(traces: np.ndarray, domains: np.ndarray, num_domains: int, size: int,
                     count: int, num_experts: int, rng: np.random.Generator,
                     split: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """Same-domain vs mixed distinct experts per step for batches of ``size`` over
    ``traces`` [R, L, S, k]; plus the halves noise floor (``split[d]`` = halves of domain d)."""
    pools = [np.flatnonzero(domains == d) for d in range(num_domains)]
    mixed = float(batch_step_distinct(traces, mixed_batches(pools, size, count, rng),
                                      num_experts).mean())
    same = [float(batch_step_distinct(traces, same_domain_batches(pools[d], size, count, rng),
                                      num_experts).mean()) for d in range(num_domains)]
    floor = []
    for half_a, half_b in split:
        a_only = batch_step_distinct(traces, same_domain_batches(half_a, size, count, rng),
                                     num_experts).mean()
        a_and_b = batch_step_distinct(traces, mixed_batches([half_a, half_b], size, count, rng),
                                      num_experts).mean()
        floor.append(reduction(float(a_only), float(a_and_b)))
    return {"same": same, "mixed": mixed, "reduction": reduction(float(np.mean(same)), mixed),
            "reduction_by_domain": [reduction(s, mixed) for s in same],
            "noise_floor": float(np.mean(floor))}


def analyse(prefill_ids: list[np.ndarray], decode_ids: np.ndarray, domains: np.ndarray,
            num_domains: int, num_experts: int, batch_sizes: Sequence[int], count: int,
            seed: int, first_eos: np.ndarray | None = None,
            router: tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]] | None = None
            ) -> dict[str, Any]:
    """Every figure of one model. ``prefill_ids``: per request [L, P, k];
    ``decode_ids`` [R, L, S, k]; ``domains`` [R] domain index of each request;
    ``first_eos`` [R]: decode steps before each request's first EOS (default: all);
    ``router``: the router weights [L, d, E] and, per phase, the traced router inputs
    [L, n, d] and expert ids [L, n, k] (for the next-layer recall)."""
    from moejax.expert_trace import expert_counts

    rng = np.random.default_rng(seed)
    prefill = np.stack(prefill_ids)                                      # [R, L, P, k]
    split = [halves(np.flatnonzero(domains == d), rng) for d in range(num_domains)]
    out: dict[str, Any] = {"decode": {}, "prefill_positions": {}}
    for size in batch_sizes:
        out["decode"][size] = locality_figures(decode_ids, domains, num_domains, size, count,
                                               num_experts, rng, split)
        out["prefill_positions"][size] = locality_figures(prefill, domains, num_domains, size,
                                                          count, num_experts, rng, split)
    size = batch_sizes[0] if len(batch_sizes) == 1 else sorted(batch_sizes)[len(batch_sizes) // 2]
    pools = [np.flatnonzero(domains == d) for d in range(num_domains)]
    out["prefill_union_same"] = float(np.mean([union_distinct(
        prefill, same_domain_batches(p, size, count, rng), num_experts).mean() for p in pools]))
    out["prefill_union_mixed"] = float(union_distinct(
        prefill, mixed_batches(pools, size, count, rng), num_experts).mean())

    pc = np.stack([expert_counts(ids, num_experts) for ids in prefill_ids])     # [R, L, E]
    dc = np.stack([expert_counts(ids, num_experts) for ids in decode_ids])
    own = np.arange(len(domains))
    same_pair = other_pairing(domains, rng, same_domain=True)
    other_pair = other_pairing(domains, rng, same_domain=False)
    pf, df = usage_fractions(pc), usage_fractions(dc)
    pf_c, df_c = pf - pf.mean(axis=0), df - df.mean(axis=0)
    out["correlation"] = float(np.nanmean(paired_correlations(pc, dc, own)))
    out["correlation_other_same_domain"] = float(np.nanmean(paired_correlations(pc, dc, same_pair)))
    out["correlation_noise_floor"] = float(np.nanmean(paired_correlations(pc, dc, other_pair)))
    out["correlation_centered"] = float(np.nanmean(paired_correlations(pf_c, df_c, own)))
    out["correlation_centered_noise_floor"] = float(np.nanmean(
        paired_correlations(pf_c, df_c, other_pair)))
    if first_eos is not None:      # decode counts of the answer proper (steps before EOS)
        answered = np.array([int(e) > 0 for e in first_eos])
        dc_eos = np.stack([expert_counts(ids[:, :max(int(e), 1)], num_experts)
                           for ids, e in zip(decode_ids, first_eos)])
        r_eos = paired_correlations(pc, dc_eos, own)
        out["correlation_before_eos"] = float(np.nanmean(r_eos[answered]))
        out["answered_fraction"] = float(answered.mean())
        out["eos_fraction"] = float(np.mean(first_eos < decode_ids.shape[2] + 1))
    out["correlation_by_domain"] = [float(np.nanmean(paired_correlations(pc, dc, own)[domains == d]))
                                    for d in range(num_domains)]
    out["correlation_domain_aggregate"], out["correlation_domain_aggregate_noise_floor"] = (
        domain_aggregate_correlation(pc, dc, domains, num_domains))
    out["correlation_sampling_ceiling"] = sampling_ceiling(pc, dc, rng)

    for name, counts in (("prefill", pc), ("decode", dc)):
        half_a = [usage_fractions(counts[a].sum(axis=0)) for a, _ in split]
        half_b = [usage_fractions(counts[b].sum(axis=0)) for _, b in split]
        between = np.mean([tv_distance(half_a[i], half_a[j]) for i in range(num_domains)
                           for j in range(i + 1, num_domains)], axis=0)           # [L]
        within = np.mean([tv_distance(half_a[d], half_b[d]) for d in range(num_domains)],
                         axis=0)
        out[f"tv_between_domains_{name}"] = between
        out[f"tv_between_halves_{name}"] = within
        out[f"divergence_by_domain_{name}"] = usage_divergence_by_domain(counts, domains,
                                                                         num_domains)
    if router is not None:
        router_w, phases = router
        k = decode_ids.shape[-1]
        out["next_layer_recall"] = {phase: next_layer_recall(inputs, ids, router_w, k)
                                    for phase, (inputs, ids) in phases.items()}
        out["next_layer_recall_chance"] = k / num_experts
    return out


def flat_figures(result: dict[str, Any], domains: Sequence[str], primary: int, suffix: str
                 ) -> dict[str, float]:
    """The JSON keys of one model's :func:`analyse` result (``suffix``: "" or "_untrained")."""
    f: dict[str, float] = {}
    dec = result["decode"][primary]
    f["same_domain_expert_reduction"] = dec["reduction"]
    f["same_domain_expert_reduction_noise_floor"] = dec["noise_floor"]
    f["distinct_experts_same_domain"] = float(np.mean(dec["same"]))
    f["distinct_experts_mixed"] = dec["mixed"]
    for name, value in zip(domains, dec["reduction_by_domain"]):
        f[f"same_domain_expert_reduction_{name}"] = value
    for size, r in result["decode"].items():
        f[f"same_domain_expert_reduction_b{size}"] = r["reduction"]
        f[f"same_domain_expert_reduction_noise_floor_b{size}"] = r["noise_floor"]
    pre = result["prefill_positions"][primary]
    f["same_domain_expert_reduction_prefill_positions"] = pre["reduction"]
    f["same_domain_expert_reduction_prefill_positions_noise_floor"] = pre["noise_floor"]
    f["prefill_union_distinct_same_domain"] = result["prefill_union_same"]
    f["prefill_union_distinct_mixed"] = result["prefill_union_mixed"]
    f["prefill_decode_correlation"] = result["correlation"]
    f["prefill_decode_correlation_noise_floor"] = result["correlation_noise_floor"]
    f["prefill_decode_correlation_other_same_domain"] = result["correlation_other_same_domain"]
    f["prefill_decode_correlation_centered"] = result["correlation_centered"]
    if "correlation_before_eos" in result:
        f["prefill_decode_correlation_before_eos"] = result["correlation_before_eos"]
        f["eos_fraction"] = result["eos_fraction"]
    f["prefill_decode_correlation_centered_noise_floor"] = result["correlation_centered_noise_floor"]
    for name, value in zip(domains, result["correlation_by_domain"]):
        f[f"prefill_decode_correlation_{name}"] = value
    f["prefill_decode_correlation_domain_aggregate"] = result["correlation_domain_aggregate"]
    f["prefill_decode_correlation_domain_aggregate_noise_floor"] = result[
        "correlation_domain_aggregate_noise_floor"]
    f["prefill_decode_correlation_sampling_ceiling"] = result["correlation_sampling_ceiling"]
    for phase in ("prefill", "decode"):
        for kind in ("domains", "halves"):
            per_layer = result[f"tv_between_{kind}_{phase}"]
            f[f"usage_tv_between_{kind}_{phase}"] = float(np.mean(per_layer))
            for layer, value in enumerate(per_layer):
                f[f"usage_tv_between_{kind}_{phase}_layer{layer}"] = float(value)
    for name, per_layer in zip(domains, result["divergence_by_domain_decode"]):
        f[f"usage_divergence_{name}"] = float(np.mean(per_layer))
        for layer, value in enumerate(per_layer):
            f[f"usage_divergence_{name}_layer{layer}"] = float(value)
    for name, per_layer in zip(domains, result["divergence_by_domain_prefill"]):
        f[f"usage_divergence_{name}_prefill"] = float(np.mean(per_layer))
    if "next_layer_recall" in result:
        f["next_layer_recall_chance"] = result["next_layer_recall_chance"]
        for phase, per_layer in result["next_layer_recall"].items():
            key = "next_layer_recall_router_baseline" + ("" if phase == "decode" else "_prefill")
            f[key] = float(np.mean(per_layer))
            for layer, value in enumerate(per_layer):
                f[f"{key}_layer{layer}"] = float(value)
    return {key + suffix: value for key, value in f.items()}


# ------------------------------------------------------------------------------ models
def first_stop(token_ids: Sequence[int], stop: Sequence[int] | frozenset) -> int:
    """Index of the first token of ``token_ids`` in ``stop`` (``len(token_ids)`` if none):
    the decode steps before it are the request's answer proper."""
    return next((i for i, t in enumerate(token_ids) if t in stop), len(token_ids))


def trace_arrays(trace, eos_ids: frozenset[int] | Sequence[int]) -> dict[str, Any]:
    """What :func:`analyse` reads from a ``moejax.traces.Trace`` whose requests all decoded
    the same number of steps: per request prefill ids [L, P, k], decode ids
    [R, L, S, k], the index of each request's first EOS (its generated-token count if
    none), the domain labels and, if recorded, the router inputs [L, tokens, d] of both
    phases with each token's request."""
    requests = trace.requests
    steps = {r.decode_experts.shape[1] for r in requests}
    if len(steps) != 1:
        raise ValueError(f"the trace's requests decoded different step counts {sorted(steps)}; "
                         "write it with stop_token_ids=[] (benchmarks/expert_traces.py does)")
    if any(r.domain is None for r in requests):
        raise ValueError("every request of the trace needs a domain label")
    stop = frozenset(int(t) for t in eos_ids)
    out = {"prefill": [r.prefill_experts for r in requests],
           "decode": np.stack([r.decode_experts for r in requests]),
           "first_eos": np.array([first_stop([int(t) for t in r.generated_token_ids], stop)
                                  for r in requests]),
           "labels": [r.domain for r in requests]}
    if trace.has_router_inputs:
        out["router_inputs"] = {phase: (trace.arrays[f"{phase}_router_inputs"],
                                        trace.arrays[f"{phase}_experts"])
                                for phase in ("prefill", "decode")}
    return out


def next_layer_recall(router_inputs: np.ndarray, experts: np.ndarray, router_w: np.ndarray,
                      k: int) -> np.ndarray:
    """Per layer l < L-1, recall@k of predicting layer l+1's top-k experts by applying
    layer l+1's router to layer l's router input (its normed residual): ``router_inputs``
    [L, n, d], ``experts`` [L, n, k] (what the tokens chose), ``router_w`` [L, d, E].
    Returns [L-1]: the mean over tokens of |predicted ∩ chosen| / k (chance: k / E)."""
    out = []
    for layer in range(router_inputs.shape[0] - 1):
        logits = router_inputs[layer].astype(np.float64) @ router_w[layer + 1].astype(np.float64)
        predicted = np.argsort(-logits, axis=-1, kind="stable")[:, :k]            # [n, k]
        hits = (predicted[:, :, None] == experts[layer + 1][:, None, :]).any(axis=-1)
        out.append(float(hits.sum(axis=-1).mean() / k))
    return np.array(out)


def domain_aggregate_correlation(prefill: np.ndarray, decode: np.ndarray, domains: np.ndarray,
                                 num_domains: int) -> tuple[float, float]:
    """Pearson's r between a domain's summed prefill counts and its summed decode counts
    ([R, L, E] each), averaged over domains, and the same against other domains' decode
    counts (the floor): the workload-level form of the prefill-decode correlation."""
    pre = [prefill[domains == d].sum(axis=0) for d in range(num_domains)]
    dec = [decode[domains == d].sum(axis=0) for d in range(num_domains)]
    own = float(np.mean([pearson(pre[d], dec[d]) for d in range(num_domains)]))
    other = float(np.mean([pearson(pre[d], dec[e]) for d in range(num_domains)
                           for e in range(num_domains) if e != d]))
    return own, other


def sampling_ceiling(prefill: np.ndarray, decode: np.ndarray, rng: np.random.Generator
                     ) -> float:
    """The mean r a request would reach if its decode slots were drawn from its own
    prefill usage per layer (as many slots as it decoded): how far sampling noise alone
    keeps the per-request correlation below 1. ``prefill``, ``decode`` [R, L, E]."""
    out = []
    for pc, dc in zip(prefill, decode):
        slots = dc.sum(axis=-1)                                              # [L]
        drawn = np.stack([rng.multinomial(n, p) for n, p in zip(slots, usage_fractions(pc))])
        out.append(pearson(pc, drawn))
    return float(np.nanmean(out))


def usage_divergence_by_domain(counts: np.ndarray, domains: np.ndarray, num_domains: int
                               ) -> np.ndarray:
    """Per domain and layer, the TV distance between the domain's expert usage and that of
    every other domain pooled: counts [R, L, E] -> [D, L]."""
    out = []
    for d in range(num_domains):
        own = usage_fractions(counts[domains == d].sum(axis=0))
        rest = usage_fractions(counts[domains != d].sum(axis=0))
        out.append(tv_distance(own, rest))
    return np.array(out)


def print_model(name: str, result: dict[str, Any], domains: Sequence[str], primary: int,
                num_experts: int) -> None:
    dec = result["decode"][primary]
    print(f"\n== {name}")
    print(f"distinct experts per decode step, batch of {primary} (of {num_experts} per layer):")
    print("  " + ", ".join(f"{d} {s:.2f}" for d, s in zip(domains, dec["same"]))
          + f"; mixed {dec['mixed']:.2f}")
    print("  reduction 1 - same/mixed: " + ", ".join(
        f"{d} {r:+.1%}" for d, r in zip(domains, dec["reduction_by_domain"]))
        + f"; overall {dec['reduction']:+.1%}  (noise floor, half A vs A+B: "
          f"{dec['noise_floor']:+.1%})")
    print("  by batch size: " + "; ".join(
        f"N={n}: {r['reduction']:+.1%} (floor {r['noise_floor']:+.1%})"
        for n, r in result["decode"].items()))
    pre = result["prefill_positions"][primary]
    print(f"  prompt tokens at the same position: {pre['reduction']:+.1%} "
          f"(floor {pre['noise_floor']:+.1%}); whole-prompt union of a batch: same "
          f"{result['prefill_union_same']:.2f}, mixed {result['prefill_union_mixed']:.2f}")
    print(f"prefill-decode correlation (Pearson over [L, E] counts, mean over requests): "
          f"{result['correlation']:.3f}; against another request of the same domain "
          f"{result['correlation_other_same_domain']:.3f}, of another domain "
          f"{result['correlation_noise_floor']:.3f} (floor)")
    print("  by domain: " + ", ".join(f"{d} {c:.3f}" for d, c in
                                      zip(domains, result["correlation_by_domain"]))
          + f"; centered (minus mean usage): {result['correlation_centered']:.3f} "
            f"(another domain: {result['correlation_centered_noise_floor']:.3f})")
    print(f"  ceiling from sampling alone (decode slots drawn from the request's own prefill "
          f"usage): {result['correlation_sampling_ceiling']:.3f}; per domain, summed over its "
          f"requests: {result['correlation_domain_aggregate']:.3f} (against another domain's "
          f"decode: {result['correlation_domain_aggregate_noise_floor']:.3f})")
    for phase in ("prefill", "decode"):
        between = result[f"tv_between_domains_{phase}"]
        within = result[f"tv_between_halves_{phase}"]
        print(f"usage TV distance ({phase} tokens) per layer: between domains "
              + " ".join(f"{v:.3f}" for v in between) + "; between halves of a domain "
              + " ".join(f"{v:.3f}" for v in within))
    print("usage divergence of each domain from the others (decode, TV per layer):")
    for name, per_layer in zip(domains, result["divergence_by_domain_decode"]):
        print(f"  {name:>10}: " + " ".join(f"{v:.3f}" for v in per_layer))
    if "next_layer_recall" in result:
        for phase, per_layer in result["next_layer_recall"].items():
            print(f"next-layer recall@k, layer l+1's router on layer l's router input "
                  f"({phase}), per layer l: " + " ".join(f"{v:.3f}" for v in per_layer)
                  + f" (chance {result['next_layer_recall_chance']:.3f})")


def router_weights(model_dir: str) -> np.ndarray:
    """The model's router weights [L, d, E] in float32."""
    from moejax import checkpoint

    _, params, _ = checkpoint.load_model_dir(model_dir, "float32")
    return np.asarray(params["layers"]["router"], np.float32)


def model_traces(args: argparse.Namespace, shape: dict[str, Any], model_dir: str,
                 domains: Sequence[str], tmp: str) -> list[tuple[str, str, str, Any]]:
    """(label, model dir, JSON suffix, trace) of the model and its untrained twin: read
    from ``--traces DIR`` (``DIR/<model>.npz``, ``DIR/<twin>.npz``), else generated here
    by ``benchmarks.lib.reference_traces`` on the same prompts. A model without a
    built-in twin gets one written to ``tmp`` (``untrained_model_dir``)."""
    from moejax import traces
    from serving.api import resolve_model_dir
    from serving.requests import TokenizerAdapter

    twin = expert_traces.twin_name(args.model)
    if twin is not None:
        twin_dir, _ = resolve_model_dir(twin)
        twin_label = f"untrained twin {twin}"
    else:
        seed = expert_traces.untrained_model_dir(model_dir, tmp)
        twin, twin_dir, twin_label = tmp, tmp, f"untrained (init seed {seed})"
    models = [("trained", args.model, model_dir, ""), (twin_label, twin, twin_dir, "_untrained")]
    if args.traces:
        out = []
        for label, name, path, suffix in models:
            file = os.path.join(args.traces, expert_traces.trace_file_name(args.model, bool(suffix)))
            if not os.path.isfile(file):
                raise SystemExit(f"--traces {args.traces}: no trace {file} (write them with "
                                 f"python -m benchmarks.expert_traces --model {args.model})")
            out.append((label, path, suffix, traces.load(file)))
        return out
    tokenizer = TokenizerAdapter.from_file(os.path.join(model_dir, "tokenizer.json"))
    prompts, labels = expert_traces.held_out_prompts(tokenizer, domains, shape["per_domain"],
                                                     shape["prompt_tokens"], args.seed)
    out = []
    for label, name, path, suffix in models:
        trace, seconds = expert_traces.make_trace(name, prompts, labels, shape["new_tokens"],
                                                  router_inputs=True, batch=args.gen_batch)
        print(f"{label}: generated {len(prompts)} traced requests in {seconds:.1f} s")
        out.append((label, path, suffix, trace))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, quick_help="16 requests per domain, 32-token prompts, 16 "
                          "new tokens", model="demo", model_help="model directory, or a "
                          "built-in model: demo (default), demo-e32")
    parser.add_argument("--traces", default=None,
                        help="read the traces benchmarks/expert_traces.py wrote to this "
                             "directory instead of generating them")
    parser.add_argument("--per-domain", type=int, help="requests per domain (default 64)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt length (default 64)")
    parser.add_argument("--new-tokens", type=int, help="greedy tokens decoded (default 32)")
    parser.add_argument("--batch", type=int, default=8, help="headline batch size (default 8)")
    parser.add_argument("--batch-sizes", default="2,4,8,16",
                        help="batch sizes of the sweep (default 2,4,8,16; sizes above half "
                             "the requests per domain are left out, with a note)")
    parser.add_argument("--batches", type=int, help="batches drawn per configuration "
                                                    "(default 400)")
    parser.add_argument("--gen-batch", type=int, default=16,
                        help="Generator max_batch_size (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(parser, argv)
    shape = run_shape(args, QUICK, FULL, ("per_domain", "prompt_tokens", "new_tokens", "batches"))
    if args.traces:     # the traces decide the request counts and lengths
        shape = {"batches": shape["batches"]}
    asked = sorted({int(s) for s in args.batch_sizes.split(",") if s.strip()} | {args.batch})
    if "new_tokens" in shape and (shape["new_tokens"] < 2 or shape["prompt_tokens"] < 1):
        parser.error("--new-tokens must be >= 2, --prompt-tokens >= 1")
    if min(asked) < 1:
        parser.error("batch sizes must be >= 1")

    run_start = time.perf_counter()
    from moejax.config import load_config
    from serving.api import resolve_model_dir
    from serving.generate import model_eos_ids

    logging.getLogger("moejax.scorer").setLevel(logging.ERROR)
    model_dir, is_demo = resolve_model_dir(args.model)
    if is_demo:
        from moejax.demo import demo_model

        print(f"note: {demo_model(args.model).notice}")
    cfg = load_config(model_dir)
    domains = expert_traces.model_domains(args.model, model_dir)
    eos = model_eos_ids(model_dir, cfg.vocab_size)
    figures: dict[str, Any] = {"model": args.model, **shape, "batch": args.batch,
                               "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="moejax-untrained-") as tmp:
        runs = model_traces(args, shape, model_dir, domains, tmp)
        for label, path, suffix, trace in runs:
            data = trace_arrays(trace, eos)
            per_domain = min(data["labels"].count(d) for d in domains)
            sizes = [n for n in asked if 2 * n <= per_domain]
            if args.batch not in sizes:
                raise SystemExit(f"the headline batch {args.batch} needs at least "
                                 f"{2 * args.batch} requests per domain (the noise floor draws "
                                 f"batches from half a domain); the trace has {per_domain}")
            if sizes != asked:
                print(f"note: batch sizes {sorted(set(asked) - set(sizes))} left out: they "
                      f"need more than {per_domain} requests per domain")
            if not suffix:
                decode_steps = data["decode"].shape[2]
                print(f"expert specialization: {args.model} ({cfg.num_layers} layers, "
                      f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}), float32; "
                      f"{per_domain} held-out requests x {len(domains)} domains "
                      f"({', '.join(domains)}), {data['prefill'][0].shape[1]}-token prompts, "
                      f"{decode_steps + 1} greedy tokens (EOS ignored); {shape['batches']} "
                      f"batches per configuration, batch sizes {sizes} (headline "
                      f"{args.batch}); load average {os.getloadavg()[0]:.2f}")
                figures.update(per_domain=per_domain, prompt_tokens=data["prefill"][0].shape[1],
                               new_tokens=decode_steps + 1, batch_sizes=sizes)
            labels = np.array([domains.index(d) for d in data["labels"]])
            router = None
            if "router_inputs" in data:
                router = (router_weights(path), data["router_inputs"])
            result = analyse(data["prefill"], data["decode"], labels, len(domains),
                             cfg.num_experts, sizes, shape["batches"], args.seed,
                             data["first_eos"], router)
            print_model(label, result, domains, args.batch, cfg.num_experts)
            print(f"  {result['eos_fraction']:.0%} of requests generated EOS (decoding went "
                  f"on past it); correlation over the tokens before EOS only: "
                  f"{result['correlation_before_eos']:.3f} ({result['answered_fraction']:.0%} "
                  f"of requests have such tokens)")
            figures.update(flat_figures(result, domains, args.batch, suffix))
    print("\nheadline (trained / untrained / noise floor):")
    for key in ("same_domain_expert_reduction", "prefill_decode_correlation"):
        print(f"  {key}: {figures[key]:.3f} / {figures[key + '_untrained']:.3f} / "
              f"{figures[key + '_noise_floor']:.3f} (untrained floor "
              f"{figures[key + '_noise_floor_untrained']:.3f})")
    if "next_layer_recall_router_baseline" in figures:
        print(f"  next_layer_recall_router_baseline: "
              f"{figures['next_layer_recall_router_baseline']:.3f} / "
              f"{figures['next_layer_recall_router_baseline_untrained']:.3f} / chance "
              f"{figures['next_layer_recall_chance']:.3f}")
    print("  (ELDR: 17-21% fewer experts for task domains; correlation 0.70-0.92)")
    figures["total_seconds"] = time.perf_counter() - run_start
    print(f"total {figures['total_seconds']:.0f} s")
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
