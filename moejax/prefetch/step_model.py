"""A per-decode-step cost model of offloaded MoE decode, by context length and batch.

The experts live in host memory; each decode step copies the experts a layer needs to
the device (PCIe, host -> device) and computes the layer there. Per layer l the model
counts:

* attention: the KV cache read at the context (``batch * context`` tokens of K and V)
  plus the attention projections' weights, over the HBM bandwidth, plus a fixed launch
  cost for the attention block's kernels. Decode attention at batch <= a few dozen is
  bandwidth bound, so bytes / bandwidth is its time;
* expert compute: the H100 cost file's fit (``t = per_layer + per_active * n``, the fit of
  the smallest measured batch >= the step's batch), over the layer's active experts n;
* the expert copy: n experts' bytes over the host -> device rate measured on the H100.

n is the expected number of distinct experts ``batch`` tokens route to,
``E * (1 - (1 - k/E) ** batch)`` (uniform, independent routing: an upper bound on real,
skewed routing; exactly k at batch 1).

Overlap (the seed's Eq. 1, with attention added to the window): layer l's prediction of
layer l+1 is ready after layer l's attention; its copy is issued once layer l's experts
are enqueued, so it runs under layer l's expert compute and layer l+1's attention
(``window = expert + attention``), and hides ``min(copy, window)``. One copy engine
serves copies in order, so an on-demand copy issued after layer l+1 routes waits for
the rest of the prefetch (``copy - window`` when positive). Layer 0 has no predecessor
and copies on demand in every mode. Modes:

* ``ondemand``: every layer copies its experts after routing; all of the copy is exposed;
* ``exact``: layers >= 1 prefetch the predicted experts, then copy the misses on demand
  (``(1 - recall) * copy``, exposed, after the prefetch's unhidden part);
* ``speculative``: layers >= 1 prefetch the predicted experts and compute with them; a
  miss is never copied.

So at recall 1 exact equals speculative, and at recall 0 exact costs on-demand's copy
plus the unhidden part of a useless prefetch (equal to on-demand when the window covers
the copy). The model counts the layer stack only (no embedding, LM head or sampling):
the modes differ in the layers alone, and the figures compare modes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from moejax.asyncmoe import costs
from moejax.asyncmoe.checks import int_at_least, nonnegative, positive
from moejax.model_shape import ModelShape

MODES = ("ondemand", "exact", "speculative")
COMPUTE_MODELS = ("expert", "layer")

# A CUDA kernel launch costs ~5 us on the host-side launch path (NVIDIA, "Getting
# Started with CUDA Graphs", 2019: 2-5 us per launch); a decode attention block runs
# six kernels (input norm, qkv projection, q/k norm + rope, KV write, attention, output
# projection).
KERNEL_LAUNCH_SECONDS = 5e-6
ATTENTION_KERNELS = 6


@dataclasses.dataclass(frozen=True)
class Device:
    """The rates of the decode device: HBM and host -> device bytes per second, and the
    fixed cost of one layer's attention kernels."""

    hbm_bytes_per_s: float
    h2d_bytes_per_s: float
    attention_launch_s: float

    def __post_init__(self) -> None:
        for name in ("hbm_bytes_per_s", "h2d_bytes_per_s"):
            positive(f"Device.{name}", getattr(self, name))
        nonnegative("Device.attention_launch_s", self.attention_launch_s)


# The H100 figures of the AsyncMoE H100 cost table (one definition): HBM bandwidth (the
# datasheet) and the host -> device rate (measured).
H100 = Device(hbm_bytes_per_s=costs.H100_HBM_BPS, h2d_bytes_per_s=costs.H100_H2D_BPS,
              attention_launch_s=ATTENTION_KERNELS * KERNEL_LAUNCH_SECONDS)


@dataclasses.dataclass(frozen=True)
class ExpertCost:
    """Expert compute of one layer: ``per_layer_s + per_active_s * n`` for n active
    experts."""

    per_active_s: float
    per_layer_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_active_s", "per_layer_s"):
            nonnegative(f"ExpertCost.{name}", getattr(self, name))

    def layer_seconds(self, active: float) -> float:
        return self.per_layer_s + self.per_active_s * active


def expert_cost_from_file(path: str | Path, batch: int = 1,
                          compute_model: str = "expert") -> ExpertCost:
    """The cost file's (``benchmarks/eldr_cost.py --cost-out``) fit for ``batch`` tokens:
    that of the smallest measured batch >= ``batch``. ``compute_model="expert"`` keeps
    the per-active-expert term only, ``"layer"`` adds the fit's per-layer term."""
    if compute_model not in COMPUTE_MODELS:
        raise ValueError(f"compute_model must be one of {COMPUTE_MODELS}, got {compute_model!r}")
    batch = int_at_least("batch", batch, 1)
    fits = json.loads(Path(path).read_text())["by_batch"]
    measured = sorted(int(b) for b in fits)
    above = [b for b in measured if b >= batch]
    if not above:
        raise ValueError(f"{path}: no expert-cost fit for batch {batch} (fits for batches "
                         f"{measured})")
    fit = fits[str(above[0])]
    return ExpertCost(per_active_s=float(fit["a_s"]),
                      per_layer_s=float(fit["t0_s"]) if compute_model == "layer" else 0.0)


def active_experts(shape: ModelShape, batch: int) -> float:
    """Expected distinct experts of one layer over ``batch`` tokens (uniform routing)."""
    batch = int_at_least("batch", batch, 1)
    e, k = shape.num_experts, shape.top_k
    return e * (1.0 - (1.0 - k / e) ** batch)


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer's seconds: attention, expert compute, and copying its active experts."""

    attention_s: float
    expert_s: float
    copy_s: float

    @property
    def window_s(self) -> float:
        """What a prefetch of this layer hides under: the previous layer's experts and
        this layer's attention (layers are alike, so this layer's own figures)."""
        return self.expert_s + self.attention_s


def layer_cost(shape: ModelShape, device: Device, expert_cost: ExpertCost, context: int,
               batch: int = 1) -> LayerCost:
    """The per-layer costs of a decode step at ``context`` tokens of KV per sequence."""
    context = int_at_least("context (tokens)", context, 1)
    active = active_experts(shape, batch)
    kv_bytes = batch * context * shape.kv_bytes_per_token_layer
    attention = ((kv_bytes + shape.attention_weight_bytes) / device.hbm_bytes_per_s
                 + device.attention_launch_s)
    return LayerCost(attention_s=attention, expert_s=expert_cost.layer_seconds(active),
                     copy_s=active * shape.expert_bytes / device.h2d_bytes_per_s)


@dataclasses.dataclass(frozen=True)
class StepBreakdown:
    """Seconds of one decode step: copy exposed (the compute stream waits on it), copy
    hidden (under compute), attention, expert compute, and the total
    (attention + expert + copy exposed)."""

    copy_exposed_s: float
    copy_hidden_s: float
    attention_s: float
    expert_s: float

    @property
    def total_s(self) -> float:
        return self.attention_s + self.expert_s + self.copy_exposed_s

    def as_ms(self) -> dict[str, float]:
        return {"copy_exposed_ms": 1000 * self.copy_exposed_s,
                "copy_hidden_ms": 1000 * self.copy_hidden_s,
                "attention_ms": 1000 * self.attention_s, "expert_ms": 1000 * self.expert_s,
                "total_ms": 1000 * self.total_s}


def step_breakdown(mode: str, layer: LayerCost, num_layers: int, recall: float = 0.0
                   ) -> StepBreakdown:
    """One decode step of ``num_layers`` layers alike in ``mode`` (module docstring);
    ``recall``: the predictor's recall@k on layers >= 1 (exact and speculative)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    num_layers = int_at_least("num_layers", num_layers, 1)
    if not 0.0 <= recall <= 1.0:
        raise ValueError(f"recall must lie in [0, 1], got {recall!r}")
    predicted = num_layers - 1 if mode != "ondemand" else 0
    hidden = min(layer.copy_s, layer.window_s)
    spill = layer.copy_s - hidden
    misses = (1.0 - recall) * layer.copy_s if mode == "exact" else 0.0
    exposed = (num_layers - predicted) * layer.copy_s + predicted * (spill + misses)
    return StepBreakdown(copy_exposed_s=exposed, copy_hidden_s=predicted * hidden,
                         attention_s=num_layers * layer.attention_s,
                         expert_s=num_layers * layer.expert_s)


def step_breakdowns(shape: ModelShape, device: Device, expert_cost: ExpertCost, context: int,
                    recall: float, batch: int = 1) -> dict[str, StepBreakdown]:
    """Every mode's step at one context and batch, the predictor's ``recall``."""
    layer = layer_cost(shape, device, expert_cost, context, batch)
    return {mode: step_breakdown(mode, layer, shape.num_layers, recall) for mode in MODES}


__all__: Sequence[str] = ("Device", "ExpertCost", "LayerCost", "StepBreakdown", "H100", "MODES",
                          "COMPUTE_MODELS", "expert_cost_from_file", "active_experts", "layer_cost",
                          "step_breakdown", "step_breakdowns")
