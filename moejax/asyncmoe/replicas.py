"""Token → expert-replica routing inside the μ-queue (issue 44; seed: METRO).

When an expert has several replicas (``moejax.asyncmoe.placement``), an attention batch's
k copies of each token must each go to one replica of their expert. Policies, applied per
attention batch (the tokens that leave one rank together, for one block):

* ``"home"``: always the expert's first replica (the runtime's behaviour before replicas);
* ``"round_robin"`` (alias ``"even"``): the copies for expert e (token order, then slot
  order) are dealt to its replicas in turn, from where the rank's previous batches left
  off (a per-rank rotor, ``rotor[e]``: copies of e dealt so far): the tokens of each
  expert spread evenly over its replicas (EPLB's token-balancing routing, METRO §II-C).
  Without the rotor a batch's single copy for an expert would always go home;
* ``"metro"``: METRO's Algorithm 1 (greedy min-activated-experts): every expert with a
  token in the batch gets one replica (Lemma 1: one replica per expert suffices); the
  experts are visited with the fewest replicas first (ties: lower id; with equal replica
  counts this is the seed's order, by expert id), each going to its candidate device
  with the fewest experts activated so far in this batch (ties: lowest device id). All
  its tokens follow it.

Every policy is a function of the batch's top-k ids, the placement and (round robin)
the rank's rotor, which only the rank's own earlier batches move, so the simulator and
the real runtime, which route the same batches in the same order, send the same copies
to the same devices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moejax.asyncmoe.placement import ReplicaSets

HOME = "home"
ROUND_ROBIN = "round_robin"
METRO = "metro"
REPLICA_ROUTINGS = (HOME, ROUND_ROBIN, METRO)
ALIASES = {"even": ROUND_ROBIN}


def check_replica_routing(name: str) -> str:
    """The policy's canonical name; ValueError for an unknown one."""
    canonical = ALIASES.get(name, name) if isinstance(name, str) else name
    if canonical not in REPLICA_ROUTINGS:
        raise ValueError(f"replica_routing must be one of {REPLICA_ROUTINGS} (or "
                         f"{sorted(ALIASES)}), got {name!r}")
    return canonical


def metro_assignment(experts: Sequence[int], replicas: ReplicaSets) -> dict[int, int]:
    """METRO's greedy (module docstring): the device for each of the distinct active
    ``experts``."""
    active = sorted(set(int(e) for e in experts), key=lambda e: (len(replicas[e]), e))
    activated: dict[int, int] = {}
    chosen: dict[int, int] = {}
    for expert in active:
        device = min(replicas[expert], key=lambda d: (activated.get(d, 0), d))
        activated[device] = activated.get(device, 0) + 1
        chosen[expert] = device
    return chosen


def replica_destinations(policy: str, topk_experts: np.ndarray, replicas: ReplicaSets,
                         rotor: dict[int, int] | None = None) -> np.ndarray:
    """[n, k] device per (token, slot) of a batch's top-k expert ids [n, k] under
    ``policy`` (module docstring). ``rotor``: round robin's copies dealt so far per expert
    (advanced in place; None: a fresh one, this batch alone)."""
    policy = check_replica_routing(policy)
    ids = np.asarray(topk_experts)
    out = np.empty(ids.shape, dtype=np.int64)
    if policy == HOME:
        for index, expert in np.ndenumerate(ids):
            out[index] = replicas[int(expert)][0]
    elif policy == ROUND_ROBIN:
        seen = {} if rotor is None else rotor
        for index, expert in np.ndenumerate(ids):
            expert = int(expert)
            count = seen.get(expert, 0)
            out[index] = replicas[expert][count % len(replicas[expert])]
            seen[expert] = count + 1
    else:
        chosen = metro_assignment(ids.ravel().tolist(), replicas)
        for index, expert in np.ndenumerate(ids):
            out[index] = chosen[int(expert)]
    return out


def activated_per_device(topk_experts: np.ndarray, destinations: np.ndarray,
                         num_devices: int) -> np.ndarray:
    """[num_devices]: distinct experts a batch's routing activates on each device."""
    pairs = {(int(d), int(e)) for d, e in zip(np.ravel(destinations), np.ravel(topk_experts))}
    counts = np.zeros(num_devices, dtype=np.int64)
    for device, _ in pairs:
        counts[device] += 1
    return counts
