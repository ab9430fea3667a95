"""Command-line options of the gRPC commands: how a client reaches a server, and how a
server listens.

``moejax client ...`` and ``moejax score --target`` (:mod:`serving.remote_score`, whose
transport :mod:`serving.score_transport` opens the connection) take the connection
options and :func:`connect` with them; ``moejax serve`` (:mod:`serving.grpc.cli`) and
``moejax router`` (:mod:`serving.grpc.router_cli`) take the listener options. Every one
of them reads its bearer token with :func:`token_of`. They live here, apart from the
commands, so that those modules share them without importing one another (no import
cycle).

Importing this module loads neither gRPC nor JAX: :func:`connect` loads the client when
it is called.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Sequence

TOKEN_ENV = "MOEJAX_TOKEN"


def token_of(args: argparse.Namespace) -> str | None:
    """The bearer token of a command: ``--token``, else ``$MOEJAX_TOKEN`` (None: no auth)."""
    return args.token or os.environ.get(TOKEN_ENV) or None


def connect(args: argparse.Namespace, options: Sequence[tuple[str, Any]] = ()) -> Any:
    """A :class:`serving.grpc.client.Client` of the connection options
    (:func:`add_connection_options`); ``options``: more gRPC channel options."""
    from serving.grpc.client import Client

    return Client(args.target, token=token_of(args), tls=args.tls, tls_ca=args.tls_ca,
                  tls_server_name=args.tls_server_name, options=options)


def add_connection_options(p: argparse.ArgumentParser, timeout: float | None, *,
                           target: bool = True, timeout_help: str | None = None) -> None:
    """--target, --token, the TLS options and --timeout; ``target=False`` for a command
    that defines --target itself (``moejax score``), ``timeout_help`` where --timeout means
    something else than the whole call."""
    if target:
        p.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
    p.add_argument("--token", default=None,
                   help=f"bearer token (default: ${TOKEN_ENV}, if set)")
    p.add_argument("--tls", action="store_true", help="use TLS with the system's root CAs")
    p.add_argument("--tls-ca", default=None,
                   help="use TLS, trusting this PEM CA / self-signed server certificate")
    p.add_argument("--tls-server-name", default=None,
                   help="name to check the server's certificate against (default: the host)")
    p.add_argument("--timeout", type=float, default=timeout,
                   help=timeout_help or "seconds for the whole call" + (
                       f" (default {timeout})" if timeout else " (default: none)"))


def add_listener_options(p: argparse.ArgumentParser, *, default_port: int, callers: str
                         ) -> None:
    """Where a gRPC server listens and whom it lets in (``serve``, ``router``): ``--host``,
    ``--port``, ``--token``, ``--tls-cert``, ``--tls-key``."""
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 or :: for all)")
    p.add_argument("--port", type=int, default=default_port,
                   help=f"port (default {default_port}; 0 = a free one); printed on stdout")
    p.add_argument("--token", default=None,
                   help=f"require 'authorization: Bearer TOKEN' on {callers} "
                        f"(default: ${TOKEN_ENV}, if set; health stays open)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (enables TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
