"""``moejax eldr-fit TRACES... -o FIT --decoders K``: fit ELDR's decode router offline.

Reads one or more expert traces (``moejax trace REQUESTS.jsonl -o TRACE.npz``, over
calibration requests: generation requests, one a line, each with an optional ``"domain"``
label, e.g. ``examples/calibration.jsonl``; several traces must agree on model, layers,
experts and top-k), fits the IDF weights, the signature layers and one centroid per
decoder with Hungarian-balanced K-means (``moejax.eldr.fitting``), and writes the fit
file (``moejax.eldr.fitfile``), versioned against the model's router weights.

The model whose fingerprint the fit records is ``--model`` (a built-in name such as
``demo-e32``, or a model directory), by default the ``model`` the traces name; its
layers, experts and top-k must be the traces'. ``--layers 0,2,5`` fixes the signature
layers instead of the greedy selection. A short summary goes to stderr; errors exit 2
with one line ``moejax: error: ...`` (``serving.cli``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

from serving.cli.options import add_traces_argument, positive_int


def layer_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated distinct layer indices >= 0 ("0,2,5")."""
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated layer indices such as "
                                         f"0,2,5, got {text!r}") from None
    if any(layer < 0 for layer in layers) or len(set(layers)) != len(layers):
        raise argparse.ArgumentTypeError(f"must be distinct layer indices >= 0, got {text!r}")
    return layers


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``eldr-fit`` on the ``moejax`` subparsers."""
    from moejax.eldr.fitfile import CLUSTERINGS
    from moejax.eldr.kmeans import DEFAULT_MAX_ITERATIONS

    p = subparsers.add_parser("eldr-fit", help="fit ELDR's expert-locality decode router "
                                               "from expert traces",
                              description=__doc__.split("\n\n")[1])
    add_traces_argument(p)
    p.add_argument("-o", "--output", required=True,
                   help="the fit file (.npz, written under exactly this name)")
    p.add_argument("--decoders", type=positive_int, required=True,
                   help="K, the number of decoders: one centroid each")
    p.add_argument("--model", default=None,
                   help="the model the fit is for: a built-in name (demo-e32, ...) or a model "
                        "directory (default: the model the traces name)")
    p.add_argument("--clustering", choices=CLUSTERINGS, default="balanced",
                   help="balanced: Hungarian-balanced K-means (default); plain: the ablation")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of the k-means++ initialization (default 0)")
    p.add_argument("--layers", type=layer_list, default=None,
                   help="signature layers, e.g. 0,2,5 (default: the greedy selection)")
    p.add_argument("--max-iterations", type=positive_int, default=DEFAULT_MAX_ITERATIONS,
                   help=f"K-means assignment steps at most (default {DEFAULT_MAX_ITERATIONS})")
    p.set_defaults(func=cmd_eldr_fit)
    return p


def _check_output(path: str, inputs: list[str]) -> None:
    """-o must name a file in an existing, writable directory, and no input (checked
    before any work)."""
    if os.path.isdir(path):
        raise ValueError(f"output {path}: is a directory")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"output {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"output {path}: the directory {folder} is not writable")
    if os.path.exists(path):
        for name in inputs:
            if os.path.exists(name) and os.path.samefile(name, path):
                raise ValueError(f"output {path} is the input trace {name}: writing the fit "
                                 f"would destroy it (give another -o)")


def _write(path: str, fit: Any) -> None:
    """Write the fit to a temporary sibling, then rename it into place (no half-written
    file under ``path``)."""
    from moejax.eldr import fitfile

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".eldr-fit-", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        fitfile.save(tmp, fit)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _summary(details: Any, path: str) -> str:
    fit, clusters = details.fit, details.clusters
    sizes = ", ".join(str(int(n)) for n in clusters.sizes)
    state = "converged" if clusters.converged else "not converged"
    return (f"eldr-fit: {fit.calibration_requests} requests, layers "
            f"{','.join(map(str, fit.layers))} of {fit.num_layers}"
            f"{' (given)' if details.selection is None else ''}, rho {fit.rho:.3f}, "
            f"{fit.clustering} K-means K={fit.num_decoders} ({clusters.iterations} "
            f"iterations, {state}), cluster sizes [{sizes}], {details.seconds:.2f}s "
            f"-> {path}")


def cmd_eldr_fit(args: argparse.Namespace) -> int:
    """Run ``eldr-fit``; returns the exit status (errors raise ValueError / OSError,
    which ``serving.cli.main`` turns into exit 2)."""
    from moejax.checkpoint import load_model_dir
    from moejax.eldr import fitfile, fitting
    from serving.api import resolve_model_dir

    if args.output == "-":
        raise ValueError("-o: a fit is a binary .npz file; give a file name, not '-'")
    _check_output(args.output, args.traces)
    start = time.perf_counter()
    traces = fitting.load_traces(args.traces)
    trace_model = traces[0].model
    model = args.model if args.model is not None else trace_model
    if not model:
        raise ValueError("the traces do not name their model; give --model NAME_OR_DIR")
    model_dir, _ = resolve_model_dir(model)
    cfg, params, _ = load_model_dir(model_dir, "float32")
    first = traces[0]
    traced = (first.num_layers, first.num_experts, first.top_k)
    shape = (cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok)
    if traced != shape:
        raise ValueError(f"the traces ({args.traces[0]}) have {traced[0]} layers, "
                         f"{traced[1]} experts, top-{traced[2]}, but model {model!r} has "
                         f"{shape[0]} layers, {shape[1]} experts, top-{shape[2]}: trace that "
                         f"model, or give the model the traces were made with (--model)")
    if trace_model and trace_model != model:
        print(f"eldr-fit: note: the traces were made with model {trace_model!r}; the fit is "
              f"recorded for {model!r}", file=sys.stderr)
    fingerprint = fitfile.model_fingerprint(cfg, params["layers"]["router"])
    details = fitting.fit_trace_detailed(traces, args.decoders, fingerprint=fingerprint,
                                         clustering=args.clustering, seed=args.seed,
                                         layers=args.layers,
                                         max_iterations=args.max_iterations, model=model)
    _write(args.output, details.fit)
    print(_summary(details, args.output) + f" (total {time.perf_counter() - start:.2f}s)",
          file=sys.stderr)
    return 0
