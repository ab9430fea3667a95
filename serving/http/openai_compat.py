"""OpenAI-compatible generation: ``POST /v1/completions`` and ``POST /v1/chat/completions``,
streamed (server-sent events) and not, on the gRPC server's Generator loop (one continuous
batch for both doors; a call counts against the same ``max_streams``).

Mapping onto a generation request (``serving.generation_requests``): ``prompt`` (text or
token ids; chat: ``messages`` rendered with the model's chat template, the assistant's
turn opened), ``max_tokens`` → ``max_new_tokens`` (default 16), ``temperature``, ``top_p``,
``seed``, and the extension ``stop_token_ids``. What is not supported is refused by name
(400): ``n`` other than 1, ``stop`` strings, ``echo``, ``logprobs`` and ``best_of``.

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
    if body.stop not in (None, [], ""):
        return "stop", "stop strings are not supported: give stop_token_ids"
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

    def rest(self, final_text: str) -> str:
        """What the final text holds past what was sent (the result is authoritative)."""
        return final_text[len(self.sent):] if final_text.startswith(self.sent) else ""


def usage(result: Any) -> dict[str, int]:
    completion = len(result.token_ids)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.prompt_tokens + completion}


def completion_body(result: Any, model: str, chat: bool) -> dict[str, Any]:
    created = int(time.time())
    if chat:
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant",
                                                     "content": result.text},
                             "logprobs": None, "finish_reason": result.finish_reason}],
                "usage": usage(result)}
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created,
            "model": model, "choices": [{"index": 0, "text": result.text, "logprobs": None,
                                         "finish_reason": result.finish_reason}],
            "usage": usage(result)}


async def event_stream(events: AsyncIterator[tuple[list[int], Any]], tokenizer: Any,
                       model: str, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
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

    deltas = TextDeltas(tokenizer)
    if chat:
        yield chunk(None, None, first=True)
    async for tokens, result in events:
        if result is None:
            text = deltas.add(tokens)
            if text:
                yield chunk(text, None)
            continue
        if result.error is not None:
            error = {"error": {"message": result.error, "type": "server_error",
                               "param": None, "code": "generation_failed"}}
            yield f"data: {json.dumps(error)}\n\n".encode()
            break
        # The result's text is authoritative (it leaves out a stop token): send its rest.
        yield chunk(deltas.rest(result.text or ""), result.finish_reason)
        if include_usage:
            body = {"id": ident, "object": kind, "created": created, "model": model,
                    "choices": [], "usage": usage(result)}
            yield f"data: {json.dumps(body)}\n\n".encode()
    yield b"data: [DONE]\n\n"


__all__ = ("ChatCompletionRequest", "CompletionRequest", "TextDeltas", "completion_body",
           "event_stream", "generation_request", "unsupported")
