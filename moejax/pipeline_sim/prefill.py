"""The prefill stage: one group of G devices, data-parallel attention, the experts either
split over the devices with two all-to-alls per layer (sync EP, the MoE-Prefill seed's
DP+EP baseline) or gathered a layer ahead (AsyncEP, the seed's DP+AsyncEP).

Per layer, for one batch (requests dealt to devices longest-first onto the device with
the fewest tokens; T_g tokens on device g; R_g[l, e] the rows its tokens send to expert
e at layer l, from each request's real (lifted) prompt routing scaled to its prompt
length):

* attention on device g: :func:`prefill_attention_s` (a roofline: the weights read once,
  the KV written once, 2 FLOP per weight per token plus 4·heads·head_dim per causal
  (query, key) pair);
* an expert layer on one device: the H100 fit t0 + a·(active experts) + (b/k)·rows
  (:class:`moejax.pipeline_sim.hardware.ExpertFit`);
* **sync EP**: device h holds experts [h·E/G, (h+1)·E/G); a layer is max_g attention,
  an all-to-all (dispatch), max_h of its experts' layer time over every device's rows to
  them (the routing-skew straggler), an all-to-all (combine). An all-to-all moves
  max_g T_g·k·hidden bf16 · (G-1)/G bytes per device at the link rate, plus its latency.
* **AsyncEP**: every device runs its own tokens through the whole layer's experts
  (active = experts its rows reach); the layer's expert weights are all-gathered
  ((G-1)/G of them per device at the link rate, plus latency) while the layer before
  computes, so layer l costs max(compute_l, gather_{l+1}) (the seed's window: the
  gather is hidden when compute is longer, exposed otherwise); layer 0 is held whole.

At G = 1 both are one device running everything: the same time.

Batching: first come, first served. When the stage is idle and a request waits, it
starts a batch of the waiting requests in arrival order up to ``tokens_per_device`` · G
prompt tokens (always at least one request); every request of the batch is handed to
the decoders, with its first token, when the batch ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from jaxtyping import Float, Integer

from moejax.asyncmoe import costs
from moejax.asyncmoe.checks import int_at_least
from moejax.model_shape import ModelShape
from moejax.pipeline_sim import hardware

STRATEGIES = ("sync_ep", "async_ep")


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """The prefill group: ``devices`` H100s, ``strategy`` (sync_ep or async_ep) and the
    most prompt tokens one batch puts on a device."""

    devices: int
    strategy: str
    tokens_per_device: int

    def __post_init__(self) -> None:
        for name in ("devices", "tokens_per_device"):
            object.__setattr__(self, name, int_at_least(f"PrefillConfig.{name}",
                                                        getattr(self, name), 1))
        if self.strategy not in STRATEGIES:
            raise ValueError(f"PrefillConfig.strategy must be one of {STRATEGIES}, "
                             f"got {self.strategy!r}")


def prefill_attention_s(shape: ModelShape, prompt_tokens: Sequence[int]) -> float:
    """One layer's attention on one device over whole prompts of ``prompt_tokens``
    tokens each (module docstring's roofline at the H100 peaks; 0 for no prompt)."""
    lengths = np.asarray(prompt_tokens, np.float64)
    if not lengths.size:
        return 0.0
    tokens = float(lengths.sum())
    weights = shape.non_expert_weight_count
    nbytes = weights * shape.dtype_bytes + tokens * shape.kv_bytes_per_token_layer
    pairs = float(np.sum(lengths * (lengths + 1) / 2))
    flops = 2 * weights * tokens + 4 * shape.num_heads * shape.head_dim * pairs
    return costs.roofline_s(nbytes, flops)


def deal_to_devices(prompt_tokens: Sequence[int], devices: int) -> Integer[np.ndarray, "n"]:
    """The device of each request: longest first, each onto the device with the fewest
    tokens so far (ties: lower device)."""
    lengths = np.asarray(prompt_tokens, np.int64)
    load = np.zeros(devices, np.int64)
    out = np.zeros(lengths.shape[0], np.int64)
    for i in np.argsort(-lengths, kind="stable"):
        d = int(np.argmin(load))
        out[i] = d
        load[d] += lengths[i]
    return out


def link_transfer_s(nbytes: float) -> float:
    """One collective moving ``nbytes`` per device over NVLink: its latency plus the
    bytes at the link rate."""
    return costs.H100_LINK_LATENCY_S + nbytes / costs.H100_LINK_BPS


def all_to_all_s(tokens: float, shape: ModelShape, devices: int) -> float:
    """One all-to-all of ``tokens`` tokens' top-k rows (activations,
    ``shape.dtype_bytes`` each) from one device of ``devices`` (0 on one device)."""
    if devices == 1:
        return 0.0
    nbytes = (tokens * shape.top_k * shape.hidden_size * shape.dtype_bytes * (devices - 1)
              / devices)
    return link_transfer_s(nbytes)


def gather_s(shape: ModelShape, devices: int) -> float:
    """All-gathering one layer's experts over ``devices`` (0 on one device)."""
    if devices == 1:
        return 0.0
    nbytes = shape.layer_expert_bytes * (devices - 1) / devices
    return link_transfer_s(nbytes)


def forward_s(config: PrefillConfig, shape: ModelShape, fit: hardware.ExpertFit,
              prompt_tokens: Sequence[int], rows_per_token: Sequence[np.ndarray]) -> float:
    """One prefill forward of a batch: ``prompt_tokens[i]`` tokens of request i, whose
    tokens send ``rows_per_token[i]`` [L, E] rows per token to each expert."""
    lengths = np.asarray(prompt_tokens, np.int64)
    if lengths.ndim != 1 or not lengths.size or (lengths < 1).any():
        raise ValueError(f"prompt_tokens: need at least one prompt of >= 1 token, got "
                         f"{lengths.tolist()}")
    if len(rows_per_token) != lengths.size:
        raise ValueError(f"{len(rows_per_token)} rows_per_token for {lengths.size} prompts")
    g = config.devices
    if shape.num_experts % g:
        raise ValueError(f"{shape.num_experts} experts do not split over {g} devices")
    device = deal_to_devices(lengths, g)
    rows = np.zeros((g, shape.num_layers, shape.num_experts))
    for i, q in enumerate(rows_per_token):
        rows[device[i]] += lengths[i] * np.asarray(q, np.float64)
    tokens = np.bincount(device, weights=lengths, minlength=g)
    attention = np.array([prefill_attention_s(shape, lengths[device == d]) for d in range(g)])
    if config.strategy == "sync_ep":
        per_home = rows.sum(axis=0).reshape(shape.num_layers, g, shape.num_experts // g)
        experts = np.max(fit.t0_s + fit.a_s * (per_home > 0).sum(axis=2)
                         + fit.row_s * per_home.sum(axis=2), axis=1)            # [L]
        exchange = 2 * all_to_all_s(float(tokens.max()), shape, g)
        return float(np.sum(attention.max() + exchange + experts))
    compute = np.max(attention[:, None] + fit.t0_s + fit.a_s * (rows > 0).sum(axis=2)
                     + fit.row_s * rows.sum(axis=2), axis=0)                    # [L]
    ahead = np.full(shape.num_layers, gather_s(shape, g))
    ahead[-1] = 0.0                       # nothing to gather during the last layer
    return float(np.sum(np.maximum(compute, ahead)))


@dataclasses.dataclass(frozen=True, eq=False)
class PrefillResult:
    """Per request: ``batch`` (index of its batch), ``handoff`` (its batch's end: first
    token, hand-off to the decoders); per batch: ``batch_start``, ``batch_end``."""

    batch: np.ndarray
    handoff: np.ndarray
    batch_start: np.ndarray
    batch_end: np.ndarray


def simulate_prefill(config: PrefillConfig, shape: ModelShape, fit: hardware.ExpertFit,
                     arrivals: Float[np.ndarray, "n"], prompt_tokens: Sequence[int],
                     rows_per_token: Sequence[np.ndarray]) -> PrefillResult:
    """First-come-first-served batches (module docstring) over requests arriving at
    ``arrivals`` (sorted, seconds)."""
    times = np.asarray(arrivals, np.float64)
    lengths = np.asarray(prompt_tokens, np.int64)
    n = times.shape[0]
    if lengths.shape != (n,) or len(rows_per_token) != n:
        raise ValueError(f"{n} arrivals, {lengths.shape[0]} prompt lengths, "
                         f"{len(rows_per_token)} rows_per_token: one of each per request")
    if n and (np.diff(times) < 0).any():
        raise ValueError("arrivals must be sorted")
    budget = config.tokens_per_device * config.devices
    batch = np.zeros(n, np.int64)
    handoff = np.zeros(n)
    starts, ends = [], []
    clock, i = 0.0, 0
    while i < n:
        start = max(clock, float(times[i]))
        j, total = i + 1, int(lengths[i])
        while j < n and times[j] <= start and total + lengths[j] <= budget:
            total += int(lengths[j])
            j += 1
        end = start + forward_s(config, shape, fit, lengths[i:j], rows_per_token[i:j])
        batch[i:j] = len(starts)
        handoff[i:j] = end
        starts.append(start)
        ends.append(end)
        clock, i = end, j
    return PrefillResult(batch=batch, handoff=handoff, batch_start=np.array(starts),
                         batch_end=np.array(ends))
