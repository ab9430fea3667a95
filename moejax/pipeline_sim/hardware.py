"""The pipeline model's modelled constant and the measured H100 expert-cost fit. Its H100
figures (HBM, bf16 rate, NVLink, link latency, host→device rate) and the cost file are
``moejax.asyncmoe.costs``' ``H100_*``, read there."""

from __future__ import annotations

import dataclasses

from moejax.asyncmoe import costs
from moejax.asyncmoe.checks import int_at_least, nonnegative
from moejax.eldr.simulator import COST_KEYS
from moejax.model_shape import QWEN3_30B_A3B

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
            object.__setattr__(self, name, nonnegative(f"ExpertFit.{name}", getattr(self, name)))
        object.__setattr__(self, "top_k", int_at_least("ExpertFit.top_k", self.top_k, 1))

    @property
    def row_s(self) -> float:
        """Seconds per expert row (b per token of top_k rows, over top_k)."""
        return self.b_s / self.top_k

    def layer_s(self, active: float, rows: float) -> float:
        """One device's MoE layer: ``active`` experts with ``rows`` rows among them."""
        return self.t0_s + self.a_s * active + self.row_s * rows

    @classmethod
    def from_file(cls, path: str = costs.H100_FIT_FILE, fit_name: str = costs.H100_FIT,
                  top_k: int = QWEN3_30B_A3B.top_k) -> ExpertFit:
        """The fit ``fit_name`` of an H100 cost file (``"top"``: its top-level fit),
        negative coefficients taken as 0 (fit noise)."""
        fit = costs.load_h100_fit(path, fit_name)
        return cls(*(max(float(fit[key]), 0.0) for key in COST_KEYS), top_k=top_k)
