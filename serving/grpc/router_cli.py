"""``moejax router``: the command that runs :class:`serving.grpc.upstream_router.RouterServer`.

    moejax router --upstream HOST:PORT,HOST:PORT,... [--model DIR|demo] [--host H] [--port P]
                  [--routing prefix|round_robin|least_tokens|random] [--theta FLOPS]
                  [--token T] [--tls-cert F --tls-key F]
                  [--upstream-token T] [--upstream-tls | --upstream-tls-ca F]
                  [--upstream-tls-server-name NAME] [--upstream-timeout S]
                  [--health-interval S] [--startup-timeout S] [--grace-seconds S]

Like ``moejax serve``: prints the bound port alone on one line of stdout (``--port 0`` picks
a free one), logs to stderr, and on SIGTERM/SIGINT turns health NOT_SERVING, refuses new
calls, lets in-flight calls finish within ``--grace-seconds`` and exits 0. Tokens may come
from ``MOEJAX_TOKEN`` (toward clients) and ``MOEJAX_UPSTREAM_TOKEN`` (toward upstreams)
instead of the flags, which show in ``ps``.

Start-up: a bad flag (an ``--upstream`` value that is not HOST:PORT, a TLS file that cannot
be read, an ``--upstream-tls-ca`` that holds no PEM certificate, ...) is a one-line ``moejax router: error: ...`` naming the value, exit 2, before
anything binds. After binding, the router waits up to ``--startup-timeout`` seconds for
every upstream's ModelInfo: an upstream serving another model (architecture, vocabulary,
layers, experts, context) or refusing ``--upstream-token`` stops the router with exit 2
naming it; one that does not answer in time is only warned about (it is checked, and
used, once it serves).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

UPSTREAM_TOKEN_ENV = "MOEJAX_UPSTREAM_TOKEN"


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_router_command(sub: Any) -> None:
    """Register ``router`` on the ``moejax`` subparsers."""
    from serving.grpc.cli_options import add_listener_options
    from moejax.core.router import ROUTER_NAMES

    p = sub.add_parser("router", help="route the gRPC API over many 'moejax serve' upstreams "
                                      "(prefix-aware, health-checked, with failover)")
    p.add_argument("--upstream", required=True, metavar="HOST:PORT,...",
                   help="the upstream servers, comma-separated (IPv6: [::1]:50051)")
    p.add_argument("--model", default="demo",
                   help="the upstreams' model (directory or built-in name; only its config "
                        "and tokenizer are loaded; default demo)")
    add_listener_options(p, default_port=50050, callers="calls from clients")
    p.add_argument("--routing", choices=ROUTER_NAMES, default="prefix",
                   help="prefix = Algorithm 1 (prefix affinity, FLOP-aware load, Θ "
                        "saturation, spill; default); round_robin, least_tokens, random: "
                        "baselines")
    p.add_argument("--theta", type=float, default=None,
                   help="saturation threshold Θ in FLOPs (default: the first upstream's "
                        "calibrated Θ, else one full batch of its max_batch_tokens)")
    p.add_argument("--upstream-token", default=None,
                   help=f"bearer token sent to the upstreams (default: ${UPSTREAM_TOKEN_ENV}, "
                        f"if set)")
    p.add_argument("--upstream-tls", action="store_true",
                   help="TLS to the upstreams, with the system's root CAs")
    p.add_argument("--upstream-tls-ca", default=None,
                   help="TLS to the upstreams, trusting this PEM CA / self-signed certificate "
                        "(a file holding no PEM certificate is refused, exit 2)")
    p.add_argument("--upstream-tls-server-name", default=None,
                   help="name to check the upstreams' certificates against (default: host)")
    p.add_argument("--upstream-timeout", type=_positive_float, default=120.0,
                   help="seconds an upstream call may take (a stream: seconds without a "
                        "result while results are owed) before it is retried elsewhere "
                        "(default 120)")
    p.add_argument("--health-interval", type=_positive_float, default=0.5,
                   help="seconds between health checks of each upstream (default 0.5)")
    p.add_argument("--startup-timeout", type=float, default=60.0,
                   help="seconds to wait at start for every upstream's ModelInfo (default 60)")
    p.add_argument("--grace-seconds", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, time for in-flight calls (default 30)")
    p.add_argument("--max-message-mib", type=_positive_float, default=16.0,
                   help="largest request message accepted (default 16 MiB)")
    p.add_argument("--workers", type=int, default=2,
                   help="threads that tokenize requests for routing (default 2)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics: per upstream, "
                        "serving, requests routed, load and Θ in FLOPs, cached blocks (0 "
                        "picks a free port, logged; default: not served)")
    p.set_defaults(func=cmd_router)


def _check_ca(path: str) -> None:
    """Refuse an ``--upstream-tls-ca`` file that holds no PEM certificate: gRPC would take
    it and fail every handshake, leaving the router NOT_SERVING with no word why."""
    from serving.grpc.client import read_pem

    read_pem(path, where=f"--upstream-tls-ca {path}")


def router_options(args: argparse.Namespace) -> Any:
    """The RouterOptions of parsed arguments; ValueError naming a bad value."""
    from serving.grpc.cli_options import token_of
    from serving.grpc.upstream_router import RouterOptions
    from serving.grpc.upstreams import UpstreamOptions, parse_upstreams

    upstreams = parse_upstreams(args.upstream)
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                       ("--upstream-tls-ca", args.upstream_tls_ca)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    if args.upstream_tls_ca is not None:
        _check_ca(args.upstream_tls_ca)
    upstream = UpstreamOptions(
        token=args.upstream_token or os.environ.get(UPSTREAM_TOKEN_ENV) or None,
        tls=args.upstream_tls, tls_ca=args.upstream_tls_ca,
        tls_server_name=args.upstream_tls_server_name, timeout=args.upstream_timeout,
        health_interval=args.health_interval)
    return RouterOptions(
        upstreams=upstreams, model=args.model, host=args.host, port=args.port,
        routing=args.routing, theta=args.theta,
        token=token_of(args), tls_cert=args.tls_cert,
        tls_key=args.tls_key, upstream=upstream, max_message_mib=args.max_message_mib,
        workers=args.workers, grace_seconds=args.grace_seconds,
        startup_timeout=args.startup_timeout, metrics_port=args.metrics_port)


def cmd_router(args: argparse.Namespace) -> int:
    """Run the router until SIGTERM/SIGINT (see the module docstring)."""
    from serving.grpc.upstream_router import RouterServer, load_model

    logging.getLogger("moejax.grpc").setLevel(logging.INFO)
    try:
        options = router_options(args)
        model = load_model(options.model)
    except (ValueError, OSError) as exc:
        print(f"moejax router: error: {exc}", file=sys.stderr)
        return 2
    server = RouterServer(options, model=model)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        port = server.start()
    except (ValueError, OSError) as exc:  # an address taken, a bad certificate
        print(f"moejax router: error: {exc}", file=sys.stderr)
        return 2
    print(port, flush=True)
    # Wait for every upstream's ModelInfo in short slices, so that a signal is not kept
    # waiting for the whole --startup-timeout.
    deadline = time.monotonic() + max(0.0, options.startup_timeout)
    while True:
        refused, silent = server.check_upstreams(
            max(0.0, min(0.5, deadline - time.monotonic())))
        if refused or not silent or stop.is_set() or time.monotonic() >= deadline:
            break
    if refused:
        server.stop(0)
        for problem in refused:
            print(f"moejax router: error: {problem}", file=sys.stderr)
        return 2
    for problem in silent:
        logging.getLogger("moejax.grpc.router").warning("%s", problem)
    while not stop.wait(1.0):
        pass
    server.stop(args.grace_seconds)
    return 0
