"""Cost tables of the AsyncMoE simulator: attention over (batch, context), an expert over
batch, the head over batch, a per-execution overhead and a point-to-point link
(measured by ``benchmarks/asyncmoe_cost.py``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from moejax.asyncmoe.checks import (grid, int_at_least, interp1, nonnegative, positive,
                                    seconds_row, segment)
from moejax.model_shape import QWEN3_30B_A3B

TABLE_KEYS = ("attention", "expert", "head", "batch_overhead_s", "link")
"""The keys of a cost-table dict (:meth:`CostTables.from_dict`); "meta" may be added."""
META_KEY = "meta"
FREE_LINK_BPS = 1e30       # a link whose transfers take no time


@dataclasses.dataclass(frozen=True)
class CostTables:
    """Measured execution and transfer costs, in seconds.

    * attention: ``attention_seconds[i][j]`` for a batch of ``attention_batch[i]`` tokens
      at context ``attention_context[j]`` (one block: the top-k merge, attention, gate);
    * expert: ``expert_seconds[i]`` for ``expert_batch[i]`` tokens (one expert, one
      block);
    * head: ``head_seconds[i]`` for ``head_batch[i]`` tokens (final norm, LM head,
      sampling);
    * ``batch_overhead_s``: a fixed cost added to every execution (scheduling, gathering
      the batch's inputs, launch) on top of the grid;
    * link: ``link_latency_s + bytes / link_bandwidth_Bps`` per transfer.

    Between grid points costs are (bi)linear; beyond them they extrapolate the end
    segments linearly (a one-point axis is constant), floored at 0."""

    attention_batch: tuple[float, ...]
    attention_context: tuple[float, ...]
    attention_seconds: tuple[tuple[float, ...], ...]
    expert_batch: tuple[float, ...]
    expert_seconds: tuple[float, ...]
    head_batch: tuple[float, ...]
    head_seconds: tuple[float, ...]
    batch_overhead_s: float
    link_latency_s: float
    link_bandwidth_Bps: float

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        fix("attention_batch", grid("attention.batch", self.attention_batch))
        fix("attention_context", grid("attention.context", self.attention_context))
        rows = self.attention_seconds
        if isinstance(rows, (str, bytes)) or not isinstance(rows, (Sequence, np.ndarray)) \
                or len(rows) != len(self.attention_batch):
            raise ValueError(f"attention.seconds must have one row per batch size "
                             f"({len(self.attention_batch)}), got {rows!r}")
        fix("attention_seconds", tuple(
            seconds_row(f"attention.seconds[{i}]", row, len(self.attention_context))
            for i, row in enumerate(rows)))
        for part in ("expert", "head"):
            fix(f"{part}_batch", grid(f"{part}.batch", getattr(self, f"{part}_batch")))
            fix(f"{part}_seconds", seconds_row(f"{part}.seconds",
                                                getattr(self, f"{part}_seconds"),
                                                len(getattr(self, f"{part}_batch"))))
        fix("batch_overhead_s", nonnegative("batch_overhead_s", self.batch_overhead_s))
        fix("link_latency_s", nonnegative("link.latency_s", self.link_latency_s))
        fix("link_bandwidth_Bps", positive("link.bandwidth_Bps", self.link_bandwidth_Bps))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostTables:
        """From ``{"attention": {"batch", "context", "seconds"}, "expert": {"batch",
        "seconds"}, "head": {"batch", "seconds"}, "batch_overhead_s", "link":
        {"latency_s", "bandwidth_Bps"}}`` (and an optional "meta", ignored), the shape of
        a JSON cost file. ValueError naming a missing, unknown or bad entry."""
        if not isinstance(data, Mapping):
            raise ValueError(f"cost tables must be a dict, got {type(data).__name__}")
        _check_keys("cost tables", data, TABLE_KEYS, optional=(META_KEY,))
        attention = _section(data, "attention", ("batch", "context", "seconds"))
        expert = _section(data, "expert", ("batch", "seconds"))
        head = _section(data, "head", ("batch", "seconds"))
        link = _section(data, "link", ("latency_s", "bandwidth_Bps"))
        return cls(attention["batch"], attention["context"], attention["seconds"],
                   expert["batch"], expert["seconds"], head["batch"], head["seconds"],
                   data["batch_overhead_s"], link["latency_s"], link["bandwidth_Bps"])

    @classmethod
    def uniform(cls, seconds: float = 1.0) -> CostTables:
        """Every execution takes ``seconds`` and transfers are free: the real runtime's
        default virtual clock (``moejax.asyncmoe.runtime``)."""
        flat = [[seconds, seconds], [seconds, seconds]]
        return cls.from_dict({"attention": {"batch": [1, 2], "context": [1, 2], "seconds": flat},
                              "expert": {"batch": [1, 2], "seconds": flat[0]},
                              "head": {"batch": [1, 2], "seconds": flat[0]},
                              "batch_overhead_s": 0.0,
                              "link": {"latency_s": 0.0, "bandwidth_Bps": FREE_LINK_BPS}})

    def to_dict(self) -> dict[str, Any]:
        """The :meth:`from_dict` form (JSON-serializable)."""
        return {"attention": {"batch": list(self.attention_batch),
                              "context": list(self.attention_context),
                              "seconds": [list(row) for row in self.attention_seconds]},
                "expert": {"batch": list(self.expert_batch),
                           "seconds": list(self.expert_seconds)},
                "head": {"batch": list(self.head_batch), "seconds": list(self.head_seconds)},
                "batch_overhead_s": self.batch_overhead_s,
                "link": {"latency_s": self.link_latency_s,
                         "bandwidth_Bps": self.link_bandwidth_Bps}}

    def attention_s(self, batch: int, context: float) -> float:
        """One attention execution of ``batch`` tokens at (mean) ``context``."""
        batch = int_at_least("attention batch", batch, 1)
        i, t = segment(float(batch), self.attention_batch)
        j, u = segment(float(context), self.attention_context)
        grid = self.attention_seconds
        i1 = min(i + 1, len(grid) - 1)
        j1 = min(j + 1, len(grid[0]) - 1)
        value = ((1 - t) * ((1 - u) * grid[i][j] + u * grid[i][j1])
                 + t * ((1 - u) * grid[i1][j] + u * grid[i1][j1]))
        return self.batch_overhead_s + max(value, 0.0)

    def expert_s(self, batch: int) -> float:
        """One expert execution of ``batch`` tokens."""
        batch = int_at_least("expert batch", batch, 1)
        return self.batch_overhead_s + max(
            interp1(float(batch), self.expert_batch, self.expert_seconds), 0.0)

    def head_s(self, batch: int) -> float:
        """One head (LM head + sampler) execution of ``batch`` tokens."""
        batch = int_at_least("head batch", batch, 1)
        return self.batch_overhead_s + max(
            interp1(float(batch), self.head_batch, self.head_seconds), 0.0)

    def link_s(self, nbytes: float) -> float:
        """One transfer of ``nbytes`` between two devices (0 for nothing to send)."""
        nbytes = nonnegative("bytes", nbytes)
        return self.link_latency_s + nbytes / self.link_bandwidth_Bps if nbytes else 0.0


def _check_keys(where: str, data: Mapping[str, Any], required: Sequence[str],
                optional: Sequence[str] = ()) -> None:
    missing = [key for key in required if key not in data]
    unknown = sorted(str(key) for key in data if key not in required and key not in optional)
    if missing or unknown:
        raise ValueError(f"{where}: " + "; ".join(
            ([f"missing {missing}"] if missing else [])
            + ([f"unknown {unknown}"] if unknown else []))
            + f" (expects {list(required)})")


def _section(data: Mapping[str, Any], name: str, keys: Sequence[str]) -> Mapping[str, Any]:
    section = data[name]
    if not isinstance(section, Mapping):
        raise ValueError(f"cost tables: {name!r} must be a dict with {list(keys)}, got "
                         f"{section!r}")
    _check_keys(f"cost tables {name!r}", section, keys)
    return section


# ----------------------------------------------------------------------------- H100 table
# Figures of the H100 cost table (:func:`h100_cost_tables`). Each says where it comes from;
# "modelled" marks an assumption that no measurement or datasheet here supports.
H100_HBM_BPS = 3.35e12
"""H100 SXM 80 GB HBM3 memory bandwidth, B/s: the vendor's datasheet figure, as quoted in
``/work/.library/device/H200.md`` ("an H100 (80 GB at 3.35 TB/s)")."""
H100_BF16_FLOPS = 990e12
"""H100 SXM dense bf16 matrix rate, FLOP/s: the datasheet figure quoted in
``/work/.library/device/H200.md`` ("dense bf16 about 990 TFLOP/s", the H100's)."""
H100_LINK_BPS = 450e9
"""Device-to-device bandwidth, B/s, one direction: NVLink 4 on H100 SXM, 900 GB/s
bidirectional by the datasheet; the same 450 GB/s default as ``benchmarks/ep_decode.py
--link-gbps`` (not measured here)."""
H100_LINK_LATENCY_S = 5e-6
"""Per-transfer latency of a device-to-device copy, s: a MODELLED assumption (a few µs
for a P2P copy launch over NVLink); no figure here measures it."""
H100_BATCH_OVERHEAD_S = 0.0
"""Extra fixed cost per execution, s: 0 by default, because the fit's per-layer t0 (charged
on attention) and per-expert a already hold the measured program's launch and fixed work;
a MODELLED knob for sensitivity."""
H100_H2D_SECONDS_PER_QWEN3_LAYER = 22.7e-3
"""Measured host→device copy of one Qwen3-30B-A3B layer of experts (128 × 9.4 MB bf16,
1.21 GB) on the lent H100: docs/PERF.md "Execution backends on one GPU"."""
H100_H2D_BPS = QWEN3_30B_A3B.layer_expert_bytes / H100_H2D_SECONDS_PER_QWEN3_LAYER
"""Host→device rate per device, B/s, from that measurement (53 GB/s: PCIe Gen5 x16)."""

H100_EXPERT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
H100_ATTENTION_BATCH = (1, 4, 16, 64, 256, 1024)
H100_ATTENTION_CONTEXT = (1, 64, 256, 1024, 4096)
H100_HEAD_BATCH = (1, 16, 64, 256, 1024)
H100_FIT = "fused_tiles_given"
"""The fit of ``benchmarks/data/eldr_cost_h100_qwen3-30b-a3b.json`` the table uses: the
one whose plane t = t0 + a·n + b·B fits (R² 0.9998; the Pallas fits' planes have
R² 0.81 and a negative b, their per-expert cost changing with B rather than with an
expert's rows); ``benchmarks/ep_decode.py``'s modelled MoE time uses it too."""
H100_FIT_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks", "data", "eldr_cost_h100_qwen3-30b-a3b.json")
"""The measured H100 cost file of one Qwen3-30B-A3B MoE layer (``benchmarks/eldr_cost.py``
on the lent H100), whose fits :data:`H100_FIT` names: the one path every H100 cost model
and benchmark reads it from (a data file of the repository, located from this file)."""


def roofline_s(nbytes: float, flops: float) -> float:
    """The larger of the memory time and the arithmetic time at the H100 ceilings."""
    return max(nbytes / H100_HBM_BPS, flops / H100_BF16_FLOPS)


def h100_attention_roofline_s(batch: float, context: float) -> float:
    """One Qwen3-30B-A3B attention block for ``batch`` tokens at ``context`` (roofline
    floor at the H100 ceilings): read q/k/v/o and router weights once plus every token's
    KV (2 · kv_heads · head_dim bf16 per position); 2 FLOP per weight per token plus
    QKᵀ and PV (4 · heads · head_dim per position per token)."""
    shape = QWEN3_30B_A3B
    weights = shape.non_expert_weight_count                    # q, o; k, v; router
    kv_bytes = batch * context * shape.kv_bytes_per_token_layer
    flops = 2 * weights * batch + 4 * shape.num_heads * shape.head_dim * context * batch
    return roofline_s(weights * shape.dtype_bytes + kv_bytes, flops)


def h100_head_roofline_s(batch: float) -> float:
    """The LM head (vocab × hidden bf16, read once) for ``batch`` tokens (roofline)."""
    weights = QWEN3_30B_A3B.lm_head_weight_count
    return roofline_s(weights * QWEN3_30B_A3B.dtype_bytes, 2 * weights * batch)


def h100_expert_s(rows: float, fit: Mapping[str, Any],
                  fit_top_k: int = QWEN3_30B_A3B.top_k) -> float:
    """One expert of one layer over ``rows`` rows from a per-layer fit t0 + a·n + b·B
    (B tokens of ``fit_top_k`` rows each): a + (b / fit_top_k) · rows, a negative
    coefficient (fit noise) taken as 0."""
    a = max(float(fit["a_s"]), 0.0)
    b = max(float(fit["b_s"]), 0.0)
    return a + b / fit_top_k * float(rows)


def h100_cost_tables(fit: Mapping[str, Any], fit_top_k: int = QWEN3_30B_A3B.top_k,
                     batch_overhead_s: float = H100_BATCH_OVERHEAD_S,
                     link_latency_s: float = H100_LINK_LATENCY_S,
                     link_bandwidth_Bps: float = H100_LINK_BPS) -> CostTables:
    """The simulator's cost table for Qwen3-30B-A3B-shaped blocks on an H100.

    * expert (rows r): :func:`h100_expert_s` of the measured fit ``fit`` (one of the
      ``fits`` of ``benchmarks/data/eldr_cost_h100_qwen3-30b-a3b.json``: per MoE layer
      t0 + a·n + b·B over n active experts and B tokens of top-``fit_top_k``) — the
      per-expert part a plus its rows' share of b. At the fit's sample points n experts
      of B·k/n rows each sum to a·n + b·B exactly (the table is linear in rows);
    * attention (batch, context): the fit's t0 (the layer's fixed part: route, permute,
      combine, the program launch — the gate and the top-k merge, which the simulator's
      attention execution holds) plus :func:`h100_attention_roofline_s`;
    * head: :func:`h100_head_roofline_s` (a floor: no sampler cost is measured);
    * link: ``link_latency_s`` (modelled) + bytes / ``link_bandwidth_Bps`` (NVLink 4).

    The attention and head rows are bandwidth/arithmetic floors at datasheet rates, not
    measurements; the expert row and attention's fixed part are the H100 measurement."""
    t0 = max(float(fit["t0_s"]), 0.0)
    return CostTables(
        attention_batch=H100_ATTENTION_BATCH, attention_context=H100_ATTENTION_CONTEXT,
        attention_seconds=tuple(tuple(t0 + h100_attention_roofline_s(b, c)
                                      for c in H100_ATTENTION_CONTEXT)
                                for b in H100_ATTENTION_BATCH),
        expert_batch=H100_EXPERT_ROWS,
        expert_seconds=tuple(h100_expert_s(r, fit, fit_top_k) for r in H100_EXPERT_ROWS),
        head_batch=H100_HEAD_BATCH,
        head_seconds=tuple(h100_head_roofline_s(b) for b in H100_HEAD_BATCH),
        batch_overhead_s=batch_overhead_s, link_latency_s=link_latency_s,
        link_bandwidth_Bps=link_bandwidth_Bps)


def load_h100_fit(path: str = H100_FIT_FILE, fit_name: str = H100_FIT) -> dict[str, Any]:
    """The fit ``fit_name`` of an ELDR H100 cost file (``"top"``: its top-level fit)."""
    import json

    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if fit_name == "top":
        return {key: data[key] for key in ("t0_s", "a_s", "b_s")}
    fits = data.get("fits", {})
    if fit_name not in fits:
        raise ValueError(f"{path}: no fit {fit_name!r} (it has {sorted(fits)} and 'top')")
    return dict(fits[fit_name])
