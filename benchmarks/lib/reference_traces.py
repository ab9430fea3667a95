"""Reference expert traces of a built-in demo model and its untrained twin.

For each domain of the model's corpus (``moejax.demo.corpus``, held-out split):
``per_domain`` prompts of exactly ``prompt_tokens`` token ids (held-out texts of the domain
joined by newlines, cut), each decoded ``new_tokens`` greedy tokens with
``serving.Generator(trace_experts=True)`` (EOS ignored, so every request has the same
number of decode steps to align); one trace per model in the format of ``moejax.traces``:
``<dir>/<model>.npz`` and its untrained twin's ``<dir>/<model>-init.npz``, on the same
prompts. ``python -m benchmarks.expert_traces`` writes them; the ELDR, prefetch,
expert-parallel decode and specialization benchmarks read them (:func:`reference_traces`
writes them first when missing).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, Mapping, Sequence

import numpy as np

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


def model_prompts(model: str, per_domain: int, prompt_tokens: int, seed: int
                  ) -> tuple[str, tuple[str, ...], list[list[int]], list[str]]:
    """(model directory, domains, prompts, labels): :func:`held_out_prompts` of the
    domains ``model`` was trained on, tokenized with its tokenizer."""
    from serving.api import resolve_model_dir
    from serving.requests import TokenizerAdapter

    model_dir, _ = resolve_model_dir(model)
    domains = model_domains(model, model_dir)
    tokenizer = TokenizerAdapter.from_file(os.path.join(model_dir, "tokenizer.json"))
    prompts, labels = held_out_prompts(tokenizer, domains, per_domain, prompt_tokens, seed)
    return model_dir, domains, prompts, labels


def model_trace(model: str, *, per_domain: int, prompt_tokens: int, new_tokens: int,
                seed: int, router_inputs: bool = False) -> Any:
    """``model``'s trace (``moejax.traces.Trace``) of :func:`model_prompts`, in memory:
    a reference-shaped trace of the model alone (no twin)."""
    _, _, prompts, labels = model_prompts(model, per_domain, prompt_tokens, seed)
    return make_trace(model, prompts, labels, new_tokens, router_inputs=router_inputs)[0]


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

    model_dir, domains, prompts, labels = model_prompts(model, per_domain, prompt_tokens, seed)
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



def reference_traces(model: str, traces_dir: str, shape: Mapping[str, Any], seed: int,
                     new_tokens_key: str = "new_tokens") -> dict[str, Any]:
    """:func:`reference_pair` at a benchmark's trace shape (``shape["per_domain"]``,
    ``shape["prompt_tokens"]`` and the decode length under ``new_tokens_key``)."""
    return reference_pair(model, traces_dir, per_domain=shape["per_domain"],
                          prompt_tokens=shape["prompt_tokens"],
                          new_tokens=shape[new_tokens_key], seed=seed)
