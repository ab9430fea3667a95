"""Size limits of one scoring request, checked before any tokenization.

Tokenizing a 15 MB prompt takes tens of seconds and gigabytes; a request that could never
fit the model's context should cost nothing. :class:`RequestLimits` bounds what a request
may carry, measured without tokenizing:

* ``max_text_bytes`` — UTF-8 bytes of the request's text (prompt plus candidates);
  ``"auto"`` = :data:`AUTO_BYTES_PER_TOKEN` bytes per token of the model's context, more
  than any real tokenizer averages, so a prompt that fits the context is never refused;
* ``max_token_ids`` — token ids of the request (prompt plus candidates); ``"auto"`` =
  :data:`AUTO_IDS_PER_CONTEXT` × the context;
* ``max_candidates`` — candidates of one request.

A request over a limit gets a :class:`~serving.requests.RequestError` naming the field and
the limit (the Scorer: an error result; the gRPC server: ``INVALID_ARGUMENT``). The limits
appear in ``Scorer.info``, ``moejax info`` and the server's ``ModelInfo``.

:func:`least_cost` is the other measure taken before tokenizing: a lower bound of what a
request costs to compute, which the gRPC server uses to refuse, untokenized, a batch that
could never fit its queue's cost bound.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from serving.requests import RequestError, request_label

AUTO_BYTES_PER_TOKEN = 64
AUTO_IDS_PER_CONTEXT = 16


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """Resolved limits (plain integers); see the module docstring."""

    max_text_bytes: int
    max_token_ids: int
    max_candidates: int
    max_context: int

    @classmethod
    def resolve(cls, max_context: int, *, max_text_bytes: int | str = "auto",
                max_token_ids: int | str = "auto", max_candidates: int = 4096
                ) -> RequestLimits:
        """Limits for a model of ``max_context`` tokens ("auto" values derived from it)."""
        return cls(
            max_text_bytes=(AUTO_BYTES_PER_TOKEN * max_context if max_text_bytes == "auto"
                            else int(max_text_bytes)),
            max_token_ids=(AUTO_IDS_PER_CONTEXT * max_context if max_token_ids == "auto"
                           else int(max_token_ids)),
            max_candidates=int(max_candidates), max_context=int(max_context))

    def as_dict(self) -> dict[str, int]:
        """The limits (``max_context`` is the model's, reported elsewhere)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "max_context"}

    def check(self, request: Any, index: int) -> None:
        """Raise RequestError when ``request`` (a dict, ScoreRequest or anything with the
        request fields as attributes) is over a limit. Cheap: lengths only, no parsing
        (malformed fields are left to the parser)."""
        get = request.get if isinstance(request, Mapping) else (
            lambda name: getattr(request, name, None))
        try:
            label = request_label(get("id"), index)
        except Exception:  # noqa: BLE001  (an id the parser will refuse)
            label = request_label(None, index)
        candidates = get("candidates")
        candidate_ids = get("candidate_token_ids")
        for field, values in (("candidates", candidates),
                              ("candidate_token_ids", candidate_ids)):
            count = _length(values)
            if count is not None and count > self.max_candidates:
                raise RequestError(f"{label}: {field}: {count} candidates, over the limit of "
                                   f"{self.max_candidates} (max_candidates)",
                                   index=index, field=field)
        text = _text_bytes(get("prompt"), limit=self.max_text_bytes)
        for message in _items(get("messages")):      # chat messages count as prompt text
            content = message.get("content") if isinstance(message, Mapping) else None
            for part in content if isinstance(content, list) else [content]:
                text += _text_bytes(part.get("text") if isinstance(part, Mapping) else part,
                                    limit=self.max_text_bytes)
            if text > self.max_text_bytes:
                break
        for value in _items(candidates):
            text += _text_bytes(value, limit=self.max_text_bytes)
            if text > self.max_text_bytes:
                break
        if text > self.max_text_bytes:
            raise RequestError(f"{label}: prompt: the request's text (prompt and candidates) "
                               f"is over the limit of {self.max_text_bytes} UTF-8 bytes "
                               f"(max_text_bytes)", index=index, field="prompt")
        ids = _length(get("prompt_token_ids")) or 0
        if ids > self.max_context:  # the parser's own rule, decided before copying the ids
            raise RequestError(f"{label}: prompt: has {ids} tokens, more than max_context "
                               f"({self.max_context})", index=index, field="prompt")
        for value in _items(candidate_ids):
            ids += _length(value) or 0
        if ids > self.max_token_ids:
            raise RequestError(f"{label}: prompt_token_ids: the request holds {ids} token ids, "
                               f"over the limit of {self.max_token_ids} (max_token_ids)",
                               index=index, field="prompt_token_ids")


def least_cost(request: Any) -> int:
    """A lower bound, from lengths only (no tokenizing, no parsing), of the compute a valid
    ``request`` (a dict, ScoreRequest or anything with the request fields as attributes)
    costs in token-equivalents (:attr:`serving.api.PreparedRequest.cost`).

    Every token an op runs costs at least one token-equivalent (its linear FLOPs; attention
    and the head come on top), and every valid request runs at least one op. The ops of
    ``n`` prompt token ids and of candidates of ``m_k`` token ids run, between them, at
    least ``n + sum(m_k - 1)`` tokens: the first op the whole prompt, each other op at least
    the tokens after the prompt it may share (a candidate's last token is scored, not run).
    Text counts one token per request at most: a tokenizer's normalizer can turn any number
    of bytes into one token, so a bound from byte lengths would not be safe. So the bound
    never exceeds the real cost of a valid request; an invalid one costs nothing (it gets an
    error result), which only a request carrying token ids that the parser then refuses
    could make the bound overstate."""
    get = request.get if isinstance(request, Mapping) else (
        lambda name: getattr(request, name, None))
    tokens = _length(get("prompt_token_ids")) or 0
    for ids in _items(get("candidate_token_ids")):
        tokens += max(0, (_length(ids) or 0) - 1)
    return max(1, tokens)


def _length(value: Any) -> int | None:
    """len() of a list-like value, None for anything else (the parser reports it)."""
    if isinstance(value, (str, bytes, bytearray, Mapping)) or value is None:
        return None
    try:
        return len(value)
    except TypeError:
        return None


def _items(value: Any) -> Any:
    """The items of a list-like value (a list, tuple, array, protobuf repeated field);
    nothing for anything else (the parser reports it)."""
    return value if _length(value) is not None else ()


def _text_bytes(value: Any, *, limit: int) -> int:
    """UTF-8 bytes of a text value (0 for anything else). A string of more characters than
    ``limit`` is over it whatever its encoding, and is not encoded."""
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if not isinstance(value, str):
        return 0
    if len(value) > limit or value.isascii():
        return len(value)
    return len(value.encode("utf-8", errors="surrogatepass"))
