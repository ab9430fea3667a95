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
import logging
import os
from collections.abc import Iterator
from typing import Any, Mapping, Sequence

import jax

from moejax import checkpoint
from moejax.backends.base import BackendError, require_devices
from moejax.core.continuous import Scheduler, SchedulerOptions, SequenceTooLong
from moejax.core.decoders import DecoderPool
from moejax.decode.factory import make_runner
from moejax.decode.programs import StepOptions
from moejax.distributed import DistributedOptions, join as join_processes
from moejax.eldr import fitfile
from moejax.eldr.policies import DEFAULT_TAU, Policy, make_policy
from moejax.prefix_hash import BLOCK_SIZE
from moejax.sequences import SequenceOutput, SequenceSpec
from moejax.static.decode import DecodeEngine
from serving.api import resolve_model_dir
from serving.compilation_cache import enable_compilation_cache
from serving.generation_loop import CallGuard, GeneratorLoop, SubmittedRequest
from serving.generation_options import (DEFAULT_KV_CACHE_MIB, GeneratorOptions,
                                        check_decode_processes, make_options)
from serving.generation_requests import (GenerationEvent, GenerationRequest,
                                         GenerationResult, as_generation_request,
                                         model_eos_ids, parse_generation_request)
from serving.requests import RequestError, TokenizerAdapter, request_id_of, request_label
from serving.scorer_sharing import plan_sharing

# The request, result, option and loop types, importable from here as they always were.
__all__ = ["CallGuard", "GenerationEvent", "GenerationRequest", "GenerationResult",
           "Generator", "GeneratorLoop", "GeneratorOptions", "SubmittedRequest",
           "model_eos_ids", "parse_generation_request"]

log = logging.getLogger(__name__)


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
                                      self.result(requests[index], index, specs[index], out))
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
                    result = None if event.output is None else self.result(
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

    def result(self, obj: Any, index: int, spec: SequenceSpec, out: SequenceOutput
               ) -> GenerationResult:
        """The result of request ``obj`` (at ``index``) from its sequence's output."""
        req = as_generation_request(obj, index)
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



def _as_list(requests: Any) -> list[Any]:
    if isinstance(requests, (str, bytes, Mapping, GenerationRequest)):
        raise TypeError("generate() takes a list of requests; wrap a single request in "
                        "a list")
    return list(requests)


def _count(requests: Any) -> int:
    return len(_as_list(requests))
