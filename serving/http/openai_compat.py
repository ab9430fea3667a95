"""OpenAI-compatible generation: the request and response shapes of ``POST
/v1/completions`` and ``POST /v1/chat/completions``, the text of a choice as its tokens
arrive, and the server-sent events of a streamed call (the call itself runs in
:mod:`serving.http.completions`, on the gRPC server's Generator loop: one continuous batch
for both doors; each choice counts against the same ``max_streams``).

Mapping onto a generation request (``serving.generation_requests``): ``prompt`` (a text,
texts, token ids or lists of token ids: one choice per prompt; chat: ``messages`` rendered
with the model's chat template, the assistant's turn opened), ``n`` choices per prompt
(choice j samples with ``seed + j``; at most :data:`MAX_CHOICES` in a call),
``max_tokens`` → ``max_new_tokens`` (default 16; 0 with ``echo``: the prompt alone),
``temperature``, ``top_p``, ``seed``, ``stop`` (up to 4 strings: the text ends before the
first one, which is not returned, and the sequence is cancelled there; ``finish_reason``
"stop"), ``echo`` (the prompt before the text), ``logprobs`` (completions: 0..20
alternatives; chat: ``logprobs: true`` and ``top_logprobs``) and the extension
``stop_token_ids``. What is not supported is refused by name (400): ``best_of`` other than
1, penalties, and ``logprobs`` or ``echo`` with ``stream``.

A stream sends one chunk per scheduler step that completes text of a choice (a token that
ends inside a multi-byte character waits for the next), each with the choice's index, then
a chunk with its ``finish_reason``; after every choice, ``stream_options:
{"include_usage": true}`` adds the usage chunk, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator

from pydantic import BaseModel, ConfigDict, Field

from serving.requests import MAX_TOP_LOGPROBS


MAX_CHOICES = 16        # prompts × n in one call


class _Generation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    # Refused by name when set to anything they do not already mean (module docstring).
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]] = Field()
    echo: bool = False
    # A text prompt starts with the tokenizer config's special tokens (a BOS) unless false.
    add_special_tokens: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    # The chat template writes the special tokens it wants (a BOS) itself.
    add_special_tokens: bool = False
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


def prompts_of(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion call: one text, texts, one token list or token lists."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def top_count(body: _Generation) -> int | None:
    """How many alternatives to report per token; None: no log-probabilities asked."""
    if isinstance(body, ChatCompletionRequest):
        if not body.logprobs:
            return None
        return body.top_logprobs or 0
    return body.logprobs


def unsupported(body: _Generation, choices: int) -> tuple[str, str] | None:
    """(field, why) of the first option this server does not support, or None."""
    if body.best_of not in (None, 1):
        return "best_of", "only best_of=1 is supported"
    if choices > MAX_CHOICES:
        return "n", (f"prompts × n is {choices}, more than one call takes ({MAX_CHOICES}): "
                     f"split it")
    stops = stop_strings(body)
    if len(stops) > MAX_STOPS or not all(stops):
        return "stop", f"at most {MAX_STOPS} non-empty strings"
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
        return "top_logprobs", "needs logprobs: true"
    if top_count(body) is not None and body.stream:
        return "logprobs", "log-probabilities are given by non-streamed calls only"
    echo = getattr(body, "echo", False)
    if body.max_tokens == 0 and not echo:
        return "max_tokens", "0 generates nothing: use it with echo (the prompt alone)"
    if echo and body.stream:
        return "echo", "echo is given by non-streamed calls only"
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            return name, f"{name} is not supported"
    return None


def generation_request(body: _Generation, prompt: str | list[int], choice: int = 0
                       ) -> dict[str, Any]:
    """The generation request of choice ``choice`` of a prompt (choice j samples with seed
    + j, so the n choices of one prompt differ)."""
    request: dict[str, Any] = {"max_new_tokens": 16 if body.max_tokens is None
                               else body.max_tokens}
    if isinstance(prompt, str):
        request["prompt"] = prompt
    else:
        request["prompt_token_ids"] = list(prompt)
    for ours, theirs in (("temperature", body.temperature), ("top_p", body.top_p),
                         ("stop_token_ids", body.stop_token_ids)):
        if theirs is not None:
            request[ours] = theirs
    if body.seed is not None or choice:
        request["seed"] = (body.seed or 0) + choice
    if isinstance(prompt, str) and body.add_special_tokens is not None:
        request["add_special_tokens"] = body.add_special_tokens
    return request


MAX_STOPS = 4


def stop_strings(body: _Generation) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


class TextDeltas:
    """New text as tokens arrive: the decoding of all tokens so far, minus what was
    already sent; text ending in an incomplete character waits for the next token."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, token_ids: list[int]) -> str:
        self.tokens.extend(token_ids)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


class StoppingText:
    """One completion's text as its tokens arrive, cut before the first stop string:
    :meth:`add` and :meth:`finish` return the text that may be sent now (text that could
    still turn out to begin a stop string is held back). ``stopped``: a stop string ended
    it (the caller cancels the sequence and reads no further)."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        self.deltas = TextDeltas(tokenizer)
        self.stops = stops
        self.hold = max((len(stop) for stop in stops), default=1) - 1
        self.sent = 0                  # characters of the text sent so far
        self.tokens = 0                # tokens received
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        self.tokens += len(token_ids)
        self.deltas.add(token_ids)
        return self._release(self.deltas.sent, final=False)

    def finish(self, result: Any) -> str:
        """The rest, from the result's own text (authoritative: it leaves out a stop
        token)."""
        text = result.text or ""
        if not text.startswith(self.deltas.sent[:self.sent]):
            text = self.deltas.sent
        return self._release(text, final=True)

    def _release(self, text: str, final: bool) -> str:
        cut = min((i for i in (text.find(stop, max(0, self.sent - self.hold))
                               for stop in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            end = cut
        else:
            end = len(text) if final else max(self.sent, len(text) - self.hold)
        out, self.sent = text[self.sent:end], max(self.sent, end)
        return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Failed(Exception):
    """The generation ended in an error (or was cancelled under the caller)."""


@dataclasses.dataclass
class ChoiceOutcome:
    """One finished choice of a non-streamed call: its text and why it ended, the prompt's
    tokens and the generated tokens behind the text, and (when asked) its rendered
    log-probabilities."""

    text: str
    finish_reason: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: dict[str, Any] | None = None


async def collect(stream: Any, tokenizer: Any, stops: list[str]) -> ChoiceOutcome:
    """A non-streamed choice, to its end; raises Failed."""
    text = StoppingText(tokenizer, stops)
    pieces = []
    prompt = list(stream.handle.sequence.spec.prompt)
    async for tokens, result in stream.updates():
        if result is None:
            pieces.append(text.add(tokens))
            if text.stopped:
                stream.cancel()            # (free the sequence now)
                out = "".join(pieces)
                return ChoiceOutcome(out, "stop", prompt, covering_tokens(
                    tokenizer, text.deltas.tokens, out))
            continue
        if result.error is not None or result.finish_reason not in ("stop", "length"):
            raise Failed(result.error or f"generation ended: {result.finish_reason}")
        pieces.append(text.finish(result))
        out = "".join(pieces)
        if text.stopped:
            return ChoiceOutcome(out, "stop", prompt, covering_tokens(
                tokenizer, list(result.token_ids), out))
        return ChoiceOutcome(out, result.finish_reason, prompt, list(result.token_ids))
    raise Failed("the generation ended without a result")


def covering_tokens(tokenizer: Any, tokens: list[int], text: str) -> list[int]:
    """The fewest leading ``tokens`` whose decoding holds ``text`` (a stop string cut the
    text inside the generated tokens: the log-probabilities cover what was returned)."""
    for count in range(len(tokens) + 1):
        if len(tokenizer.decode(tokens[:count], skip_special_tokens=True)) >= len(text):
            return tokens[:count]
    return tokens


def prompt_length(stream: Any) -> int:
    return len(stream.handle.sequence.spec.prompt)


# ------------------------------------------------------------------ log-probabilities
# One token of a choice: (id, log-probability or None for a prompt's first token, the
# most likely tokens there as (id, log-probability), best first).
TokenLogprob = tuple[int, "float | None", list[tuple[int, float]]]


def token_logprobs(result: Any) -> list[TokenLogprob]:
    """A "prompt_logprobs" scoring result as one entry per token."""
    tops = result.top_token_ids or [[] for _ in result.logprobs]
    top_lps = result.top_logprobs or [[] for _ in result.logprobs]
    entries: list[TokenLogprob] = [(result.token_ids[0], None, [])]
    for token, logprob, ids, lps in zip(result.token_ids[1:], result.logprobs, tops, top_lps):
        entries.append((token, logprob, list(zip(ids, lps))))
    return entries


def _piece(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def legacy_logprobs(tokenizer: Any, entries: list[TokenLogprob], top: int,
                    offset: int = 0) -> dict[str, Any]:
    """The completions API's ``logprobs``: tokens, their log-probabilities, the ``top``
    most likely tokens at each (with the token itself, as OpenAI gives it) and each
    token's character offset in the returned text (from ``offset``)."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for token, logprob, best in entries:
        piece = _piece(tokenizer, token)
        tokens.append(piece)
        logprobs.append(logprob)
        offsets.append(offset)
        offset += len(piece)
        if logprob is None:
            tops.append(None)
            continue
        alternatives = {_piece(tokenizer, t): lp for t, lp in best[:top]}
        alternatives.setdefault(piece, logprob)
        tops.append(alternatives)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob], top: int) -> dict[str, Any]:
    """The chat API's ``logprobs``: ``content``, one object per generated token."""
    def item(token: int, logprob: float) -> dict[str, Any]:
        piece = _piece(tokenizer, token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    return {"content": [{**item(token, logprob),
                         "top_logprobs": [item(t, lp) for t, lp in best[:top]]}
                        for token, logprob, best in entries]}


# ------------------------------------------------------------------ bodies
def choice_body(index: int, outcome: ChoiceOutcome, chat: bool) -> dict[str, Any]:
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": outcome.text},
                "logprobs": outcome.logprobs, "finish_reason": outcome.finish_reason}
    return {"index": index, "text": outcome.text, "logprobs": outcome.logprobs,
            "finish_reason": outcome.finish_reason}


def completion_body(choices: list[dict[str, Any]], counts: dict[str, int], model: str,
                    chat: bool) -> dict[str, Any]:
    kind, prefix = ("chat.completion", "chatcmpl") if chat else ("text_completion", "cmpl")
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": model, "choices": choices, "usage": counts}


# ------------------------------------------------------------------ streams
def _delta(index: int, chat: bool, text: str | None, finish: str | None,
           first: bool = False) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}


async def choice_events(stream: Any, tokenizer: Any, stops: list[str], index: int,
                        chat: bool) -> AsyncIterator[tuple[str, Any]]:
    """One streamed choice as ("choice", its chunk's choice), ("usage", (prompt tokens,
    completion tokens)) at its end, or ("error", an OpenAI error object)."""
    text = StoppingText(tokenizer, stops)
    if chat:
        yield "choice", _delta(index, chat, None, None, first=True)
    async for tokens, result in stream.updates():
        if result is None:
            piece = text.add(tokens)
            if text.stopped:
                stream.cancel()             # (free the sequence now)
                yield "choice", _delta(index, chat, piece, "stop")
                yield "usage", (prompt_length(stream), text.tokens)
                return
            if piece:
                yield "choice", _delta(index, chat, piece, None)
            continue
        if result.error is not None or result.finish_reason not in ("stop", "length"):
            yield "error", {"error": {"message": result.error or f"generation ended: "
                                                                 f"{result.finish_reason}",
                                      "type": "server_error", "param": None,
                                      "code": "generation_failed"}}
            return
        piece = text.finish(result)
        yield "choice", _delta(index, chat, piece, "stop" if text.stopped
                               else result.finish_reason)
        yield "usage", (result.prompt_tokens, len(result.token_ids))
        return


async def event_stream(streams: list[Any], tokenizer: Any, stops: list[str], model: str,
                       chat: bool, include_usage: bool, n: int) -> AsyncIterator[bytes]:
    """Server-sent events of a call's choices (module docstring): each choice's chunks as
    they come (choice i of prompt p has index p * n + i), then the usage chunk when asked
    (each prompt's tokens counted once), then ``data: [DONE]``."""
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def frame(body: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    def chunk(**fields: Any) -> bytes:
        return frame({"id": ident, "object": kind, "created": created, "model": model,
                      **fields})

    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: Any) -> None:
        try:
            async for item in choice_events(stream, tokenizer, stops, index, chat):
                await queue.put((index, item))
        except Exception as exc:   # noqa: BLE001  (reported in the stream, as OpenAI does)
            await queue.put((index, ("error", {"error": {
                "message": f"{type(exc).__name__}: {exc}", "type": "server_error",
                "param": None, "code": "generation_failed"}})))
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running, prompt_tokens, completion_tokens = len(tasks), 0, 0
        while running:
            entry = await queue.get()
            if entry is None:
                running -= 1
                continue
            index, (what, value) = entry
            if what == "choice":
                yield chunk(choices=[value])
            elif what == "usage":
                prompt_tokens += value[0] if index % n == 0 else 0
                completion_tokens += value[1]
            else:
                yield frame(value)
        if include_usage:
            yield chunk(choices=[], usage=usage(prompt_tokens, completion_tokens))
        yield b"data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()


__all__ = ("ChatCompletionRequest", "ChoiceOutcome", "CompletionRequest", "Failed",
           "StoppingText", "TextDeltas", "TokenLogprob", "chat_logprobs", "choice_body",
           "collect", "completion_body", "event_stream", "generation_request",
           "legacy_logprobs", "prompts_of", "stop_strings", "token_logprobs", "top_count",
           "unsupported")
