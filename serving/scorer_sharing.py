"""What a :class:`serving.Generator` built with ``share_with=scorer`` shares with the
:class:`serving.Scorer` it is built beside, so that a server scoring and generating on
one device holds one copy of each:

* **the weights**: the placement the Scorer's first engine runs on becomes the decode
  runner's, when both use the same backend: resident
  (:class:`moejax.backends.resident.ResidentPlacement`), offload
  (:class:`moejax.offload.OffloadPlacement`: the dense weights on the device and the
  experts in host memory, once; the scoring window and decode's slots both copy from
  it) or sync_ep over the same devices (:class:`moejax.backends.sync_ep.SyncEPPlacement`);
* **the KV pool**: the Scorer's first engine's :class:`moejax.kv.KVStore` (pool and block
  allocator) becomes the continuous scheduler's, when generation runs on one rank of the
  same device. Prompt blocks either side computed are then found by the other under
  their chain hash and read in place, by the same block ids.

Each part is shared where it can be; where not, the Generator keeps its own and the
reason is logged and kept (:attr:`ScorerSharing.why_not`). A Scorer of another model is
refused outright.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np

from moejax.backends.resident import ResidentPlacement
from moejax.backends.sync_ep import SyncEPPlacement
from moejax.kv import KVStore
from moejax.offload.placement import OffloadPlacement

log = logging.getLogger(__name__)
PARTS = ("weights", "kv_pool")


@dataclasses.dataclass(frozen=True)
class ScorerSharing:
    """The shared placement and KV store (None where not shared) and, for each part not
    shared, why."""

    placement: ResidentPlacement | OffloadPlacement | SyncEPPlacement | None = None
    kv_store: KVStore | None = None
    why_not: dict[str, str] = dataclasses.field(default_factory=dict)

    def describe(self) -> dict[str, str]:
        """Each part (``weights``, ``kv_pool``): ``"shared"`` or why not."""
        return {part: self.why_not.get(part, "shared") for part in PARTS}


def plan_sharing(scorer: Any, config: Any, dtype: Any, options: Any) -> ScorerSharing:
    """What a Generator of ``config`` computing in ``dtype`` with ``options``
    (:class:`serving.generate.GeneratorOptions`) can share with ``scorer``."""
    if scorer.config != config:
        raise ValueError("share_with: the Scorer serves another model configuration than "
                         "this Generator; nothing of it can be shared")
    engine = scorer.engine
    common = _common_blocker(engine, dtype, options)
    why_not = {}
    placement = getattr(engine.backend, "placement", None)
    if common:
        why_not = {part: common for part in PARTS}
    else:
        weights = _weights_blocker(placement, engine.backend.name, options)
        if weights:
            why_not["weights"] = weights
        kv = _kv_blocker(engine, options)
        if kv:
            why_not["kv_pool"] = kv
    sharing = ScorerSharing(placement=None if "weights" in why_not else placement,
                            kv_store=None if "kv_pool" in why_not else engine.kv_store,
                            why_not=why_not)
    for part, state in sharing.describe().items():
        log.info("share_with: %s %s", part.replace("_", " "),
                 "shared with the Scorer" if state == "shared" else f"not shared: {state}")
    return sharing


def _common_blocker(engine: Any, dtype: Any, options: Any) -> str | None:
    """Why nothing can be shared, or None."""
    if options.runtime != "continuous" or options.batching != "continuous":
        return "this Generator does not run continuous batching on the paged runtime"
    if options.splits:
        return "this Generator splits prefill and decode over several devices"
    if np.dtype(engine.dtype) != np.dtype(dtype):
        return (f"the Scorer computes in {np.dtype(engine.dtype).name}, this Generator in "
                f"{np.dtype(dtype).name}")
    if engine.device != jax.devices()[0]:
        return "the Scorer's first engine is not on this Generator's device"
    return None


def _weights_blocker(placement: Any, backend: str, options: Any) -> str | None:
    """Why the Scorer's weight placement cannot be the decode runner's, or None: the same
    backend's placement (resident; sync_ep on as many devices, with the layout the
    Scorer's options built)."""
    if isinstance(placement, ResidentPlacement):
        if options.backend != "resident" or options.prefetch not in (None, "none"):
            return "this Generator does not decode on the resident backend"
        return None
    if isinstance(placement, OffloadPlacement):
        if options.backend != "offload" or len(placement.devices) != 1:
            return "this Generator does not decode on the offload backend"
        return None
    if isinstance(placement, SyncEPPlacement):
        if options.backend != "sync_ep" or options.devices != len(placement.devices):
            return (f"this Generator does not decode on backend sync_ep over the Scorer's "
                    f"{len(placement.devices)} devices")
        own = dict(options.backend_options or {})
        if own.get("replicas") is not None or own.get("expert_load") is not None:
            return "this Generator sets its own expert layout (replicas / expert_load)"
        return None
    return (f"backend {backend!r} places the Scorer's weights for scoring only (async_ep, "
            f"hybrid and tp have no decode runner on their placement)")


def _kv_blocker(engine: Any, options: Any) -> str | None:
    """Why the KV pool cannot be shared, or None."""
    store = engine.kv_store
    if store is None:
        return "the Scorer keeps no KV pool (prefix_cache_blocks=0, share_prompts=false)"
    if options.backend not in ("resident", "offload") or options.devices != 1:
        return "this Generator decodes on more than one rank"
    if len(store.pool.keys.devices()) != 1:
        return "the Scorer's pool spans several devices"
    if options.kv_cache_blocks is not None or options.kv_cache_mib is not None:
        return "this Generator sizes its own pool (kv_cache_blocks / kv_cache_mib)"
    return None
