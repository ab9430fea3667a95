"""ELDR's cluster of a request as a prior for its decoder's expert-prefetch predictor, and
its ablation, on demo-e32 (issue 44, "signals across techniques").

Inputs: the reference trace of ``benchmarks/expert_traces.py`` for demo-e32
(``--traces DIR``, written there when missing; ``--quick`` writes a small one of the
model alone to a temporary folder). Requests 0, 4, 8, ... are held out
(``moejax.prefetch.train.split_requests``); on the others (the training requests) the
ELDR fit (K = ``--decoders`` balanced clusters), the cluster priors
(``moejax.eldr.priors``: each cluster's decode-time expert frequencies per layer), the
default vectors and the estimator are fitted, and the prior's weight is chosen. Every
figure below is on the held-out requests' decode tokens.

Routing: the requests arrive in a seeded random order and the ELDR policy
(``moejax.eldr.policies``, τ = ``--tau``) sends each to a decoder, its load being the
requests it was sent among the last K × ``--in-flight`` arrivals (the requests still
decoding). Decoder d's predictor is given decoder d's prior: the prior of the cluster of
centroid d.

Per predictor p ∈ {router, quasi, estimator} (``moejax.prefetch.predictors``, the code the
runtime calls; the prior re-ranks with (1 − w)·score/Σscore + w·prior):

* ``prefetch_recall_<p>_no_prior``: recall@k (w = 0, today's predictor: the ablation);
* ``prefetch_recall_<p>_eldr_prior``: at the weight ``prefetch_prior_weight_<p>`` that
  maximised recall on the training requests (routed the same way), from ``--weights``;
* ``..._shuffled_prior``: the same with a wrong cluster's prior (decoder d gets cluster
  (d + 1) mod K's: the noise floor), and ``..._global_prior``: with the prior of all
  training requests (one cluster: popularity; what the cluster adds is eldr − global);
* ``eldr_prior_recall_gain_<p>`` = eldr − no prior; ``..._shuffled``, ``..._global``:
  the same for those priors (each with its own weight chosen on training requests);
  ``..._se``: its standard error with requests as clusters (a request's tokens are not
  independent); ``eldr_over_global_recall_gain_<p>`` (and ``_se``): eldr − global, what
  the cluster adds over popularity;
* ``prefetch_recall_prior_only`` (and ``_shuffled``, ``_global``): the prior's top-k
  for every token (w = 1);
* ``prefetch_prior_weight``: the one weight that maximises the mean training recall of
  the three predictors with the ELDR prior (a single runtime setting);
* ``prior_total_variation``: the mean over decoder pairs and layers ≥ 1 of the total
  variation distance between two decoders' priors (0: the clusters use experts alike).

Recall@k is averaged over target layers j ≥ 1 (every layer a predictor predicts; layer
1's is the weakest, ``benchmarks/expert_prefetch.py`` averages j ≥ 2) and pooled over the
decoders' tokens; ``..._layer<j>`` per layer, ``..._decoder<d>`` per decoder. A prefetch
of k experts per token misses (1 − recall)·k experts, which exact mode copies on demand,
and the same number of its copies is wasted.

    python -m benchmarks.prefetch_prior [--quick] [--json PATH] [--traces DIR]
        [--decoders K] [--tau T] [--in-flight N] [--weights W,W,...] [--steps N]
        [--per-domain N] [--seed N]
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from benchmarks.expert_prefetch import checked_replay
from benchmarks.lib.cli import bench_parser, parse_args, run_shape
from benchmarks.lib.meta import finish_run
from benchmarks.lib.reference_traces import model_trace, reference_traces

MODEL = "demo-e32"
FULL = dict(per_domain=64, prompt_tokens=64, trace_new_tokens=32, steps=2000, decoders=4)
QUICK = dict(per_domain=2, prompt_tokens=32, trace_new_tokens=8, steps=20, decoders=2)
PREDICTORS = ("router", "quasi", "estimator")
PRIOR_SETS = ("eldr", "shuffled", "global")
WEIGHTS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
SMALLEST_BUCKET = 64     # replayed tokens are padded to a power of two >= this (compiles)


# ----------------------------------------------------------------------------- inputs
def split_indices(num_requests: int, heldout_every: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) request indices, as ``train.split_requests`` splits them."""
    index = np.arange(num_requests)
    return index[index % heldout_every != 0], index[index % heldout_every == 0]


# ----------------------------------------------------------------------------- routing
def route_requests(fit: Any, prefill: np.ndarray, tau: float, in_flight: int, seed: int
                   ) -> np.ndarray:
    """The decoder [N] the ELDR policy sends each request to, the requests arriving in a
    seeded random order, a decoder's load the requests it got among the last
    K × ``in_flight`` arrivals."""
    from moejax.eldr.policies import HandOff, make_policy

    policy = make_policy("eldr", fit.num_decoders, fit=fit, tau=tau)
    window = fit.num_decoders * in_flight
    decoder = np.full(len(prefill), -1)
    recent: list[int] = []
    for i in np.random.default_rng(seed).permutation(len(prefill)):
        loads = np.bincount(recent[-window:], minlength=fit.num_decoders)
        decoder[i] = policy.choose(HandOff(counts=prefill[i]), loads.tolist())
        recent.append(int(decoder[i]))
    return decoder


def prior_sets(fit: Any, prefill: np.ndarray, decode: np.ndarray) -> dict[str, np.ndarray]:
    """Each decoder's prior [K, L, E] by set: its cluster's (eldr), the next cluster's
    (shuffled: a wrong cluster), every training request's (global)."""
    from moejax.eldr import priors

    eldr = priors.cluster_priors(fit, prefill, decode)
    total = decode.sum(axis=0).astype(np.float64)
    everyone = total / total.sum(axis=1, keepdims=True)
    return {"eldr": eldr, "shuffled": np.roll(eldr, -1, axis=0),
            "global": np.broadcast_to(everyone, eldr.shape).copy()}


def total_variation(priors: np.ndarray) -> float:
    """Mean over decoder pairs and layers >= 1 of ½ Σ_e |p_a − p_b| (0 with one decoder)."""
    pairs = [(a, b) for a in range(len(priors)) for b in range(a + 1, len(priors))]
    if not pairs:
        return 0.0
    return float(np.mean([0.5 * np.abs(priors[a, 1:] - priors[b, 1:]).sum(axis=-1).mean()
                          for a, b in pairs]))


# ----------------------------------------------------------------------------- recall
def bucket(tokens: int) -> int:
    """The padded token count: a power of two >= SMALLEST_BUCKET (one compile each)."""
    return max(SMALLEST_BUCKET, 1 << max(tokens - 1, 0).bit_length())


class DecoderStates:
    """One decoder's decode-token states, padded to a bucket (the pad rows' predictions
    are dropped), and each token's request."""

    def __init__(self, states: Any):
        self.tokens = states.num_tokens
        size = bucket(self.tokens)
        pad = ((0, 0), (0, size - self.tokens), (0, 0))
        self.residual = np.pad(states.residual, pad)
        self.experts = np.pad(states.experts, pad)
        self.weights = np.pad(states.weights, pad)
        self.true = states.experts
        self.request = states.request


class Evaluator:
    """Recall@k of a predictor, with a prior set at a weight, pooled over decoders."""

    def __init__(self, cfg: Any, params: Any, fitted: dict[str, Any], decoders: list[Any]):
        self.cfg, self.params, self.decoders = cfg, params, decoders
        self.defaults = fitted["defaults"].defaults
        self.estimator = fitted["params"]
        self.hybrid = tuple(int(j) for j in fitted["meta"]["hybrid_layers"].split(",") if j)

    def predict(self, kind: str, priors: np.ndarray | None, weight: float,
                only: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(predicted ids [L, T, k], true ids [L, T, k], request [T]) over the decoders'
        tokens (or decoder ``only``'s), decoder d predicting with prior ``priors[d]``."""
        from moejax.prefetch import predictors

        predicted, true, request = [], [], []
        for d, states in enumerate(self.decoders):
            if states.tokens == 0 or (only is not None and d != only):
                continue
            tables = predictors.make_tables(
                self.cfg, self.defaults, self.estimator, self.hybrid,
                prior=None if priors is None else priors[d], prior_weight=weight)
            ids = predictors.predict_states(kind, self.cfg, self.params["layers"], tables,
                                            states.residual, states.experts, states.weights)
            predicted.append(ids[:, :states.tokens])
            true.append(states.true)
            request.append(states.request)
        return (np.concatenate(predicted, axis=1), np.concatenate(true, axis=1),
                np.concatenate(request))

    def per_layer(self, kind: str, priors: np.ndarray | None, weight: float,
                  only: int | None = None) -> np.ndarray:
        """Recall@k per layer [L] over the decoders' tokens (or decoder ``only``'s)."""
        from moejax.prefetch import predictors

        predicted, true, _ = self.predict(kind, priors, weight, only)
        return predictors.recall_at_k(predicted, true)

    def per_token(self, kind: str, priors: np.ndarray | None, weight: float
                  ) -> tuple[np.ndarray, np.ndarray]:
        """(each token's recall@k averaged over target layers j >= 1 [T], its request
        [T]); their mean is :meth:`recall`."""
        predicted, true, request = self.predict(kind, priors, weight)
        hits = (predicted[1:, :, :, None] == true[1:, :, None, :]).any(-1).sum(-1)
        return hits.mean(axis=0) / true.shape[-1], request

    def recall(self, kind: str, priors: np.ndarray | None, weight: float) -> float:
        """Recall@k averaged over target layers j >= 1."""
        return float(np.mean(self.per_layer(kind, priors, weight)[1:]))


def paired_gain(with_prior: np.ndarray, without: np.ndarray, request: np.ndarray
                ) -> tuple[float, float]:
    """(mean per-token recall gain, its standard error with requests as clusters: a
    request's tokens are not independent). SE = sqrt(R/(R−1) Σ_r (D_r − ḡ·n_r)²) / N, D_r
    and n_r request r's summed gain and tokens (the ratio estimator's SE)."""
    diff = np.asarray(with_prior, np.float64) - np.asarray(without, np.float64)
    requests, index = np.unique(request, return_inverse=True)
    sums = np.bincount(index, weights=diff)
    tokens = np.bincount(index)
    gain = float(diff.mean())
    if len(requests) < 2:
        return gain, float("nan")
    spread = np.sum((sums - gain * tokens) ** 2) * len(requests) / (len(requests) - 1)
    return gain, float(np.sqrt(spread) / len(diff))


def decoder_states(cfg: Any, params: Any, requests: list[Any], decoder: np.ndarray,
                   num_decoders: int) -> list[DecoderStates]:
    """The requests' decode tokens replayed (checked against the trace), by decoder."""
    states = checked_replay(cfg, params, requests)
    decode = states.take(states.decode)
    token_decoder = decoder[decode.request]
    return [DecoderStates(decode.take(token_decoder == d)) for d in range(num_decoders)]


def choose_weight(train: Evaluator, kind: str, priors: np.ndarray, weights: Sequence[float]
                  ) -> tuple[float, dict[float, float]]:
    """(the weight of the highest training recall, ties to the smaller; every weight's)."""
    scores = {w: train.recall(kind, priors, w) for w in weights}
    best = max(scores.values())
    return min(w for w, r in scores.items() if r == best), scores


# ----------------------------------------------------------------------------- driver
def run(trace: Any, shape: dict[str, Any], args: Any) -> dict[str, Any]:
    from moejax.eldr import fitfile, fitting
    from moejax.prefetch import train

    cfg, params = train.load_model(MODEL)
    counts = fitting.trace_counts(trace)
    if counts.num_requests != len(trace):
        raise SystemExit(f"{MODEL}: the reference trace has errored requests; rewrite it")
    train_idx, held_idx = split_indices(counts.num_requests, train.HELDOUT_EVERY)
    # every request ran (checked above), so the count rows are the trace's requests
    requests = trace.requests
    training = [requests[int(i)] for i in train_idx]
    heldout = [requests[int(i)] for i in held_idx]
    k = shape["decoders"]
    fit = fitting.fit_counts(counts.prefill[train_idx], counts.decode[train_idx],
                             counts.decode_tokens[train_idx], k,
                             fingerprint=fitfile.model_fingerprint(cfg, params["layers"]["router"]),
                             model=MODEL, top_k=counts.top_k, seed=args.seed)
    sets = prior_sets(fit, counts.prefill[train_idx], counts.decode[train_idx])
    fitted = train.train_estimator(cfg, params, training, model=MODEL, steps=shape["steps"],
                                   seed=args.seed)
    routed = {name: route_requests(fit, counts.prefill[idx], args.tau, args.in_flight,
                                   args.seed + offset)
              for name, idx, offset in (("train", train_idx, 0), ("heldout", held_idx, 1))}
    evaluators = {name: Evaluator(cfg, params, fitted,
                                  decoder_states(cfg, params, reqs, routed[name], k))
                  for name, reqs in (("train", training), ("heldout", heldout))}
    ev_train, ev_held = evaluators["train"], evaluators["heldout"]
    if not any(s.tokens for s in ev_held.decoders):
        raise SystemExit("no held-out decode token: trace more requests (--per-domain)")
    out: dict[str, Any] = {
        "decoders": k, "tau": args.tau, "in_flight": args.in_flight,
        "weight_grid": ",".join(f"{w:g}" for w in args.weights),
        "fit_layers": ",".join(map(str, fit.layers)), "fit_rho": fit.rho,
        "train_requests": len(train_idx), "heldout_requests": len(held_idx),
        "train_decode_tokens": sum(s.tokens for s in ev_train.decoders),
        "heldout_decode_tokens": sum(s.tokens for s in ev_held.decoders),
        "estimator_train_seconds": fitted["meta"]["train_seconds"],
        "prior_total_variation": total_variation(sets["eldr"])}
    for d in range(k):
        out[f"heldout_requests_decoder{d}"] = int((routed["heldout"] == d).sum())
        out[f"heldout_decode_tokens_decoder{d}"] = ev_held.decoders[d].tokens
    train_recall: dict[str, dict[float, float]] = {}
    for kind in PREDICTORS:
        none_layers = ev_held.per_layer(kind, None, 0.0)
        none_tokens, request = ev_held.per_token(kind, None, 0.0)
        out[f"prefetch_recall_{kind}_no_prior"] = float(np.mean(none_layers[1:]))
        tokens_by_set = {}
        for name in PRIOR_SETS:
            tag = "" if name == "eldr" else f"_{name}"
            weight, scores = choose_weight(ev_train, kind, sets[name], args.weights)
            if name == "eldr":
                train_recall[kind] = scores
            layers = ev_held.per_layer(kind, sets[name], weight)
            tokens_by_set[name], _ = ev_held.per_token(kind, sets[name], weight)
            gain, se = paired_gain(tokens_by_set[name], none_tokens, request)
            out[f"prefetch_prior_weight_{kind}{tag}"] = weight
            out[f"prefetch_recall_{kind}_{name}_prior"] = float(np.mean(layers[1:]))
            out[f"eldr_prior_recall_gain_{kind}{tag}"] = gain
            out[f"eldr_prior_recall_gain_{kind}{tag}_se"] = se
            if name == "eldr":
                for j in range(1, cfg.num_layers):
                    out[f"prefetch_recall_{kind}_no_prior_layer{j}"] = float(none_layers[j])
                    out[f"prefetch_recall_{kind}_eldr_prior_layer{j}"] = float(layers[j])
                for d in range(k):
                    if ev_held.decoders[d].tokens:
                        for label, w in (("no_prior", 0.0), ("eldr_prior", weight)):
                            out[f"prefetch_recall_{kind}_{label}_decoder{d}"] = float(np.mean(
                                ev_held.per_layer(kind, sets[name], w, only=d)[1:]))
        gain, se = paired_gain(tokens_by_set["eldr"], tokens_by_set["global"], request)
        out[f"eldr_over_global_recall_gain_{kind}"] = gain
        out[f"eldr_over_global_recall_gain_{kind}_se"] = se
    for name in PRIOR_SETS:
        tag = "" if name == "eldr" else f"_{name}"
        out[f"prefetch_recall_prior_only{tag}"] = ev_held.recall("router", sets[name], 1.0)
    mean_train = {w: float(np.mean([train_recall[kind][w] for kind in PREDICTORS]))
                  for w in args.weights}
    best = max(mean_train.values())
    out["prefetch_prior_weight"] = min(w for w, r in mean_train.items() if r == best)
    return out


def report(figures: dict[str, Any]) -> None:
    print(f"\n{MODEL}, K = {figures['decoders']} ELDR decoders (τ = {figures['tau']}), "
          f"{figures['heldout_decode_tokens']} held-out decode tokens; recall@k over "
          f"layers >= 1 (weight chosen on {figures['train_decode_tokens']} training tokens)")
    print(f"  {'predictor':<10} {'no prior':>9} {'ELDR (w)':>14} {'shuffled (w)':>14} "
          f"{'global (w)':>14}")
    for kind in PREDICTORS:
        cells = []
        for name in PRIOR_SETS:
            tag = "" if name == "eldr" else f"_{name}"
            cells.append(f"{figures[f'prefetch_recall_{kind}_{name}_prior']:.3f} "
                         f"({figures[f'prefetch_prior_weight_{kind}{tag}']:.2f})")
        print(f"  {kind:<10} {figures[f'prefetch_recall_{kind}_no_prior']:9.3f} "
              + " ".join(f"{c:>14}" for c in cells))
    for kind in PREDICTORS:
        print(f"  {kind} gain (± SE, requests as clusters): ELDR "
              f"{figures[f'eldr_prior_recall_gain_{kind}']:+.4f} ± "
              f"{figures[f'eldr_prior_recall_gain_{kind}_se']:.4f}, shuffled "
              f"{figures[f'eldr_prior_recall_gain_{kind}_shuffled']:+.4f}, global "
              f"{figures[f'eldr_prior_recall_gain_{kind}_global']:+.4f}; ELDR over global "
              f"{figures[f'eldr_over_global_recall_gain_{kind}']:+.4f} ± "
              f"{figures[f'eldr_over_global_recall_gain_{kind}_se']:.4f}")
    print(f"  prior alone: ELDR {figures['prefetch_recall_prior_only']:.3f}, shuffled "
          f"{figures['prefetch_recall_prior_only_shuffled']:.3f}, global "
          f"{figures['prefetch_recall_prior_only_global']:.3f}; priors' total variation "
          f"{figures['prior_total_variation']:.3f}; one weight for all: "
          f"{figures['prefetch_prior_weight']:g}; {figures['seconds']:.0f} s")


def parse_weights(text: str) -> tuple[float, ...]:
    """``--weights``: comma-separated numbers in [0, 1], 0 among them (the ablation)."""
    try:
        weights = tuple(sorted({float(w) for w in text.split(",") if w.strip()}))
    except ValueError:
        raise SystemExit(f"--weights: not a comma-separated list of numbers: {text!r}") from None
    if not weights or weights[0] != 0.0 or weights[-1] > 1.0 or weights[0] < 0:
        raise SystemExit(f"--weights must lie in [0, 1] and include 0, got {text!r}")
    return weights


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, quick_help="a small trace (2 requests per domain, 8 new "
                          "tokens) of the model alone, 2 decoders, 20 estimator steps",
                          traces=True)
    parser.add_argument("--decoders", type=int, help="K, ELDR decoders (default 4; --quick 2)")
    parser.add_argument("--tau", type=float, default=0.1, help="ELDR's τ (default 0.1)")
    parser.add_argument("--in-flight", type=int, default=8,
                        help="requests decoding per decoder, for the policy's loads "
                             "(default 8)")
    parser.add_argument("--weights", default=",".join(f"{w:g}" for w in WEIGHTS),
                        help="the prior weights tried on the training requests")
    parser.add_argument("--steps", type=int, help="estimator training steps (default 2000)")
    parser.add_argument("--per-domain", type=int,
                        help="requests per domain of a trace written here (default 64; "
                             "--quick 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(parser, argv)
    args.weights = parse_weights(args.weights)
    shape = run_shape(args, QUICK, FULL, ("steps", "decoders", "per_domain"))
    if shape["decoders"] < 2:
        raise SystemExit(f"--decoders must be at least 2 (a prior per cluster), got "
                         f"{shape['decoders']}")
    started = time.perf_counter()
    figures: dict[str, Any] = {"model": MODEL, "quick": int(args.quick),
                               **{f"shape_{key}": value for key, value in shape.items()}}
    if args.quick:
        # a small trace of the model alone (no twin: the prior is a property of the
        # trained model's clusters)
        trace = model_trace(MODEL, per_domain=shape["per_domain"],
                            prompt_tokens=shape["prompt_tokens"],
                            new_tokens=shape["trace_new_tokens"], seed=args.seed)
    else:
        trace = reference_traces(MODEL, args.traces, shape, args.seed,
                                 new_tokens_key="trace_new_tokens")[""]
    figures.update(run(trace, shape, args))
    figures["seconds"] = time.perf_counter() - started
    report(figures)
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
