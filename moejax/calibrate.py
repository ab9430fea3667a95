"""Start-up calibration of the saturation threshold Θ (DESIGN.md "Formulas", seed Eq. (1), (3)).

Θ is how much queued work (FLOPs) an engine needs for its compute to cover the
per-layer expert transfers: with t_x the time to move one layer's experts over the
backend's slowest channel and R the FLOP rate the device achieves on a layer,

    Θ = (1 + ε) · L_moe · t_x · R          (ε = 0.1 by default)

Both are measured here, on the real device(s):

* R — a dummy forward at a reference batch (``reference_tokens`` tokens in sequences
  of ``reference_sequence``), one layer program per decoder layer, each timed with a
  device synchronization; R = FLOPs of one layer at that batch / median layer time.
  Weights are random at the model's shapes (timing does not depend on their values),
  so calibration never needs the whole model on one device.
* t_x — the backend times one layer's expert transfer in isolation
  (``Backend.time_expert_transfer``): host-to-device for ``offload``, the all-gather
  of one layer's shards for ``async_ep``, the slower of the two for ``hybrid``; 0 for
  ``resident`` (nothing moves, so Θ = 0: it is saturated by any work).

Fallback (documented, conservative): a backend with no weight transfer to hide
(``sync_ep``, ``tp``), or a run that skips measuring, gets Θ = the FLOPs of one full
batch of ``max_batch_tokens`` tokens through the whole model — an engine counts as
saturated once one full batch of work is queued, so a router never piles more than
that on it while others idle. An operator can pin Θ by hand (``theta=``).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax.attention_kinds import PackedCausal
from moejax import model as model_lib
from moejax.config import ModelConfig

log = logging.getLogger("moejax.calibrate")

DEFAULT_EPS = 0.1
DEFAULT_REFERENCE_TOKENS = 2048
DEFAULT_REFERENCE_SEQUENCE = 512
DEFAULT_REPEATS = 3


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What the router's saturation test consumes (all per engine).

    theta: Θ in FLOPs. t_x: seconds per layer of expert transfer (None when not measured);
    channel: what t_x timed. rate: R, achieved FLOP/s on one layer (None when not measured).
    reference_flops / reference_tokens: one layer's FLOPs at the reference batch and its
    size. layer_seconds: the measured per-layer times. source: "measured", "fallback"
    or "pinned".
    """

    backend: str
    theta: float
    source: str
    eps: float = DEFAULT_EPS
    t_x: float | None = None
    channel: str = "none"
    rate: float | None = None
    reference_flops: float | None = None
    reference_tokens: int | None = None
    num_moe_layers: int = 0
    layer_seconds: tuple[float, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def threshold(eps: float, num_moe_layers: int, t_x: float, rate: float) -> float:
    """Θ = (1+ε)·L_moe·t_x·R."""
    return (1.0 + eps) * num_moe_layers * t_x * rate


def fallback_theta(cfg: ModelConfig, max_batch_tokens: int) -> float:
    """Θ when nothing was measured: one full batch of work (see the module docstring)."""
    return float(max_batch_tokens * cfg.linear_flops_per_token
                 + cfg.attention_flops_range(1, max_batch_tokens))


def reference_batch(cfg: ModelConfig, tokens: int, sequence: int, seed: int = 0
                    ) -> tuple[model_lib.PackedBatch, model_lib.ForwardOptions]:
    """``tokens`` random tokens in sequences of ``sequence`` (one per attention block)."""
    if tokens % sequence:
        raise ValueError(f"reference_tokens ({tokens}) must be a multiple of "
                         f"reference_sequence ({sequence})")
    count = tokens // sequence
    rng = np.random.default_rng(seed)
    batch = model_lib.PackedBatch(
        tokens=rng.integers(0, cfg.vocab_size, tokens).astype(np.int32),
        positions=np.tile(np.arange(sequence, dtype=np.int32), count),
        segment_ids=np.repeat(np.arange(count, dtype=np.int32), sequence),
        score_positions=(np.arange(count, dtype=np.int32) + 1) * sequence - 1,
        score_token_ids=np.zeros((count, 2), np.int32))
    return batch, model_lib.ForwardOptions(attn_block=sequence, full_vocab=False)


def layer_flops(cfg: ModelConfig, tokens: int, sequence: int) -> float:
    """One decoder layer's FLOPs on the reference batch (matmuls + causal attention)."""
    attention_per_layer = cfg.attention_flops_range(1, sequence) // cfg.num_layers
    return float(tokens * cfg.linear_flops_per_layer + (tokens // sequence) * attention_per_layer)


def _timed_layer(params, x, attn, cfg, opts):
    """One decoder layer of a one-layer model, through the model's single-layer entry."""
    module = model_lib.decoder(cfg, params)
    return module.layer(0, x, attn, module.local_dispatcher(opts.expert_impl, opts.tile_rows)).x


def time_layers(cfg: ModelConfig, device: jax.Device, dtype, tokens: int, sequence: int,
                expert_impl: str = "auto") -> tuple[float, ...]:
    """Seconds of each of the L layers of a dummy forward on ``device`` (synchronized)."""
    batch, opts = reference_batch(cfg, tokens, sequence)
    opts = dataclasses.replace(opts, expert_impl=expert_impl)
    one_layer_cfg = dataclasses.replace(cfg, num_layers=1)
    params = jax.device_put(jax.tree.map(lambda a: jnp.asarray(a, dtype),
                                         model_lib.init_params(one_layer_cfg, seed=0)), device)
    batch = jax.device_put(batch, device)
    # Built once, outside the timed program (as a forward builds it once for all layers).
    attn = jax.device_put(PackedCausal.of(jnp.asarray(batch.positions),
                                          jnp.asarray(batch.segment_ids), opts.attn_block), device)
    x = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal(
        (tokens, cfg.hidden_size)) * 0.1, dtype), device)
    run = jax.jit(_timed_layer, static_argnames=("cfg", "opts"))
    jax.block_until_ready(run(params, x, attn, cfg=one_layer_cfg, opts=opts))   # compile
    seconds = []
    for _ in range(cfg.num_layers):
        start = time.perf_counter()
        x = jax.block_until_ready(run(params, x, attn, cfg=one_layer_cfg, opts=opts))
        seconds.append(time.perf_counter() - start)
    return tuple(seconds)


def uncalibrated(backend, max_batch_tokens: int, eps: float = DEFAULT_EPS) -> Calibration:
    """The fallback record, for when calibration is switched off."""
    return Calibration(backend=backend.name, source="fallback", eps=eps,
                       theta=fallback_theta(backend.cfg, max_batch_tokens),
                       num_moe_layers=backend.cfg.num_layers)


def calibrate(backend, *, eps: float = DEFAULT_EPS, theta: float | None = None,
              reference_tokens: int = DEFAULT_REFERENCE_TOKENS,
              reference_sequence: int = DEFAULT_REFERENCE_SEQUENCE,
              repeats: int = DEFAULT_REPEATS, max_batch_tokens: int | None = None,
              expert_impl: str = "auto") -> Calibration:
    """Measure t_x and R for ``backend`` and return Θ (see the module docstring).

    theta: pin Θ by hand (nothing is measured). max_batch_tokens: the batch size of
    the fallback (default: reference_tokens).
    """
    cfg = backend.cfg
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if theta is not None:
        if theta < 0:
            raise ValueError(f"a pinned theta must be >= 0 FLOPs, got {theta}")
        record = Calibration(backend=backend.name, theta=float(theta), source="pinned", eps=eps,
                             num_moe_layers=cfg.num_layers)
        log.info("calibration (%s): Θ pinned at %.3g FLOPs", backend.name, theta)
        return record
    transfer = backend.time_expert_transfer(repeats)
    if transfer is None:
        record = uncalibrated(backend, max_batch_tokens or reference_tokens, eps)
        log.info("calibration (%s): no expert transfer to hide; fallback Θ = %.3g FLOPs "
                 "(one full batch)", backend.name, record.theta)
        return record
    channel, t_x = transfer
    if t_x == 0:      # nothing moves: any work saturates, no need to time the layers
        record = Calibration(backend=backend.name, source="measured", eps=eps, theta=0.0,
                             t_x=0.0, channel=channel, num_moe_layers=cfg.num_layers)
        log.info("calibration (%s): no expert transfer, Θ = 0", backend.name)
        return record
    # A device of this process's own (over several processes, devices[0] may be another's).
    device = next(d for d in backend.devices if d.process_index == jax.process_index())
    seconds = time_layers(cfg, device, backend.dtype, reference_tokens,
                          reference_sequence, expert_impl)
    flops = layer_flops(cfg, reference_tokens, reference_sequence)
    rate = flops / statistics.median(seconds)
    record = Calibration(backend=backend.name, source="measured", eps=eps,
                         theta=threshold(eps, cfg.num_layers, t_x, rate), t_x=t_x,
                         channel=channel, rate=rate, reference_flops=flops,
                         reference_tokens=reference_tokens, num_moe_layers=cfg.num_layers,
                         layer_seconds=seconds)
    log.info("calibration (%s): t_x = %.3g ms (%s), R = %.3g TFLOP/s, Θ = %.3g FLOPs "
             "(ε = %.2f, %d MoE layers)", backend.name, t_x * 1e3, channel, rate / 1e12,
             record.theta, eps, cfg.num_layers)
    return record


def sample_seconds(fn, repeats: int, warmup: int = 1) -> list[float]:
    """Wall times of ``repeats`` (at least one) calls of ``fn()`` (which must synchronize)
    after ``warmup`` untimed calls. (The benchmarks time through this too.)"""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` (which must synchronize) after one warm-up call."""
    return statistics.median(sample_seconds(fn, repeats))
