"""``moejax prefetch-calibrate TRACES... -o DEFAULTS --model M``: default vectors offline.

Replays the calibration requests of the traces (``moejax trace REQUESTS.jsonl -o
TRACE.npz``; requests such as ``examples/calibration.jsonl``) through the model (``moejax.prefetch``:
the replay is checked against the traced routing) and writes each expert's mean output
per layer, the default vectors d_{l,e} of the quasi-hidden state, with the per-layer
expert counts (``moejax.prefetch.defaults``). Every ``--heldout-every``-th request
(index 0, N, 2N, ...; default 4, as ``python -m moejax.prefetch.train``) is left out so
that an evaluation on those stays out of sample; 0 uses every request.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from serving.cli.eldr import non_negative_int
from serving.cli.options import add_traces_argument


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``prefetch-calibrate`` on the ``moejax`` subparsers."""
    p = subparsers.add_parser("prefetch-calibrate",
                              help="compute the default vectors of speculative expert "
                                   "prefetch from expert traces",
                              description=__doc__.split("\n\n")[1])
    add_traces_argument(p)
    p.add_argument("-o", "--output", required=True, help="the default-vector file (.npz)")
    p.add_argument("--model", default=None,
                   help="a built-in name or model directory (default: the model the traces "
                        "name)")
    p.add_argument("--heldout-every", type=non_negative_int, default=4,
                   help="leave out requests 0, N, 2N, ... (default 4; 0: use all)")
    p.set_defaults(func=cmd_prefetch_calibrate)
    return p


def cmd_prefetch_calibrate(args: argparse.Namespace) -> int:
    from moejax.prefetch import defaults, replay, train
    from moejax.traces import load

    started = time.perf_counter()
    model = args.model or load(args.traces[0]).model
    if not model:
        raise ValueError("the traces do not name their model; give --model NAME_OR_DIR")
    if os.path.isdir(args.output):
        raise ValueError(f"output {args.output}: is a directory")
    cfg, params = train.load_model(model)
    calibration, _ = train.split_requests(train.load_requests(args.traces, cfg),
                                          args.heldout_every)
    states = replay.replay(cfg, params, calibration)
    agreement = replay.check_against_trace(states, calibration)
    vectors = defaults.calibrate(cfg, params, states.router_input, states.experts,
                                 model=model, requests=len(calibration))
    defaults.save(args.output, vectors)
    print(f"prefetch-calibrate: {len(calibration)} requests, {vectors.calibration_tokens} "
          f"tokens (replay routes {agreement:.2%} as traced), default vectors "
          f"[{cfg.num_layers}, {cfg.num_experts}, {cfg.hidden_size}], "
          f"{os.path.getsize(args.output) / 1024:.1f} KiB, "
          f"{time.perf_counter() - started:.1f}s -> {args.output}", file=sys.stderr)
    return 0
