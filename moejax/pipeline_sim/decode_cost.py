"""A decoder's step cost: one expert-parallel group of G H100s (data-parallel attention,
experts placed by EPLB with redundant replicas), its tokens routed to replicas by
EPLB-even (the baseline) or METRO, its experts resident in HBM or offloaded to host
memory and copied in (on demand, or prefetched a layer ahead).

Activated replicas come from running the routers, never from an assumed factor.
:func:`activation_table` draws decode steps of real (lifted) requests -- B requests at a
random decode position each, at a random layer -- places each layer's replicas with
``kernels_pallas.metro.eplb_placement`` from the calibration requests' decode load, and
routes every step's rows with ``route_eplb_even`` or METRO's ``route_metro_reference``
(the seed's Algorithm 1, the NumPy twin of the kernel ``moejax.backends.sync_ep`` runs).
Per union size n (distinct experts the step's rows chose at that layer) it keeps the mean
of the busiest device's activated replicas and of the largest device share of the rows.

:class:`DecoderCost` is a :class:`moejax.eldr.simulator.CostModel`, so the ELDR
simulator's decoders run on it unchanged: the simulator gives it a step's distinct experts
summed over layers and its batch; with n = that sum / L (the mean union per layer), a
layer on the busiest device costs

* compute = attention (``moejax.asyncmoe.costs.h100_attention_roofline_s`` of ⌈B/G⌉
  requests at the mean context) + 2 all-to-alls of ⌈B/G⌉ tokens (G > 1) + the H100 fit
  t0 + a·act(n) + (b/k)·B·k·share(n);
* copy (offloaded experts) = act(n) experts · expert bytes / the measured host→device rate;

and a step is L layers of compute (resident); L·(compute + copy) (offload, on demand);
or, prefetching each layer's experts while the layer before computes (the speculating-
experts seed's Eq. 1, as ``benchmarks/expert_prefetch.py``'s ``modelled_tpot``):
compute + copy for layer 0, then compute + max(0, copy - compute) per layer; plus the LM
head (``h100_head_roofline_s`` of ⌈B/G⌉ tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np
from jaxtyping import Integer

from kernels_pallas import metro
from moejax.asyncmoe import costs
from moejax.eldr.simulator import CostModel, SimRequest
from moejax.model_shape import ModelShape
from moejax.pipeline_sim import hardware
from moejax.pipeline_sim.prefill import all_to_all_s
from moejax.pipeline_sim.shape import layer_period, lifted_counts

ROUTERS = ("eplb_even", "metro")
EXPERT_MODES = ("resident", "offload_prefetch", "offload_ondemand")


@dataclasses.dataclass(frozen=True, eq=False)
class ActivationTable:
    """For a layer whose step rows chose n distinct experts (index n = 0 … E): the mean
    activated replicas on the busiest device, ``max_activated[n]``, and the mean largest
    device share of the rows, ``max_row_share[n]`` (module docstring). Between measured
    n, linear; beyond the largest measured n, its value."""

    router: str
    devices: int
    max_activated: np.ndarray
    max_row_share: np.ndarray

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"ActivationTable.router must be one of {ROUTERS}, got "
                             f"{self.router!r}")
        for name in ("max_activated", "max_row_share"):
            values = np.asarray(getattr(self, name), np.float64)
            if values.ndim != 1 or values.size < 2 or not np.isfinite(values).all() \
                    or (values < 0).any():
                raise ValueError(f"ActivationTable.{name} must be finite values >= 0 for "
                                 f"n = 0 … E, got shape {values.shape}")
            values.setflags(write=False)
            object.__setattr__(self, name, values)

    @classmethod
    def single_device(cls, num_experts: int) -> ActivationTable:
        """One device: it activates every chosen expert and gets every row."""
        n = np.arange(num_experts + 1, dtype=np.float64)
        return cls("eplb_even", 1, n, (n > 0).astype(np.float64))

    @functools.cached_property
    def union_grid(self) -> np.ndarray:
        """The union sizes n = 0 … E the table holds values at (built once: :meth:`at`
        runs every simulated step)."""
        return np.arange(self.max_activated.size, dtype=np.float64)

    def at(self, n: float) -> tuple[float, float]:
        """(activated replicas on the busiest device, its share of the rows) at a union
        of ``n`` experts."""
        return (float(np.interp(n, self.union_grid, self.max_activated)),
                float(np.interp(n, self.union_grid, self.max_row_share)))


def layer_placements(requests: Sequence[SimRequest], devices: int, replication: float,
                     num_layers: int | None = None) -> list[np.ndarray]:
    """Per layer (the first ``num_layers``, default all), the EPLB placement [E, G] bool
    of round(replication·E) replicas from ``requests``' decode load at that layer."""
    if not requests:
        raise ValueError("layer_placements: need calibration requests")
    num_layers = num_layers or requests[0].num_layers
    num_experts = requests[0].num_experts
    if not 1.0 <= replication <= devices:
        raise ValueError(f"replication must lie in [1, devices = {devices}], got {replication}")
    load = np.zeros((num_layers, num_experts))
    for req in requests:
        load += lifted_counts(req.decode_experts[:num_layers], num_experts)
    replicas = round(replication * num_experts)
    return [metro.eplb_placement(load[l], devices, replicas) for l in range(num_layers)]


def route_rows(router: str, placement: np.ndarray, rows_per_expert: np.ndarray
               ) -> tuple[int, float]:
    """(activated replicas on the busiest device, largest device share of the rows) of
    one layer's rows per expert [E] under ``router``."""
    if router == "eplb_even":
        tokens = metro.route_eplb_even(placement, rows_per_expert)
    elif router == "metro":
        chosen = metro.route_metro_reference(placement, rows_per_expert)
        tokens = metro.routed_tokens(chosen, rows_per_expert, placement.shape[1])
    else:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    activated = metro.activated_per_device(tokens)
    rows = metro.tokens_per_device(tokens)
    return int(activated.max()), float(rows.max() / max(rows.sum(), 1))


def activation_table(requests: Sequence[SimRequest], router: str, devices: int,
                     replication: float, batch_sizes: Sequence[int], samples: int,
                     seed: int) -> ActivationTable:
    """:class:`ActivationTable` of ``router`` on ``devices`` devices, measured on
    ``samples`` drawn steps per batch size (module docstring)."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    num_experts = requests[0].num_experts
    if devices == 1:
        return ActivationTable.single_device(num_experts)
    # A lifted trace repeats its layers: the first period of them are every layer there is.
    period = layer_period(requests)
    placements = layer_placements(requests, devices, replication, period)
    rng = np.random.default_rng(seed)
    sums = np.zeros((2, num_experts + 1))
    seen = np.zeros(num_experts + 1)
    for batch in batch_sizes:
        for _ in range(samples):
            layer = int(rng.integers(period))
            chosen = []                   # [batch, k]: each drawn request's experts
            for i in rng.choice(len(requests), int(batch)):
                ids = requests[int(i)].decode_experts
                chosen.append(ids[layer, int(rng.integers(ids.shape[1]))])
            rows = metro.tokens_per_expert(np.stack(chosen), num_experts)
            n = int(np.count_nonzero(rows))
            activated, share = route_rows(router, placements[layer], rows)
            sums[:, n] += (activated, share)
            seen[n] += 1
    measured = np.flatnonzero(seen)
    grid = np.concatenate([[0], measured])
    out = [np.interp(np.arange(num_experts + 1), grid,
                     np.concatenate([[0.0], sums[row, measured] / seen[measured]]))
           for row in range(2)]
    return ActivationTable(router, devices, out[0], out[1])


@dataclasses.dataclass(frozen=True)
class DecoderCost(CostModel):
    """The step cost of one decoder (module docstring). ``t0``, ``a``, ``b`` hold the fit
    as the ELDR simulator's CostModel does (step t0 = L·t0_layer; they describe, the
    override of :meth:`seconds` computes); ``context_tokens`` is the mean KV length a
    decode step's attention reads."""

    shape: ModelShape
    fit: hardware.ExpertFit
    table: ActivationTable
    experts: str
    context_tokens: float

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.experts not in EXPERT_MODES:
            raise ValueError(f"DecoderCost.experts must be one of {EXPERT_MODES}, got "
                             f"{self.experts!r}")
        if not math.isfinite(self.context_tokens) or self.context_tokens < 1:
            raise ValueError(f"DecoderCost.context_tokens must be >= 1, got "
                             f"{self.context_tokens!r}")

    @classmethod
    def build(cls, shape: ModelShape, fit: hardware.ExpertFit, table: ActivationTable,
              experts: str, context_tokens: float) -> DecoderCost:
        return cls(t0=shape.num_layers * fit.t0_s, a=fit.a_s, b=fit.b_s, shape=shape,
                   fit=fit, table=table, experts=experts, context_tokens=context_tokens)

    def layer_compute_s(self, union: float, batch: int) -> float:
        """One layer on the busiest device at a union of ``union`` experts, ``batch``
        requests."""
        return self.busiest_compute_s(*self.table.at(union), batch)

    def busiest_compute_s(self, activated: float, share: float, batch: int) -> float:
        """One layer on the busiest device: ``activated`` replicas and ``share`` of the
        rows on it (``self.table.at`` of the step's union), ``batch`` requests."""
        g = self.table.devices
        local = math.ceil(batch / g)
        moe = self.fit.layer_s(activated, batch * self.shape.top_k * share)
        return (costs.h100_attention_roofline_s(local, self.context_tokens)
                + 2 * all_to_all_s(local, self.shape, g) + moe)

    def busiest_copy_s(self, activated: float) -> float:
        """Copying the busiest device's ``activated`` experts host → device (each device
        has its own PCIe link: the devices of a group copy in parallel)."""
        return activated * self.shape.expert_bytes / costs.H100_H2D_BPS

    def seconds(self, total_active: int, batch: int, num_layers: int) -> float:
        """One step of ``batch`` requests whose rows chose ``total_active`` distinct
        experts summed over ``num_layers`` layers."""
        if num_layers != self.shape.num_layers:
            raise ValueError(f"a step of {num_layers} layers on a {self.shape.num_layers}-"
                             f"layer cost model")
        if batch < 1:
            raise ValueError(f"a step needs a batch >= 1, got {batch}")
        activated, share = self.table.at(total_active / num_layers)
        # one table lookup per step: both the compute and the copy need it
        compute = self.busiest_compute_s(activated, share, batch)
        head = costs.h100_head_roofline_s(math.ceil(batch / self.table.devices))
        if self.experts == "resident":
            return num_layers * compute + head
        copy = self.busiest_copy_s(activated)
        if self.experts == "offload_ondemand":
            return num_layers * (compute + copy) + head
        return compute + copy + (num_layers - 1) * (compute + max(0.0, copy - compute)) + head


def mean_context(prompt_tokens: Integer[np.ndarray, "n"] | Sequence[int],
                 decode_tokens: Integer[np.ndarray, "n"] | Sequence[int]) -> float:
    """The mean KV length over every decode step of the requests: prompt + half the
    decode, weighted by decode tokens."""
    prompts = np.asarray(prompt_tokens, np.float64)
    decode = np.asarray(decode_tokens, np.float64)
    return float(np.sum(decode * (prompts + decode / 2)) / np.sum(decode))

