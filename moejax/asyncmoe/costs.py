"""Cost tables of the AsyncMoE simulator: attention over (batch, context), an expert over
batch, the head over batch, a per-execution overhead and a point-to-point link
(measured by ``benchmarks/asyncmoe_cost.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from moejax.asyncmoe.checks import (grid, int_at_least, interp1, nonnegative, positive,
                                    seconds_row, segment)

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
