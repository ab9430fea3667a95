"""The HTTP door of ``moejax serve`` (``--http-port``): FastAPI on uvicorn, on the gRPC
server's engine (one Scorer, one batcher, one admission bound, one metrics registry).
Needs the ``http`` extra (``pip install moejax[http]``: fastapi, uvicorn)."""

from serving.http.server import HttpOptions, HttpServer

__all__ = ("HttpOptions", "HttpServer")
