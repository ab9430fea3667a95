"""Optional shared-secret auth: a bearer token in the ``authorization`` metadata.

Calls to the Scoring and Generation services must carry ``authorization: Bearer <token>``;
others get ``UNAUTHENTICATED``. Health checks and reflection stay open, since load
balancers and orchestrators probe health without credentials (and reflection only
describes the API). The token travels in clear text unless TLS is on.
"""

from __future__ import annotations

import hmac
from typing import Any, Callable, Sequence

import grpc


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that refuses the call (asyncio)."""
    async def refuse(request_or_iterator: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_or_iterator: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as a response-streaming handler must be

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    return grpc.unary_unary_rpc_method_handler(refuse)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to methods under ``protected`` (a "/package.Service/" prefix, or a
    sequence of them) that do not carry the token."""

    def __init__(self, token: str, protected: str | Sequence[str]):
        if not token:
            raise ValueError("the auth token must not be empty")
        self._expected = f"Bearer {token}".encode("utf-8")
        self._protected = (protected,) if isinstance(protected, str) else tuple(protected)

    async def intercept_service(self, continuation: Callable[[Any], Any],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._protected):
            return handler
        given = [value for key, value in handler_call_details.invocation_metadata or ()
                 if key == "authorization"]
        if not given:
            return _denied(handler, "missing credentials: send metadata "
                                    "'authorization: Bearer <token>'")
        value = given[0].encode("utf-8") if isinstance(given[0], str) else bytes(given[0])
        if not hmac.compare_digest(value, self._expected):
            return _denied(handler, "invalid bearer token")
        return handler
