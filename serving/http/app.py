"""The HTTP routes (FastAPI): they parse, call :class:`serving.http.scoring.HttpScoring`,
and render; nothing else.

* ``GET /health``: liveness (200 while the process serves);
* ``GET /ready``: readiness, 503 until the model is loaded and while draining;
* ``GET /metrics``: the server's Prometheus metrics (``serving.metrics``);
* ``GET /v1/models``: the model, in the OpenAI list shape;
* ``POST /v1/moejax/score``: the JSONL request schema of ``moejax score``. A body that is
  one request object gets one result object; ``{"requests": [...]}`` gets ``{"results":
  [...]}``, one per request in order, an invalid one with its ``error`` set;
* ``POST /v1/score`` (SGLang's shape), ``POST /score`` and ``POST /rerank`` (vLLM's, and
  Cohere/Jina-style reranking; also ``/v1/rerank``), ``POST /classify`` (label candidates):
  :mod:`serving.http.shapes` maps each onto the request kinds; these answer all or
  nothing (a bad request fails the call with 400);
* ``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI-compatible
  generation, streamed and not (:mod:`serving.http.openai_compat`);
* ``GET /docs``: the OpenAPI page.

Errors are the OpenAI error JSON, ``{"error": {"message", "type", "param", "code"}}``:
400 a bad body (naming what was wrong), 401 without the bearer token (``token``), 404, 413
a body or batch over the limits, 429 overload with ``Retry-After`` (seconds), 503 not
ready or draining.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.chat import ChatTemplateError
from serving.http import completions, openai_compat, shapes
from serving.http.errors import ApiError, scored
from serving.http.scoring import HttpScoring

SCORE_ENDPOINT = "/v1/moejax/score"
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/docs", "/openapi.json",
                        "/docs/oauth2-redirect", "/redoc"})


class Guard:
    """Bearer-token auth on everything but the open paths, and the body size limit by
    ``Content-Length``: a plain ASGI middleware (Starlette's ``BaseHTTPMiddleware`` runs
    each call through a task and memory streams of its own, a large part of a small
    request's cost)."""

    def __init__(self, app: Any, expected: bytes | None, max_body_bytes: int):
        self.app, self.expected, self.max_body_bytes = app, expected, max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: dict) -> ApiError | None:
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return ApiError(401, "invalid or missing bearer token (Authorization: Bearer "
                                "<token>)", kind="authentication_error", code="invalid_api_key")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return ApiError(413, f"the body is {int(length)} bytes, more than the server "
                            f"accepts ({self.max_body_bytes})", code="body_too_large")
        return None


def make_app(scoring: HttpScoring, *, token: str | None = None,
             max_body_bytes: int = 16 << 20, max_batch_requests: int = 256) -> FastAPI:
    """The app over ``scoring`` (see the module docstring)."""
    app = FastAPI(title="moejax", description="Scoring and generation for Mixture-of-Experts "
                  "models", version="1")
    expected = None if token is None else f"Bearer {token}".encode()

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind=kind).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}",
                        param=param).response()

    app.add_middleware(Guard, expected=expected, max_body_bytes=max_body_bytes)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if scoring.ready:
            return JSONResponse({"status": "ready"})
        return ApiError(503, "not ready: the model is loading or the server is draining",
                        kind="service_unavailable", code="not_ready").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(scoring.server.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = scoring.model_name
        if name is None:
            raise ApiError(503, "the model is still loading", kind="service_unavailable",
                           code="not_ready")
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "moejax"}]}

    @app.post(SCORE_ENDPOINT)
    async def score(request: Request) -> JSONResponse:
        body = await _json_body(request, max_body_bytes)
        batch = isinstance(body, dict) and "requests" in body
        if batch:
            extra = sorted(set(body) - {"requests"})
            if extra:
                raise ApiError(400, f"unknown field(s) {extra} beside 'requests'",
                               param=extra[0])
            requests = body["requests"]
            if not isinstance(requests, list):
                raise ApiError(400, "requests: must be a list of request objects",
                               param="requests")
            if len(requests) > max_batch_requests:
                raise ApiError(413, f"the batch holds {len(requests)} requests, more than the "
                               f"server takes in one call ({max_batch_requests}): split it",
                               param="requests", code="batch_too_large")
        elif not isinstance(body, dict):
            raise ApiError(400, "the body must be a request object or {\"requests\": [...]}")
        else:
            requests = [body]
        results = await scored(scoring, requests, SCORE_ENDPOINT)
        if batch:
            return JSONResponse({"results": [r.to_dict() for r in results]})
        (result,) = results
        if result.error is not None:
            raise ApiError(400, result.error)
        return JSONResponse(result.to_dict())

    @app.post("/v1/score")
    async def sglang_score(body: shapes.SGLangScore) -> dict[str, Any]:
        """SGLang's scoring shape (``serving.http.shapes``)."""
        results = await _scored_all(scoring, shapes.sglang_requests(body), "/v1/score",
                                    max_batch_requests)
        return shapes.sglang_response(results, scoring.model_name)

    @app.post("/score")
    async def vllm_score(body: shapes.VllmScore) -> dict[str, Any]:
        """vLLM's ``text_1``/``text_2`` scores: relevance, P(yes) of the "multi" kind."""
        requests, places = shapes.pair_requests(shapes.vllm_score_pairs(body))
        results = await _scored_all(scoring, requests, "/score", max_batch_requests)
        return shapes.vllm_score_response(results, places, scoring.model_name)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def rerank(body: shapes.Rerank) -> dict[str, Any]:
        """Cohere/Jina-style reranking of ``documents`` against ``query``."""
        (result,) = await _scored_all(scoring, shapes.relevance_requests(
            body.query, shapes.document_texts(body)), "/rerank", max_batch_requests)
        return shapes.rerank_response(body, result, scoring.model_name)

    @app.post("/classify")
    async def classify(body: shapes.Classify) -> dict[str, Any]:
        """Each input classified over the ``labels`` (probabilities over the labels), or by
        the model's classification head when no labels are given."""
        results = await _scored_all(scoring, shapes.classify_requests(body), "/classify",
                                    max_batch_requests)
        scorer = scoring.server.service.scorer
        head = () if scorer is None or scorer.head is None else scorer.head.labels
        return shapes.classify_response(body, results, scoring.model_name, head)

    @app.post("/v1/completions")
    async def text_completions(body: openai_compat.CompletionRequest) -> Response:
        prompts = openai_compat.prompts_of(body)
        for i, prompt in enumerate(prompts):
            if not prompt:
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise ApiError(400, f"{where}: is empty", param="prompt")
        return await completions.respond(scoring, body, prompts, False, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: openai_compat.ChatCompletionRequest) -> Response:
        generator = completions.generation_service(scoring).generator
        template = generator.tokenizer.chat_template
        if template is None:
            raise ApiError(400, "messages: the model has no chat template (chat_template.jinja "
                           "or tokenizer_config.json's chat_template): use /v1/completions",
                           param="messages")
        try:
            prompt = template.render([m.model_dump(exclude_none=True) for m in body.messages])
        except ChatTemplateError as exc:
            raise ApiError(400, f"messages: {exc}", param="messages") from None
        return await completions.respond(scoring, body, [prompt], True,
                                         "/v1/chat/completions")

    return app


async def _json_body(request: Request, limit: int) -> Any:
    raw = await request.body()
    if len(raw) > limit:
        raise ApiError(413, f"the body is {len(raw)} bytes, more than the server accepts "
                       f"({limit})", code="body_too_large")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None


async def _scored_all(scoring: HttpScoring, requests: list[dict[str, Any]], endpoint: str,
                      max_batch_requests: int) -> list[Any]:
    """The results of a call whose shape answers all or nothing: the first error fails it
    (400)."""
    if len(requests) > max_batch_requests:
        raise ApiError(413, f"the call makes {len(requests)} requests, more than the server "
                       f"takes in one call ({max_batch_requests}): split it",
                       code="batch_too_large")
    results = await scored(scoring, requests, endpoint)
    failed = next((r.error for r in results if r.error is not None), None)
    if failed is not None:
        raise ApiError(400, failed)
    return results


__all__ = ("SCORE_ENDPOINT", "make_app")
