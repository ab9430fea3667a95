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
import os
import re
import sys
import time
from typing import Any

import numpy as np

# COLLECTIVE_TIMEOUT_FLAG: imported here too, as the flag with_collective_timeout sets.
from moejax.backends.xla_flags import COLLECTIVE_TIMEOUT_FLAG, apply_collective_timeout  # noqa: F401

log = logging.getLogger("moejax.distributed")

# How long a silent peer may go unnoticed (seconds). JAX's default (100 s) is meant for
# large clusters; an interactive run should give up sooner when a process died. It must
# stay above COLLECTIVE_RENDEZVOUS_SECONDS: a collective that needs a new connection to a
# dead peer fails only when its rendezvous times out, and a heartbeat that runs out first
# makes JAX's coordination service abort the survivors (a C++ stack trace, exit 134)
# instead of moejax reporting the failed collective (exit 1, one message). Measured: with
# 30 s the two raced, and a CI run lost.
DEFAULT_HEARTBEAT_SECONDS = 60
# XLA's CPU collectives (gloo) wait this long for a peer while setting up a connection
# (a key of the coordination service's store; "GetKeyValue() timed out ... 30 s").
COLLECTIVE_RENDEZVOUS_SECONDS = 30
# How long a process waits for every process to join (seconds): long enough for a
# scheduler to start the others, short enough that an unreachable coordinator is noticed
# (JAX's default is 300 s, silently).
DEFAULT_JOIN_SECONDS = 60
_ADDRESS = re.compile(r"^(?:\[(?P<ipv6>[^\]]*)\]|(?P<host>[^:\[\]]+)):(?P<port>\d+)$")
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")


class JoinError(RuntimeError):
    """This process could not join the others (an unreachable coordinator, a process that
    never came, ...): the message names the coordinator and the timeout."""


def coordinator_problem(address: str) -> str | None:
    """Why ``address`` is not a usable coordinator ``HOST:PORT`` (a hostname, an IPv4
    address, or an IPv6 address in brackets; a port 1-65535), or None when it is."""
    import ipaddress

    match = _ADDRESS.match(address)
    if match is None:
        return "must be HOST:PORT (an IPv6 address in brackets: [::1]:8476)"
    port = int(match["port"])
    if not 1 <= port <= 65535:
        return f"port {port} is not in 1..65535"
    if match["ipv6"] is not None:
        try:
            ipaddress.IPv6Address(match["ipv6"])
        except ValueError:
            return f"[{match['ipv6']}] is not an IPv6 address"
        return None
    host = match["host"]
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host} is not an IPv4 address"
        return None
    if len(host) > 253 or not all(_HOST_LABEL.match(label) for label in host.split(".")):
        return f"{host!r} is not a host name"
    return None


@dataclasses.dataclass(frozen=True)
class DistributedOptions:
    """How this process joins the others.

    ``coordinator`` HOST:PORT of process 0's coordination service, ``num_processes`` and
    ``process_id`` (0 … N−1): explicit. ``auto``: let JAX detect the cluster (SLURM, Open
    MPI, Kubernetes / other ``cluster_detection_method`` environments) and give none of
    the three. ``heartbeat_timeout_seconds``: how long a dead peer may go unnoticed.
    ``initialization_timeout_seconds``: how long to wait for every process to join (the
    coordinator to answer, the other processes to come) before giving up
    (:class:`JoinError`)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    heartbeat_timeout_seconds: int = DEFAULT_HEARTBEAT_SECONDS
    initialization_timeout_seconds: int = DEFAULT_JOIN_SECONDS

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
        problem = None if self.coordinator is None else coordinator_problem(self.coordinator)
        if problem is not None:
            raise ValueError(f"distributed: --coordinator {self.coordinator!r}: {problem}")
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
    # JAX's preemption service is off: moejax uses no preemption sync points, and the
    # service's SIGTERM handler starts a sync protocol whose barrier only processes still
    # running can join, so one process's SIGTERM could hold its exit for 3 minutes after
    # the others left, failing their shutdown barrier. SIGTERM is each command's own
    # (``moejax serve``: process 0 drains and tells the others to stop).
    jax.config.update("jax_enable_preemption_service", False)
    # Read when the CPU backend starts, which is after this (no computation before a join).
    os.environ["XLA_FLAGS"] = with_collective_timeout(os.environ.get("XLA_FLAGS", ""),
                                                      options.heartbeat_timeout_seconds)
    timeout = options.initialization_timeout_seconds
    kwargs: dict[str, Any] = dict(
        heartbeat_timeout_seconds=options.heartbeat_timeout_seconds,
        # A process that stops with an error waits this long at the shutdown barrier for
        # the others; JAX's 300 s default would keep a failed run alive for 5 minutes.
        shutdown_timeout_seconds=options.heartbeat_timeout_seconds,
        # JAX ends the process with a fatal log (a C++ stack trace, no Python exception)
        # when its own timeout passes; ours (_Watchdog) comes first, with a message.
        initialization_timeout=timeout + _JAX_TIMEOUT_MARGIN)
    if not options.auto:
        kwargs.update(coordinator_address=options.coordinator,
                      num_processes=options.num_processes, process_id=options.process_id)
    if options.heartbeat_timeout_seconds <= COLLECTIVE_RENDEZVOUS_SECONDS:
        log.warning("heartbeat of %d s is not above the collectives' %d s rendezvous: a "
                    "process that dies may end the others with JAX's fatal error instead of "
                    "a failed collective (--heartbeat-seconds)",
                    options.heartbeat_timeout_seconds, COLLECTIVE_RENDEZVOUS_SECONDS)
    where = "the auto-detected cluster" if options.auto else \
        f"coordinator {options.coordinator} as process {options.process_id} of " \
        f"{options.num_processes}"
    # Said before the wait, which is silent otherwise: a process whose coordinator is not
    # up yet, or never comes, shows what it waits for and for how long.
    print(f"moejax: joining {where} (giving up after {timeout}s, --coordinator-timeout)",
          file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout
    if not options.auto and options.process_id != 0:
        _wait_for_coordinator(options.coordinator, deadline, where, timeout)
    with _Watchdog(deadline, f"moejax: error: could not join {where} within {timeout}s "
                             f"(--coordinator-timeout): not every process joined"):
        try:
            jax.distributed.initialize(**kwargs)
        except Exception as exc:   # JAX raises RuntimeError/ValueError/XlaRuntimeError
            detail = next(iter(str(exc).splitlines()), "")
            raise JoinError(f"could not join {where}: {type(exc).__name__}: {detail}") \
                from exc
    _joined = options
    log.info("process %d of %d: %d local of %d devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def with_collective_timeout(xla_flags: str, heartbeat_seconds: int) -> str:
    """``xla_flags`` with XLA's CPU collective timeout at half the heartbeat (at least 10 s),
    unless it sets one already. A collective can wait on a dead peer without an error (an
    all-gather stuck reading from it: seen in 2 of 9 SIGKILL trials, 60 s and more); JAX's
    heartbeat would then abort the survivors with a C++ stack trace. Timed out first, the
    collective fails, and moejax stops with exit 1 and its message. A peer slower than
    this at a collective (a long compile) also fails the run, as at the 30 s rendezvous."""
    environ = {"XLA_FLAGS": xla_flags}
    apply_collective_timeout(max(10, heartbeat_seconds // 2), environ)
    return environ["XLA_FLAGS"]


_JAX_TIMEOUT_MARGIN = 30   # seconds JAX's join timeout is given past ours
_CONNECT_POLL = 0.25       # seconds between attempts to reach the coordinator


def _wait_for_coordinator(address: str, deadline: float, where: str, timeout: int) -> None:
    """Wait until the coordinator's port accepts a TCP connection (it may start after this
    process); :class:`JoinError` when it does not by ``deadline``, naming the last error.
    Without this JAX would wait out its timeout and then abort the process."""
    import socket

    match = _ADDRESS.match(address)
    assert match is not None, address   # checked by DistributedOptions
    host, port = match["ipv6"] or match["host"], int(match["port"])
    last = "no attempt"
    while True:
        try:
            with socket.create_connection((host, port),
                                          timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            last = exc.strerror or str(exc) or type(exc).__name__
        if time.monotonic() >= deadline:
            raise JoinError(f"could not join {where}: the coordinator did not answer within "
                            f"{timeout}s (--coordinator-timeout); last attempt: {last}")
        time.sleep(_CONNECT_POLL)


class _Watchdog:
    """Ends the process with ``message`` (exit 1) if the block is still running at
    ``deadline``: JAX's join cannot be interrupted, and its own timeout aborts the
    process with a C++ stack trace instead of a reason."""

    def __init__(self, deadline: float, message: str):
        import threading

        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire,
                                      args=(message,))
        self._timer.daemon = True

    @staticmethod
    def _fire(message: str) -> None:
        import os

        print(message, file=sys.stderr, flush=True)
        os._exit(1)

    def __enter__(self) -> "_Watchdog":
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._timer.cancel()


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
