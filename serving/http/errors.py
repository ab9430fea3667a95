"""The HTTP door's errors in the OpenAI error shape, and the scoring calls that raise them:
:class:`ApiError` (what the routes raise), :func:`overloaded` (a refusal by the admission
bound: 429 with ``Retry-After``, or 413 when the call can never fit) and :func:`scored`
(scoring on the shared engine, its refusals as ApiErrors)."""

from __future__ import annotations

import math
from typing import Any

from fastapi.responses import JSONResponse

from serving.grpc.service import Refused
from serving.http.scoring import HttpScoring, Unavailable


class ApiError(Exception):
    """An error answered in the OpenAI error shape."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, headers=self.headers, content={
            "error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}})


def overloaded(exc: Refused) -> ApiError:
    """A refusal by the admission bound or the stream limit, with its retry hint."""
    if exc.retry_ms is None:
        return ApiError(413, str(exc), code="request_too_large")
    seconds = max(1, math.ceil(exc.retry_ms / 1000))
    return ApiError(429, f"{exc}; retry after {seconds} s", kind="rate_limit_error",
                    code="overloaded", headers={"Retry-After": str(seconds),
                                                "retry-after-ms": str(exc.retry_ms)})


async def scored(scoring: HttpScoring, requests: list[Any], endpoint: str) -> list[Any]:
    """One result per request (an invalid one: its error); the call refused as an
    ApiError (503 not ready, 429/413 over the admission bound)."""
    try:
        return await scoring.score(requests, endpoint)
    except Unavailable as exc:
        raise ApiError(503, str(exc), kind="service_unavailable", code="not_ready") from None
    except Refused as exc:
        raise overloaded(exc) from None


__all__ = ("ApiError", "overloaded", "scored")
