"""Train the routing estimator from expert traces.

    python -m moejax.prefetch.train --model M --traces T [T ...] -o EST.npz
        [--defaults DEFAULTS.npz] [--steps 2000] [--batch-size 1024] [--learning-rate 1e-3]
        [--width 256] [--ffn-width 512] [--heldout-every 4] [--hybrid-threshold R]
        [--seed 0] [--json PATH]

The traces give the requests (``moejax trace`` / ``benchmarks/expert_traces.py``);
every ``--heldout-every``-th request (index 0, N, 2N, ...) is held out and never read,
so an evaluation on those stays out of sample. The training requests are replayed
through the model (``moejax.prefetch.replay``, checked against the traced routing) to
get each token's post-attention residual r_l; the input of row (token, l) is the
quasi-hidden state q_l (the default vectors: ``--defaults``, or computed from the same
training requests) and its target is layer l+1's router distribution, for l in
[0, L-1). The loss is KL(router || estimator).

The hybrid rule is stored with the estimator: it predicts target layer j when quasi's
recall@k at j over the training requests' decode tokens is below ``--hybrid-threshold``
(default: the mean of quasi's recall over layers >= 1, so the estimator takes the
model's weakest layers); quasi predicts every other layer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from moejax.config import ModelConfig
from moejax.eldr.fitfile import model_fingerprint
from moejax.param_layout import Params
from moejax.prefetch import defaults as defaults_lib
from moejax.prefetch import estimator as estimator_lib
from moejax.prefetch import predictors, replay
from moejax.traces import RequestTrace

HELDOUT_EVERY = 4
DEFAULT_STEPS = 2000


def split_requests(requests: Sequence[RequestTrace], heldout_every: int = HELDOUT_EVERY
                   ) -> tuple[list[RequestTrace], list[RequestTrace]]:
    """(training, held-out): request i is held out when i % heldout_every == 0 (0: none)."""
    if heldout_every < 0 or heldout_every == 1:
        raise ValueError(f"heldout_every must be 0 (hold out none) or >= 2, got {heldout_every}")
    ok = [req for req in requests if req.ok]
    if heldout_every == 0:
        return ok, []
    return ([r for i, r in enumerate(ok) if i % heldout_every],
            [r for i, r in enumerate(ok) if i % heldout_every == 0])


_QUASI = jax.jit(predictors.quasi_state, static_argnames=("eps",))


def quasi_states(cfg: ModelConfig, params: Params, defaults: np.ndarray,
                 states: replay.LayerStates) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training rows: (q [N, d], source layer [N], target router distribution [N, E]),
    N = tokens x (L - 1), layer-major."""
    norms = np.asarray(params["layers"]["mlp_norm"])
    q = [np.asarray(_QUASI(states.residual[l], states.experts[l], states.weights[l],
                           defaults[l], norms[l + 1], eps=cfg.rms_norm_eps))
         for l in range(cfg.num_layers - 1)]
    layer = np.repeat(np.arange(cfg.num_layers - 1, dtype=np.int32), states.num_tokens)
    return (np.concatenate(q).astype(np.float32), layer,
            states.probs[1:].reshape(-1, cfg.num_experts).astype(np.float32))


def layer_recall(kind: str, cfg: ModelConfig, params: Params, tables: predictors.PrefetchTables,
                 states: replay.LayerStates) -> np.ndarray:
    """recall@k per layer [L] of a computed predictor on ``states`` (layer 0: 1)."""
    predicted = predictors.predict_states(kind, cfg, params["layers"], tables, states.residual,
                                          states.experts, states.weights)
    return predictors.recall_at_k(predicted, states.experts)


def train_estimator(cfg: ModelConfig, params: Params, requests: Sequence[RequestTrace], *,
                    model: str = "", defaults: defaults_lib.DefaultVectors | None = None,
                    steps: int = DEFAULT_STEPS, batch_size: int = 1024,
                    learning_rate: float = 1e-3, width: int = 256, ffn_width: int = 512,
                    hybrid_threshold: float | None = None,
                    seed: int = 0) -> dict[str, Any]:
    """Replay ``requests``, fit the estimator, choose the hybrid layers -> a dict with
    ``config``, ``params``, ``meta`` (what the file records), ``defaults``, ``result``."""
    started = time.perf_counter()
    states = replay.replay(cfg, params, requests)
    replay.check_against_trace(states, requests)
    if defaults is None:
        defaults = defaults_lib.calibrate(cfg, params, states.router_input, states.experts,
                                          model=model, requests=len(requests))
    q, layer, target = quasi_states(cfg, params, defaults.defaults, states)
    est_cfg = estimator_lib.EstimatorConfig(hidden_size=cfg.hidden_size,
                                            num_experts=cfg.num_experts,
                                            num_layers=cfg.num_layers, width=width,
                                            ffn_width=ffn_width)
    result = estimator_lib.train(est_cfg, q, layer, target, steps=steps, batch_size=batch_size,
                                 learning_rate=learning_rate, seed=seed)
    decode = states.take(states.decode)
    tables = predictors.make_tables(cfg, defaults.defaults)
    quasi = layer_recall("quasi", cfg, params, tables, decode)
    hybrid, threshold = predictors.hybrid_layers(quasi, hybrid_threshold)
    meta = {"model": model, "fingerprint": model_fingerprint(cfg, params["layers"]["router"]),
            "hybrid_layers": ",".join(map(str, hybrid)), "hybrid_threshold": threshold,
            "train_requests": len(requests), "train_rows": int(q.shape[0]),
            "training_tokens": result.tokens, "steps": result.steps,
            "train_seconds": round(result.seconds, 3),
            "param_count": estimator_lib.param_count(result.params),
            "final_loss": float(np.mean(result.losses[-20:])),
            "quasi_recall_train": ",".join(f"{r:.4f}" for r in quasi)}
    return {"config": est_cfg, "params": result.params, "meta": meta, "defaults": defaults,
            "result": result, "seconds": time.perf_counter() - started}


def load_model(model: str) -> tuple[ModelConfig, Params]:
    from moejax.checkpoint import load_model_dir
    from moejax.model_dirs import resolve_model_dir

    cfg, params, _ = load_model_dir(resolve_model_dir(model)[0], "float32")
    return cfg, params


def load_requests(paths: Sequence[str], cfg: ModelConfig) -> list[RequestTrace]:
    """Every request of the traces at ``paths`` (their shape must be the model's)."""
    from moejax.eldr.fitting import load_traces

    traces = load_traces(list(paths))
    for path, trace in zip(paths, traces):
        if (trace.num_layers, trace.num_experts, trace.top_k) != (
                cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok):
            raise ValueError(f"{path}: a trace of L={trace.num_layers}, E={trace.num_experts}, "
                             f"k={trace.top_k}; the model has L={cfg.num_layers}, "
                             f"E={cfg.num_experts}, k={cfg.num_experts_per_tok}")
    return [req for trace in traces for req in trace.requests]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moejax.prefetch.train",
                                     description=__doc__.split("\n\n")[1])
    parser.add_argument("--model", required=True, help="built-in name or model directory")
    parser.add_argument("--traces", nargs="+", required=True, help="expert traces (.npz)")
    parser.add_argument("-o", "--output", required=True, help="the estimator file (.npz)")
    parser.add_argument("--defaults", default=None, help="default vectors (default: computed "
                                                          "from the training requests)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--ffn-width", type=int, default=512)
    parser.add_argument("--heldout-every", type=int, default=HELDOUT_EVERY)
    parser.add_argument("--hybrid-threshold", type=float, default=None,
                        help="quasi recall below which the hybrid uses the estimator "
                             "(default: quasi's mean recall over layers >= 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the training summary here")
    args = parser.parse_args(argv)
    try:
        if args.steps < 1 or args.batch_size < 1:
            raise ValueError("--steps and --batch-size must be positive")
        if args.hybrid_threshold is not None and not 0.0 <= args.hybrid_threshold <= 1.0:
            raise ValueError(f"--hybrid-threshold must lie in [0, 1], got {args.hybrid_threshold}")
        cfg, params = load_model(args.model)
        training, _ = split_requests(load_requests(args.traces, cfg), args.heldout_every)
        given = None
        if args.defaults is not None:
            given = defaults_lib.load(args.defaults)
            given.check_model(cfg, params, args.defaults)
        out = train_estimator(cfg, params, training, model=args.model, defaults=given,
                              steps=args.steps, batch_size=args.batch_size,
                              learning_rate=args.learning_rate, width=args.width,
                              ffn_width=args.ffn_width, hybrid_threshold=args.hybrid_threshold,
                              seed=args.seed)
    except (ValueError, OSError) as exc:
        print(f"moejax.prefetch.train: error: {exc}", file=sys.stderr)
        return 2
    estimator_lib.save(args.output, out["config"], out["params"], out["meta"])
    meta = out["meta"]
    print(f"estimator: {meta['param_count']} params, {meta['training_tokens']} training rows "
          f"seen ({meta['train_rows']} distinct, {meta['train_requests']} requests), "
          f"{meta['train_seconds']} s training, hybrid layers [{meta['hybrid_layers']}] "
          f"-> {args.output}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "output": os.fspath(args.output)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
