"""Expert specialization by domain, and how well prefill routing predicts decode routing.

The two measurements of the ELDR seed (``shared/seeds/eldr-expert-locality-decode-routing.txt``)
that decide whether expert-locality routing can pay off on a model:

1. **Distinct experts per decode step, same-domain vs mixed batch.** A decode step of a
   batch of N requests runs one token per request; per layer it must load every expert that
   any of those N tokens picked (its top-k). For each domain of the demo corpus (code, prose,
   math, data: ``moejax.demo.corpus``, held-out split) ``--per-domain`` requests are decoded
   greedily for ``--new-tokens`` tokens with ``serving.Generator(trace_experts=True)``; a
   token's routing does not depend on its batch-mates, so the experts a batch *would*
   activate at step t are the union of its members' traced top-k ids at step t. Batches are
   drawn ``--batches`` times: same-domain (N distinct requests of one domain) and mixed (N/4
   of each domain; N = 2 takes two different domains). Distinct experts are averaged over
   layers, steps and batches; ``reduction = 1 - same / mixed`` (ELDR: 17-21% fewer for task
   domains). The headline is N = ``--batch`` (4: with 8 experts top-2 a batch of 4 random
   tokens activates about 5.5 of 8, far from both bounds); the sweep over
   ``--batch-sizes`` is printed and kept. The same statistic over prompt tokens at the same
   position (``*_prefill_positions``) is printed too; over whole prompts a batch's union is
   all E experts for any composition (``prefill_union_*``), so prefill batching has no
   locality to gain on such a model.

2. **Prefill-decode correlation.** Per request, Pearson's r between its per-(layer, expert)
   prefill counts and its decode counts (``moejax.generate.expert_counts``, flattened [L, E]),
   averaged over requests (ELDR: 0.70-0.92). Part of that is just each layer's global expert
   popularity, shared by every request, so it is printed beside the same r against the
   decode counts of *another* request of the same domain and of a *different* domain (the
   noise floor: the correlation popularity alone gives), and a *centered* r (each count
   vector minus the mean over all requests, as usage fractions) that keeps only what is
   specific to the request.

Every figure is computed for the model AND for the same-shaped untrained model (the
training script's own seeded init, ``moejax.demo.train.init_params`` with the seed in the
model's ``train_log.json``, written to a temporary model directory in bfloat16 like the
trained weights, tokenizer and config copied), and beside a **noise floor**: each domain's
requests split into two random halves used as if they were two domains -- the reduction of
a half-A batch against a half-A + half-B batch (should be ~0), and the per-layer
total-variation distance between the expert-usage distributions of two domains (half A of
each) against that between the two halves of one domain (same token counts). Routing
differences that the untrained model shows too come from token statistics, not training;
differences not above the halves' floor are sampling noise.

Prompts: held-out texts of one domain joined by newlines and cut to exactly
``--prompt-tokens`` tokens (so every domain has the same prompt length and the model
continues a text of its domain). Decoding ignores EOS (``stop_token_ids=[]``) so that every
request has ``--new-tokens`` steps to align; the share of requests that generated EOS is
printed (after it the model starts a new text, which can leave the domain), and the
correlation is also given over each request's decode tokens before its first EOS only
(``prefill_decode_correlation_before_eos``; requests whose first token is EOS left out).

    python benchmarks/expert_specialization.py [--quick] [--json PATH] [--model DIR|demo]
        [--per-domain N] [--prompt-tokens N] [--new-tokens N] [--batch N]
        [--batch-sizes 2,4,8] [--batches N] [--seed N]

JSON keys (flat; every key also exists with the suffix ``_untrained`` for the untrained
model): same_domain_expert_reduction, same_domain_expert_reduction_noise_floor,
same_domain_expert_reduction_{domain}, distinct_experts_same_domain, distinct_experts_mixed,
same_domain_expert_reduction_b{N}, same_domain_expert_reduction_noise_floor_b{N},
same_domain_expert_reduction_prefill_positions(_noise_floor),
prefill_union_distinct_same_domain, prefill_union_distinct_mixed,
prefill_decode_correlation, prefill_decode_correlation_noise_floor (another request of a
different domain), prefill_decode_correlation_other_same_domain,
prefill_decode_correlation_centered, prefill_decode_correlation_centered_noise_floor,
prefill_decode_correlation_before_eos, prefill_decode_correlation_{domain},
usage_tv_between_domains_{prefill,decode}, usage_tv_between_halves_{prefill,decode} (and
``_layer{l}``), eos_fraction; plus the run's settings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.figures import write_json  # noqa: E402

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
            seed: int, first_eos: np.ndarray | None = None) -> dict[str, Any]:
    """Every figure of one model. ``prefill_ids``: per request [L, P, k];
    ``decode_ids`` [R, L, S, k]; ``domains`` [R] domain index of each request;
    ``first_eos`` [R]: decode steps before each request's first EOS (default: all)."""
    from moejax.generate import expert_counts

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

    for name, counts in (("prefill", pc), ("decode", dc)):
        half_a = [usage_fractions(counts[a].sum(axis=0)) for a, _ in split]
        half_b = [usage_fractions(counts[b].sum(axis=0)) for _, b in split]
        between = np.mean([tv_distance(half_a[i], half_a[j]) for i in range(num_domains)
                           for j in range(i + 1, num_domains)], axis=0)           # [L]
        within = np.mean([tv_distance(half_a[d], half_b[d]) for d in range(num_domains)],
                         axis=0)
        out[f"tv_between_domains_{name}"] = between
        out[f"tv_between_halves_{name}"] = within
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
    for phase in ("prefill", "decode"):
        for kind in ("domains", "halves"):
            per_layer = result[f"tv_between_{kind}_{phase}"]
            f[f"usage_tv_between_{kind}_{phase}"] = float(np.mean(per_layer))
            for layer, value in enumerate(per_layer):
                f[f"usage_tv_between_{kind}_{phase}_layer{layer}"] = float(value)
    return {key + suffix: value for key, value in f.items()}


# ------------------------------------------------------------------------------ models
def domain_prompts(src, tokenizer, domain: str, count: int, length: int,
                   rng: np.random.Generator) -> list[list[int]]:
    """``count`` prompts of exactly ``length`` token ids: held-out texts of ``domain``
    joined by newlines, cut."""
    prompts = []
    for _ in range(count):
        text, ids = "", []
        while len(ids) < length:
            text = f"{text}\n{src.text(domain, rng)}" if text else src.text(domain, rng)
            ids = tokenizer.encode(text)
        prompts.append(ids[:length])
    return prompts


def untrained_model_dir(model_dir: str, out_dir: str) -> int:
    """Write the untrained twin of ``model_dir`` into ``out_dir``: the training script's
    seeded init (seed from ``train_log.json``, else the demo's), as bfloat16 safetensors
    in the Hugging Face layout, with the model's config and tokenizer. Returns the seed.

    The export inverts the loader's plan slot by slot and is checked by loading it back."""
    import jax
    import ml_dtypes

    from moejax import checkpoint
    from moejax.config import load_config
    from moejax.demo import train
    from moejax.safetensors_io import write_safetensors

    cfg = load_config(model_dir)
    seed = train.TrainConfig().seed
    log_path = os.path.join(model_dir, "train_log.json")
    if os.path.isfile(log_path):
        with open(log_path, encoding="utf-8") as fh:
            seed = int(json.load(fh).get("train_config", {}).get("seed", seed))
    params = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32),
                                    train.init_params(cfg, seed))
    tensors = {}
    for slot in checkpoint.hf_tensor_plan(cfg, set()):
        (write,) = slot.writes
        leaf: Any = params
        for key in write.key:
            leaf = leaf[key]
        value = np.asarray(leaf[write.index], np.float32)
        probe = np.empty((2, 3))
        swapped = write.transform(probe).shape == (3, 2)      # the loader's HF -> moejax step
        tensor = np.swapaxes(value, -1, -2) if swapped else value
        if tensor.shape != slot.shape:
            raise RuntimeError(f"{slot.name}: param slice {value.shape} does not fit {slot.shape}")
        tensors[slot.name] = np.ascontiguousarray(tensor).astype(ml_dtypes.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        if os.path.isfile(os.path.join(model_dir, name)):
            shutil.copyfile(os.path.join(model_dir, name), os.path.join(out_dir, name))
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors,
                      metadata={"format": "pt", "notice": f"untrained init, seed {seed}"})
    _, loaded, _ = checkpoint.load_model_dir(out_dir, "float32")
    bf16 = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)
    same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(bf16(a), b)), params, loaded)
    if not all(jax.tree_util.tree_leaves(same)):
        raise RuntimeError("the untrained export does not load back as the init params")
    return seed


def first_stop(token_ids: Sequence[int], stop: Sequence[int] | frozenset) -> int:
    """Index of the first token of ``token_ids`` in ``stop`` (``len(token_ids)`` if none):
    the decode steps before it are the request's answer proper."""
    return next((i for i, t in enumerate(token_ids) if t in stop), len(token_ids))


def trace_model(model_dir: str, prompts: list[list[int]], new_tokens: int, batch: int
                ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, float]:
    """Greedy generation with expert tracing: per request prefill ids [L, P, k], decode ids
    [R, L, new_tokens - 1, k], the index of each request's first EOS (``new_tokens`` if
    none), and wall seconds."""
    from serving import Generator

    generator = Generator(model_dir, dtype="float32", trace_experts=True, max_batch_size=batch)
    eos = generator.eos_token_ids
    requests = [{"id": i, "prompt_token_ids": p, "max_new_tokens": new_tokens,
                 "stop_token_ids": []} for i, p in enumerate(prompts)]
    start = time.perf_counter()
    results = generator.generate(requests)
    seconds = time.perf_counter() - start
    for r in results:
        if r.error is not None:
            raise RuntimeError(f"request {r.id}: {r.error}")
    decode = np.stack([r.experts["decode"] for r in results])
    if decode.shape[2] != new_tokens - 1:
        raise RuntimeError(f"expected {new_tokens - 1} traced decode steps, got {decode.shape[2]}")
    first_eos = np.array([first_stop(r.token_ids, eos) for r in results])
    return [r.experts["prefill"] for r in results], decode, first_eos, seconds


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
    for phase in ("prefill", "decode"):
        between = result[f"tv_between_domains_{phase}"]
        within = result[f"tv_between_halves_{phase}"]
        print(f"usage TV distance ({phase} tokens) per layer: between domains "
              + " ".join(f"{v:.3f}" for v in between) + "; between halves of a domain "
              + " ".join(f"{v:.3f}" for v in within))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="16 requests per domain, 32-token prompts, 16 new tokens")
    parser.add_argument("--json", dest="json_path", help="write the figures to this JSON file")
    parser.add_argument("--model", default="demo",
                        help="model directory, or 'demo' (the built-in model; default)")
    parser.add_argument("--per-domain", type=int, help="requests per domain (default 64)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt length (default 64)")
    parser.add_argument("--new-tokens", type=int, help="greedy tokens decoded (default 32)")
    parser.add_argument("--batch", type=int, default=4, help="headline batch size (default 4)")
    parser.add_argument("--batch-sizes", default="2,4,8", help="batch sizes of the sweep")
    parser.add_argument("--batches", type=int, help="batches drawn per configuration "
                                                    "(default 400)")
    parser.add_argument("--gen-batch", type=int, default=16,
                        help="Generator max_batch_size (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = dict(QUICK if args.quick else FULL)
    for key in ("per_domain", "prompt_tokens", "new_tokens", "batches"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    sizes = sorted({int(s) for s in args.batch_sizes.split(",") if s.strip()} | {args.batch})
    if shape["new_tokens"] < 2 or shape["prompt_tokens"] < 1 or min(sizes) < 1:
        parser.error("--new-tokens must be >= 2, --prompt-tokens and batch sizes >= 1")
    if shape["per_domain"] < 2 * max(sizes):
        parser.error(f"--per-domain must be at least twice the largest batch size "
                     f"({2 * max(sizes)}): the noise floor draws batches from half a domain")

    run_start = time.perf_counter()
    from moejax.config import load_config
    from moejax.demo import corpus
    from serving.api import resolve_model_dir
    from serving.requests import TokenizerAdapter

    logging.getLogger("moejax.scorer").setLevel(logging.ERROR)
    model_dir, is_demo = resolve_model_dir(args.model)
    if is_demo:
        from moejax.demo import DEMO_NOTICE

        print(f"note: {DEMO_NOTICE}")
    cfg = load_config(model_dir)
    tokenizer = TokenizerAdapter.from_file(os.path.join(model_dir, "tokenizer.json"))
    src = corpus.sources("eval")
    domains = corpus.DOMAINS
    prompts, labels = [], []
    for d, domain in enumerate(domains):
        rng = np.random.default_rng(args.seed * 1000 + d)
        prompts += domain_prompts(src, tokenizer, domain, shape["per_domain"],
                                  shape["prompt_tokens"], rng)
        labels += [d] * shape["per_domain"]
    labels = np.array(labels)
    print(f"expert specialization: {args.model} ({cfg.num_layers} layers, {cfg.num_experts} "
          f"experts top-{cfg.num_experts_per_tok}), float32; {shape['per_domain']} held-out "
          f"requests x {len(domains)} domains ({', '.join(domains)}), {shape['prompt_tokens']}-"
          f"token prompts, {shape['new_tokens']} greedy tokens (EOS ignored); {shape['batches']} "
          f"batches per configuration, batch sizes {sizes} (headline {args.batch}); "
          f"load average {os.getloadavg()[0]:.2f}")

    figures: dict[str, Any] = {"model": args.model, **shape, "batch": args.batch,
                               "batch_sizes": sizes, "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="moejax-untrained-") as tmp:
        init_seed = untrained_model_dir(model_dir, tmp)
        figures["untrained_init_seed"] = init_seed
        for name, path, suffix in (("trained", model_dir, ""),
                                   (f"untrained (init seed {init_seed})", tmp, "_untrained")):
            pre, dec, first_eos, seconds = trace_model(path, prompts, shape["new_tokens"],
                                                       args.gen_batch)
            result = analyse(pre, dec, labels, len(domains), cfg.num_experts, sizes,
                             shape["batches"], args.seed, first_eos)
            print_model(name, result, domains, args.batch, cfg.num_experts)
            print(f"  {result['eos_fraction']:.0%} of requests generated EOS within "
                  f"{shape['new_tokens']} tokens (decoding went on past it); correlation over "
                  f"the tokens before EOS only: {result['correlation_before_eos']:.3f} "
                  f"({result['answered_fraction']:.0%} of requests have such tokens); "
                  f"generation took {seconds:.1f} s")
            figures.update(flat_figures(result, domains, args.batch, suffix))
    print("\nheadline (trained / untrained / noise floor):")
    for key in ("same_domain_expert_reduction", "prefill_decode_correlation"):
        print(f"  {key}: {figures[key]:.3f} / {figures[key + '_untrained']:.3f} / "
              f"{figures[key + '_noise_floor']:.3f} (untrained floor "
              f"{figures[key + '_noise_floor_untrained']:.3f})")
    print("  (ELDR: 17-21% fewer experts for task domains; correlation 0.70-0.92)")
    figures["total_seconds"] = time.perf_counter() - run_start
    print(f"total {figures['total_seconds']:.0f} s")
    write_json(args.json_path, figures)
    return figures


if __name__ == "__main__":
    main()
