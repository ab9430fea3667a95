"""The composed pipeline: requests arrive, are prefilled (:mod:`.prefill`), handed off at
their batch's end to K decoders routed by JSQ or ELDR (the runtime's own
:class:`moejax.eldr.policies.Policy` objects), and decoded on the ELDR simulator
(:func:`moejax.eldr.simulator.simulate`) under :class:`.decode_cost.DecoderCost`.

Techniques (:class:`Techniques`), each on or off; all off is the plain baseline
(sync-EP prefill, JSQ, EPLB-even token routing, resident experts):

* ``async_ep``: AsyncEP prefill instead of sync EP;
* ``eldr``: ELDR routing of the hand-off (fitted on calibration requests) instead of JSQ;
* ``metro``: METRO token routing inside each decoder's EP group instead of EPLB-even;
* ``offload_prefetch``: the decoders hold their experts in host memory and prefetch each
  layer's during the layer before, instead of holding them in HBM.

Figures of one run (:class:`PipelineRun`): output tokens (each request's first token from
prefill plus its D decode tokens) per second from the first arrival to the last finish;
TTFT = hand-off − arrival; TPOT = the ELDR simulator's (finish − hand-off) / D (queueing
at a decoder included).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
from jaxtyping import Float, Integer

from moejax.asyncmoe.checks import int_at_least
from moejax.eldr import fitting
from moejax.eldr.fitfile import EldrFit
from moejax.eldr.policies import DEFAULT_TAU, make_policy
from moejax.eldr.simulator import SimRequest, SimResult, simulate
from moejax.model_shape import ModelShape
from moejax.pipeline_sim import decode_cost, hardware
from moejax.pipeline_sim.prefill import PrefillConfig, PrefillResult, simulate_prefill
from moejax.pipeline_sim.shape import layer_period, lifted_counts, rows_per_token

TECHNIQUES = ("async_ep", "eldr", "metro", "offload_prefetch")
BASELINE = "baseline"


@dataclasses.dataclass(frozen=True)
class Techniques:
    """Which techniques are on (module docstring)."""

    async_ep: bool = False
    eldr: bool = False
    metro: bool = False
    offload_prefetch: bool = False

    def __post_init__(self) -> None:
        for name in TECHNIQUES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Techniques.{name} must be a bool, got "
                                 f"{getattr(self, name)!r}")

    @property
    def name(self) -> str:
        """``baseline``, or the techniques on joined by ``+`` in :data:`TECHNIQUES` order."""
        on = [name for name in TECHNIQUES if getattr(self, name)]
        return "+".join(on) if on else BASELINE

    @classmethod
    def of(cls, names: Sequence[str]) -> Techniques:
        unknown = [name for name in names if name not in TECHNIQUES]
        if unknown:
            raise ValueError(f"unknown techniques {unknown}; known: {TECHNIQUES}")
        return cls(**{name: True for name in names})


def every_combination() -> list[Techniques]:
    """All 2^4 combinations, the baseline first, then by how many are on."""
    return [Techniques.of(on) for size in range(len(TECHNIQUES) + 1)
            for on in itertools.combinations(TECHNIQUES, size)]


@dataclasses.dataclass(frozen=True)
class Deployment:
    """The H100s and their roles: a prefill group of ``prefill_devices`` (batches of at
    most ``prefill_tokens_per_device`` prompt tokens per device), ``num_decoders``
    decoders of ``decoder_devices`` each (at most ``max_batch_size`` running requests),
    EPLB ``replication`` inside a decoder, ELDR's ``eldr_tau``."""

    prefill_devices: int
    prefill_tokens_per_device: int
    num_decoders: int
    decoder_devices: int
    max_batch_size: int
    replication: float = hardware.EPLB_REPLICATION
    eldr_tau: float = DEFAULT_TAU

    def __post_init__(self) -> None:
        for name in ("prefill_devices", "prefill_tokens_per_device", "num_decoders",
                     "decoder_devices", "max_batch_size"):
            object.__setattr__(self, name, int_at_least(f"Deployment.{name}",
                                                        getattr(self, name), 1))
        if not 1.0 <= self.replication <= self.decoder_devices:
            raise ValueError(f"Deployment.replication must lie in [1, decoder_devices = "
                             f"{self.decoder_devices}], got {self.replication!r}")
        if not 0.0 <= self.eldr_tau <= 1.0:
            raise ValueError(f"Deployment.eldr_tau must lie in [0, 1], got {self.eldr_tau!r}")

    @property
    def devices(self) -> int:
        return self.prefill_devices + self.num_decoders * self.decoder_devices


@dataclasses.dataclass(frozen=True, eq=False)
class Calibration:
    """What the techniques learn from calibration requests: the ELDR fit (None when
    K = 1) and each token router's :class:`.decode_cost.ActivationTable`."""

    eldr_fit: EldrFit | None
    tables: dict[str, decode_cost.ActivationTable]


def calibrate(requests: Sequence[SimRequest], deployment: Deployment, *, model: str,
              batch_sizes: Sequence[int], samples: int, seed: int) -> Calibration:
    """The ELDR fit of ``requests`` for the deployment's K decoders and the EPLB-even and
    METRO activation tables of its decoder groups, measured on ``requests``' steps."""
    if not requests:
        raise ValueError("calibrate: need calibration requests")
    fit = None
    if deployment.num_decoders > 1:
        prefill = np.stack([r.counts for r in requests])
        decode = np.stack([lifted_counts(r.decode_experts, r.num_experts) for r in requests])
        tokens = np.array([r.decode_tokens for r in requests])
        options = dict(fingerprint=f"lifted:{model}", model=model,
                       top_k=int(requests[0].decode_experts.shape[2]), seed=seed)
        # ELDR's greedy layer selection over the first period of a lifted trace's layers
        # (the rest repeat them), then the fit over every layer with that selection.
        period = layer_period(requests)
        layers = fitting.fit_counts(prefill[:, :period], decode[:, :period], tokens,
                                    deployment.num_decoders, **options).layers
        fit = fitting.fit_counts(prefill, decode, tokens, deployment.num_decoders,
                                 layers=layers, **options)
    tables = {router: decode_cost.activation_table(
        requests, router, deployment.decoder_devices, deployment.replication, batch_sizes,
        samples, seed) for router in decode_cost.ROUTERS}
    return Calibration(eldr_fit=fit, tables=tables)


@dataclasses.dataclass(frozen=True, eq=False)
class Workload:
    """The requests to serve, in arrival order: ``requests``, ``prompt_tokens`` [n],
    ``arrivals`` [n] (sorted seconds)."""

    requests: tuple[SimRequest, ...]
    prompt_tokens: np.ndarray
    arrivals: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.requests)
        if n < 1:
            raise ValueError("Workload: needs at least one request")
        lengths = np.asarray(self.prompt_tokens, np.int64)
        times = np.asarray(self.arrivals, np.float64)
        if lengths.shape != (n,) or times.shape != (n,):
            raise ValueError(f"Workload: {n} requests, {lengths.shape} prompt lengths, "
                             f"{times.shape} arrivals: one of each per request")
        if (lengths < 1).any():
            raise ValueError("Workload: every prompt needs at least one token")
        if not np.isfinite(times).all() or (np.diff(times) < 0).any():
            raise ValueError("Workload: arrivals must be finite and sorted")
        object.__setattr__(self, "requests", tuple(self.requests))
        object.__setattr__(self, "prompt_tokens", lengths)
        object.__setattr__(self, "arrivals", times)

    @property
    def decode_tokens(self) -> Integer[np.ndarray, "n"]:
        return np.array([r.decode_tokens for r in self.requests], np.int64)


def draw_workload(pool: Sequence[SimRequest], n: int, prompt_range: tuple[int, int],
                  arrivals: Float[np.ndarray, "n"], seed: int) -> Workload:
    """``n`` requests drawn with replacement from ``pool``, prompt lengths uniform in
    ``prompt_range`` (inclusive), arriving at ``arrivals``
    (``np.random.default_rng(seed)``)."""
    low, high = prompt_range
    if not 1 <= low <= high:
        raise ValueError(f"prompt_range must be 1 <= low <= high, got {prompt_range}")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(pool), n)
    return Workload(requests=tuple(pool[int(i)] for i in picks),
                    prompt_tokens=rng.integers(low, high + 1, n),
                    arrivals=np.asarray(arrivals, np.float64))


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineRun:
    """One run: the workload, the prefill stage's result, the decoders' (requests in
    hand-off order: ``order[j]`` is the workload index of the decode result's request j)."""

    techniques: Techniques
    workload: Workload
    prefill: PrefillResult
    decode: SimResult
    order: np.ndarray

    @property
    def ttft(self) -> Float[np.ndarray, "n"]:
        """Hand-off (first token) − arrival, per request in workload order."""
        return self.prefill.handoff - self.workload.arrivals

    @property
    def tpot(self) -> Float[np.ndarray, "n"]:
        """(finish − hand-off) / D, per request in workload order."""
        out = np.empty(len(self.order))
        out[self.order] = self.decode.tpot
        return out

    @property
    def output_tokens(self) -> int:
        """Each request's prefill token plus its decode tokens."""
        return int(self.workload.decode_tokens.sum() + len(self.workload.requests))

    @property
    def makespan_s(self) -> float:
        return float(self.decode.finish.max() - self.workload.arrivals.min())

    @property
    def throughput_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s

    @property
    def ttft_p50_s(self) -> float:
        return float(np.percentile(self.ttft, 50))

    @property
    def tpot_p50_s(self) -> float:
        return self.decode.tpot_p50          # a median: the hand-off order does not matter


def run_pipeline(techniques: Techniques, deployment: Deployment, shape: ModelShape,
                 fit: hardware.ExpertFit, calibration: Calibration, workload: Workload
                 ) -> PipelineRun:
    """Serve ``workload`` with ``techniques`` on ``deployment`` (module docstring)."""
    if techniques.eldr and calibration.eldr_fit is None:
        raise ValueError("ELDR needs a fit: calibrate with more than one decoder")
    prefill_config = PrefillConfig(deployment.prefill_devices,
                                   "async_ep" if techniques.async_ep else "sync_ep",
                                   deployment.prefill_tokens_per_device)
    rows = [rows_per_token(r) for r in workload.requests]
    prefill = simulate_prefill(prefill_config, shape, fit, workload.arrivals,
                               workload.prompt_tokens, rows)
    order = np.argsort(prefill.handoff, kind="stable")
    requests = [workload.requests[int(i)] for i in order]
    k = deployment.num_decoders
    policy = (make_policy("eldr", k, fit=calibration.eldr_fit, tau=deployment.eldr_tau)
              if techniques.eldr else make_policy("jsq", k))
    table = calibration.tables["metro" if techniques.metro else "eplb_even"]
    cost = decode_cost.DecoderCost.build(
        shape, fit, table, "offload_prefetch" if techniques.offload_prefetch else "resident",
        decode_cost.mean_context(workload.prompt_tokens, workload.decode_tokens))
    decode = simulate(requests, prefill.handoff[order], policy, num_decoders=k, cost=cost,
                      max_batch_size=deployment.max_batch_size)
    return PipelineRun(techniques=techniques, workload=workload, prefill=prefill,
                       decode=decode, order=order)
