"""Reference expert traces of a built-in demo model and its untrained twin.

For each domain of the model's corpus (``moejax.demo.corpus``, held-out split) it builds
``--per-domain`` prompts of exactly ``--prompt-tokens`` token ids (held-out texts of the
domain joined by newlines, cut), decodes ``--new-tokens`` greedy tokens for each with
``serving.Generator(trace_experts=True)`` (EOS ignored, so every request has the same
number of decode steps to align), and writes one trace per model in the format of
``moejax.traces`` (top-k ids, gate weights, router inputs with ``--router-inputs``, the
domain label of every request):

    OUT/<model>.npz         e.g. out/traces/demo-e32.npz
    OUT/<model>-init.npz    its untrained twin (``demo-e32-init``; for a model directory
                            the training script's seeded init): the same prompts

The ELDR, prefetch and expert-parallel decode benchmarks, and
``benchmarks/expert_specialization.py --traces OUT``, read these. The same seed gives the
same prompts and (greedy, float32) the same traces. The full set (64 requests x 8 domains,
64-token prompts, 32 new tokens, router inputs) is about 160 MB per model uncompressed, so
it is not committed: it takes about 3 minutes to rebuild on the 2-core CPU.

    python benchmarks/expert_traces.py [--quick] [--json PATH] [--model demo-e32]
        [--out out/traces] [--per-domain N] [--prompt-tokens N] [--new-tokens N]
        [--router-inputs | --no-router-inputs] [--seed N]

JSON keys: requests, prompt_tokens_total, decode_tokens_total, trace_seconds_{model},
trace_mib_{model}, and the run's settings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.figures import write_json  # noqa: E402

FULL = dict(per_domain=64, prompt_tokens=64, new_tokens=32)
QUICK = dict(per_domain=8, prompt_tokens=32, new_tokens=8)


def model_domains(model: str, model_dir: str) -> tuple[str, ...]:
    """The corpus domains a model was trained on: a built-in model's, else those its
    ``train_log.json`` records, else the small demo's."""
    from moejax import demo
    from moejax.demo import corpus

    if model in demo.MODELS:
        return demo.demo_model(model).domains
    log_path = os.path.join(model_dir, "train_log.json")
    if os.path.isfile(log_path):
        with open(log_path, encoding="utf-8") as fh:
            recorded = json.load(fh).get("corpus", {}).get("domains")
        if recorded:
            return tuple(recorded)
    return corpus.DOMAINS


def twin_name(model: str) -> str | None:
    """The built-in untrained twin of a built-in model (``demo-e32`` -> ``demo-e32-init``)."""
    from moejax import demo

    twin = demo.twin_of(model) if model in demo.MODELS else None
    return twin.name if twin else None


def untrained_model_dir(model_dir: str, out_dir: str) -> int:
    """Write the untrained twin of ``model_dir`` into ``out_dir``
    (``moejax.demo.write_untrained_twin``: the training script's seeded init, seed from
    ``train_log.json``, else the demo's) and check it loads back as the init params.
    Returns the seed."""
    import jax
    import ml_dtypes

    from moejax import checkpoint
    from moejax.config import load_config
    from moejax.demo import recorded_seed, train, write_untrained_twin

    seed = recorded_seed(model_dir, default=train.TrainConfig().seed)
    os.makedirs(out_dir, exist_ok=True)
    write_untrained_twin(model_dir, out_dir, seed)
    params = train.init_params(load_config(model_dir), seed)
    _, loaded, _ = checkpoint.load_model_dir(out_dir, "float32")
    bf16 = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(bf16(a), b)), params, loaded)
    if not all(jax.tree_util.tree_leaves(same)):
        raise RuntimeError("the untrained export does not load back as the init params")
    return seed


def trace_file_name(model: str, twin: bool = False) -> str:
    """``<model>.npz``, or the twin's ``<model>-init.npz`` (``demo-e32-init.npz``)."""
    return os.path.basename(os.path.normpath(model)) + ("-init" if twin else "") + ".npz"


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


def held_out_prompts(tokenizer, domains: Sequence[str], per_domain: int, prompt_tokens: int,
                     seed: int) -> tuple[list[list[int]], list[str]]:
    """Every domain's prompts (domain d from seed ``seed * 1000 + d``), and their labels."""
    from moejax.demo import corpus

    src = corpus.sources("eval", tuple(domains))
    prompts, labels = [], []
    for d, domain in enumerate(domains):
        rng = np.random.default_rng(seed * 1000 + d)
        prompts += domain_prompts(src, tokenizer, domain, per_domain, prompt_tokens, rng)
        labels += [domain] * per_domain
    return prompts, labels


def make_trace(model: str, prompts: list[list[int]], labels: Sequence[str | None],
               new_tokens: int, router_inputs: bool, batch: int = 16, name: str | None = None):
    """Greedy float32 generation of ``new_tokens`` per prompt (EOS ignored) with expert
    tracing; returns the ``moejax.traces.Trace`` (its ``model`` is ``name``, default
    ``model``) and the wall seconds."""
    from moejax import traces
    from serving import Generator

    generator = Generator(model, dtype="float32", trace_experts=True,
                          trace_router_inputs=router_inputs, max_batch_size=batch)
    requests = [{"id": i, "prompt_token_ids": p, "max_new_tokens": new_tokens,
                 "stop_token_ids": []} for i, p in enumerate(prompts)]
    start = time.perf_counter()
    results = generator.generate(requests)
    seconds = time.perf_counter() - start
    failed = [r for r in results if r.error is not None]
    if failed:
        raise RuntimeError(f"request {failed[0].id}: {failed[0].error}")
    trace = traces.from_results(results, prompts, list(labels), config=generator.config,
                                router_inputs=router_inputs, model=name or os.fspath(model))
    return trace, seconds


def reference_pair(model: str, traces_dir: str, *, per_domain: int, prompt_tokens: int,
                   new_tokens: int, seed: int = 0) -> dict[str, Any]:
    """{"": ``model``'s reference trace, "_twin": its twin's}, read from ``traces_dir``
    (both written there first, with router inputs, when either is missing)."""
    from moejax import traces

    paths = {suffix: os.path.join(traces_dir, trace_file_name(model, twin))
             for suffix, twin in (("", False), ("_twin", True))}
    if not all(os.path.isfile(p) for p in paths.values()):
        print(f"writing reference traces to {traces_dir} ...")
        write_reference_traces(model, traces_dir, per_domain=per_domain,
                               prompt_tokens=prompt_tokens, new_tokens=new_tokens,
                               router_inputs=True, seed=seed)
    return {suffix: traces.load(path) for suffix, path in paths.items()}


def write_reference_traces(model: str, out_dir: str, *, per_domain: int, prompt_tokens: int,
                           new_tokens: int, router_inputs: bool, seed: int = 0,
                           batch: int = 16) -> dict[str, Any]:
    """Write ``out_dir/<model>.npz`` and its untrained twin's ``out_dir/<model>-init.npz``
    (the built-in twin, or one written from the training script's seeded init), on the
    same prompts. Returns figures: paths, seconds, sizes."""
    from moejax import traces
    from serving.api import resolve_model_dir
    from serving.requests import TokenizerAdapter

    model_dir, _ = resolve_model_dir(model)
    domains = model_domains(model, model_dir)
    tokenizer = TokenizerAdapter.from_file(os.path.join(model_dir, "tokenizer.json"))
    prompts, labels = held_out_prompts(tokenizer, domains, per_domain, prompt_tokens, seed)
    os.makedirs(out_dir, exist_ok=True)
    figures: dict[str, Any] = {"requests": len(prompts), "domains": list(domains),
                               "prompt_tokens_total": sum(map(len, prompts))}
    with tempfile.TemporaryDirectory(prefix="moejax-untrained-") as tmp:
        twin = twin_name(model)
        if twin is None:          # a model directory: its untrained twin, written here
            untrained_model_dir(model_dir, tmp)
            twin = tmp
        for name, is_twin in ((model, False), (twin, True)):
            path = os.path.join(out_dir, trace_file_name(model, is_twin))
            trace, seconds = make_trace(name, prompts, labels, new_tokens, router_inputs, batch,
                                        name=os.path.basename(path)[:-len(".npz")])
            traces.save(path, trace)
            key = os.path.basename(path)[:-len(".npz")]
            figures[f"trace_path_{key}"] = path
            figures[f"trace_seconds_{key}"] = seconds
            figures[f"trace_mib_{key}"] = os.path.getsize(path) / 2 ** 20
            figures["decode_tokens_total"] = trace.num_decode_tokens
    return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="8 requests per domain, 32-token prompts, 8 new tokens")
    parser.add_argument("--json", dest="json_path", help="write the figures to this JSON file")
    parser.add_argument("--model", default="demo-e32", help="built-in model or directory")
    parser.add_argument("--out", default=os.path.join("out", "traces"),
                        help="directory of the traces (default out/traces)")
    parser.add_argument("--per-domain", type=int, help="requests per domain (default 64)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt length (default 64)")
    parser.add_argument("--new-tokens", type=int, help="greedy tokens decoded (default 32)")
    parser.add_argument("--router-inputs", action=argparse.BooleanOptionalAction, default=True,
                        help="record every token's router input at every layer (default on)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = dict(QUICK if args.quick else FULL)
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    if shape["new_tokens"] < 2 or shape["prompt_tokens"] < 1 or shape["per_domain"] < 1:
        parser.error("--new-tokens must be >= 2, --prompt-tokens and --per-domain >= 1")
    logging.getLogger("moejax.scorer").setLevel(logging.ERROR)
    start = time.perf_counter()
    figures = {"model": args.model, **shape, "router_inputs": args.router_inputs,
               "seed": args.seed}
    figures.update(write_reference_traces(args.model, args.out, router_inputs=args.router_inputs,
                                          seed=args.seed, **shape))
    figures["total_seconds"] = time.perf_counter() - start
    for key, value in figures.items():
        if key.startswith("trace_path_"):
            name = key[len("trace_path_"):]
            print(f"{value}: {figures['requests']} requests, "
                  f"{figures[f'trace_mib_{name}']:.1f} MiB, "
                  f"{figures[f'trace_seconds_{name}']:.1f} s")
    print(f"total {figures['total_seconds']:.0f} s")
    write_json(args.json_path, {k: v for k, v in figures.items() if k != "domains"})
    return figures


if __name__ == "__main__":
    main()
