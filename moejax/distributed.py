"""One model over several processes: JAX's multi-controller runtime, set up for moejax.

``jax.distributed.initialize`` joins this process to the others; afterwards ``jax.devices()``
lists every process's devices, so the backends' meshes (``async_ep``, ``sync_ep``, ``tp``,
``hybrid``) span all of them and XLA runs their collectives across processes: NCCL on GPUs,
gloo on CPU (set here, before the first computation). Every process runs the same program
on the same requests (SPMD, as JAX's multi-controller model asks): the host side (tokenizing,
packing, routing) is deterministic, so every process builds the same batches; each then feeds
only the ranks of its own devices (:func:`place_local_ranks`, with
``jax.make_array_from_process_local_data``) and reads the results back with an all-gather
across processes (:func:`fetch_global`). Process 0 writes the output.

Failure: the coordination service's heartbeat notices a process that died, and a collective
waiting on a dead peer fails when its connection closes, so the others stop with an error
instead of hanging (bounded by ``heartbeat_timeout_seconds``).

Where the processes come from: ``--coordinator HOST:PORT --num-processes N --process-id I``
on every ``moejax`` command (``moejax launch`` adds them for N local processes), or JAX's
auto-detection (``--distributed auto``: SLURM, Open MPI, Kubernetes, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import numpy as np

log = logging.getLogger("moejax.distributed")

# How long a silent peer may go unnoticed (seconds). JAX's default (100 s) is meant for
# large clusters; an interactive run should give up sooner when a process died.
DEFAULT_HEARTBEAT_SECONDS = 30
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class DistributedOptions:
    """How this process joins the others.

    ``coordinator`` HOST:PORT of process 0's coordination service, ``num_processes`` and
    ``process_id`` (0 … N−1): explicit. ``auto``: let JAX detect the cluster (SLURM, Open
    MPI, Kubernetes / other ``cluster_detection_method`` environments) and give none of
    the three. ``heartbeat_timeout_seconds``: how long a dead peer may go unnoticed.
    ``initialization_timeout_seconds``: how long to wait for every process to join."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    heartbeat_timeout_seconds: int = DEFAULT_HEARTBEAT_SECONDS
    initialization_timeout_seconds: int = 300

    def __post_init__(self) -> None:
        explicit = (self.coordinator, self.num_processes, self.process_id)
        given = [v is not None for v in explicit]
        if self.auto and any(given):
            raise ValueError("distributed: give either auto-detection or --coordinator, "
                             "--num-processes and --process-id, not both")
        if not self.auto and any(given) and not all(given):
            missing = [name for name, g in zip(("--coordinator", "--num-processes",
                                                "--process-id"), given) if not g]
            raise ValueError(f"distributed: {', '.join(missing)} missing (a multi-process run "
                             f"needs --coordinator, --num-processes and --process-id together)")
        if self.coordinator is not None and not _ADDRESS.match(self.coordinator):
            raise ValueError(f"distributed: --coordinator must be HOST:PORT, got "
                             f"{self.coordinator!r}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"distributed: --num-processes must be >= 1, got "
                             f"{self.num_processes}")
        if self.process_id is not None and not 0 <= self.process_id < (self.num_processes or 0):
            raise ValueError(f"distributed: --process-id must be in [0, {self.num_processes}), "
                             f"got {self.process_id}")
        if self.heartbeat_timeout_seconds < 1 or self.initialization_timeout_seconds < 1:
            raise ValueError("distributed: timeouts must be >= 1 second")

    @property
    def enabled(self) -> bool:
        """Whether this run joins other processes at all."""
        return self.auto or (self.num_processes is not None and self.num_processes > 1)


_joined: DistributedOptions | None = None


def initialize(options: DistributedOptions) -> bool:
    """Join the other processes (before any JAX computation). Returns whether this run is
    multi-process. A second call with the same options is a no-op; different ones raise."""
    global _joined
    if not options.enabled:
        return False
    if _joined is not None:
        if _joined != options:
            raise RuntimeError(f"jax.distributed is already initialized with {_joined}; "
                               f"cannot re-initialize with {options}")
        return True
    import jax

    # Gloo carries the CPU collectives between processes (the default CPU collectives
    # work inside one process only). It is ignored by GPU backends.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = dict(
        heartbeat_timeout_seconds=options.heartbeat_timeout_seconds,
        # A process that stops with an error waits this long at the shutdown barrier for
        # the others; JAX's 300 s default would keep a failed run alive for 5 minutes.
        shutdown_timeout_seconds=options.heartbeat_timeout_seconds,
        initialization_timeout=options.initialization_timeout_seconds)
    if not options.auto:
        kwargs.update(coordinator_address=options.coordinator,
                      num_processes=options.num_processes, process_id=options.process_id)
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as exc:   # JAX raises RuntimeError/ValueError/XlaRuntimeError here
        where = "auto-detected cluster" if options.auto else \
            f"coordinator {options.coordinator} as process {options.process_id} of " \
            f"{options.num_processes}"
        raise RuntimeError(f"jax.distributed.initialize failed ({where}): {exc}") from exc
    _joined = options
    log.info("process %d of %d: %d local of %d devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def process_count() -> int:
    """Processes in this run (1 without jax.distributed)."""
    import jax

    return jax.process_count()


def is_output_process() -> bool:
    """Whether this process writes the run's output (process 0)."""
    import jax

    return jax.process_index() == 0


def place_local_ranks(stacked: Any, sharding: Any) -> Any:
    """``stacked`` (a pytree of host arrays with a leading rank axis, the same on every
    process) placed by ``sharding`` (rank axis on the mesh): with one process a plain
    ``device_put``; with several, each process feeds only the rows of its own devices
    (``jax.make_array_from_process_local_data``)."""
    import jax

    if jax.process_count() == 1:
        return jax.device_put(stacked, sharding)

    def local(array: Any) -> Any:
        array = np.asarray(array)
        rows = sorted({index[0].indices(array.shape[0])[:2] for index in
                       sharding.addressable_devices_indices_map(array.shape).values()})
        start, stop = rows[0][0], rows[-1][1]
        if any(b[0] != a[1] for a, b in zip(rows, rows[1:])):
            raise ValueError("place_local_ranks: this process's devices hold non-contiguous "
                             "ranks of the mesh")
        return jax.make_array_from_process_local_data(sharding, array[start:stop],
                                                      array.shape)

    return jax.tree.map(local, stacked)


def fetch_global(array: Any) -> Any:
    """A device array as host NumPy on every process: as is when this process holds all of
    it, else all-gathered across processes (a collective: every process must call it)."""
    import jax

    if not isinstance(array, jax.Array) or array.is_fully_addressable or \
            array.is_fully_replicated:
        return array
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def agree(value: Any) -> Any:
    """Process 0's ``value`` on every process (a picklable object; a collective: every
    process must call it). Measured quantities that steer host decisions (the calibrated
    Θ) must be the same everywhere, or the processes would pack different batches."""
    import jax

    if jax.process_count() == 1:
        return value
    import pickle

    from jax.experimental import multihost_utils

    payload = np.frombuffer(pickle.dumps(value), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(payload.size)))
    buffer = np.zeros(size, np.uint8)
    if jax.process_index() == 0:
        buffer[:] = payload
    received = multihost_utils.broadcast_one_to_all(buffer)
    return pickle.loads(np.asarray(received, np.uint8).tobytes())


def join(distributed: "DistributedOptions | dict[str, Any] | None") -> bool:
    """:func:`initialize` from what an entry point was given (options, their dict, or None:
    nothing to join). Returns whether this call joined a multi-process run."""
    if distributed is None:
        return False
    if isinstance(distributed, dict):
        distributed = DistributedOptions(**distributed)
    if not isinstance(distributed, DistributedOptions):
        raise TypeError(f"distributed must be DistributedOptions, a dict of its fields or "
                        f"None, got {type(distributed).__name__}")
    return initialize(distributed)
