"""Where a μ-queue run puts its work: which devices are attention ranks and which devices
hold a replica of each expert (issue 44).

The seed (AsyncMoE §3.3) disaggregates attention from experts: attention ranks run
attention and the LM head and hold the requests' KV caches; expert devices host experts
(every block's copy of an expert on the same device) and run expert batches only. The
default here is the colocated layout the runtime started with: every device is both.

An expert may have several replicas (METRO's setting: the replicas hold the same weights,
and a token's copy for that expert may go to any of them; ``moejax.asyncmoe.replicas``
chooses which). ``expert_replicas[e]`` lists expert e's devices, its *home* first (the
replica the "home" routing always uses).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from moejax.asyncmoe.checks import int_at_least
from moejax.asyncmoe.records import ATTENTION_UNIT, HEAD_UNIT

ReplicaSets = tuple[tuple[int, ...], ...]
"""Per expert, the devices holding a replica of it (home first)."""


def _device_id(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a device id (an int >= 0), got {value!r}")
    return int(value)


def replica_sets(expert_device: Sequence[int | Sequence[int]]) -> ReplicaSets:
    """``expert_device[e]``: expert e's device (an int) or its replicas' devices (a
    sequence, home first) -> one tuple of devices per expert. ValueError for no experts,
    an expert without a device, or a device repeated in one expert's replicas."""
    if isinstance(expert_device, (str, bytes)) or len(expert_device) == 0:
        raise ValueError(f"expert_device must place at least one expert, got "
                         f"{expert_device!r}")
    sets = []
    for e, where in enumerate(expert_device):
        if isinstance(where, (int, np.integer)) and not isinstance(where, bool):
            devices: tuple[int, ...] = (_device_id(f"expert_device[{e}]", where),)
        elif isinstance(where, (Sequence, np.ndarray)) and not isinstance(where, (str, bytes)):
            devices = tuple(_device_id(f"expert_device[{e}][{r}]", d)
                            for r, d in enumerate(where))
        else:
            raise ValueError(f"expert_device[{e}] must be a device id or a sequence of "
                             f"device ids, got {where!r}")
        if not devices:
            raise ValueError(f"expert_device[{e}]: expert {e} has no replica")
        if len(set(devices)) != len(devices):
            raise ValueError(f"expert_device[{e}]: expert {e} repeats a device in its "
                             f"replicas {list(devices)}")
        sets.append(devices)
    return tuple(sets)


def hosted_experts(device: int, replicas: ReplicaSets) -> tuple[int, ...]:
    """The experts with a replica on ``device``, ascending."""
    return tuple(e for e, devices in enumerate(replicas) if device in devices)


def device_units(device: int, expert_device: Sequence[int | Sequence[int]],
                 hosts_attention: bool = True) -> tuple[int, ...]:
    """The default unit (queue column) order of ``device``: attention (-1) and head (-2)
    when it is an attention rank, then the experts with a replica on it, ascending."""
    hosted = hosted_experts(device, replica_sets(expert_device))
    return ((ATTENTION_UNIT, HEAD_UNIT) if hosts_attention else ()) + hosted


def contiguous_placement(num_experts: int, num_devices: int) -> tuple[int, ...]:
    """The default expert placement: expert e on device e · G // E (contiguous blocks of
    experts, as even as E and G allow)."""
    num_experts = int_at_least("num_experts", num_experts, 1)
    num_devices = int_at_least("num_devices", num_devices, 1)
    return tuple(e * num_devices // num_experts for e in range(num_experts))


def replicated_placement(num_experts: int, expert_devices: Sequence[int],
                         replicas: int) -> ReplicaSets:
    """``replicas`` replicas of every expert over ``expert_devices`` (M devices): the home
    of expert e is expert_devices[i], i = e · M // E (contiguous), replica r on
    expert_devices[(i + r · M // R) % M] (R ≤ M: the replicas of one expert are on R
    distinct devices, spread round the expert devices)."""
    hosts = tuple(expert_devices)
    m = len(hosts)
    if isinstance(replicas, bool) or not isinstance(replicas, (int, np.integer)) \
            or not 1 <= replicas <= m:
        raise ValueError(f"replicas must be an int in [1, {m}] (the number of expert "
                         f"devices), got {replicas!r}")
    return tuple(tuple(hosts[(home + r * m // replicas) % m] for r in range(replicas))
                 for home in contiguous_placement(num_experts, m))


@dataclasses.dataclass(frozen=True)
class Placement:
    """A run's layout over ``num_devices`` devices: the attention ranks (requests bind
    to these only) and each expert's replicas (module docstring). Validated: every device
    is an attention rank or hosts an expert (an idle device is a mistake), devices in
    range, no repeats."""

    num_devices: int
    attention_devices: tuple[int, ...]
    expert_replicas: ReplicaSets

    def __post_init__(self) -> None:
        g = int_at_least("num_devices", self.num_devices, 1)
        ranks = tuple(_device_id(f"attention_devices[{i}]", d)
                      for i, d in enumerate(self.attention_devices))
        if not ranks:
            raise ValueError("attention_devices is empty: a run needs at least one "
                             "attention rank")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"attention_devices {list(ranks)} repeat a device")
        replicas = replica_sets(self.expert_replicas)
        for name, devices in (("attention_devices", ranks),
                              *((f"expert {e}'s replicas", r) for e, r in enumerate(replicas))):
            outside = [d for d in devices if d >= g]
            if outside:
                raise ValueError(f"{name} {list(devices)}: devices {outside} outside "
                                 f"[0, {g})")
        idle = sorted(set(range(g)) - set(ranks) - {d for r in replicas for d in r})
        if idle:
            raise ValueError(f"devices {idle} are neither attention ranks nor host an "
                             f"expert")
        object.__setattr__(self, "num_devices", int(g))
        object.__setattr__(self, "attention_devices", tuple(sorted(ranks)))
        object.__setattr__(self, "expert_replicas", replicas)

    @property
    def num_experts(self) -> int:
        return len(self.expert_replicas)

    # Cached: the simulators read these per routed token (the placement is frozen).
    @functools.cached_property
    def expert_devices(self) -> tuple[int, ...]:
        """The devices hosting at least one expert replica, ascending."""
        return tuple(sorted({d for r in self.expert_replicas for d in r}))

    @functools.cached_property
    def home(self) -> tuple[int, ...]:
        """Each expert's home device (its first replica)."""
        return tuple(r[0] for r in self.expert_replicas)

    @property
    def max_replicas(self) -> int:
        return max(len(r) for r in self.expert_replicas)

    @property
    def disaggregated(self) -> bool:
        """Whether no attention rank hosts an expert."""
        return not set(self.attention_devices) & set(self.expert_devices)

    def hosts_attention(self, device: int) -> bool:
        return device in self.attention_devices

    def units(self, device: int) -> tuple[int, ...]:
        """``device``'s queue columns (:func:`device_units`)."""
        return device_units(device, self.expert_replicas, self.hosts_attention(device))


def make_placement(num_experts: int, num_devices: int, *,
                   attention_devices: Sequence[int] | None = None,
                   expert_devices: Sequence[int] | None = None,
                   expert_device: Sequence[int | Sequence[int]] | None = None,
                   replicas: int = 1) -> Placement:
    """The :class:`Placement` of a run.

    ``attention_devices``: the attention ranks (default: every device).
    ``expert_devices``: the devices that may host experts (default: the devices that are
    not attention ranks, or every device when all are: today's colocated layout).
    ``expert_device``: an explicit placement (per expert a device or its replicas' devices,
    home first), each on an expert device; else ``replicas`` replicas of every expert over
    the expert devices (:func:`replicated_placement`; 1: :func:`contiguous_placement`).
    ValueError naming what is wrong: an empty set, a device out of range, an expert on an
    attention-only device, both ``expert_device`` and ``replicas`` > 1, ..."""
    num_experts = int_at_least("num_experts", num_experts, 1)
    num_devices = int_at_least("num_devices", num_devices, 1)
    ranks = (tuple(range(num_devices)) if attention_devices is None
             else tuple(_device_id(f"attention_devices[{i}]", d)
                        for i, d in enumerate(attention_devices)))
    if expert_devices is None:
        hosts = tuple(d for d in range(num_devices) if d not in ranks) or tuple(range(num_devices))
    else:
        hosts = tuple(_device_id(f"expert_devices[{i}]", d) for i, d in enumerate(expert_devices))
        if not hosts:
            raise ValueError("expert_devices is empty: the experts need at least one device")
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"expert_devices {list(hosts)} repeat a device")
        outside = [d for d in hosts if d >= num_devices]
        if outside:
            raise ValueError(f"expert_devices {list(hosts)}: devices {outside} outside "
                             f"[0, {num_devices})")
    if expert_device is None:
        sets = replicated_placement(num_experts, hosts, replicas)
    else:
        if replicas != 1:
            raise ValueError(f"give replicas ({replicas!r}) or an explicit expert_device, "
                             f"not both")
        sets = replica_sets(expert_device)
        if len(sets) != num_experts:
            raise ValueError(f"expert_device places {len(sets)} experts; the model has "
                             f"{num_experts}")
        for e, devices in enumerate(sets):
            stray = [d for d in devices if d not in hosts]
            if stray:
                kind = ("an attention-only device" if all(d in ranks for d in stray)
                        else "not an expert device")
                raise ValueError(f"expert {e} has a replica on device(s) {stray}, {kind} "
                                 f"(expert devices: {list(hosts)})")
    return Placement(num_devices, ranks, sets)
