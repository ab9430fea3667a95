"""Offloaded experts: one host store, one device-side unit (expert slots), two policies.

* :class:`OffloadPlacement` — dense weights on the device(s), experts in host memory
  once (:class:`HostExperts`); what the ``offload``/``hybrid`` scoring backends and the
  offload decode runners run on.
* :class:`ExpertSlots` — S expert slots on the device and which (layer, expert) each
  holds, filled from the host store a whole layer or an expert at a time.
* :class:`ExpertWindow` — scoring's policy: W whole layers ahead, cyclic.
* :class:`AlternatingSlots` — decode's policy: two slot buffers by layer parity, filled
  per expert on demand or from a prediction.
"""

from moejax.offload.alternating import AlternatingSlots
from moejax.offload.host import HostExperts, host_memory_kind
from moejax.offload.placement import OffloadPlacement
from moejax.offload.slots import RENUMBER_EXPERTS, ExpertSlots, slot_map_is_injective
from moejax.offload.window import ExpertWindow

__all__ = ("AlternatingSlots", "ExpertSlots", "ExpertWindow", "HostExperts",
           "OffloadPlacement", "RENUMBER_EXPERTS", "host_memory_kind", "slot_map_is_injective")
