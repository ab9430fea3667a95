"""``Generator``: the Python entry point for text generation (prefill + KV-cache decode).

By default requests run on the decode runtime (``moejax.decode``): a paged KV pool of
16-token blocks and continuous batching (``moejax.core.continuous``), on the ``resident``,
``offload`` or ``sync_ep`` backend, with fused or layer-by-layer steps
(:class:`GeneratorOptions`). ``batching="static"`` keeps the older baseline (batches of
``max_batch_size`` over a dense cache, run to their longest sequence). ``stream`` yields
tokens as they are produced; ``start_loop`` serves many callers from a background thread.

    from serving import Generator
    gen = Generator("demo")                        # or a local Hugging Face / converted dir
    [result] = gen.generate([{"prompt": "12 + 9 =", "max_new_tokens": 2}])   # " 21\n"
    result.token_ids, result.text, result.finish_reason

Requests (dicts or :class:`GenerationRequest`), fields:

* ``id`` (optional): a string or an integer, echoed in the result;
* ``prompt`` (text, encoded WITHOUT special tokens, as in scoring) or
  ``prompt_token_ids`` (a non-empty list of vocabulary ids) — exactly one;
* ``max_new_tokens`` (default 16, >= 1; prompt + max_new_tokens <= the model's context);
* ``temperature`` (default 0 = greedy; > 0 samples from softmax(logits / temperature));
  sampling runs in float32, so a temperature must be 0 or a normal float32 (between
  about 1.2e-38 and 3.4e38);
* ``top_p`` (default 1; in (0, 1], and not 0 in float32: sample among the most likely
  tokens holding top_p of the probability);
* ``seed`` (default 0; an integer in [0, 2**64)): the same seed gives the same tokens,
  whatever else is in the batch;
* ``stop_token_ids`` (default: the model's ``eos_token_id`` from generation_config.json or
  config.json, as Hugging Face ``generate`` stops on EOS; ``[]`` disables stopping).
* ``domain`` (optional, a string of at most 256 characters): the request's domain label,
  read only by the ``domain`` decode routing (the label oracle, ``decoders`` > 1).

Results come back in request order (:class:`GenerationResult`): ``token_ids`` are the
generated ids only, the stop token that ended generation INCLUDED (as Hugging Face
includes its EOS); ``text`` decodes them WITHOUT that stop token and without special
tokens; ``finish_reason`` is ``"stop"`` or ``"length"``. A bad request becomes a result
whose ``error`` reads ``"request 'ID': FIELD: problem"`` and the others still run.

With ``trace_experts=True`` each result carries ``experts = {"prefill": [L, n_prompt, k],
"decode": [L, n_generated - 1, k]}`` int32 arrays: the top-k expert ids (descending
router probability) of every prompt token and of every generated token that was fed back
(the last generated token never runs through the model). They come from the same compiled
programs as untraced runs, so tracing never changes the tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from moejax import checkpoint
from moejax.backends import check_multi_process
from moejax.backends.base import BackendError, require_devices
from moejax.core.continuous import GenerationLoop, Scheduler, SchedulerOptions, SequenceTooLong
from moejax.core.decoders import DecoderPool
from moejax.decode.factory import make_runner
from moejax.decode.programs import StepOptions
from moejax.distributed import DistributedOptions, join as join_processes
from moejax.eldr import fitfile
from moejax.eldr.policies import DEFAULT_TAU, POLICIES, Policy, check_tau, make_policy
from moejax.static.decode import DecodeEngine
from moejax.prefix_hash import BLOCK_SIZE
from moejax.sampling import MAX_SEED
from moejax.sequences import SequenceOutput, SequenceSpec
from serving.api import resolve_model_dir
from serving.compilation_cache import enable_compilation_cache
from serving.options import ScorerOptions
from serving.requests import (FieldChecker, RequestError, TokenizerAdapter, id_problem,
                              request_id_of, request_label, show, unexpected_error,
                              unknown_fields)
from serving.scorer_sharing import plan_sharing

DEFAULT_MAX_NEW_TOKENS = 16
MAX_DOMAIN_CHARS = 256
log = logging.getLogger(__name__)
_FLOAT32 = np.finfo(np.float32)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One generation request, as the user wrote it (see the module docstring)."""

    id: str | int | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    domain: str | None = None


_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationRequest))


@dataclasses.dataclass
class GenerationResult:
    """The answer to one request. ``experts`` is set only with ``trace_experts``."""

    id: str | int | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    experts: dict[str, np.ndarray] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``experts`` (nested lists [L][n][k]) appears only when set."""
        d: dict[str, Any] = {"id": self.id, "token_ids": self.token_ids, "text": self.text,
                             "finish_reason": self.finish_reason, "error": self.error,
                             "prompt_tokens": self.prompt_tokens}
        if self.experts is not None:
            d["experts"] = {name: np.asarray(ids).tolist() for name, ids in self.experts.items()}
        return d


BATCHING = ("continuous", "static")
SPLIT_BACKENDS = ("resident", "offload")   # the backends a decoder of several may use
STEPS = ("auto", "fused", "layerwise")
RUNTIMES = ("continuous", "mu_queue")
DEFAULT_KV_CACHE_MIB = 1024


@dataclasses.dataclass(frozen=True)
class GeneratorOptions:
    """How a :class:`Generator` runs.

    * ``dtype`` ("float32" | "bfloat16" | "auto": bfloat16 on GPU, float32 on CPU);
    * ``batching``: "continuous" (default: sequences join and leave the running batch at
      every step, ``moejax.core.continuous``) or "static" (the old baseline: batches of
      ``max_batch_size`` run to their longest sequence; resident, fused only);
    * ``step``: "fused" (every layer in one program), "layerwise" (the host drives each
      layer: it sees the routing between attention and experts) or "auto" (layerwise
      where the backend needs it, i.e. offload; fused otherwise);
    * ``backend`` ("resident" | "offload" | "sync_ep"), ``devices`` and
      ``backend_options`` (a dict of the backend's own options) as for the Scorer;
    * ``max_batch_size``: sequences decoded together; ``max_prefill_tokens``: prompt
      tokens prefilled per step (longer prompts take several steps), in rows of
      ``prefill_row_tokens`` (default 64) packed from several prompts;
    * ``precompile``: compile every step program when the Generator is built (a few
      seconds per program on CPU; no request then waits on a compile); continuous
      batching only;
    * ``kv_cache_blocks`` or ``kv_cache_mib`` (at most one): the paged KV pool's size
      in 16-token blocks or MiB per rank; default: enough for ``max_batch_size``
      sequences at the model's full context, capped at 1024 MiB;
    * ``trace_experts`` (every token's top-k ids and gate weights) and
      ``trace_router_inputs`` (also the router inputs; needs ``trace_experts``);
    * ``expert_impl`` and ``tile_rows`` (as for the Scorer), ``compilation_cache`` (as
      for the Scorer: default None leaves JAX's process-wide compilation cache alone);
    * ``decoders`` (default 1): with K >= 2, prefill runs on a prefill engine (device 0)
      and decode on K decoders, decoder i on device i (``moejax.core.decoders``); resident or
      offload backend on one device each. Each decoder runs up to ``max_batch_size``
      sequences and has its own pool (``kv_cache_*``: per decoder; the prefill engine's
      pool has the same size). ``routing`` picks each request's decoder at the
      hand-off: "jsq" (default), "round_robin", "p2c", "random", "domain" (the label
      oracle: the requests' ``domain`` field) or "eldr" (expert locality,
      ``moejax.eldr``: needs ``eldr_fit``, a fit file made by ``moejax eldr-fit`` for
      this model and K decoders, and takes ``eldr_tau`` in [0, 1], default 0.1);
      ``routing_seed`` seeds random and p2c; ``routing`` may also be a
      ``moejax.eldr.policies.Policy`` object over K decoders (custom routing). Tokens do
      not depend on the routing.
    * ``prefetch`` (offload backend, layerwise decode; ``moejax.prefetch``): "none"
      (default: each layer's experts are copied after it routes), "router", "quasi",
      "estimator", "hybrid" (predict layer l+1's experts from layer l and copy them while
      layer l computes), "oracle" (the true experts) or "layer" (every expert of the next
      layer); ``prefetch_mode`` "exact" (default: compute with the true experts, copy
      misses on demand: tokens equal resident decode) or "speculative" (compute layer
      l >= 1 with the predicted experts and gate weights, never copy a miss: tokens may
      change); ``prefetch_files``: the default-vector file (``moejax prefetch-calibrate``,
      for quasi/estimator/hybrid) and the estimator file (``python -m
      moejax.prefetch.train``, for estimator/hybrid), one path or a list.
    * ``runtime``: "continuous" (default: the paged decode runtime above) or "mu_queue"
      (AsyncMoE, ``moejax.asyncmoe``: every one of ``devices`` is an attention rank and
      hosts a contiguous share of the experts; tokens wait in per-(layer, expert) and
      per-layer queues, and ``scheduler`` — "defrag" (default), "most_tokens" or
      "first_layer" — picks what an idle device runs). It takes whole calls (no
      ``start_loop``), the resident backend's options only, and no expert traces.
    """

    dtype: str = "auto"
    trace_experts: bool = False
    trace_router_inputs: bool = False
    batching: str = "continuous"
    step: str = "auto"
    backend: str = "resident"
    devices: int = 1
    backend_options: Mapping[str, Any] | None = None
    max_batch_size: int = 8
    max_prefill_tokens: int = 512
    prefill_row_tokens: int = 64
    precompile: bool = False
    kv_cache_blocks: int | None = None
    kv_cache_mib: float | None = None
    expert_impl: str = "auto"
    tile_rows: int | None = None
    compilation_cache: str | bool | None = None
    decoders: int = 1
    routing: "str | Policy | None" = None
    eldr_tau: float | None = None
    eldr_fit: str | os.PathLike | None = None
    routing_seed: int = 0
    prefetch: str | None = None
    prefetch_mode: str | None = None
    prefetch_files: Any = None
    runtime: str = "continuous"
    scheduler: str | None = None

    def __post_init__(self) -> None:
        for name in ("trace_experts", "trace_router_inputs", "precompile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.trace_router_inputs and not self.trace_experts:
            raise ValueError("trace_router_inputs needs trace_experts=True")
        for name in ("max_batch_size", "max_prefill_tokens", "prefill_row_tokens", "devices"):
            _positive_int(name, getattr(self, name))
        if self.kv_cache_blocks is not None:
            _positive_int("kv_cache_blocks", self.kv_cache_blocks)
        if self.kv_cache_mib is not None and (
                isinstance(self.kv_cache_mib, bool)
                or not isinstance(self.kv_cache_mib, (int, float)) or not self.kv_cache_mib > 0):
            raise ValueError(f"kv_cache_mib must be a positive number, got {self.kv_cache_mib!r}")
        if self.kv_cache_blocks is not None and self.kv_cache_mib is not None:
            raise ValueError("give kv_cache_blocks or kv_cache_mib, not both")
        if self.batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {self.batching!r}")
        if self.step not in STEPS:
            raise ValueError(f"step must be one of {STEPS}, got {self.step!r}")
        if self.backend_options is not None and not isinstance(self.backend_options, Mapping):
            raise ValueError(f"backend_options must be a dict, got "
                             f"{type(self.backend_options).__name__}")
        if self.batching == "static" and (self.backend != "resident" or self.step == "layerwise"
                                          or self.trace_router_inputs):
            raise ValueError("batching='static' is the resident, fused baseline (no other "
                             "backend, no layerwise step, no router-input traces); use "
                             "batching='continuous'")
        if self.batching == "static" and self.precompile:
            raise ValueError("precompile applies to batching='continuous' (static batches "
                             "compile per prompt length)")
        self.scorer_view()   # validates dtype, expert_impl, tile_rows as the Scorer does
        self._check_decoders()
        self._check_prefetch()
        self._check_runtime()

    def _check_runtime(self) -> None:
        from moejax.asyncmoe.schedulers import SCHEDULER_NAMES

        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES}, got {self.runtime!r}")
        if self.runtime == "continuous":
            if self.scheduler is not None:
                raise ValueError("scheduler picks the μ-queue runtime's next queue: give it "
                                 "with runtime='mu_queue'")
            return
        if self.scheduler is not None and self.scheduler not in SCHEDULER_NAMES:
            raise ValueError(f"scheduler must be one of {SCHEDULER_NAMES}, got "
                             f"{self.scheduler!r}")
        clashes = [name for name, bad in (
            ("batching='static'", self.batching != "continuous"),
            (f"backend={self.backend!r}", self.backend != "resident"),
            ("backend_options", bool(self.backend_options)),
            ("decoders", self.decoders != 1),
            ("prefetch", self.prefetch_options() != {}),
            ("trace_experts", self.trace_experts),
            ("precompile", self.precompile),
            ("kv_cache_mib", self.kv_cache_mib is not None),
            ("step='layerwise'", self.step == "layerwise")) if bad]
        if clashes:
            raise ValueError(f"runtime='mu_queue' places the experts itself over `devices` and "
                             f"runs whole calls; it does not take {', '.join(clashes)}")

    def _check_prefetch(self) -> None:
        from moejax.prefetch.runner import check_choice

        given = [name for name in ("prefetch", "prefetch_mode", "prefetch_files")
                 if getattr(self, name) is not None]
        if not given:
            return
        if self.backend != "offload" or self.batching != "continuous" \
                or self.resolved_step() != "layerwise":
            raise ValueError(f"{', '.join(given)}: expert prefetch runs on backend='offload' "
                             f"with continuous batching and layerwise steps (got backend="
                             f"{self.backend!r}, batching={self.batching!r}, step={self.step!r})")
        try:
            check_choice(self.prefetch or "none", self.prefetch_mode or "exact")
        except BackendError as exc:
            raise ValueError(str(exc)) from None

    def prefetch_options(self) -> dict[str, Any]:
        """The offload runner's prefetch keywords ({} when prefetch is not asked for)."""
        if self.prefetch is None and self.prefetch_mode is None and self.prefetch_files is None:
            return {}
        return {"prefetch": self.prefetch or "none",
                "prefetch_mode": self.prefetch_mode or "exact",
                "prefetch_files": self.prefetch_files or ()}

    def _check_decoders(self) -> None:
        _positive_int("decoders", self.decoders)
        if not isinstance(self.routing_seed, int) or isinstance(self.routing_seed, bool) \
                or self.routing_seed < 0:
            raise ValueError(f"routing_seed must be a non-negative integer, got "
                             f"{self.routing_seed!r}")
        if self.decoders == 1:
            given = [name for name in ("routing", "eldr_tau", "eldr_fit")
                     if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} choose among several decoders; give "
                                 f"decoders >= 2 (decoders=1 prefills and decodes together)")
            return
        if self.batching != "continuous":
            raise ValueError("decoders >= 2 needs batching='continuous'")
        if self.backend not in SPLIT_BACKENDS or self.devices != 1:
            raise ValueError(f"decoders >= 2 runs each decoder on one device with backend "
                             f"{' or '.join(map(repr, SPLIT_BACKENDS))}, devices=1; got "
                             f"backend={self.backend!r}, devices={self.devices}")
        routing = self.resolved_routing()
        if isinstance(routing, Policy):
            if routing.num_decoders != self.decoders or self.eldr_tau is not None \
                    or self.eldr_fit is not None:
                raise ValueError(f"a routing policy object routes over its own "
                                 f"{routing.num_decoders} decoders (decoders={self.decoders}) "
                                 f"and takes no eldr_tau or eldr_fit")
            return
        if routing not in POLICIES:
            raise ValueError(f"routing must be one of {POLICIES}, got {routing!r}")
        if self.eldr_tau is not None:
            if routing != "eldr":
                raise ValueError(f"eldr_tau applies to routing='eldr', not {routing!r}")
            check_tau(self.eldr_tau)
        if routing == "eldr" and self.eldr_fit is None:
            raise ValueError("routing='eldr' needs eldr_fit=PATH, a fit file made by "
                             "`moejax eldr-fit TRACES -o PATH --decoders K`")
        if routing != "eldr" and self.eldr_fit is not None:
            raise ValueError(f"eldr_fit applies to routing='eldr', not {routing!r}")

    def resolved_routing(self) -> "str | Policy":
        """The decode routing policy (decoders >= 2): "jsq" unless given."""
        return "jsq" if self.routing is None else self.routing

    def resolved_step(self) -> str:
        """The step mode: "auto" is layerwise on offload (the host picks the experts to
        copy each layer), fused elsewhere."""
        if self.step != "auto":
            return self.step
        return "layerwise" if self.backend == "offload" else "fused"

    def scorer_view(self) -> ScorerOptions:
        """The options shared with the Scorer, resolved by the same code."""
        return ScorerOptions(dtype=self.dtype, expert_impl=self.expert_impl,
                             tile_rows=self.tile_rows, compilation_cache=self.compilation_cache)


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def make_options(options: Mapping[str, Any]) -> GeneratorOptions:
    """Keyword options -> :class:`GeneratorOptions` (None values mean the default)."""
    known = {f.name for f in dataclasses.fields(GeneratorOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown Generator option(s) {unknown}; known: {sorted(known)}")
    return GeneratorOptions(**{k: v for k, v in options.items() if v is not None})


def model_eos_ids(model_dir: str, vocab_size: int) -> frozenset[int]:
    """The model's EOS id(s): generation_config.json wins over config.json (as in
    transformers); ids outside the vocabulary are dropped (they cannot be generated)."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as fh:
                config = json.load(fh)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(f"{path}: not a valid JSON file ({exc})") from None
        eos = config.get("eos_token_id") if isinstance(config, dict) else None
        if eos is None:
            continue
        ids = eos if isinstance(eos, list) else [eos]
        return frozenset(int(t) for t in ids if isinstance(t, int) and 0 <= t < vocab_size)
    return frozenset()


# ----------------------------------------------------------------------------- parsing
def _as_request(obj: Any, index: int) -> GenerationRequest:
    """A dict (JSON object) or a GenerationRequest -> GenerationRequest; unknown keys are
    an error (they are usually typos)."""
    if isinstance(obj, GenerationRequest):
        return obj
    if not isinstance(obj, Mapping):
        raise RequestError(f"{request_label(None, index)}: expected an object (dict), "
                           f"got {type(obj).__name__}", index=index)
    unknown = unknown_fields(obj, _FIELDS)
    if unknown:
        raise RequestError(f"{request_label(obj.get('id'), index)}: unknown field(s) "
                           f"{', '.join(show(k) for k in unknown)} (accepted: "
                           f"{', '.join(_FIELDS)})", index=index, field=unknown[0])
    return GenerationRequest(**{name: obj[name] for name in _FIELDS if name in obj})


def _prompt_ids(check: FieldChecker, req: GenerationRequest, tokenizer: TokenizerAdapter,
                vocab_size: int) -> list[int]:
    """Exactly one of prompt / prompt_token_ids, as non-empty vocabulary ids."""
    if (req.prompt is None) == (req.prompt_token_ids is None):
        raise check.fail("prompt", "give exactly one of prompt or prompt_token_ids (got "
                                   f"{'neither' if req.prompt is None else 'both'})")
    if req.prompt_token_ids is not None:
        return check.token_ids(req.prompt_token_ids, "prompt_token_ids", vocab_size=vocab_size)
    if not isinstance(req.prompt, str):
        raise check.fail("prompt", f"must be a str, got {type(req.prompt).__name__}")
    if not req.prompt:
        raise check.fail("prompt", "is empty")
    try:
        ids = tokenizer.encode(req.prompt)
    except Exception as exc:  # noqa: BLE001  (any tokenizer failure is this request's only)
        raise check.fail("prompt", str(exc)) from exc
    if not ids:
        raise check.fail("prompt", f"{req.prompt!r} tokenizes to no tokens")
    return check.token_ids(ids, "prompt (tokenized)", vocab_size=vocab_size)


def parse_generation_request(obj: Any, index: int, tokenizer: TokenizerAdapter, *,
                             vocab_size: int, max_context: int,
                             default_stop: frozenset[int]) -> SequenceSpec:
    """Validate and tokenize one request -> :class:`SequenceSpec`; raises RequestError
    (only: anything else a request makes the checks raise becomes one, so that one bad
    request never sinks the batch)."""
    try:
        return _parse(obj, index, tokenizer, vocab_size=vocab_size, max_context=max_context,
                      default_stop=default_stop)
    except RequestError:
        raise
    except Exception as exc:  # noqa: BLE001  (safety net)
        raise RequestError(unexpected_error(obj, index, exc), index=index) from exc


def _parse(obj: Any, index: int, tokenizer: TokenizerAdapter, *, vocab_size: int,
           max_context: int, default_stop: frozenset[int]) -> SequenceSpec:
    """:func:`parse_generation_request` without the safety net."""
    req = _as_request(obj, index)
    check = FieldChecker(req.id, index)
    problem = id_problem(req.id)
    if problem is not None:
        raise check.fail("id", problem)
    prompt = _prompt_ids(check, req, tokenizer, vocab_size)
    max_new = DEFAULT_MAX_NEW_TOKENS if req.max_new_tokens is None else check.integer(
        req.max_new_tokens, "max_new_tokens", 1)
    if len(prompt) + max_new > max_context:
        raise check.fail("max_new_tokens", f"prompt ({len(prompt)} tokens) + max_new_tokens "
                                           f"({max_new}) = {len(prompt) + max_new}, more than "
                                           f"the model's context ({max_context})")
    temperature = 0.0 if req.temperature is None else check.number(req.temperature,
                                                                    "temperature")
    if temperature < 0:
        raise check.fail("temperature", f"must be >= 0 (0 = greedy), got {temperature}")
    if 0 < temperature < _FLOAT32.tiny:
        # A subnormal float32 (or 0 after rounding) would not divide the logits sanely.
        raise check.fail("temperature", f"must be 0 (greedy) or at least {_FLOAT32.tiny:.7g} "
                                        f"(the smallest normal float32), got {temperature:g}")
    top_p = 1.0 if req.top_p is None else check.number(req.top_p, "top_p")
    if not 0 < top_p <= 1:
        raise check.fail("top_p", f"must lie in (0, 1], got {top_p}")
    if np.float32(top_p) == 0:
        raise check.fail("top_p", f"must not round to 0 in float32, got {top_p:g}")
    seed = 0 if req.seed is None else check.integer(req.seed, "seed", 0, MAX_SEED)
    stop = default_stop if req.stop_token_ids is None else frozenset(
        check.token_ids(req.stop_token_ids, "stop_token_ids", vocab_size=vocab_size,
                        allow_empty=True))
    domain = req.domain
    if domain is not None and (not isinstance(domain, str) or len(domain) > MAX_DOMAIN_CHARS):
        raise check.fail("domain", f"must be a string of at most {MAX_DOMAIN_CHARS} "
                                   f"characters, got {show(domain)}")
    return SequenceSpec(prompt=tuple(prompt), max_new_tokens=max_new, temperature=temperature,
                        top_p=top_p, seed=seed, stop_token_ids=stop, domain=domain)


# ----------------------------------------------------------------------------- generator
@dataclasses.dataclass(frozen=True)
class GenerationEvent:
    """New tokens of request ``index`` (its position in the ``stream`` call, or the
    handle's for a loop submission); ``result`` is set on the request's last event."""

    index: int
    token_ids: list[int]
    result: GenerationResult | None = None


def check_decode_processes(opts: GeneratorOptions) -> None:
    """BackendError unless ``opts`` can decode over the processes of this run (no-op in one
    process): only continuous batching on ``sync_ep`` spans them (its one mesh holds every
    process's devices); the other runners place the model on one device."""
    if jax.process_count() == 1:
        return
    single = [f"{name}={value!r}" for name, value, ok in (
        ("backend", opts.backend, opts.backend == "sync_ep"),
        ("runtime", opts.runtime, opts.runtime == "continuous"),
        ("batching", opts.batching, opts.batching == "continuous"),
        ("decoders", opts.decoders, opts.decoders == 1)) if not ok]
    if single:
        raise BackendError(f"generation over {jax.process_count()} processes runs on "
                           f"backend='sync_ep' with continuous batching and one decoder; "
                           f"got {', '.join(single)}")
    check_multi_process(opts.backend, opts.devices)


class CallGuard:
    """Lets one call at a time drive a Generator's engine (its KV pool, scheduler and
    buffers are donated and rewritten by every step, so two calls interleaving steps read
    each other's deleted buffers): a ``generate`` or ``stream`` call holds it from
    :meth:`acquire` to :meth:`release`, waiting for the call before it, as the Scorer's
    runs wait on its engine's lock; a generation loop (:meth:`Generator.start_loop`)
    holds it from :meth:`open_loop` until :meth:`close_loop`.

    A call that could only deadlock is refused instead of waiting: one from the thread
    whose stream is still open (an unfinished ``stream`` iterator), and any while a loop
    is open (its thread owns the scheduler until ``close()``; a call already waiting when
    a loop opens waits for it to close)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: int | None = None      # the thread ident of the call holding it
        self._loop_open = False

    def _refuse_deadlock(self, what: str) -> None:
        if self._loop_open:
            raise RuntimeError(f"{what}: this Generator's generation loop (start_loop()) "
                               f"is open; submit to the loop, or close() it first")
        if self._holder == threading.get_ident():
            raise RuntimeError(f"{what}: this thread's earlier stream() on the Generator is "
                               f"still open; exhaust or close() it first")

    def acquire(self, what: str) -> None:
        """Wait until no other call drives the Generator, then hold it."""
        self._refuse_deadlock(what)
        self._lock.acquire()
        self._holder = threading.get_ident()

    def release(self) -> None:
        self._holder = None
        self._lock.release()

    def open_loop(self) -> None:
        """Hold the Generator for a loop (released by :meth:`close_loop`, from any thread)."""
        self.acquire("start_loop()")
        self._holder, self._loop_open = None, True

    def close_loop(self) -> None:
        if self._loop_open:
            self._loop_open = False
            self._lock.release()


class Generator:
    """Generates text with one model: ``Generator(model, **options).generate(requests)``.

    ``model``: a built-in model (``"demo"``, ``"demo-e32"``, ``"demo-e32-init"``) or a
    local Hugging Face / converted moejax directory (with
    ``tokenizer.json``). Options: see :class:`GeneratorOptions`. With continuous batching
    the paged KV pool lives as long as the Generator, so a later call whose prompts start
    with the same full 16-token blocks (a shared system prompt) reuses their keys/values.
    Thread safety: calls from several threads are safe and each returns what it returns
    alone (greedy tokens are identical). A Generator runs one call at a time: a
    ``generate`` or ``stream`` call waits until the call before it has finished (a
    ``stream`` holds the Generator from its first event until it is exhausted or closed),
    as the Scorer serializes its runs. While a loop from :meth:`start_loop` is open it
    owns the Generator: ``generate``/``stream`` then raise RuntimeError (submit to the
    loop instead, whose ``submit`` is thread-safe), as does a second ``start_loop``.

    ``share_with=scorer`` builds the Generator beside a :class:`serving.Scorer` of the same
    model on the same device, sharing its weights (both resident) and its KV pool (one
    rank): one copy of each, and prompt blocks either side computed are read by the other
    in place (:mod:`serving.scorer_sharing`). What cannot be shared is kept apart and the
    reason logged; :attr:`shared_with_scorer` says which. ``moejax serve`` does this.

    ``distributed`` (:class:`moejax.distributed.DistributedOptions` or its dict): join the
    other processes of a multi-process run first (backend ``sync_ep`` over every
    process's devices; every process runs the same requests and gets the same tokens).
    """

    def __init__(self, model: str | os.PathLike = "demo", *, share_with: Any = None,
                 distributed: DistributedOptions | dict[str, Any] | None = None,
                 **options: Any):
        join_processes(distributed)   # before anything computes (see moejax.distributed)
        self.options = make_options(options)
        shared = self.options.scorer_view()
        enable_compilation_cache(shared.compilation_cache)
        self.model_dir, self.is_demo = resolve_model_dir(model)
        dtype = shared.resolved_dtype()
        self.config, params, tokenizer = checkpoint.load_model_dir(self.model_dir, dtype.name)
        self.sharing = (plan_sharing(share_with, self.config, dtype, self.options)
                        if share_with is not None else None)
        self.tokenizer = TokenizerAdapter(tokenizer)
        self.eos_token_ids = model_eos_ids(self.model_dir, self.config.vocab_size)
        opts = self.options
        check_decode_processes(opts)
        self.engine: DecodeEngine | None = None
        self.scheduler: Scheduler | DecoderPool | None = None
        self.mu_queue: Any = None
        if opts.runtime == "mu_queue":
            from moejax.asyncmoe.runtime import MuQueueRuntime

            self.mu_queue = MuQueueRuntime(
                self.config, params, require_devices("mu_queue", opts.devices),
                scheduler=opts.scheduler or "defrag", dtype=dtype,
                blocks_per_rank=opts.kv_cache_blocks)
        elif opts.batching == "static":
            self.engine = DecodeEngine(params, self.config, expert_impl=opts.expert_impl,
                                       tile_rows=opts.tile_rows,
                                       max_batch_size=opts.max_batch_size)
        elif opts.decoders == 1:
            runner = self._runner(params, dtype, devices=opts.devices)
            store = None if self.sharing is None else self.sharing.kv_store
            self.scheduler = Scheduler(
                runner, self.kv_cache_blocks(runner) if store is None else store.num_blocks,
                self._scheduler_options(), store=store)
        else:
            self.scheduler = self._decoder_pool(params, dtype)
        if self.scheduler is not None and opts.precompile:
            self.scheduler.precompile()
        self.call_guard = CallGuard()
        del params  # the engine or runner holds the device copy

    @property
    def shared_with_scorer(self) -> dict[str, str] | None:
        """With ``share_with``: ``weights`` and ``kv_pool``, each ``"shared"`` or why not;
        None without."""
        return None if self.sharing is None else self.sharing.describe()

    def _runner(self, params: Any, dtype: Any, **placement: Any) -> Any:
        opts = self.options
        if self.sharing is not None and self.sharing.placement is not None:
            params, placement["placement"] = None, self.sharing.placement
        return make_runner(opts.backend, self.config, params, dtype=dtype,
                           opts=StepOptions(expert_impl=opts.expert_impl,
                                            tile_rows=opts.tile_rows,
                                            router_inputs=opts.trace_router_inputs),
                           **placement, **dict(opts.backend_options or {}),
                           **opts.prefetch_options())

    def _scheduler_options(self, **changes: Any) -> SchedulerOptions:
        opts = self.options
        return dataclasses.replace(SchedulerOptions(
            max_batch_size=opts.max_batch_size, max_prefill_tokens=opts.max_prefill_tokens,
            prefill_row_tokens=opts.prefill_row_tokens, step=opts.resolved_step(),
            trace=opts.trace_experts), **changes)

    def _decoder_pool(self, params: Any, dtype: Any) -> DecoderPool:
        """A prefill engine on device 0 and ``decoders`` decoders, decoder i on device i,
        behind the routing policy (:class:`GeneratorOptions`)."""
        opts, count = self.options, self.options.decoders
        devices = jax.devices()
        if count > len(devices):
            hint = (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before "
                    "JAX starts)" if devices[0].platform == "cpu" else "")
            raise BackendError(f"decoders={count} needs one device per decoder, but only "
                               f"{len(devices)} {devices[0].platform} device(s) exist{hint}")
        routing = opts.resolved_routing()
        if isinstance(routing, Policy):
            policy = routing
        else:
            fit = None
            if routing == "eldr":
                fit = fitfile.load(opts.eldr_fit)
                fit.check_model(self.config, fitfile.model_fingerprint(
                    self.config, params["layers"]["router"]), count,
                    where=f"eldr_fit {os.fspath(opts.eldr_fit)!r}")
            policy = make_policy(routing, count, fit=fit,
                                 tau=DEFAULT_TAU if opts.eldr_tau is None else opts.eldr_tau,
                                 seed=opts.routing_seed)
        prefill_runner = self._runner(params, dtype, device=devices[0])
        # One decoder's pool size: the prefill engine holds prompts only, each until its
        # decoder adopts it (when it runs short, prefill waits for adoptions to free blocks).
        prefill = Scheduler(prefill_runner, self.kv_cache_blocks(prefill_runner),
                            self._scheduler_options(
                                max_batch_size=count * opts.max_batch_size, handoff=True,
                                expert_counts=policy.reads_counts))
        decoders = []
        for index in range(count):
            # Decoder 0 shares the prefill engine's device and (resident) its placement.
            shared = getattr(prefill_runner, "placement", None) if index == 0 else None
            runner = (self._runner(None, dtype, placement=shared) if shared is not None
                      else self._runner(params, dtype, device=devices[index]))
            decoders.append(Scheduler(runner, self.kv_cache_blocks(runner),
                                      self._scheduler_options(record_steps=True)))
        return DecoderPool(prefill, decoders, policy)

    def kv_cache_blocks(self, runner: Any) -> int:
        """The paged pool's blocks per rank (:class:`GeneratorOptions`)."""
        opts, block = self.options, runner.block_bytes()
        if opts.kv_cache_blocks is not None:
            return opts.kv_cache_blocks
        if opts.kv_cache_mib is not None:
            blocks = int(opts.kv_cache_mib * 2**20 // block)
            if blocks < 1:
                raise ValueError(f"kv_cache_mib={opts.kv_cache_mib} holds no KV block "
                                 f"({block} bytes each)")
            return blocks
        per_rank = -(-opts.max_batch_size // runner.num_ranks)
        full = per_rank * -(-self.config.max_context // BLOCK_SIZE)
        return max(1, min(full, DEFAULT_KV_CACHE_MIB * 2**20 // block))

    # ----------------------------------------------------------------- entry points
    def generate(self, requests: Sequence[GenerationRequest | Mapping[str, Any]]
                 ) -> list[GenerationResult]:
        """One result per request, in request order; bad requests get ``error`` set.
        Thread-safe: waits for another thread's call on this Generator to finish."""
        results: list[GenerationResult | None] = [None] * _count(requests)
        events = self.stream(requests)
        try:
            for event in events:
                if event.result is not None:
                    results[event.index] = event.result
        finally:
            events.close()
        return results

    def stream(self, requests: Sequence[GenerationRequest | Mapping[str, Any]]
               ) -> Iterator[GenerationEvent]:
        """Events as tokens are produced (continuous batching: every step; static: each
        batch's tokens when it finishes). Every request ends with one event whose
        ``result`` is set; a bad request's comes first.

        Thread-safe: from its first event until it is exhausted or closed, a stream holds
        the Generator (another thread's call waits; this thread's own second call raises
        RuntimeError rather than deadlock)."""
        requests = _as_list(requests)
        self.call_guard.acquire("stream()/generate()")
        try:
            yield from self._stream_held(requests)
        finally:
            self.call_guard.release()

    def _stream_held(self, requests: list[Any]) -> Iterator[GenerationEvent]:
        """:meth:`stream`'s events, the call guard held."""
        specs: dict[int, SequenceSpec] = {}
        for index, obj in enumerate(requests):
            try:
                specs[index] = self.parse(obj, index)
            except RequestError as exc:
                yield GenerationEvent(index, [], GenerationResult(id=request_id_of(obj),
                                                                  error=str(exc)))
        if self.engine is not None or self.mu_queue is not None:
            indices = list(specs)
            outputs = (self.mu_queue.generate([specs[i] for i in indices])
                       if self.mu_queue is not None else
                       self.engine.generate([specs[i] for i in indices],
                                            trace=self.options.trace_experts))
            for index, out in zip(indices, outputs):
                yield GenerationEvent(index, list(out.token_ids),
                                      self._result(requests[index], index, specs[index], out))
            return
        yield from self._stream_continuous(requests, specs)

    def _stream_continuous(self, requests: list[Any], specs: dict[int, SequenceSpec]
                           ) -> Iterator[GenerationEvent]:
        scheduler = self.scheduler
        index_of: dict[int, int] = {}
        for index, spec in specs.items():
            try:
                index_of[scheduler.submit(spec).seq_id] = index
            except SequenceTooLong as exc:
                yield GenerationEvent(index, [], GenerationResult(
                    id=request_id_of(requests[index]),
                    error=f"{request_label(request_id_of(requests[index]), index)}: "
                          f"max_new_tokens: {exc}"))
        try:
            while scheduler.busy:
                for event in scheduler.step():
                    index = index_of[event.sequence.seq_id]
                    result = None if event.output is None else self._result(
                        requests[index], index, specs[index], event.output)
                    yield GenerationEvent(index, event.token_ids, result)
        finally:   # a consumer that stops early leaves nothing running
            for seq in list(scheduler.running) + list(scheduler.waiting):
                scheduler.cancel(seq)
            while scheduler.busy:
                scheduler.step()

    def parse(self, obj: Any, index: int) -> SequenceSpec:
        """One request -> :class:`SequenceSpec` (raises RequestError naming the field)."""
        return parse_generation_request(obj, index, self.tokenizer,
                                        vocab_size=self.config.vocab_size,
                                        max_context=self.config.max_context,
                                        default_stop=self.eos_token_ids)

    def start_loop(self) -> "GeneratorLoop":
        """A background loop that many callers submit to (servers, benchmarks)."""
        if self.scheduler is None:
            raise ValueError("a generation loop needs batching='continuous' and "
                             "runtime='continuous'")
        self.call_guard.open_loop()
        try:
            return GeneratorLoop(self)
        except BaseException:
            self.call_guard.close_loop()
            raise

    def _result(self, obj: Any, index: int, spec: SequenceSpec, out: SequenceOutput
                ) -> GenerationResult:
        req = _as_request(obj, index)
        if out.error is not None:
            return GenerationResult(id=req.id, token_ids=list(out.token_ids),
                                    finish_reason=out.finish_reason, error=out.error,
                                    prompt_tokens=len(spec.prompt))
        shown = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
        experts = None
        if self.options.trace_experts:
            experts = {"prefill": out.prefill_experts, "decode": out.decode_experts}
            for name in ("prefill_weights", "decode_weights", "prefill_router_inputs",
                         "decode_router_inputs"):
                if getattr(out, name) is not None:
                    experts[name] = getattr(out, name)
        return GenerationResult(id=req.id, token_ids=list(out.token_ids),
                                text=self.tokenizer.tokenizer.decode(shown,
                                                                     skip_special_tokens=True),
                                finish_reason=out.finish_reason, prompt_tokens=len(spec.prompt),
                                experts=experts)


class SubmittedRequest:
    """A request in a :class:`GeneratorLoop`: ``cancel()`` frees its sequence at the next
    step (its last event then has finish_reason "cancelled")."""

    def __init__(self, loop: "GeneratorLoop", sequence: Any):
        self._loop, self.sequence = loop, sequence

    def cancel(self) -> None:
        self._loop.loop.cancel(self.sequence)


class GeneratorLoop:
    """A :class:`~moejax.core.continuous.GenerationLoop` over a Generator's scheduler that
    takes requests as :meth:`Generator.generate` does."""

    def __init__(self, generator: Generator):
        self.generator = generator
        self.loop = GenerationLoop(generator.scheduler)
        # Whether this loop still holds the Generator (Generator.start_loop took it): a
        # second close() must not release a later loop's hold.
        self._holds_generator = True

    def submit(self, request: GenerationRequest | Mapping[str, Any],
               on_event: Callable[[GenerationEvent], None], index: int = 0
               ) -> SubmittedRequest:
        """Queue one request; ``on_event`` gets its :class:`GenerationEvent` s from the
        loop thread (``index`` is echoed in them). A bad request raises RequestError
        naming the field (nothing is queued)."""
        generator = self.generator
        spec = generator.parse(request, index)

        def deliver(event: Any) -> None:
            result = None if event.output is None else generator._result(
                request, index, spec, event.output)
            on_event(GenerationEvent(index, event.token_ids, result))

        try:
            sequence = self.loop.submit(spec, deliver)
        except SequenceTooLong as exc:
            raise RequestError(f"{request_label(request_id_of(request), index)}: "
                               f"max_new_tokens: {exc}", index=index,
                               field="max_new_tokens") from None
        return SubmittedRequest(self, sequence)

    def occupancy(self) -> int:
        """KV blocks held by running sequences."""
        return self.generator.scheduler.occupancy()

    def close(self) -> None:
        """Finish what was submitted, then stop the thread and hand the Generator back to
        ``generate``/``stream`` calls."""
        try:
            self.loop.close()
        finally:
            if self._holds_generator:
                self._holds_generator = False
                self.generator.call_guard.close_loop()


def _as_list(requests: Any) -> list[Any]:
    if isinstance(requests, (str, bytes, Mapping, GenerationRequest)):
        raise TypeError("generate() takes a list of requests; wrap a single request in "
                        "a list")
    return list(requests)


def _count(requests: Any) -> int:
    return len(_as_list(requests))
