"""The scoring policy over the expert slots: a cyclic window of W whole layers.

Prefill touches nearly every expert of every layer, so the unit copied in is a whole
layer (:meth:`ExpertSlots.whole_layer`: one copy per weight name from the host store).
Copies are issued in layer order (0, 1, …, L-1, 0, …), W layers ahead, and taken in
that order; releasing a finished layer frees its slots and issues the next copy, so a
copy runs while the W-1 layers before it compute. The backends that drive it
(``moejax.backends.streamed``) explain the synchronization.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Iterable, Sequence

import jax

from moejax.offload.host import HostExperts, LayerArrays
from moejax.offload.slots import ExpertSlots, free


def wait_quietly(arrays: Iterable[jax.Array]) -> None:
    """Wait until nothing is computing into ``arrays`` (their own errors are the failed
    step's, already raised)."""
    for array in arrays:
        try:
            if not array.is_deleted():
                array.block_until_ready()
        except Exception:    # noqa: BLE001  (a failed producer: nothing left running)
            pass


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """A program the host has dispatched and not yet seen finish: ``done`` (one of its
    outputs) is ready when it has, and it is the last reader of ``release`` (window
    layers) and ``drop`` (gathered layers), freed then."""

    done: jax.Array
    release: tuple[LayerArrays, ...] = ()
    drop: tuple[LayerArrays, ...] = ()


class ExpertWindow:
    """W whole layers of experts (or expert shards) in slots on the device(s), cyclic.

    The window also keeps track of the arrays a step holds (taken layers, and the layers
    gathered from them, :meth:`adopt`) and of the programs reading them
    (:meth:`dispatched`, freed by :meth:`settle`), so that :meth:`reset` can free them
    after a failed step."""

    def __init__(self, host: HostExperts, size: int):
        self._host = host
        self.size = size
        self._incoming: collections.deque[tuple[int, ExpertSlots]] = collections.deque()
        self._taken: list[ExpertSlots] = []
        self._adopted: list[LayerArrays] = []
        self._dispatched: collections.deque[Dispatched] = collections.deque()
        self._next_layer = 0
        self.fill()

    def fill(self) -> None:
        """Issue copies until W layers are on their way or taken (after a reset: layers
        0 … W-1)."""
        while len(self._incoming) + len(self._taken) < self.size:
            layer = self._next_layer % self._host.num_layers
            self._next_layer += 1
            self._incoming.append((layer, ExpertSlots.whole_layer(self._host, layer)))

    def take(self, layer: int) -> LayerArrays:
        """Layer ``layer``'s experts (their copy may still be in flight)."""
        if not self._incoming:
            raise RuntimeError(f"expert window empty: wanted layer {layer}")
        held, slots = self._incoming[0]
        if held != layer:
            raise RuntimeError(f"expert window out of order: wanted layer {layer}, holds {held}")
        self._incoming.popleft()
        self._taken.append(slots)
        return slots.buffers

    def release(self, arrays: LayerArrays) -> None:
        """Free a finished layer's experts now and copy in the next layer."""
        for slots in [s for s in self._taken if s.buffers is arrays]:
            self._taken.remove(slots)
            slots.free()
        self.fill()

    def adopt(self, arrays: LayerArrays) -> LayerArrays:
        """Hold arrays made from taken ones (a gathered layer) until :meth:`drop`."""
        self._adopted.append(arrays)
        return arrays

    def drop(self, arrays: LayerArrays) -> None:
        self._adopted = [a for a in self._adopted if a is not arrays]
        free(arrays)

    def dispatched(self, done: jax.Array, release: Sequence[LayerArrays] = (),
                   drop: Sequence[LayerArrays] = ()) -> None:
        """Note a program just dispatched: once :meth:`settle` has seen ``done`` ready,
        ``release`` goes back to the window and ``drop`` is freed."""
        self._dispatched.append(Dispatched(done, tuple(release), tuple(drop)))

    def settle(self, lag: int) -> None:
        """Wait for the oldest dispatched programs, oldest first, until at most ``lag``
        are left that the host has not seen finish; free what each read (which issues
        the next copies). ``lag=0``: wait for all of them."""
        while len(self._dispatched) > lag:
            program = self._dispatched[0]
            jax.block_until_ready(program.done)
            self._dispatched.popleft()
            for arrays in program.drop:        # gathered layers first: the freed bytes
                self.drop(arrays)              # are never beside the next copy's
            for arrays in program.release:
                self.release(arrays)

    def reset(self) -> None:
        """Forget a failed step: wait out the copies and programs still writing or
        reading the window's arrays, free them all, and start again at layer 0 (the
        copies are issued by the next :meth:`fill`)."""
        held = ([slots.buffers for _, slots in self._incoming]
                + [slots.buffers for slots in self._taken] + self._adopted)
        running = [program.done for program in self._dispatched]
        wait_quietly(itertools.chain(running, (a for arrays in held for a in arrays.values())))
        for arrays in held:
            free(arrays)
        self._incoming.clear()
        self._dispatched.clear()
        self._taken, self._adopted = [], []
        self._next_layer = 0


__all__ = ("Dispatched", "ExpertWindow", "wait_quietly")
