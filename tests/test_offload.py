"""Offloaded experts as one mechanism (``moejax.offload``): one host store per placement,
expert slots filled from it a whole layer or an expert at a time, and the two policies
over them (the scoring window, decode's alternating slots) reading the same store."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from backend_fixtures import CFG, make_params
from moejax.backends.base import BackendError, validated
from moejax.offload import (AlternatingSlots, ExpertSlots, ExpertWindow, HostExperts,
                            OffloadPlacement, slot_map_is_injective)
from moejax.param_layout import split_experts

E = CFG.num_experts


@pytest.fixture(scope="module")
def stacks():
    """{name: [L, E, ...]} float32 expert stacks of the tiny model."""
    return split_experts(validated(make_params(), CFG, np.float32)["layers"])[1]


def _on_one_device() -> NamedSharding:
    return NamedSharding(Mesh(jax.devices()[:1], ("x",)), P(), memory_kind="device")


class CountingHost(HostExperts):
    """A host store that counts its copies of whole layers and of single experts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.copies = {"layer": 0, "expert": 0}

    def layer_to_device(self, layer):
        self.copies["layer"] += 1
        return super().layer_to_device(layer)

    def expert_to_device(self, layer, expert):
        self.copies["expert"] += 1
        return super().expert_to_device(layer, expert)


@pytest.mark.parametrize("kind", ["auto", None])
def test_the_host_store_copies_a_layer_or_one_expert_to_the_device(stacks, kind):
    host = HostExperts(stacks, _on_one_device(), kind)
    stored = host.layers[1]["w_up"]
    if kind is None:
        assert host.memory_kind is None and isinstance(stored, np.ndarray)
    else:   # JAX's CPU devices have pinned host memory, like a GPU's
        assert host.memory_kind == "pinned_host" == stored.sharding.memory_kind
    assert host.num_layers == CFG.num_layers and host.num_experts == E
    assert host.expert_bytes == 3 * CFG.hidden_size * CFG.moe_intermediate_size * 4
    layer = host.layer_to_device(2)
    one = host.expert_to_device(2, 5)
    for name, stack in stacks.items():
        assert layer[name].sharding.memory_kind == one[name].sharding.memory_kind == "device"
        np.testing.assert_array_equal(np.asarray(layer[name]), stack[2])
        np.testing.assert_array_equal(np.asarray(one[name]), stack[2, 5])


def test_a_load_of_every_expert_of_a_fresh_layer_is_one_whole_layer_copy(stacks):
    host = CountingHost(stacks, _on_one_device())
    slots = ExpertSlots.empty(host, E)
    slot_of, copied = slots.load(host, 0, np.arange(E))
    assert copied == E and host.copies == {"layer": 1, "expert": 0}
    np.testing.assert_array_equal(slot_of, np.arange(E))
    assert slots.load(host, 0, np.array([3, 1]))[1] == 0          # already held
    # Three experts of layer 1 one by one (into the slots of layer 0's), then the rest:
    # a layer partly held is completed expert by expert, never copied whole again.
    slot_of, copied = slots.load(host, 1, np.array([6, 0, 2]))
    assert copied == 3 and host.copies == {"layer": 1, "expert": 3}
    slot_of, copied = slots.load(host, 1, np.arange(E))
    assert copied == E - 3 and host.copies == {"layer": 1, "expert": E}
    assert slot_map_is_injective(slots, 1, slot_of)
    for name, stack in stacks.items():
        np.testing.assert_array_equal(np.asarray(slots.buffers[name])[slot_of], stack[1])
    with pytest.raises(ValueError, match="more than"):
        ExpertSlots.empty(host, 2).load(host, 0, np.arange(3))


def test_the_window_and_the_alternating_slots_read_one_host_store(stacks):
    """Scoring's window (whole layers, cyclic, W ahead) and decode's alternating slots
    (experts on demand) over one placement's store hold the same weights."""
    placement = OffloadPlacement.place(CFG, make_params(), np.float32, jax.devices()[:1])
    host = placement.host
    window = ExpertWindow(host, 2)
    pair = AlternatingSlots(host, 3)
    for layer in range(CFG.num_layers):
        whole = window.take(layer)
        wanted = np.array([(layer + 1) % E, (layer + 4) % E])
        slot_of, copied = pair.load(layer, wanted)
        assert copied == 2
        for name, stack in stacks.items():
            np.testing.assert_array_equal(np.asarray(whole[name]), stack[layer])
            np.testing.assert_array_equal(np.asarray(pair.buffers(layer)[name])[slot_of[wanted]],
                                          stack[layer, wanted])
        window.release(whole)       # frees the layer, issues the copy of the next
    assert pair.experts_copied == 2 * CFG.num_layers
    assert pair.slots(0) is pair.slots(2) is not pair.slots(1)
    with pytest.raises(RuntimeError, match="out of order"):
        window.take(2)              # the window holds layer 0 again (cyclic)
    with pytest.raises(BackendError, match="more than expert_slots=3"):
        pair.load(0, np.arange(4))
    with pytest.raises(BackendError, match=r"expert_slots must be an integer in \[1, 8\]"):
        AlternatingSlots(host, E + 1)


def test_a_placement_is_taken_as_it_is_or_refused(stacks):
    devices = jax.devices()[:1]
    placement = OffloadPlacement.place(CFG, make_params(), np.float32, devices)
    assert OffloadPlacement.resolve("offload", CFG, None, np.float32, devices,
                                    placement) is placement
    with pytest.raises(BackendError, match="params or a placement"):
        OffloadPlacement.resolve("offload", CFG, make_params(), np.float32, devices, placement)
    other = dataclasses.replace(CFG, rope_theta=5000.0)
    with pytest.raises(BackendError, match="another model configuration"):
        OffloadPlacement.resolve("offload", other, None, np.float32, devices, placement)
    if len(jax.devices()) > 1:
        with pytest.raises(BackendError, match="other device"):
            OffloadPlacement.resolve("offload", CFG, None, np.float32, jax.devices()[1:2],
                                     placement)
