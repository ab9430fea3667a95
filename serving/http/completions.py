"""One OpenAI completion call (``POST /v1/completions``, ``POST /v1/chat/completions``) on
the gRPC server's generation service: its choices (each prompt × ``n``) opened together
against the stream limit, then streamed (their chunks interleaved, each with its index) or
collected; and the log-probabilities it asks for, read by the scoring engine.

Log-probabilities (``logprobs`` on completions, ``logprobs``/``top_logprobs`` on chat;
non-streamed calls): once a choice is generated, its prompt and generated tokens are scored
as one "prompt_logprobs" request on the shared scoring engine (one prefill forward: the
model's own distribution at each position, before temperature or top-p). So ``echo`` with
``logprobs`` and ``max_tokens: 0`` gives the prompt's log-probabilities with no generation
at all: what lm-evaluation-harness's loglikelihood tasks ask for. The first token of a
prompt has none (``null``), as OpenAI gives it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.grpc.service import Refused
from serving.http import openai_compat as oai
from serving.http.errors import ApiError, overloaded, scored
from serving.http.scoring import HttpScoring
from serving.requests import RequestError


def generation_service(scoring: HttpScoring) -> Any:
    """The gRPC server's generation service, once it serves (else 404 or 503)."""
    server = scoring.server
    scorer = server.service.scorer
    if scorer is not None and scorer.head is not None:
        raise ApiError(404, "the model is a sequence classifier (a score head, no "
                       "language-model head): it does not generate; POST /classify",
                       kind="not_found_error", code="no_generation")
    if not server.options.generation:
        raise ApiError(404, "this server does not serve generation (moejax serve "
                       "--no-generation, or a backend that cannot decode)",
                       kind="not_found_error", code="no_generation")
    service = server.generation
    if service.loop is None or service.stopping:
        raise ApiError(503, "the model is still loading or the server is stopping; retry "
                       "later", kind="service_unavailable", code="not_ready")
    return service


async def respond(scoring: HttpScoring, body: Any, prompts: list[str | list[int]],
                  chat: bool, endpoint: str) -> Response:
    """The response to one call: a JSON body, or server-sent events."""
    problem = oai.unsupported(body, len(prompts) * body.n)
    if problem is not None:
        raise ApiError(400, f"{problem[0]}: {problem[1]}", param=problem[0],
                       code="unsupported")
    if body.max_tokens == 0:             # echo of the prompts alone: nothing to generate
        outcomes = [await _prompt_alone(scoring, prompt, body.add_special_tokens)
                    for prompt in prompts
                    for _ in range(body.n)]
        return await _answer(scoring, body, prompts, outcomes, chat, endpoint)
    service = generation_service(scoring)
    streams = _open_streams(service, len(prompts) * body.n)
    service.open_calls += 1
    try:
        await asyncio.gather(*(stream.submit(oai.generation_request(body, prompt, j))
                               for stream, (prompt, j) in zip(streams, _choices(prompts,
                                                                                 body.n))))
    except BaseException as exc:
        _release(service, streams)
        if isinstance(exc, RequestError):
            raise ApiError(400, str(exc), param=exc.field) from None
        if isinstance(exc, RuntimeError):     # the loop is closed (stopping) or failed
            raise ApiError(503, str(exc), kind="service_unavailable") from None
        raise
    tokenizer = service.generator.tokenizer.tokenizer
    stops = oai.stop_strings(body)
    if body.stream:
        include = bool((body.stream_options or {}).get("include_usage"))
        events = oai.event_stream(streams, tokenizer, stops, scoring.model_name or "moejax",
                                  chat, include, body.n)
        return StreamingResponse(_closing(service, streams, events),
                                 media_type="text/event-stream")
    try:
        outcomes = list(await asyncio.gather(*(oai.collect(stream, tokenizer, stops)
                                               for stream in streams)))
    except oai.Failed as exc:
        raise ApiError(500, str(exc), kind="server_error", code="generation_failed") from None
    finally:
        _release(service, streams)
    return await _answer(scoring, body, prompts, outcomes, chat, endpoint)


def _choices(prompts: list[Any], n: int) -> list[tuple[Any, int]]:
    """(prompt, choice number) of each choice, in index order (index = p * n + j)."""
    return [(prompt, j) for prompt in prompts for j in range(n)]


def _open_streams(service: Any, count: int) -> list[Any]:
    """``count`` streams, or none: a refusal closes those already opened (429)."""
    streams: list[Any] = []
    try:
        for _ in range(count):
            streams.append(service.open_stream())
    except Refused as exc:
        for stream in streams:
            stream.discard()
        raise overloaded(exc) from None
    return streams


def _release(service: Any, streams: list[Any]) -> None:
    service.open_calls -= 1
    for stream in streams:
        stream.cancel()          # (a stop string ended it early: free the sequence now)


async def _closing(service: Any, streams: list[Any], chunks: Any) -> Any:
    """``chunks``, then the streams' slots freed (also when the client goes away)."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        _release(service, streams)


async def _prompt_alone(scoring: HttpScoring, prompt: str | list[int],
                        add_special_tokens: bool | None) -> oai.ChoiceOutcome:
    """The outcome of ``max_tokens: 0``: the prompt's tokens (by the scoring tokenizer,
    which is the generator's) and no text of its own."""
    if isinstance(prompt, str):
        scorer = scoring.server.service.scorer
        if scorer is None:
            raise ApiError(503, "the model is still loading", kind="service_unavailable",
                           code="not_ready")
        try:
            ids = scorer.tokenizer.encode_prompt(prompt, add_special_tokens)
        except (TypeError, ValueError) as exc:
            raise ApiError(400, f"prompt: {exc}", param="prompt") from None
    else:
        ids = list(prompt)
    return oai.ChoiceOutcome(text="", finish_reason="length", prompt_ids=ids,
                             completion_ids=[])


async def _answer(scoring: HttpScoring, body: Any, prompts: list[Any],
                  outcomes: list[oai.ChoiceOutcome], chat: bool, endpoint: str
                  ) -> JSONResponse:
    """The JSON body of a non-streamed call (with echo and log-probabilities)."""
    top = oai.top_count(body)
    echo = getattr(body, "echo", False)
    tokenizer = scoring.server.service.scorer.tokenizer.tokenizer
    if top is not None:
        await _add_logprobs(scoring, outcomes, top, echo, chat, tokenizer, endpoint)
    choices = []
    for index, (outcome, (prompt, _)) in enumerate(zip(outcomes, _choices(prompts, body.n))):
        if echo:
            shown = prompt if isinstance(prompt, str) else tokenizer.decode(
                prompt, skip_special_tokens=False)
            outcome.text = shown + outcome.text
        choices.append(oai.choice_body(index, outcome, chat))
    prompt_tokens = sum(len(o.prompt_ids) for o in outcomes[::body.n])
    counts = oai.usage(prompt_tokens, sum(len(o.completion_ids) for o in outcomes))
    return JSONResponse(oai.completion_body(choices, counts, scoring.model_name or "moejax",
                                            chat))


async def _add_logprobs(scoring: HttpScoring, outcomes: list[oai.ChoiceOutcome], top: int,
                        echo: bool, chat: bool, tokenizer: Any, endpoint: str) -> None:
    """Each outcome's rendered log-probabilities, from one scoring call for them all."""
    wanted = [o for o in outcomes if len(o.prompt_ids) + len(o.completion_ids) >= 2]
    requests = [{"kind": "prompt_logprobs", "prompt_token_ids": o.prompt_ids + o.completion_ids,
                 "top_logprobs": top} for o in wanted]
    results = await scored(scoring, requests, endpoint) if requests else []
    by_outcome = {id(o): r for o, r in zip(wanted, results)}
    for outcome in outcomes:
        result = by_outcome.get(id(outcome))
        if result is None:                    # one token in all: it has no log-probability
            entries: list[oai.TokenLogprob] = [(outcome.prompt_ids[0], None, [])]
        elif result.error is not None:
            raise ApiError(400, f"logprobs: the prompt and completion could not be scored "
                                f"({result.error})", param="logprobs")
        else:
            entries = oai.token_logprobs(result)
        generated = entries[len(outcome.prompt_ids):]
        if chat:
            outcome.logprobs = oai.chat_logprobs(tokenizer, generated, top)
        elif echo:
            outcome.logprobs = oai.legacy_logprobs(tokenizer, entries, top)
        else:
            outcome.logprobs = oai.legacy_logprobs(tokenizer, generated, top)


__all__ = ("generation_service", "respond")
