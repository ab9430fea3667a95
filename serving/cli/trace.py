"""``moejax trace IN.jsonl -o OUT.npz``: generate for JSONL requests and write an expert trace.

Each line is a generation request (the fields of :mod:`serving.generate`: id, prompt |
prompt_token_ids, max_new_tokens, temperature, top_p, seed, stop_token_ids) plus an
optional ``"domain"`` label (a non-empty string, or null), which is recorded in the trace
and not passed to the Generator. ``--max-new-tokens N`` is the default for requests that
do not give one. The trace (``moejax.traces``: format, keys and size per token in its
docstring) holds one request per non-blank input line, in input order; read it back with
``moejax.traces.load(OUT.npz)``.

A bad line (not JSON, too long, not UTF-8, ...) or an invalid request is not dropped: it
is reported on stderr with its line number (``moejax: trace: line 3: prompt: is empty``)
and recorded in the trace as an errored request (its ``errors`` entry, no tokens); the
other requests still run and the command exits 0. The input rules, the file checks made
before the model loads (``-o`` must be writable and not the input) and the exit statuses
are those of ``moejax generate`` (``serving.jsonl``, ``serving.cli``); Ctrl-C writes a trace
of the requests done so far and exits 130. The trace is written once, at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from serving.cli.options import add_model_options, command_compilation_cache, positive_int
from serving.cli.generate import SCORING_ONLY

# trace runs the default (resident) decode runtime: the backend flags are refused too.
REFUSED = SCORING_ONLY + ("backend", "devices")
from serving.jsonl import CommandError, JsonlLine, add_line_limit_option, open_jsonl, run_chunk
from serving.requests import request_label

_DOMAIN = "domain"


def add_trace_command(sub: Any) -> argparse.ArgumentParser:
    """Register ``trace`` on the ``moejax`` subparsers ``sub``, with the shared --model /
    --dtype / --expert-impl ... block (:func:`serving.cli.options.add_model_options`)."""
    p = sub.add_parser("trace", help="generate for a JSONL file of requests and write an "
                                     "expert trace (.npz)",
                       description=__doc__.split("\n\n")[1],
                       epilog="Of the model options, trace uses --model, --dtype, "
                              "--expert-impl and --weights-dtype; the scoring-engine ones "
                              "(not listed) are refused.")
    p.add_argument("input", help="JSONL requests ('-' for stdin)")
    p.add_argument("-o", "--output", required=True,
                   help="the trace, an .npz file (written under exactly this name)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="max_new_tokens of requests that do not give one (default 16)")
    p.add_argument("--router-inputs", action="store_true",
                   help="also record every token's router input (the normed hidden state) "
                        "at every layer: 4 x hidden_size bytes per token per layer")
    p.add_argument("--max-batch-size", type=positive_int, default=None,
                   help="requests decoded together (default 8)")
    p.add_argument("--chunk-size", type=positive_int, default=256,
                   help="requests read and generated per chunk")
    add_line_limit_option(p)
    add_model_options(p, hidden=REFUSED)   # refused below, so not offered in --help either
    p.set_defaults(func=cmd_trace)
    return p


# ----------------------------------------------------------------------------- lines
def _label(request: dict[str, Any], number: int) -> str:
    label = request_label(request.get("id"), None)
    return f"line {number}" if label == "request" else label


def _line_problem(request: dict[str, Any], number: int) -> str | None:
    """What the trace cannot record of a request (its domain, an id numpy would alter)."""
    domain = request.get(_DOMAIN)
    if domain is not None and (not isinstance(domain, str) or not domain):
        got = f"got {type(domain).__name__}" if not isinstance(domain, str) else "got ''"
        return f"{_label(request, number)}: domain: must be a non-empty string or null, {got}"
    for field in ("id", _DOMAIN):
        value = request.get(field)
        if isinstance(value, str) and value.endswith("\x00"):
            return (f"{_label(request, number)}: {field}: ends with a NUL character, which "
                    f"a trace cannot store")
    return None


def prepare_line(line: JsonlLine, max_new_tokens: int | None
                 ) -> tuple[JsonlLine, str | None]:
    """The line with its request ready for the Generator (no domain; the default
    max_new_tokens filled in), and its domain; a request the trace cannot record becomes
    a line error."""
    if line.request is None:
        return line, None
    problem = _line_problem(line.request, line.number)
    if problem is not None:
        return JsonlLine(line.number, error=problem), None
    request = {key: value for key, value in line.request.items() if key != _DOMAIN}
    if max_new_tokens is not None and request.get("max_new_tokens") is None:
        request["max_new_tokens"] = max_new_tokens
    return dataclasses.replace(line, request=request), line.request.get(_DOMAIN)


def prompt_token_ids(generator: Any, request: dict[str, Any]) -> list[int]:
    """The prompt ids the Generator ran for a valid request: its prompt_token_ids, or its
    prompt encoded as the Generator encodes it (without special tokens)."""
    if request.get("prompt_token_ids") is not None:
        return [int(t) for t in request["prompt_token_ids"]]
    return generator.tokenizer.encode(request["prompt"])


def _error_text(error: str, number: int) -> str:
    """An error that names the input line (a request with an id is named by the id)."""
    return error if error.startswith(f"line {number}") else f"line {number}: {error}"


# ----------------------------------------------------------------------------- chunks
def trace_chunk(generator: Any, chunk: list[JsonlLine], max_new_tokens: int | None,
                router_inputs: bool) -> list[Any]:
    """The :class:`~moejax.traces.RequestTrace` of every line of a chunk, in order: bad
    lines and invalid requests as errored requests (and reported on stderr), the others
    generated together."""
    from moejax.traces import request_trace
    from serving.generate import GenerationResult

    prepared = [prepare_line(line, max_new_tokens) for line in chunk]
    lines = [line for line, _ in prepared]
    results = run_chunk(lines, generator.generate, lambda error: GenerationResult(error=error))
    cfg = generator.config
    traced = []
    for (line, domain), result in zip(prepared, results):
        prompt = None
        if result.error is not None:
            result.error = _error_text(result.error, line.number)
            print(f"moejax: trace: {result.error}", file=sys.stderr)
        else:
            prompt = prompt_token_ids(generator, line.request)
        traced.append(request_trace(result, prompt, domain, router_inputs=router_inputs,
                                    num_layers=cfg.num_layers, top_k=cfg.num_experts_per_tok,
                                    router_input_dim=cfg.hidden_size))
    return traced


def _summary(trace: Any, elapsed: float, path: str) -> str:
    errors = sum(1 for error in trace.arrays["errors"].tolist() if error)
    size = sum(a.nbytes for a in trace.arrays.values()) / (1 << 20)
    return (f"traced {trace.num_requests - errors} of {trace.num_requests} requests "
            f"({errors} with errors): {trace.num_prefill_tokens} prefill + "
            f"{trace.num_decode_tokens} decode tokens, {trace.bytes_per_token} bytes/token, "
            f"{size:.2f} MiB in {elapsed:.2f}s -> {path}")


def cmd_trace(args: argparse.Namespace) -> int:
    """Run the ``trace`` subcommand; returns the exit status (130 after Ctrl-C)."""
    from moejax.traces import Trace, save
    from serving.generate import Generator

    refused = ["--" + name.replace("_", "-") for name in REFUSED
               if getattr(args, name, None) is not None]
    if refused:
        raise ValueError(f"trace does not take {', '.join(refused)} (scoring-engine options)")
    if args.output == "-":
        raise CommandError("-o: a trace is a binary .npz file; give a file name, not '-'")
    requests: list[Any] = []
    interrupted = False
    start = time.perf_counter()
    with open_jsonl(args.input, args.output, args.max_line_mib) as files:  # before the model
        generator = Generator(args.model, dtype=args.dtype, expert_impl=args.expert_impl,
                              weights_dtype=args.weights_dtype,
                              trace_experts=True, trace_router_inputs=args.router_inputs,
                              max_batch_size=args.max_batch_size,
                              compilation_cache=command_compilation_cache(None))
        try:
            for chunk in files.chunks(args.chunk_size):
                requests.extend(trace_chunk(generator, chunk, args.max_new_tokens,
                                            args.router_inputs))
        except KeyboardInterrupt:
            interrupted = True
    # ``files`` never wrote the output (it removed the file it created): write it now.
    cfg = generator.config
    trace = Trace.from_requests(requests, num_layers=cfg.num_layers,
                                top_k=cfg.num_experts_per_tok, num_experts=cfg.num_experts,
                                router_input_dim=cfg.hidden_size if args.router_inputs else None,
                                model=str(args.model))
    save(args.output, trace)
    if interrupted:
        print(f"interrupted: the trace holds the first {len(requests)} requests",
              file=sys.stderr)
    print(_summary(trace, time.perf_counter() - start, args.output), file=sys.stderr)
    return 130 if interrupted else 0
