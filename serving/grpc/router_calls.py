"""What the router's call handlers share: one request on its way to an upstream
(:class:`Item`), a failed upstream call (:class:`Failure`) and which failures are retried
elsewhere or make an upstream suspect, how a call ends with an upstream's failure
(:func:`abort_with`), and how a forwarded result says where it was served (:func:`stamp`).

Why a module of its own: the unary and batch handlers (:mod:`serving.grpc.router_service`)
and the ScoreStream forwarding (:mod:`serving.grpc.router_stream`) follow one failure
policy (:mod:`serving.grpc.upstream_router`, "Failures"); it is written once, here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc

from moejax.ops import PrefillOp
from serving.grpc import convert, scoring_pb2 as pb
from serving.grpc.router_core import Routed
from serving.requests import request_label

StatusCode = grpc.StatusCode
# Failures worth one more try elsewhere (the request itself is fine).
RETRYABLE = frozenset({StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED,
                       StatusCode.CANCELLED, StatusCode.ABORTED, StatusCode.UNKNOWN,
                       StatusCode.INTERNAL, StatusCode.RESOURCE_EXHAUSTED})
# Failures that say the upstream itself is in trouble: no new work until its next check.
SUSPECT = frozenset({StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED})
HINT_KEYS = ("retry-after-ms", "grpc-retry-pushback-ms")


@dataclasses.dataclass
class Failure:
    """A failed upstream call: its status, and where."""

    code: grpc.StatusCode
    details: str
    upstream: str
    hint: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, exc: grpc.aio.AioRpcError, upstream: str) -> "Failure":
        hint = tuple((k, v) for k, v in (exc.trailing_metadata() or ())
                     if k in HINT_KEYS and isinstance(v, str))
        return cls(exc.code(), exc.details() or "", upstream, hint)

    def describe(self) -> str:
        return f"{self.upstream} failed: {self.code.name}: {self.details}"


class CallFailed(Exception):
    """An upstream call failed in a way gRPC did not raise (no tokens in time, a short
    answer), or a batch could not be served: ``failure`` says how, and ends the call
    (:func:`abort_with`) unless it is retried."""

    def __init__(self, failure: Failure):
        super().__init__(failure.describe())
        self.failure = failure


async def abort_with(context: Any, failure: Failure) -> None:
    """End the call with ``failure``'s status, details and retry hint (as the upstream
    ended it)."""
    if failure.hint:
        context.set_trailing_metadata(failure.hint)
    await context.abort(failure.code, failure.details)


def stamp(result: pb.ScoreResult, routed: Routed) -> pb.ScoreResult:
    """Say which upstream (and router round) served a scored result."""
    if result.HasField("timings"):
        del result.timings.engines[:]
        result.timings.engines.append(routed.upstream)
        del result.timings.rounds[:]
        result.timings.rounds.append(routed.assignment.round if routed.assignment else 0)
    return result


@dataclasses.dataclass(eq=False)
class Item:
    """One request of a call on its way through the router."""

    index: int
    message: pb.ScoreRequest
    op: PrefillOp | None = None
    routed: Routed | None = None
    failures: list[Failure] = dataclasses.field(default_factory=list)

    def label(self) -> str:
        return request_label(convert.get_id(self.message), self.index)
