"""What every execution backend shares: the interface, batch stacking for
data-parallel ranks, and the memory report.

A backend owns the placement of the params (device, mesh shards, host memory) and
runs the packed forward of ``moejax.model``. A *step* takes ``num_ranks`` packed
batches of one shape (one per data-parallel rank; the engine pads a short step with
empty batches) and returns each batch's scoring-position logits, as device arrays so
that the caller can keep packing while the device computes.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax.attention_kinds import PrefixContext
from moejax.config import ModelConfig
from moejax.distributed import fetch_global
from moejax.kv import KVPool, empty_pool
from moejax.model import ForwardOptions, PackedBatch, VocabReadout, check_params
from moejax.fp8_experts import FP8_DTYPE, device_bits
from moejax.param_layout import EXPERT_SCALE_KEYS, Params, expert_matrix_names
from moejax.program_traffic import Traffic, program_traffic

# The backends that hold a prefix KV pool (``Backend.holds_prefix_pool``), named in errors.
PREFIX_POOL_BACKENDS = ("resident", "offload", "async_ep", "hybrid")

StepOutput = VocabReadout    # one batch's logits (and log-sum-exp, top ids) by position


def check_expert_bias(name: str, cfg: ModelConfig, serves: bool) -> None:
    """BackendError when ``cfg``'s experts have biases or a clamped SwiGLU (GPT-OSS) and
    backend ``name`` does not pass them to its expert compute."""
    if serves or not (cfg.expert_bias or cfg.swiglu_limit is not None):
        return
    raise BackendError(f"backend {name!r} does not serve {cfg.model_type}: its experts have "
                       "biases and a clamped SwiGLU, which this backend's expert compute does "
                       "not take (it shards the expert width, or moves the expert matrices "
                       "alone); use resident, offload, async_ep or hybrid (generation: "
                       "resident)")


# What each backend but ``resident`` would need before it could hold the routed experts in
# FP8 (``weights_dtype="fp8"``), named in the refusal.
FP8_EXPERTS_WORK = {
    "offload": "its host stacks, window buffers and H2D copies of the scale leaves",
    "hybrid": "its host stacks, shard windows and the copies and gathers of the scales",
    "async_ep": "sharding and all-gathering the scale leaves with their experts",
    "sync_ep": "replica slots and the all-to-all placement of the scales",
    "tp": "splitting f on scale-block boundaries (f/G a multiple of the block)",
    "tp_ep": "sharding the scales with their experts",
    "dp_tp": "splitting f on scale-block boundaries",
    "pp": "placing each stage's scale leaves",
    "streamed": "streaming the scale leaves with each layer",
}


def fp8_experts_refusal(name: str) -> str:
    """Why backend ``name`` cannot hold routed experts kept in FP8, and what it would need."""
    work = FP8_EXPERTS_WORK.get(name, "placing the scale leaves with the experts")
    return (f"backend {name!r} does not serve weights_dtype='fp8' (experts kept in FP8 with "
            f"block scales): only 'resident' does; {name} would need {work}, and its byte "
            f"accounting to count FP8 values and scales; use backend 'resident' or "
            f"weights_dtype='auto' (dequantize on load)")


def check_fp8_experts(name: str, cfg: ModelConfig, serves: bool) -> None:
    """BackendError when ``cfg`` holds the routed experts in FP8 (``expert_fp8_block``)
    and backend ``name`` does not place, move and count them with their block scales."""
    if not serves and cfg.expert_fp8_block is not None:
        raise BackendError(fp8_experts_refusal(name))


class BackendError(ValueError):
    """A backend cannot run as asked (devices, divisibility, memory kinds)."""


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Device memory one backend uses for weights, per device, in bytes.

    dense_weight_bytes: embeddings, attention, norms, routers, LM head.
    expert_weight_bytes: expert weights on the device at their peak (resident experts,
    the window of streamed layers, the local shards, the gathered layers in flight).
    expert_bytes_all_layers: the whole model's expert weights (what ``resident`` holds),
    so ``expert_bytes_all_layers / expert_weight_bytes`` is the saving.
    host_weight_bytes: weights kept in host memory.
    detail: named parts of expert_weight_bytes (e.g. ``window``, ``shards``, ``gathered``).
    """

    dense_weight_bytes: int
    expert_weight_bytes: int
    expert_bytes_all_layers: int
    host_weight_bytes: int = 0
    detail: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def expert_saving(self) -> float:
        return self.expert_bytes_all_layers / max(self.expert_weight_bytes, 1)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["detail"] = dict(self.detail)
        out["expert_saving"] = self.expert_saving
        return out


class Backend(abc.ABC):
    """One way to run the packed forward. Subclasses set ``name`` and implement
    :meth:`step` and :meth:`memory_report`."""

    name: str = ""
    # Whether kv_placement / prefix_step work here (the prefix cache and in-call
    # prompt sharing need them).
    holds_prefix_pool: bool = False
    # Why not, for a backend that does not (said in the refusal).
    no_prefix_pool_reason: str = ""

    # The collective kinds this backend issues ahead of the computation that needs them
    # (async_ep's next-layer all-gathers): bytes moved in the background, not on the
    # critical path (step_traffic).
    overlapped_collectives: tuple[str, ...] = ()

    # Whether this backend passes the routed experts' biases and the family's expert
    # activation to the expert compute (GPT-OSS needs both).
    serves_expert_bias: bool = False
    # Whether it holds routed experts kept in FP8 with their block scales
    # (``cfg.expert_fp8_block``: ``weights_dtype="fp8"``).
    serves_fp8_experts: bool = False

    def __init__(self, cfg: ModelConfig, *, dtype: Any = jnp.float32):
        check_expert_bias(self.name, cfg, self.serves_expert_bias)
        check_fp8_experts(self.name, cfg, self.serves_fp8_experts)
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)

    @property
    def num_ranks(self) -> int:
        """Packed batches per step (data-parallel ranks)."""
        return 1

    @property
    @abc.abstractmethod
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices this backend computes on."""

    @abc.abstractmethod
    def step(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[StepOutput]:
        """Run ``num_ranks`` host batches of one shape; outputs in the same order."""

    @abc.abstractmethod
    def lowered_steps(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[Any]:
        """The lowered program(s) one step runs (``jax.stages.Lowered``), for inspecting the
        compiled HLO or its ``memory_analysis()``; nothing is executed."""

    def step_traffic(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> Traffic:
        """Bytes one device moves in one step over ``batches``, counted from the compiled
        programs (:mod:`moejax.program_traffic`), each run once; a backend whose step runs
        a program several times or moves data between programs adds that. Compiles the
        step's programs; executes nothing."""
        return sum((self.traffic_of(lowered)
                    for lowered in self.lowered_steps(batches, opts)), Traffic())

    def traffic_of(self, lowered: Any) -> Traffic:
        """One run of one lowered program (``jax.stages.Lowered``), compiled and counted."""
        return program_traffic(lowered.compile().as_text(), len(self.devices),
                               self.overlapped_collectives)

    @abc.abstractmethod
    def memory_report(self) -> MemoryReport:
        """Bytes of weights per device (see :class:`MemoryReport`)."""

    @property
    def serialize_steps(self) -> bool:
        """Must a caller wait for each step before dispatching the next? Yes for several
        CPU devices: XLA:CPU runs collectives as host-thread rendezvous, and two
        multi-device programs in flight at once can deadlock there (seen with async_ep
        on 8 host devices). GPUs queue programs per device stream and need no wait."""
        devices = self.devices
        return len(devices) > 1 and devices[0].platform == "cpu"

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "devices": len(self.devices), "ranks": self.num_ranks}

    @property
    def kv_placement(self) -> Any:
        """Where this backend's KV pool lives (a device or a sharding), for
        :meth:`prefix_steps`; backends that cannot hold a pool raise BackendError. Scoring
        and generation on one device share the pool (:class:`moejax.kv.KVStore`). With
        several data-parallel ranks each rank holds its own blocks: the pool's token-slot
        axis is split over the ranks, and a rank's blocks are numbered from 0."""
        why = f": {self.no_prefix_pool_reason}" if self.no_prefix_pool_reason else ""
        raise BackendError(f"backend {self.name!r} cannot hold a prefix KV pool{why} (the "
                           f"prefix cache runs on {', '.join(PREFIX_POOL_BACKENDS)}); set "
                           f"prefix_cache_blocks=0 for it")

    def make_kv_pool(self, num_blocks: int) -> KVPool:
        """A zeroed KV pool of ``num_blocks`` blocks per rank placed for
        :meth:`prefix_steps`."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise BackendError(f"a KV pool needs num_blocks >= 1, got {num_blocks!r}")
        return empty_pool(self.cfg, num_blocks * self.num_ranks, self.dtype, self.kv_placement)

    def prefix_step(self, batch: PackedBatch, context: PrefixContext, pool: KVPool,
                    opts: ForwardOptions) -> tuple[StepOutput, KVPool]:
        """One batch whose sequences continue (``context``) and store prefix keys/values in
        ``pool`` (consumed: use the returned pool) -> (its output, the updated pool). One
        rank; :meth:`prefix_steps` is the general form."""
        raise BackendError(f"backend {self.name!r} cannot run the prefix cache")

    def prefix_steps(self, batches: Sequence[PackedBatch], contexts: Sequence[PrefixContext],
                     pool: KVPool, opts: ForwardOptions) -> tuple[list[StepOutput], KVPool]:
        """One batch per rank, each continuing from and storing into its own rank's blocks
        of ``pool`` (``contexts`` in rank-local slots; consumed: use the returned pool) ->
        (the outputs in rank order, the updated pool). An idle rank gets an empty batch
        and :func:`empty_context_like`. One rank: :meth:`prefix_step`."""
        if self.num_ranks != 1:
            raise BackendError(f"backend {self.name!r} cannot run the prefix cache on "
                               f"{self.num_ranks} ranks")
        if len(batches) != 1 or len(contexts) != 1:
            raise ValueError(f"backend {self.name!r} takes 1 batch per step, got "
                             f"{len(batches)}")
        output, pool = self.prefix_step(batches[0], contexts[0], pool, opts)
        return [output], pool

    def time_expert_transfer(self, repeats: int) -> tuple[str, float] | None:
        """(channel, median seconds) of moving one layer's experts over this backend's
        slowest channel, timed in isolation; None when the backend moves no weights
        (its per-layer traffic is activations, which calibration does not model)."""
        return None

    def _check_step(self, batches: Sequence[PackedBatch]) -> None:
        if len(batches) != self.num_ranks:
            raise ValueError(f"backend {self.name!r} takes {self.num_ranks} batch(es) per "
                             f"step, got {len(batches)}")
        shapes = {tuple(np.shape(b.tokens)) + tuple(np.shape(b.score_token_ids)) for b in batches}
        if len(shapes) != 1:
            raise ValueError(f"batches of one step must share a shape, got {sorted(shapes)}")


class MeshBackend(Backend):
    """A backend over ``self._devices`` (set by the subclass) with one data-parallel rank
    per device."""

    _devices: tuple[jax.Device, ...] = ()

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return self._devices

    @property
    def num_ranks(self) -> int:
        return len(self._devices)


# ------------------------------------------------------------------ helpers
def cast_params(params: Params, dtype) -> Params:
    """Every leaf as a NumPy array of ``dtype`` (host side; placement is the backend's),
    but FP8 expert matrices, which become their bytes (uint8: the device form, see
    ``moejax.fp8_experts``), and their float32 block scales (``weights_dtype="fp8"``):
    casting them is what keeping them in FP8 avoids."""
    def cast(path, a):
        a = np.asarray(a)
        key = getattr(path[-1], "key", None)
        if a.dtype == FP8_DTYPE:
            return device_bits(a)
        if key in EXPERT_SCALE_KEYS or a.dtype == np.uint8:      # scales; bytes already
            return a
        return a.astype(dtype, copy=False)

    return jax.tree_util.tree_map_with_path(cast, params)


def validated(params: Params, cfg: ModelConfig, dtype) -> Params:
    check_params(params, cfg)
    return cast_params(params, jnp.dtype(dtype))


def nbytes(tree: Any) -> int:
    return int(sum(np.prod(np.shape(a)) * np.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves(tree)))


def expert_bytes_per_layer(params: Params) -> int:
    layers = params["layers"]
    return nbytes({k: layers[k] for k in expert_matrix_names(layers)}) // int(
        np.shape(layers["w_gate"])[0])


def dense_bytes(params: Params) -> int:
    dense = {k: v for k, v in params.items() if k != "layers"}
    experts = expert_matrix_names(params["layers"])
    dense["layers"] = {k: v for k, v in params["layers"].items() if k not in experts}
    return nbytes(dense)


def empty_batch_like(batch: PackedBatch) -> PackedBatch:
    """A batch of the same shape holding no tokens (pads a short data-parallel step)."""
    return PackedBatch(tokens=np.zeros_like(batch.tokens), positions=np.zeros_like(batch.positions),
                       segment_ids=np.full_like(batch.segment_ids, -1),
                       score_positions=np.zeros_like(batch.score_positions),
                       score_token_ids=np.zeros_like(batch.score_token_ids))


def empty_context_like(context: PrefixContext, rank_slots: int) -> PrefixContext:
    """A context of ``context``'s shape that reads and stores nothing (an idle rank of a
    step on the pool): every entry unused (lo > hi), every row's slot ``rank_slots`` (past
    the rank's pool: dropped)."""
    return PrefixContext(
        ctx_slot=np.zeros_like(context.ctx_slot), ctx_lo=np.ones_like(context.ctx_lo),
        ctx_hi=np.zeros_like(context.ctx_hi), store_row=np.zeros_like(context.store_row),
        store_slot=np.full_like(context.store_slot, rank_slots),
        ctx_positions=(None if context.ctx_positions is None
                       else np.zeros_like(context.ctx_positions)))


def stack_batches(batches: Sequence[PackedBatch]) -> PackedBatch:
    """G batches of one shape -> one batch with a leading [G] axis on every field."""
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches)


def unstack_outputs(readout: VocabReadout, count: int) -> list[StepOutput]:
    """A readout of G ranks (a leading [G] axis on every field) -> G per-rank readouts.
    Over several processes the ranks of the others' devices are all-gathered first (every
    process gets all)."""
    readout = jax.tree.map(fetch_global, readout)
    return [jax.tree.map(lambda a, g=g: a[g], readout) for g in range(count)]


RANK_AXIS = "dp"
"""The mesh axis of data-parallel ranks: every rank-mesh backend's (sync_ep, async_ep,
dp_tp) and the decode runners' on their placements (``moejax.decode.rank_mesh``)."""


def rank_axis(readout: VocabReadout) -> VocabReadout:
    """A rank's readout with a leading rank axis of 1 (shard_map stacks the ranks on it)."""
    return jax.tree.map(lambda a: a[None], readout)


def resolve_placement(name: str, cfg: ModelConfig, params: Any, placement: Any,
                      place: Callable[[], Any]) -> Any:
    """What backend or runner ``name`` runs on: ``placement`` as it is (it must hold
    ``cfg``'s weights), or ``place()`` (placing ``params`` now); exactly one of
    ``params`` and ``placement`` is given. Each placement type's ``resolve`` adds its own
    checks of a given placement."""
    if (placement is None) == (params is None):
        raise BackendError(f"backend {name!r} takes params or a placement, not both")
    if placement is None:
        return place()
    if placement.cfg != cfg:
        raise BackendError(f"backend {name!r}: the placement holds another model "
                           f"configuration's weights")
    return placement


def one_device(name: str, device: Any) -> jax.Device:
    """The device a one-device backend or runner ``name`` runs on: ``device`` (a
    ``jax.Device``, e.g. one decoder of several) or the platform's first."""
    if device is None:
        return require_devices(name, 1)[0]
    if not isinstance(device, jax.Device):
        raise BackendError(f"backend {name!r}: device must be a jax.Device, got "
                           f"{type(device).__name__}")
    return device


def require_devices(name: str, count: int, platform_devices: Sequence[jax.Device] | None = None
                    ) -> tuple[jax.Device, ...]:
    """The first ``count`` devices of the default platform, or a BackendError saying why not."""
    available = list(platform_devices if platform_devices is not None else jax.devices())
    if not isinstance(count, int) or count < 1:
        raise BackendError(f"backend {name!r}: devices must be a positive integer, got {count!r}")
    if count > len(available):
        hint = (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX "
                "starts)" if available and available[0].platform == "cpu" else "")
        raise BackendError(f"backend {name!r} asks for {count} devices but only "
                           f"{len(available)} {available[0].platform if available else ''} "
                           f"device(s) exist{hint}")
    return tuple(available[:count])


def plan_steps(shape_keys: Sequence[Any], num_ranks: int) -> list[list[int]]:
    """Group batch indices into steps of up to ``num_ranks`` batches of one shape, in
    first-seen order of the shapes (short steps are padded by the caller)."""
    by_shape: dict[Any, list[int]] = {}
    for index, key in enumerate(shape_keys):
        by_shape.setdefault(key, []).append(index)
    return [group[i:i + num_ranks] for group in by_shape.values()
            for i in range(0, len(group), num_ranks)]


def padded_step(batches: Sequence[PackedBatch], num_ranks: int) -> list[PackedBatch]:
    """``batches`` plus empty batches of the same shape up to ``num_ranks``."""
    return list(batches) + [empty_batch_like(batches[0])] * (num_ranks - len(batches))
