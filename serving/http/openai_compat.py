"""OpenAI-compatible generation: ``POST /v1/completions`` and ``POST /v1/chat/completions``,
streamed (server-sent events) and not, on the gRPC server's Generator loop (one continuous
batch for both doors; a call counts against the same ``max_streams``).

Mapping onto a generation request (``serving.generation_requests``): ``prompt`` (text or
token ids; chat: ``messages`` rendered with the model's chat template, the assistant's
turn opened), ``max_tokens`` → ``max_new_tokens`` (default 16), ``temperature``, ``top_p``,
``seed``, ``stop`` (up to 4 strings: the text ends before the first one, which is not
returned, and the sequence is cancelled there; ``finish_reason`` "stop"), and the extension
``stop_token_ids``. What is not supported is refused by name (400): ``n`` other than 1,
``echo``, ``logprobs`` and ``best_of``.

A stream sends one chunk per scheduler step that completes text (a token that ends inside
a multi-byte character waits for the next), then a chunk with ``finish_reason``, then
``data: [DONE]``; ``stream_options: {"include_usage": true}`` adds the usage chunk.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from pydantic import BaseModel, ConfigDict, Field


class _Generation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    # Refused by name when set to anything they do not already mean (module docstring).
    n: int | None = None
    stop: str | list[str] | None = None
    logprobs: Any = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] = Field()
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    top_logprobs: int | None = None


def unsupported(body: _Generation) -> tuple[str, str] | None:
    """(field, why) of the first option this server does not support, or None."""
    if body.n not in (None, 1):
        return "n", "only n=1 is supported"
    if body.best_of not in (None, 1):
        return "best_of", "only best_of=1 is supported"
    stops = stop_strings(body)
    if len(stops) > MAX_STOPS or not all(stops):
        return "stop", f"at most {MAX_STOPS} non-empty strings"
    if body.logprobs not in (None, False, 0):
        return "logprobs", "log-probabilities of generated tokens are not supported yet"
    if getattr(body, "echo", False):
        return "echo", "echo is not supported yet"
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            return name, f"{name} is not supported"
    return None


def generation_request(body: _Generation, prompt: str | list[int]) -> dict[str, Any]:
    request: dict[str, Any] = {"max_new_tokens": body.max_tokens or 16}
    if isinstance(prompt, str):
        request["prompt"] = prompt
    else:
        request["prompt_token_ids"] = list(prompt)
    for ours, theirs in (("temperature", body.temperature), ("top_p", body.top_p),
                         ("seed", body.seed), ("stop_token_ids", body.stop_token_ids)):
        if theirs is not None:
            request[ours] = theirs
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


def completion_body(text: str, finish_reason: str, counts: dict[str, int], model: str,
                    chat: bool) -> dict[str, Any]:
    created = int(time.time())
    if chat:
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish_reason}],
                "usage": counts}
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created,
            "model": model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": finish_reason}],
            "usage": counts}


class Failed(Exception):
    """The generation ended in an error (or was cancelled under the caller)."""


async def collect(stream: Any, tokenizer: Any, stops: list[str]
                  ) -> tuple[str, str, dict[str, int]]:
    """(text, finish_reason, usage) of a non-streamed completion; raises Failed."""
    text = StoppingText(tokenizer, stops)
    pieces = []
    async for tokens, result in stream.updates():
        if result is None:
            pieces.append(text.add(tokens))
            if text.stopped:
                return "".join(pieces), "stop", usage(prompt_length(stream), text.tokens)
            continue
        if result.error is not None or result.finish_reason not in ("stop", "length"):
            raise Failed(result.error or f"generation ended: {result.finish_reason}")
        pieces.append(text.finish(result))
        finish = "stop" if text.stopped else result.finish_reason
        return "".join(pieces), finish, usage(result.prompt_tokens, len(result.token_ids))
    raise Failed("the generation ended without a result")


def prompt_length(stream: Any) -> int:
    return len(stream.handle.sequence.spec.prompt)


async def event_stream(stream: Any, tokenizer: Any, stops: list[str], model: str, chat: bool,
                       include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events of one completion (module docstring)."""
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False,
              **extra: Any) -> bytes:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None,
                      "finish_reason": finish}
        body = {"id": ident, "object": kind, "created": created, "model": model,
                "choices": [choice], **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    def usage_chunk(counts: dict[str, int]) -> bytes:
        body = {"id": ident, "object": kind, "created": created, "model": model,
                "choices": [], "usage": counts}
        return f"data: {json.dumps(body)}\n\n".encode()

    text = StoppingText(tokenizer, stops)
    if chat:
        yield chunk(None, None, first=True)
    async for tokens, result in stream.updates():
        if result is None:
            piece = text.add(tokens)
            if text.stopped:          # (the caller cancels the sequence)
                yield chunk(piece, "stop")
                if include_usage:
                    yield usage_chunk(usage(prompt_length(stream), text.tokens))
                break
            if piece:
                yield chunk(piece, None)
            continue
        if result.error is not None or result.finish_reason not in ("stop", "length"):
            error = {"error": {"message": result.error or f"generation ended: "
                                                          f"{result.finish_reason}",
                               "type": "server_error", "param": None,
                               "code": "generation_failed"}}
            yield f"data: {json.dumps(error)}\n\n".encode()
            break
        piece = text.finish(result)
        yield chunk(piece, "stop" if text.stopped else result.finish_reason)
        if include_usage:
            yield usage_chunk(usage(result.prompt_tokens, len(result.token_ids)))
        break
    yield b"data: [DONE]\n\n"


__all__ = ("ChatCompletionRequest", "CompletionRequest", "Failed", "StoppingText",
           "TextDeltas", "collect", "completion_body", "event_stream", "generation_request",
           "stop_strings", "unsupported")
