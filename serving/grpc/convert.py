"""Mapping between the proto messages of ``scoring.proto`` and the Python API objects.

Requests: :class:`serving.ScoreRequest` <-> ``moejax.v1.ScoreRequest``, field for field.
Absent proto fields become None (empty ``kind`` / ``normalize`` mean the defaults
"classify" / "candidates"); an empty repeated field is indistinguishable from an absent one,
so an empty ``candidates`` list arrives as "no candidates" (the Python client validates
requests before sending, so its errors read exactly as :meth:`serving.Scorer.score`'s).

Ids: a str or an int (64-bit on the wire; a Python int beyond that range, and a token id
beyond it, is refused with an error naming the field).

Results: :class:`serving.ScoreResult` <-> ``moejax.v1.ScoreResult``; ``selected`` keeps the
difference between None (not a "multi" request) and [] (nothing selected); ``timings``
gains ``queue_seconds``, the time the request waited in the server's queue.

Generation: a request dict (or :class:`serving.GenerationRequest`) <->
``moejax.v1.GenerateRequest``, only the fields that are set (``prompt_token_ids`` and
``stop_token_ids`` are ``TokenIds`` messages, so "an empty list" and "not given" differ on
the wire); a :class:`serving.generate.GenerationResult` -> the last ``GenerateResponse``.
"""

from __future__ import annotations

import json
import numbers
from typing import Any, Mapping, Sequence

from serving.grpc import scoring_pb2 as pb
from serving.requests import RequestError, ScoreRequest, ScoreResult, request_label

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _fail(request_id: Any, index: int | None, field: str, problem: str) -> RequestError:
    return RequestError(f"{request_label(request_id, index)}: {field}: {problem}",
                        index=index, field=field)


def _int64_ids(values: Sequence[int], field: str, request_id: Any,
               index: int | None) -> list[int]:
    for i, value in enumerate(values):
        if not INT64_MIN <= value <= INT64_MAX:
            raise _fail(request_id, index, f"{field}[{i}]",
                        f"token id {value} does not fit in 64 bits (gRPC int64)")
    return list(values)


def _set_id(message: Any, request_id: str | int | None, index: int | None) -> None:
    if isinstance(request_id, str):
        message.string_id = request_id
    elif isinstance(request_id, int) and not isinstance(request_id, bool):
        if not INT64_MIN <= request_id <= INT64_MAX:
            raise _fail(request_id, index, "id", "integer ids must fit in 64 bits (gRPC int64)")
        message.int_id = request_id


def _get_id(message: Any) -> str | int | None:
    which = message.WhichOneof("id")
    return None if which is None else getattr(message, which)


def get_id(message: Any) -> str | int | None:
    """The id of a request or result message (None when it has none)."""
    return _get_id(message)


class _CandidateIds:
    """``candidate_token_ids`` of a message as a list of id lists, without copying."""

    def __init__(self, repeated: Any):
        self._repeated = repeated

    def __len__(self) -> int:
        return len(self._repeated)

    def __iter__(self):
        return (c.ids for c in self._repeated)


def limit_view(message: pb.ScoreRequest) -> dict[str, Any]:
    """The fields :meth:`serving.limits.RequestLimits.check` reads, as views of the
    message (lengths are O(1): nothing is copied or converted)."""
    return {"id": _get_id(message),
            "prompt": message.prompt if message.HasField("prompt") else None,
            "prompt_token_ids": message.prompt_token_ids, "candidates": message.candidates,
            "candidate_token_ids": _CandidateIds(message.candidate_token_ids),
            "messages": [{"content": m.content} for m in message.messages]}


def request_to_proto(request: ScoreRequest, index: int | None = None) -> pb.ScoreRequest:
    """The proto of a request already checked by :func:`serving.requests.parse_request`.

    Raises :class:`RequestError` for ints that do not fit in int64 (ids, token ids)."""
    message = pb.ScoreRequest(kind=request.kind, normalize=request.normalize)
    _set_id(message, request.id, index)
    if request.prompt is not None:
        message.prompt = request.prompt
    if request.prompt_token_ids is not None:
        message.prompt_token_ids.extend(_int64_ids(request.prompt_token_ids, "prompt_token_ids",
                                                   request.id, index))
    if request.candidates is not None:
        message.candidates.extend(request.candidates)
    if request.candidate_token_ids is not None:
        for k, ids in enumerate(request.candidate_token_ids):
            message.candidate_token_ids.add().ids.extend(
                _int64_ids(ids, f"candidate_token_ids[{k}]", request.id, index))
    for chat in request.messages or ():
        content = chat.get("content")
        if not isinstance(content, (str, type(None))):
            raise RequestError(f"{request_label(request.id, index)}: messages: only text "
                               f"content travels over gRPC", index=index, field="messages")
        message.messages.add(role=chat["role"], content=content or "")
    if request.templates is not None:
        message.templates_json = json.dumps(request.templates)
    if request.top_logprobs is not None:
        message.top_logprobs = request.top_logprobs
    if request.add_special_tokens is not None:
        message.add_special_tokens = request.add_special_tokens
    return message


def request_from_proto(message: pb.ScoreRequest) -> ScoreRequest:
    """The Python request of a proto (not validated: pass it to ``parse_request``)."""
    return ScoreRequest(
        id=_get_id(message),
        prompt=message.prompt if message.HasField("prompt") else None,
        prompt_token_ids=list(message.prompt_token_ids) or None,
        candidates=list(message.candidates) or None,
        candidate_token_ids=[list(c.ids) for c in message.candidate_token_ids] or None,
        kind=message.kind or "classify",
        normalize=message.normalize or "candidates",
        messages=[{"role": m.role, "content": m.content} for m in message.messages] or None,
        templates=_templates(message.templates_json),
        top_logprobs=message.top_logprobs if message.HasField("top_logprobs") else None,
        add_special_tokens=(message.add_special_tokens
                            if message.HasField("add_special_tokens") else None))


def _templates(text: str) -> Any:
    """A request's templates from their JSON text (None when empty; what is not JSON is
    passed on as the text itself, for the parser to refuse by name)."""
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def result_to_proto(result: ScoreResult, queue_seconds: float | None = None) -> pb.ScoreResult:
    """The proto of a result; ``queue_seconds`` is added to its timings (when it has
    timings: error results have none)."""
    message = pb.ScoreResult(prompt_tokens=result.prompt_tokens)
    _set_id(message, result.id, None)
    if result.logprobs is not None:
        message.logprobs.extend(result.logprobs)
    if result.label is not None:
        message.label = result.label
    if result.error is not None:
        message.error = result.error
    if result.selected is not None:
        message.selected.SetInParent()
        message.selected.indices.extend(result.selected)
    if result.warnings:
        message.warnings.extend(result.warnings)
    if result.token_ids is not None:
        message.token_ids.extend(result.token_ids)
    for ids, logprobs in zip(result.top_token_ids or (), result.top_logprobs or ()):
        message.top.add(token_ids=ids, logprobs=logprobs)
    if result.scores is not None:
        message.scores.extend(result.scores)
    if result.timings is not None:
        timings = dict(result.timings)
        if queue_seconds is not None:
            timings["queue_seconds"] = queue_seconds
        message.timings.engines.extend(timings.get("engines", ()))
        message.timings.rounds.extend(timings.get("rounds", ()))
        message.timings.seconds = float(timings.get("seconds", 0.0))
        message.timings.queue_seconds = float(timings.get("queue_seconds", 0.0))
    return message


def result_from_proto(message: pb.ScoreResult) -> ScoreResult:
    """The Python result of a proto."""
    timings = None
    if message.HasField("timings"):
        t = message.timings
        timings = {"engines": list(t.engines), "rounds": list(t.rounds),
                   "seconds": t.seconds, "queue_seconds": t.queue_seconds}
    return ScoreResult(
        id=_get_id(message),
        # (none: an error, or a head's raw score alone)
        logprobs=list(message.logprobs) if message.logprobs or not (
            message.HasField("error") or message.scores) else None,
        label=message.label if message.HasField("label") else None,
        prompt_tokens=message.prompt_tokens,
        error=message.error if message.HasField("error") else None,
        selected=list(message.selected.indices) if message.HasField("selected") else None,
        timings=timings, warnings=list(message.warnings) or None,
        token_ids=list(message.token_ids) or None,
        top_token_ids=[list(t.token_ids) for t in message.top] or None,
        top_logprobs=[list(t.logprobs) for t in message.top] or None,
        scores=list(message.scores) or None)


def error_result(request_id: Any, error: str) -> ScoreResult:
    """The result of a request that could not be scored (an unusable id is left out)."""
    usable = request_label(request_id, None) != "request"
    return ScoreResult(id=request_id if usable else None, error=error)


PRIVATE_INFO = ("model_dir",)  # what a remote caller must not learn (the server's files)


def public_info(info: Mapping[str, Any]) -> dict[str, Any]:
    """``Scorer.info`` without what only the server's operator may see."""
    return {k: v for k, v in info.items() if k not in PRIVATE_INFO}


def info_to_proto(info: Mapping[str, Any], *, max_queued_tokens: int,
                  max_message_bytes: int) -> pb.ModelInfoResponse:
    """``ModelInfo`` of a :attr:`serving.Scorer.info` dict and the server's limits."""
    message = pb.ModelInfoResponse(
        architecture=str(info.get("model_type", "")), vocab_size=int(info.get("vocab_size", 0)),
        max_context=int(info.get("max_context", 0)), num_layers=int(info.get("num_layers", 0)),
        num_experts=int(info.get("num_experts", 0)),
        experts_per_token=int(info.get("experts_per_token", 0)),
        dtype=str(info.get("dtype", "")), backend=str(info.get("backend", "")),
        devices=int(info.get("devices", 1)), device=str(info.get("device", "")),
        theta_source=str(info.get("theta_source", "")),
        max_batch_tokens=int(info.get("max_batch_tokens", 0)),
        engines=int(info.get("engines", 1)), demo=bool(info.get("demo", False)),
        max_queued_tokens=max_queued_tokens, max_message_bytes=max_message_bytes,
        model_name=str(info.get("model_name", "")),
        info_json=json.dumps(public_info(info), default=str, sort_keys=True))
    for name, value in (info.get("limits") or {}).items():
        setattr(message, name, int(value))
    if info.get("theta_flops") is not None:
        message.theta_flops = float(info["theta_flops"])
    return message


def info_from_proto(message: pb.ModelInfoResponse) -> dict[str, Any]:
    """The server's ``Scorer.info`` dict plus its limits (``max_queued_tokens``,
    ``max_message_bytes``) and whether it serves generation (``generation``,
    ``max_generation_streams``)."""
    info = json.loads(message.info_json) if message.info_json else {}
    info.update(max_queued_tokens=message.max_queued_tokens,
                max_message_bytes=message.max_message_bytes, generation=message.generation,
                max_generation_streams=message.max_generation_streams)
    return info


# ----------------------------------------------------------------------------- generation
# Generation requests: a dict (or serving.GenerationRequest) <-> moejax.v1.GenerateRequest.
# Only what the wire cannot carry is refused here (a value of the wrong type, an integer
# past its proto type's range); everything else is validated by the server's Generator,
# whose messages are those of serving.Generator.generate.
GENERATION_FIELDS = ("id", "prompt", "prompt_token_ids", "max_new_tokens", "temperature",
                     "top_p", "seed", "stop_token_ids", "add_special_tokens")
UINT64_END = 1 << 64   # seeds lie in [0, 2**64) (moejax.sampling.MAX_SEED), a proto uint64


def _is_int(value: Any) -> bool:
    """An integer (numpy's included), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A real number (numpy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _generation_fields(obj: Any, index: int) -> dict[str, Any]:
    """The fields of a generation request (a Mapping or a dataclass with the fields) that
    are set, or RequestError for an object that is neither, or has unknown keys."""
    from serving.requests import show, unknown_fields

    if isinstance(obj, Mapping):
        unknown = unknown_fields(obj, GENERATION_FIELDS)
        if unknown:
            raise RequestError(f"{request_label(_safe_id(obj.get('id')), index)}: unknown "
                               f"field(s) {', '.join(show(k) for k in unknown)} (accepted: "
                               f"{', '.join(GENERATION_FIELDS)})", index=index, field=unknown[0])
        return {name: obj[name] for name in GENERATION_FIELDS if obj.get(name) is not None}
    if all(hasattr(obj, name) for name in GENERATION_FIELDS) and not isinstance(obj, type):
        return {name: getattr(obj, name) for name in GENERATION_FIELDS
                if getattr(obj, name) is not None}
    raise RequestError(f"{request_label(None, index)}: expected an object (dict), got "
                       f"{type(obj).__name__}", index=index)


def _safe_id(request_id: Any) -> Any:
    from serving.requests import id_problem

    return request_id if id_problem(request_id) is None else None


def generation_request_to_proto(obj: Any, index: int = 0) -> pb.GenerateRequest:
    """The proto of a generation request; raises RequestError naming the field for what a
    proto cannot carry (the rest is the server's to check)."""
    from serving.requests import id_problem, show

    fields = _generation_fields(obj, index)
    request_id = fields.get("id")
    problem = id_problem(request_id)
    if problem is not None:
        raise _fail(None, index, "id", problem)
    request_id = _safe_id(request_id)
    message = pb.GenerateRequest()
    _set_id(message, request_id, index)

    def integer(name: str, value: Any, low: int, end: int, what: str) -> int:
        if not _is_int(value):
            raise _fail(request_id, index, name, f"must be an integer, got {type(value).__name__}")
        value = int(value)
        if not low <= value < end:
            raise _fail(request_id, index, name, f"{what}, got {show(value)}")
        return value

    def token_ids(name: str, value: Any) -> list[int]:
        if not isinstance(value, (list, tuple)):
            raise _fail(request_id, index, name,
                        f"must be a list of integers, got {type(value).__name__}")
        return [integer(f"{name}[{i}]", v, INT64_MIN, INT64_MAX + 1,
                        "does not fit in 64 bits (gRPC int64)") for i, v in enumerate(value)]

    if "prompt" in fields:
        if not isinstance(fields["prompt"], str):
            raise _fail(request_id, index, "prompt",
                        f"must be a str, got {type(fields['prompt']).__name__}")
        message.prompt = fields["prompt"]
    if "prompt_token_ids" in fields:
        message.prompt_token_ids.SetInParent()   # present, even when empty
        message.prompt_token_ids.ids.extend(token_ids("prompt_token_ids",
                                                      fields["prompt_token_ids"]))
    if "stop_token_ids" in fields:
        message.stop_token_ids.SetInParent()
        message.stop_token_ids.ids.extend(token_ids("stop_token_ids", fields["stop_token_ids"]))
    if "max_new_tokens" in fields:
        message.max_new_tokens = integer("max_new_tokens", fields["max_new_tokens"], INT64_MIN,
                                         INT64_MAX + 1, "does not fit in 64 bits (gRPC int64)")
    if "seed" in fields:
        message.seed = integer("seed", fields["seed"], 0, UINT64_END,
                               f"must be in [0, {UINT64_END})")
    for name in ("temperature", "top_p"):
        if name not in fields:
            continue
        value = fields[name]
        if not _is_number(value):
            raise _fail(request_id, index, name, f"must be a number, got {type(value).__name__}")
        try:
            setattr(message, name, float(value))
        except OverflowError:
            raise _fail(request_id, index, name, f"must fit in float32, got {show(value)}"
                        ) from None
    special = fields.get("add_special_tokens")
    if special is not None:
        if not isinstance(special, bool):
            raise _fail(request_id, index, "add_special_tokens",
                        f"must be true or false, got {type(special).__name__}")
        message.add_special_tokens = special
    return message


def generation_request_from_proto(message: pb.GenerateRequest) -> dict[str, Any]:
    """The request dict of a proto (the fields it sets; not validated: the Generator
    does that)."""
    request: dict[str, Any] = {}
    request_id = _get_id(message)
    if request_id is not None:
        request["id"] = request_id
    if message.HasField("prompt"):
        request["prompt"] = message.prompt
    for name in ("prompt_token_ids", "stop_token_ids"):
        if message.HasField(name):
            request[name] = list(getattr(message, name).ids)
    for name in ("max_new_tokens", "temperature", "top_p", "seed", "add_special_tokens"):
        if message.HasField(name):
            request[name] = getattr(message, name)
    return request


def generation_response(token_ids: Sequence[int], result: Any = None) -> pb.GenerateResponse:
    """One response message: new tokens, and for the last one (``result``: a
    :class:`serving.generate.GenerationResult`) the finish reason, text, prompt length
    and id."""
    message = pb.GenerateResponse(token_ids=token_ids)
    if result is not None:
        message.finish_reason = result.finish_reason
        if result.text is not None:
            message.text = result.text
        message.prompt_tokens = result.prompt_tokens
        _set_id(message, result.id, None)
    return message
