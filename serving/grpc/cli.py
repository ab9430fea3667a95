"""``moejax serve`` and ``moejax client``: the gRPC subcommands of the ``moejax`` CLI.

    moejax serve --model DIR|demo [--host 127.0.0.1] [--port 50051] [model options of score]
                 [--max-queued-tokens N] [--grace-seconds S] [--token T] [--tls-cert F --tls-key F]
                 [--metrics-port P]
                 [--no-generation | --generation-batch-size N --max-generation-streams N
                  --precompile]
    moejax client score IN.jsonl --target HOST:PORT [-o OUT.jsonl] [--token T] [--tls-ca F]
                        [--max-line-mib MIB]
    moejax client generate IN.jsonl --target HOST:PORT [-o OUT.jsonl] [--concurrency N]
    moejax client info --target HOST:PORT
    moejax client health --target HOST:PORT        # exit 0 when SERVING

``serve`` prints the bound port alone on one line of stdout (``--port 0`` picks a free
one), logs to stderr (one line per scored batch), turns health SERVING once the model is
loaded and calibrated, and on SIGTERM/SIGINT turns health NOT_SERVING, refuses new calls,
lets in-flight calls finish within ``--grace-seconds`` and exits 0. The token may come from
the environment variable ``MOEJAX_TOKEN`` instead of ``--token`` (which shows in ``ps``).

``client score`` streams a JSONL file (the format of ``moejax score``, read by the same
rules: ``serving.jsonl``) through ``ScoreStream`` and writes one JSON result per non-blank
input line, in input order; a line that is not JSON (or too long, not UTF-8, ...) gets an
error result. Id-less requests are named by their line number (1-based, blank lines
counted), as in ``moejax score``: ``"line 3: prompt: is empty"``. The input and ``-o`` are
checked before connecting (one-line error, exit 2); an RPC failure exits 1.

``serve`` also serves ``moejax.v1.Generation`` (a :class:`serving.Generator` of the same
model, built beside the Scorer with ``share_with``: where both run on one device in one
dtype it decodes on the Scorer's resident weights and keeps its KV blocks in the Scorer's
pool, else it holds its own, ``serving.scorer_sharing``) unless ``--no-generation``,
or unless ``--backend`` names a backend that cannot decode (a warning; with
``--generation`` given explicitly, an error). The Generator takes ``--dtype``,
``--expert-impl``, ``--backend`` / ``--devices`` (resident, offload, sync_ep) or
``--pipeline FILE`` (a prefill→decode pipeline, ``serving.pipeline_config``, its stages
placed apart from the Scorer), and ``--generation-batch-size`` (its ``max_batch_size``); ``--precompile`` compiles its step
programs before the server reports SERVING (no stream then waits on a compile). On a
shared pool a generation prompt that starts with a prompt scored earlier reads its cached
blocks in place instead of prefilling them, and scoring reads generation's the same way;
the pool's size is the Scorer's (``--prefix-cache-blocks`` / ``--prefix-cache-mib``).

``client generate`` sends each request of a JSONL file (the format of ``moejax generate``)
as one ``Generate`` call, ``--concurrency`` at once, a chunk (``--chunk-size`` lines) at a
time, and writes one JSON result per non-blank input line, in input order (the fields of
``GenerationResult.to_dict``); bad lines and invalid requests get error results naming
their line, as ``moejax generate`` writes them. ``--timeout`` bounds each chunk.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import signal
import sys
import threading
import time
from typing import Any, Iterator

from serving.cli.options import (add_model_options, command_compilation_cache, positive_int,
                                 scorer_options)
# The client commands call ``connect`` by this module's name (tests replace it here).
from serving.grpc.cli_options import add_connection_options, add_listener_options, connect, token_of


class _Interrupted(Exception):
    """A stop signal while the model was loading."""


DECODE_BACKENDS = ("resident", "offload", "sync_ep")  # what serving.Generator runs on


def _serves_generation(args: argparse.Namespace) -> bool:
    """Whether ``serve`` runs a Generator (see the module docstring); ValueError when
    ``--generation`` is asked for on a backend that cannot decode."""
    if args.generation is False:
        return False
    import jax

    if jax.process_count() > 1:
        # Only process 0 hears the requests; its followers replay scoring runs
        # (serving.multi_process), not a Generator's decode loop.
        if args.generation:
            raise ValueError("--generation: a multi-process serve serves scoring only; drop "
                             "--generation (moejax generate runs over several processes)")
        logging.getLogger("moejax.grpc").warning(
            "serving scoring only over %d processes (no moejax.v1.Generation)",
            jax.process_count())
        return False
    if args.backend is None or args.backend in DECODE_BACKENDS \
            or getattr(args, "pipeline", None) is not None:
        return True      # (a pipeline places its own stages, apart from the Scorer)
    if args.generation:
        raise ValueError(f"--generation: backend {args.backend!r} cannot decode (generation "
                         f"runs on {', '.join(DECODE_BACKENDS)}); drop --generation")
    logging.getLogger("moejax.grpc").warning(
        "backend %r cannot decode: serving scoring only (no moejax.v1.Generation)",
        args.backend)
    return False


def _generator_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Generator's keywords: the Scorer's backend and devices, or ``--pipeline`` (its
    stages placed apart from the Scorer's)."""
    pipeline = getattr(args, "pipeline", None)
    placement = ({"pipeline": pipeline} if pipeline is not None
                 else {"backend": args.backend, "devices": args.devices})
    return {"dtype": args.dtype, "expert_impl": args.expert_impl, **placement,
            "weights_dtype": args.weights_dtype, "max_batch_size": args.generation_batch_size,
            "precompile": args.precompile or getattr(args, "warmup", False),
            "compilation_cache": command_compilation_cache(args.deployment)}


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT (see the module docstring). Over several
    processes, process 0 serves and the others follow its runs."""
    from moejax.distributed import is_output_process, process_count
    from serving import Scorer
    from serving.grpc.server import ScoringServer, ServerOptions
    from serving.multi_process import LeaderScorer

    logging.getLogger("moejax.grpc").setLevel(logging.INFO)
    if not is_output_process():
        return _follow(args)
    try:
        generation = _serves_generation(args)
        options = ServerOptions(
            host=args.host, port=args.port, max_queued_tokens=args.max_queued_tokens,
            batch_tokens=args.batch_tokens, grace_seconds=args.grace_seconds,
            drain_seconds=args.drain_seconds, token=token_of(args), tls_cert=args.tls_cert,
            tls_key=args.tls_key, max_message_mib=args.max_message_mib, workers=args.workers,
            max_concurrent_rpcs=args.max_concurrent_rpcs, generation=generation,
            max_generation_streams=args.max_generation_streams,
            metrics_port=args.metrics_port)
    except ValueError as exc:
        print(f"moejax serve: error: {exc}", file=sys.stderr)
        return 2
    server = ScoringServer(options)
    stop = threading.Event()
    loading = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()
        if loading.is_set():
            loading.clear()
            raise _Interrupted()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        port = server.start()
    except OSError as exc:  # the address is taken or cannot be bound
        print(f"moejax serve: error: {exc}", file=sys.stderr)
        return 2
    http = None
    if args.http_port is not None:
        try:
            http = _start_http(args, server)
        except (OSError, ValueError, ImportError) as exc:
            server.stop(0)
            print(f"moejax serve: error: {exc}", file=sys.stderr)
            return 2
    print(port, flush=True)
    if http is not None:
        print(http.port, flush=True)
    try:
        loading.set()
        scorer = None if stop.is_set() else Scorer(args.model, **scorer_options(args))
        # (Over several processes every run must run on all of them, as LeaderScorer's
        # runs do; the warm-up's do not: those servers compile on first use.)
        if scorer is not None and args.warmup and not stop.is_set() and process_count() == 1:
            compiled, seconds = scorer.warm_up()
            logging.getLogger("moejax.grpc").info(
                "warm-up: compiled %d scoring programs in %.1f s (health and /ready follow "
                "now)", compiled, seconds)
        generator = None
        if generation and scorer is not None and scorer.head is not None:
            if args.generation:
                raise ValueError("--generation: the model is a sequence classifier (a score "
                                 "head, no language-model head): it cannot generate")
            logging.getLogger("moejax.grpc").warning(
                "the model is a sequence classifier: serving scoring (kind 'head') only")
        elif generation and not stop.is_set():
            from serving.generate import Generator

            generator = Generator(args.model, share_with=scorer, **_generator_options(args))
        loading.clear()
    except _Interrupted:
        scorer = None
    except BaseException:
        loading.clear()
        server.stop(0)
        raise
    if scorer is not None and process_count() > 1:
        scorer = LeaderScorer(scorer)    # every run also runs on the other processes
    if scorer is not None and not stop.is_set():
        server.attach(scorer, generator)
    while not stop.wait(1.0):
        pass
    # The stop drains both doors: HTTP /ready says 503 and new HTTP calls are refused from
    # its start; the HTTP server closes last, after the calls in flight were answered.
    server.stop(args.grace_seconds)
    if http is not None:
        http.stop(args.grace_seconds)
    if isinstance(scorer, LeaderScorer):
        scorer.stop()
    return 0


def _start_http(args: argparse.Namespace, server: Any) -> Any:
    """The HTTP door on ``server``'s engine (same host, token and TLS); started."""
    try:
        from serving.http import HttpOptions, HttpServer
    except ImportError as exc:
        raise ImportError(f"--http-port needs the http extra (pip install moejax[http]): "
                          f"{exc}") from None
    options = HttpOptions(host=args.host, port=args.http_port, token=token_of(args),
                          tls_cert=args.tls_cert, tls_key=args.tls_key,
                          max_body_mib=args.max_message_mib, workers=args.workers)
    http = HttpServer(server, options)
    http.start()
    return http


def _follow(args: argparse.Namespace) -> int:
    """``serve`` on a process other than 0 of a multi-process run: load the same Scorer
    and run what process 0 sends until it stops (serving.multi_process)."""
    import jax

    from serving import Scorer
    from serving.multi_process import follow

    process = jax.process_index()

    def on_signal(signum: int, frame: Any) -> None:
        # Process 0 got it too (``moejax launch`` passes signals to every process): it
        # drains its calls and then tells this process to stop. Ending here instead would
        # fail the collective process 0 is in.
        print(f"moejax serve (process {process}): {signal.Signals(signum).name}: stopping "
              f"when process 0 says so", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    scorer = Scorer(args.model, **scorer_options(args))
    runs = follow(scorer)
    print(f"moejax serve (process {process}): ran {runs} batches for process 0",
          file=sys.stderr)
    return 0


def _items(lines: Iterator[Any], order: collections.deque[int]) -> Iterator[tuple[int, Any]]:
    """(line number, request dict or error ScoreResult) for each non-blank JSONL line. The
    line number is the request's index on the wire, so the server's and the client's
    messages name an id-less request ``request #N`` with N its line; each number is queued
    in ``order`` before it is sent, for writing the results in input order."""
    from serving.requests import ScoreResult

    for line in lines:
        order.append(line.number)
        yield line.number, (ScoreResult(error=line.error) if line.error is not None
                            else line.request)


def _rpc_failed(exc: Exception) -> int:
    import grpc

    if isinstance(exc, grpc.RpcError):
        print(f"moejax client: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    raise exc


def _summary(args: argparse.Namespace, written: str, start: float, status: int,
             parts: str) -> None:
    """The last line of ``client score`` / ``generate`` on stderr: what was written (for
    how long, via which server), whether it stopped early (after which ``parts``: lines,
    chunks), where the results are."""
    print(f"{written} in {time.perf_counter() - start:.2f}s via {args.target}"
          + ("" if status == 0 else f"; stopped early, the results of the {parts} before "
                                    f"are written")
          + (f", results in {args.output}" if args.output not in (None, "-") else ""),
          file=sys.stderr)


def cmd_client_score(args: argparse.Namespace) -> int:
    """Stream a JSONL file through ScoreStream; results in input order."""
    import grpc

    from serving.jsonl import name_by_line, open_jsonl

    pending: dict[int, Any] = {}
    order: collections.deque[int] = collections.deque()   # line numbers sent, in input order
    written = errors = 0
    status = 0
    bar = None
    with open_jsonl(args.input, args.output, args.max_line_mib) as files:  # before connecting
        files.start_output()
        show_bar = args.progress if args.progress is not None else sys.stderr.isatty()
        if show_bar:
            from tqdm import tqdm

            bar = tqdm(total=files.count(), unit="req", desc=f"scoring via {args.target}",
                       file=sys.stderr)
        start = time.perf_counter()
        try:
            with connect(args) as client:
                for number, result in client.stream(_items(files.lines(), order),
                                                    timeout=args.timeout):
                    result.error = name_by_line(result.error, number, number)
                    pending[number] = result
                    while order and order[0] in pending:  # input order, as results complete
                        done = pending.pop(order.popleft())
                        files.write(done.to_dict())
                        errors += done.error is not None
                        written += 1
                        if bar is not None:
                            bar.update(1)
            if order:
                raise RuntimeError(f"no result for line {order[0]}")
        except grpc.RpcError as exc:
            status = _rpc_failed(exc)
        except KeyboardInterrupt:
            status = 130
        finally:
            if bar is not None:
                bar.close()
    _summary(args, f"{written} results written ({errors} with errors)", start, status,
             "lines")
    return status


def cmd_client_generate(args: argparse.Namespace) -> int:
    """Send a JSONL file of generation requests, one Generate call each; results in input
    order."""
    import grpc

    from serving.generate import GenerationResult
    from serving.jsonl import open_jsonl, run_chunk

    written = errors = tokens = 0
    status = 0
    with open_jsonl(args.input, args.output, args.max_line_mib) as files:  # before connecting
        files.start_output()
        start = time.perf_counter()
        try:
            with connect(args) as client:
                def run(requests: list[Any]) -> list[Any]:
                    return client.generate(requests, timeout=args.timeout,
                                           max_concurrency=args.concurrency)

                for chunk in files.chunks(args.chunk_size):
                    for result in run_chunk(chunk, run, lambda e: GenerationResult(error=e)):
                        files.write(result.to_dict())
                        errors += result.error is not None
                        tokens += len(result.token_ids)
                        written += 1
                    files.flush()
        except grpc.RpcError as exc:
            status = _rpc_failed(exc)
        except KeyboardInterrupt:
            status = 130
    _summary(args, f"{written} results written ({errors} with errors, {tokens} tokens "
                   f"generated)", start, status, "chunks")
    return status


def cmd_client_info(args: argparse.Namespace) -> int:
    """Print the server's ModelInfo as JSON."""
    try:
        with connect(args) as client:
            print(json.dumps(client.info(timeout=args.timeout), indent=2))
    except Exception as exc:
        return _rpc_failed(exc)
    return 0


def cmd_client_health(args: argparse.Namespace) -> int:
    """Print the health status; exit 0 when SERVING, 1 otherwise."""
    try:
        with connect(args) as client:
            status = client.health(args.service, timeout=args.timeout)
    except Exception as exc:
        return _rpc_failed(exc)
    print(status)
    return 0 if status == "SERVING" else 1


def add_commands(sub: Any) -> None:
    """Register ``serve``, ``router`` and ``client`` on the ``moejax`` subparsers."""
    from serving.grpc.router_cli import add_router_command
    from serving.jsonl import add_line_limit_option

    serve = sub.add_parser("serve", help="serve the scoring API over gRPC "
                                         "(with grpc.health.v1 health and reflection)")
    add_listener_options(serve, default_port=50051, callers="scoring calls")
    serve.add_argument("--max-queued-tokens", type=int, default=262_144,
                       help="admission bound: compute queued or being scored, in "
                            "token-equivalents (prompt sharing counted); over it, calls get "
                            "RESOURCE_EXHAUSTED with a retry hint (default 262144)")
    serve.add_argument("--batch-tokens", type=int, default=None,
                       help="token-equivalents of compute per model call; larger requests are "
                            "split (default 4 x --max-batch-tokens)")
    serve.add_argument("--grace-seconds", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, time for in-flight calls (default 30)")
    serve.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                       help="compile the scoring shape buckets and the generation step "
                            "programs before health says SERVING and /ready 200 (default on; "
                            "--no-warmup: compile on first use)")
    serve.add_argument("--http-port", type=int, default=None,
                       help="also serve HTTP on this port (0 picks a free one; printed on "
                            "stdout's second line): /v1/moejax/score, /v1/models, /health, "
                            "/ready, /metrics, /docs, on the same engine and admission "
                            "bound, with the same --host, --token and TLS (needs the http "
                            "extra: pip install moejax[http])")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a "
                            "free port, logged; default: not served)")
    serve.add_argument("--drain-seconds", type=float, default=0.0,
                       help="on SIGTERM/SIGINT, keep serving this long after health turns "
                            "NOT_SERVING, for load balancers to notice (default 0)")
    serve.add_argument("--max-message-mib", type=float, default=16.0,
                       help="largest request message accepted (default 16 MiB)")
    serve.add_argument("--workers", type=int, default=2,
                       help="threads that validate and tokenize requests (default 2; the "
                            "handlers themselves run on one asyncio loop)")
    serve.add_argument("--max-concurrent-rpcs", type=int, default=4096,
                       help="scoring calls in progress at once; more get RESOURCE_EXHAUSTED "
                            "with a retry hint (default 4096; health is never refused)")
    serve.add_argument("--generation", action=argparse.BooleanOptionalAction, default=None,
                       help="also serve moejax.v1.Generation with a Generator of the same "
                            "model (default: on, unless --backend cannot decode)")
    serve.add_argument("--generation-batch-size", type=positive_int, default=None,
                       help="sequences the Generator decodes together (default 8)")
    serve.add_argument("--precompile", action="store_true",
                       help="compile the Generator's step programs at start-up")
    serve.add_argument("--pipeline", default=None, metavar="FILE",
                       help="generate on a prefill->decode pipeline described in a TOML or "
                            "JSON file (serving.pipeline_config: the prefill stage's backend "
                            "and devices, K decoders of any placement, their routing)")
    serve.add_argument("--max-generation-streams", type=positive_int, default=None,
                       help="generation streams at once; more get RESOURCE_EXHAUSTED with a "
                            "retry hint (default 4 x --generation-batch-size)")
    add_model_options(serve)
    serve.set_defaults(func=cmd_serve)
    add_router_command(sub)

    client = sub.add_parser("client", help="call a moejax gRPC server")
    calls = client.add_subparsers(dest="client_command", required=True)
    score = calls.add_parser("score", help="stream a JSONL file of requests through the server")
    score.add_argument("input", help="JSONL requests ('-' for stdin)")
    score.add_argument("-o", "--output", default=None, help="JSONL results (default: stdout)")
    score.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bar (default: on when stderr is a terminal)")
    add_line_limit_option(score)
    add_connection_options(score, None)
    score.set_defaults(func=cmd_client_score)
    generate = calls.add_parser("generate", help="generate for a JSONL file of requests "
                                                 "through the server (one stream each)")
    generate.add_argument("input", help="JSONL generation requests ('-' for stdin)")
    generate.add_argument("-o", "--output", default=None,
                          help="JSONL results (default: stdout)")
    generate.add_argument("--concurrency", type=positive_int, default=32,
                          help="Generate calls at once (default 32)")
    generate.add_argument("--chunk-size", type=positive_int, default=256,
                          help="lines read per chunk; results are written after each chunk "
                               "(default 256)")
    add_line_limit_option(generate)
    add_connection_options(generate, None)
    generate.set_defaults(func=cmd_client_generate)
    info = calls.add_parser("info", help="print what the server serves (ModelInfo) as JSON")
    add_connection_options(info, 10.0)
    info.set_defaults(func=cmd_client_info)
    health = calls.add_parser("health", help="print the health status; exit 0 when SERVING")
    health.add_argument("--service", default="",
                        help="service to check (default: the whole server)")
    add_connection_options(health, 10.0)
    health.set_defaults(func=cmd_client_health)
