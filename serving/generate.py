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

import logging
import os
from collections.abc import Iterator
from typing import Any, Mapping, Sequence

from moejax import checkpoint
from moejax.core.continuous import SequenceTooLong
from moejax.distributed import DistributedOptions, join as join_processes
from moejax.sequences import SequenceOutput, SequenceSpec
from serving.api import resolve_model_dir
from serving.compilation_cache import enable_compilation_cache
from serving.generation_loop import CallGuard, GeneratorLoop, SubmittedRequest
from serving.generation_options import GeneratorOptions, check_decode_processes, make_options
from serving.generation_requests import (GenerationEvent, GenerationRequest,
                                         GenerationResult, as_generation_request,
                                         model_eos_ids, parse_generation_request)
from serving.generation_runtime import build_runtime
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
        self.config, params, tokenizer = checkpoint.load_model_dir(
            self.model_dir, dtype.name, weights_dtype=shared.weights_dtype)
        if self.config.num_labels:
            raise ValueError(f"model {self.model_dir}: a sequence classifier (a score head of "
                             f"{self.config.num_labels} labels, no language-model head) "
                             f"cannot generate; score it with kind 'head'")
        self.sharing = (plan_sharing(share_with, self.config, dtype, self.options)
                        if share_with is not None else None)
        self.tokenizer = TokenizerAdapter.from_model_dir(self.model_dir, tokenizer)
        self.eos_token_ids = model_eos_ids(self.model_dir, self.config.vocab_size)
        opts = self.options
        check_decode_processes(opts)
        # The runtime the options name (serving.generation_runtime): the static batcher
        # (``engine``), a continuous scheduler or a prefill/decode split (``scheduler``),
        # or the μ-queue runtime (``mu_queue``); exactly one is set.
        runtime = build_runtime(self.config, params, dtype, opts, self.sharing)
        self.runtime_name = runtime.name
        self.engine, self.scheduler, self.mu_queue = (runtime.engine, runtime.scheduler,
                                                      runtime.mu_queue)
        self.call_guard = CallGuard()
        del params  # the engine or runner holds the device copy

    @property
    def shared_with_scorer(self) -> dict[str, str] | None:
        """With ``share_with``: ``weights`` and ``kv_pool``, each ``"shared"`` or why not;
        None without."""
        return None if self.sharing is None else self.sharing.describe()

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
