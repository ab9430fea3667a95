"""Every hardware figure and modelled constant of the pipeline model, each named with
where it comes from, and the measured H100 expert-cost fit."""

from __future__ import annotations

import dataclasses
import os

from moejax.asyncmoe import costs
from moejax.eldr.simulator import COST_KEYS
from moejax.model_shape import QWEN3_30B_A3B

# ----------------------------------------------------------------------------- H100
HBM_BPS = costs.H100_HBM_BPS
"""H100 SXM HBM3 bandwidth, B/s (datasheet; ``moejax.asyncmoe.costs.H100_HBM_BPS``)."""
BF16_FLOPS = costs.H100_BF16_FLOPS
"""H100 SXM dense bf16 rate, FLOP/s (datasheet; ``moejax.asyncmoe.costs``)."""
LINK_BPS = costs.H100_LINK_BPS
"""Device-to-device bandwidth, B/s one way: NVLink 4 (``moejax.asyncmoe.costs``)."""
LINK_LATENCY_S = costs.H100_LINK_LATENCY_S
"""Per-collective latency, s: MODELLED in ``moejax.asyncmoe.costs`` (a few µs)."""
H2D_BPS = costs.H100_H2D_BPS
"""Host→device rate per device, B/s (measured: ``moejax.asyncmoe.costs``); each device has
its own PCIe link, so devices of one group copy in parallel."""

# ----------------------------------------------------------------------------- the fit
DEFAULT_FIT_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks", "data", "eldr_cost_h100_qwen3-30b-a3b.json")
"""The measured H100 cost file of one Qwen3-30B-A3B MoE layer (``benchmarks/eldr_cost.py``
on the lent H100)."""
DEFAULT_FIT = costs.H100_FIT
"""Its fit the model uses (``fused_tiles_given``: the plane that fits, R² 0.9998; the
reason is in ``moejax.asyncmoe.costs.H100_FIT``)."""

# ----------------------------------------------------------------------------- modelled
EPLB_REPLICATION = 1.5
"""Expert replicas per expert inside a decoder's EP group (EPLB redundant experts): the
METRO seed's §V setting ("1.5x replication"), also ``benchmarks/metro_quality.py``'s
timing shapes. MODELLED for this deployment."""


@dataclasses.dataclass(frozen=True)
class ExpertFit:
    """One MoE layer on one H100: t = t0 + a·n + b·B over n active experts and B tokens
    of top-``top_k`` (B·top_k rows), per layer, seconds. A negative coefficient (fit
    noise: time does not shrink with work) is refused; take it as 0 when loading."""

    t0_s: float
    a_s: float
    b_s: float
    top_k: int

    def __post_init__(self) -> None:
        for name in ("t0_s", "a_s", "b_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
                    or value != value or value == float("inf"):
                raise ValueError(f"ExpertFit.{name} must be a finite number of seconds >= 0, "
                                 f"got {value!r}")
            object.__setattr__(self, name, float(value))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"ExpertFit.top_k must be a positive integer, got {self.top_k!r}")

    @property
    def row_s(self) -> float:
        """Seconds per expert row (b per token of top_k rows, over top_k)."""
        return self.b_s / self.top_k

    def layer_s(self, active: float, rows: float) -> float:
        """One device's MoE layer: ``active`` experts with ``rows`` rows among them."""
        return self.t0_s + self.a_s * active + self.row_s * rows

    @classmethod
    def from_file(cls, path: str = DEFAULT_FIT_FILE, fit_name: str = DEFAULT_FIT,
                  top_k: int = QWEN3_30B_A3B.top_k) -> ExpertFit:
        """The fit ``fit_name`` of an H100 cost file (``"top"``: its top-level fit),
        negative coefficients taken as 0 (fit noise)."""
        fit = costs.load_h100_fit(path, fit_name)
        return cls(*(max(float(fit[key]), 0.0) for key in COST_KEYS), top_k=top_k)
