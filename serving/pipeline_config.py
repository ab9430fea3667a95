"""One description of a prefill→decode pipeline: :class:`PipelineConfig`.

A pipeline is a prefill stage (any paged backend: ``resident``, ``offload``, ``sync_ep``
or ``async_ep``, on one device or a group) handing each prompt to one of K decoders,
each its own placement (``resident``; ``offload``, with or without expert prefetch;
``sync_ep`` with its own replica router; ``async_ep``; ``mu_queue``, AsyncMoE's
runtime), chosen by one routing policy
(ELDR or a load balancer, ``moejax.eldr.policies``). It is data: a TOML or JSON file
(:func:`load`), a dict (:meth:`PipelineConfig.from_dict`), or the dataclasses, validated
on construction; a combination that cannot work is refused with both of its parts named.
The Generator (``pipeline=``), ``moejax generate --pipeline FILE`` and ``moejax serve
--pipeline FILE`` (gRPC and HTTP) all take it; ``serving.generation_runtime`` builds it.

A file::

    routing = "eldr"                 # jsq (default), round_robin, p2c, random, domain, eldr
    eldr_fit = "fit.npz"             # routing = "eldr": `moejax eldr-fit ... --decoders K`

    [prefill]
    backend = "async_ep"             # resident (default), offload, sync_ep, async_ep
    devices = 2

    [[decoders]]
    placement = "resident"
    count = 2                        # two decoders alike

    [[decoders]]
    placement = "offload"
    prefetch = "router"              # prefetch_mode "exact" (default) or "speculative"
    prefetch_prior = "eldr"          # mix in its ELDR cluster's expert frequencies
    prefetch_prior_weight = 0.1      # (moejax.eldr.priors: from the fit and its traces)
    prefetch_prior_traces = ["calib.npz"]

    [[decoders]]
    placement = "sync_ep"
    devices = 2
    replicas = 1.5
    router = "metro"                 # decode steps' replica router, apart from prefill's

    [[decoders]]
    placement = "mu_queue"           # AsyncMoE's μ-queue runtime (moejax.asyncmoe.decoder)
    devices = 2
    scheduler = "defrag"             # defrag (default), most_tokens, first_layer

A ``mu_queue`` decoder runs whole calls: each of its steps decodes every sequence it
adopted since the last one to the end, so its tokens arrive when that call ends (options:
``scheduler``, ``attention_devices`` — indices within its devices —, ``replicas``,
``replica_routing``; its step must be "auto").

Devices: the prefill stage takes devices ``[first_device, first_device + devices)``
(default from 0); decoders are packed one after another from device 0 unless a decoder
gives ``first_device``. Stages may share devices (the default puts decoder 0 beside the
prefill stage, as ``decoders=K`` always did); a ``resident`` or ``offload`` decoder on
the prefill stage's one device, of its backend, runs on the prefill stage's weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from moejax.asyncmoe.replicas import REPLICA_ROUTINGS, check_replica_routing
from moejax.asyncmoe.schedulers import SCHEDULER_NAMES
from moejax.eldr.policies import POLICIES, Policy, check_tau

PREFILL_BACKENDS = ("resident", "offload", "sync_ep", "async_ep")
DECODER_PLACEMENTS = ("resident", "offload", "sync_ep", "async_ep", "mu_queue")
MU_QUEUE = "mu_queue"                          # the μ-queue runtime, on any device count
MESH_PLACEMENTS = ("sync_ep", "async_ep")      # data-parallel ranks over several devices
MULTI_DEVICE = (*MESH_PLACEMENTS, MU_QUEUE)    # what may take devices > 1
STEPS = ("auto", "fused", "layerwise")
REPLICA_ROUTERS = ("eplb_even", "metro")

# The options each placement takes beyond placement/devices/first_device/count/step.
PLACEMENT_OPTIONS: dict[str, tuple[str, ...]] = {
    "resident": (),
    "offload": ("expert_slots", "prefetch", "prefetch_mode", "prefetch_files",
                "prefetch_prior", "prefetch_prior_weight", "prefetch_prior_traces"),
    "sync_ep": ("replicas", "router", "prefill_router"),
    "async_ep": (),
    MU_QUEUE: ("scheduler", "attention_devices", "replicas", "replica_routing"),
}
PREFILL_OPTIONS: dict[str, tuple[str, ...]] = {
    "resident": (), "offload": ("expert_slots", "prefetch", "prefetch_mode", "prefetch_files"),
    "sync_ep": ("replicas", "router"), "async_ep": ()}
ELDR_PRIOR = "eldr"     # prefetch_prior = "eldr": the decoder's ELDR cluster, from the fit
COMMON_KEYS = ("devices", "first_device", "step")
ROUTING_KEYS = ("routing", "eldr_fit", "eldr_tau", "routing_seed")


class PipelineError(ValueError):
    """A pipeline description that cannot work; the message names the parts."""


def check_positive_int(where: str, value: Any, error: type[ValueError] = PipelineError
                       ) -> int:
    """``value`` if a positive int (not a bool), else ``error`` naming ``where`` (the
    Generator's own options raise a plain ValueError, a pipeline's a PipelineError)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise error(f"{where} must be a positive integer, got {value!r}")
    return value


def _check_device_index(where: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PipelineError(f"{where} must be a device index >= 0, got {value!r}")


def _check_devices_and_step(where: str, noun: str, kind: str, devices: int, step: str
                            ) -> None:
    """A stage's device count and step mode against its backend or placement ``kind``."""
    if devices > 1 and kind not in MESH_PLACEMENTS:
        several = MULTI_DEVICE if noun == "placement" else MESH_PLACEMENTS
        raise PipelineError(f"{where}: devices={devices}, but {noun} {kind!r} runs on one "
                            f"device (several: {' or '.join(several)})")
    _check_step(where, kind, step)


def _check_step(where: str, kind: str, step: str) -> None:
    if step not in STEPS:
        raise PipelineError(f"{where}.step must be one of {STEPS}, got {step!r}")
    if step == "fused" and kind == "offload":
        raise PipelineError(f"{where}: placement 'offload' runs layerwise steps (the host "
                            f"copies each layer's experts), not step='fused'")
    if step == "layerwise" and kind in MESH_PLACEMENTS:
        raise PipelineError(f"{where}: placement {kind!r} runs fused steps (its experts "
                            f"stay in one program), not step='layerwise'")


def _check_mu_queue_step(where: str, step: str) -> None:
    if step != "auto":
        raise PipelineError(f"{where}: placement 'mu_queue' forms its own batches in the "
                            f"μ-queue loop (layerwise programs per batch), so its step is "
                            f"'auto', not step={step!r}")


def _check_mu_queue_options(where: str, options: Mapping[str, Any], devices: int) -> None:
    """A μ-queue decoder's options against its device count (the runtime checks the
    layout as a whole when it is built)."""
    scheduler = options.get("scheduler", "defrag")
    if scheduler not in SCHEDULER_NAMES:
        raise PipelineError(f"{where}.scheduler must be one of {SCHEDULER_NAMES}, got "
                            f"{scheduler!r}")
    ranks = options.get("attention_devices")
    if ranks is not None:
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not ranks \
                or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < devices
                       for d in ranks) or len(set(ranks)) != len(ranks):
            raise PipelineError(f"{where}.attention_devices must be distinct device indices "
                                f"in [0, devices={devices}), got {ranks!r}")
    replicas = options.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) \
            or not 1 <= replicas <= devices:
        raise PipelineError(f"{where}.replicas must be an integer in [1, devices={devices}], "
                            f"got {replicas!r}")
    try:
        check_replica_routing(options.get("replica_routing", REPLICA_ROUTINGS[0]))
    except ValueError as exc:       # its message starts "replica_routing must be one of"
        raise PipelineError(f"{where}.{exc}") from None


def resolved_step(kind: str, step: str) -> str:
    """A stage's step mode: "auto" is layerwise on offload, fused elsewhere."""
    if step != "auto":
        return step
    return "layerwise" if kind == "offload" else "fused"


def _check_router(where: str, name: str, value: Any) -> None:
    if value is not None and value not in REPLICA_ROUTERS:
        raise PipelineError(f"{where}.{name} must be one of {REPLICA_ROUTERS}, got {value!r}")


def _check_replicas(where: str, options: Mapping[str, Any], devices: int) -> None:
    replicas = options.get("replicas")
    if replicas is None:
        for name in ("router", "prefill_router"):
            if options.get(name) is not None:
                raise PipelineError(f"{where}.{name} picks among an expert's replicas: give "
                                    f"{where}.replicas too")
        return
    if isinstance(replicas, bool) or not isinstance(replicas, (int, float)) \
            or not 1 <= replicas <= devices:
        raise PipelineError(f"{where}.replicas must be a number in [1, devices={devices}], "
                            f"got {replicas!r}")


def _check_prefetch(where: str, options: Mapping[str, Any]) -> None:
    """An offload stage's prefetch choice, refused by the prefetching runner's check."""
    if not any(k.startswith("prefetch") for k in options):
        return
    from moejax.prefetch.runner import check_choice     # imported when used: jax code

    try:
        check_choice(options.get("prefetch", "none"), options.get("prefetch_mode", "exact"))
    except ValueError as exc:
        raise PipelineError(f"{where}: {exc}") from None


def with_prefetch_defaults(options: Mapping[str, Any]) -> dict[str, Any]:
    """A stage's (or the Generator's) runner keywords: with any prefetch key (the
    prefetching offload runner), the prefetch choice, mode and files each filled with its
    default where missing or empty."""
    options = dict(options)
    if any(k.startswith("prefetch") for k in options):
        options["prefetch"] = options.get("prefetch") or "none"
        options["prefetch_mode"] = options.get("prefetch_mode") or "exact"
        options["prefetch_files"] = options.get("prefetch_files") or ()
    return options


@dataclasses.dataclass(frozen=True)
class PrefillStage:
    """The prefill stage: ``backend`` on ``devices`` devices from ``first_device``, its
    step mode and its backend's options (``sync_ep``: ``replicas`` and ``router``, the
    replica router of its steps; ``offload``: ``expert_slots``)."""

    backend: str = "resident"
    devices: int = 1
    first_device: int = 0
    step: str = "auto"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"prefill (backend {self.backend!r})"
        if self.backend not in PREFILL_BACKENDS:
            raise PipelineError(f"prefill.backend must be one of {PREFILL_BACKENDS}, got "
                                f"{self.backend!r}")
        check_positive_int(f"{where}.devices", self.devices)
        _check_device_index(f"{where}.first_device", self.first_device)
        _check_devices_and_step(where, "backend", self.backend, self.devices, self.step)
        unknown = sorted(set(self.options) - set(PREFILL_OPTIONS[self.backend]))
        if unknown:
            raise PipelineError(f"{where} does not take {', '.join(unknown)} (it takes "
                                f"{', '.join(PREFILL_OPTIONS[self.backend]) or 'no options'})")
        _check_router(where, "router", self.options.get("router"))
        if self.backend == "sync_ep":
            _check_replicas(where, self.options, self.devices)
        _check_prefetch(where, self.options)

    def runner_options(self) -> dict[str, Any]:
        """The decode runner's keywords (sync_ep: its one router for every step)."""
        options = with_prefetch_defaults(self.options)
        if "router" in options:
            options["prefill_router"] = options["router"]
        return options


@dataclasses.dataclass(frozen=True)
class DecoderStage:
    """``count`` decoders alike: ``placement`` on ``devices`` devices each (from
    ``first_device``, else packed after the decoder before), its step mode and its
    placement's options (``PLACEMENT_OPTIONS``)."""

    placement: str = "resident"
    devices: int = 1
    first_device: int | None = None
    count: int = 1
    step: str = "auto"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def check(self, where: str) -> None:
        """PipelineError naming ``where`` (e.g. "decoders[1]") and the part at fault."""
        if self.placement not in DECODER_PLACEMENTS:
            raise PipelineError(f"{where}.placement must be one of {DECODER_PLACEMENTS}, got "
                                f"{self.placement!r}")
        where = f"{where} (placement {self.placement!r})"
        check_positive_int(f"{where}.devices", self.devices)
        check_positive_int(f"{where}.count", self.count)
        if self.first_device is not None:
            _check_device_index(f"{where}.first_device", self.first_device)
        if self.placement == MU_QUEUE:
            _check_mu_queue_step(where, self.step)
        else:
            _check_devices_and_step(where, "placement", self.placement, self.devices,
                                    self.step)
        takes = PLACEMENT_OPTIONS[self.placement]
        unknown = sorted(set(self.options) - set(takes))
        if unknown:
            owners = sorted({p for p, names in PLACEMENT_OPTIONS.items()
                             for name in unknown if name in names})
            hint = f" ({', '.join(unknown)}: placement {' or '.join(owners)})" if owners else ""
            raise PipelineError(f"{where} does not take {', '.join(unknown)}{hint}; it takes "
                                f"{', '.join(takes) or 'no options'}")
        for name in ("router", "prefill_router"):
            _check_router(where, name, self.options.get(name))
        if self.placement == "sync_ep":
            _check_replicas(where, self.options, self.devices)
        if self.placement == MU_QUEUE:
            _check_mu_queue_options(where, self.options, self.devices)
        _check_prefetch(where, self.options)
        prior = self.options.get("prefetch_prior")
        traces = self.options.get("prefetch_prior_traces")
        if (isinstance(prior, str) and prior != ELDR_PRIOR) or (prior is None and traces):
            raise PipelineError(f"{where}: prefetch_prior takes {ELDR_PRIOR!r} (the cluster "
                                f"ELDR routes to this decoder, with prefetch_prior_traces) "
                                f"or an [L, E] array; got prefetch_prior={prior!r}")
        if prior == ELDR_PRIOR and not traces:
            raise PipelineError(f"{where}: prefetch_prior='eldr' needs prefetch_prior_traces, "
                                f"the calibration traces the ELDR fit was made from")

    @property
    def eldr_prior(self) -> bool:
        """Whether this decoder's prefetch prior is its ELDR cluster's."""
        return self.options.get("prefetch_prior") == ELDR_PRIOR

    def runner_options(self) -> dict[str, Any]:
        """The decode runner's keywords (an ELDR prior is computed by the builder)."""
        options = with_prefetch_defaults(self.options)
        if self.eldr_prior:
            del options["prefetch_prior"]
        options.pop("prefetch_prior_traces", None)
        return options


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The whole pipeline (module docstring): ``prefill``, ``decoders`` (stages, each
    ``count`` decoders), and the routing between the decoders: ``routing`` (a policy
    name, or a :class:`~moejax.eldr.policies.Policy` object over the K decoders),
    ``eldr_fit`` / ``eldr_tau`` (routing "eldr"), ``routing_seed`` (random, p2c)."""

    prefill: PrefillStage = PrefillStage()
    decoders: tuple[DecoderStage, ...] = (DecoderStage(count=2),)
    routing: "str | Policy" = "jsq"
    eldr_fit: str | os.PathLike | None = None
    eldr_tau: float | None = None
    routing_seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.prefill, PrefillStage):
            raise PipelineError(f"prefill must be a PrefillStage, got "
                                f"{type(self.prefill).__name__}")
        object.__setattr__(self, "decoders", tuple(self.decoders))
        if not self.decoders:
            raise PipelineError("a pipeline needs at least one decoder")
        for index, stage in enumerate(self.decoders):
            if not isinstance(stage, DecoderStage):
                raise PipelineError(f"decoders[{index}] must be a DecoderStage, got "
                                    f"{type(stage).__name__}")
            stage.check(f"decoders[{index}]")
        if isinstance(self.routing, Policy):
            if self.routing.num_decoders != self.num_decoders or self.eldr_tau is not None \
                    or self.eldr_fit is not None:
                raise PipelineError(f"a routing policy object routes over its own "
                                    f"{self.routing.num_decoders} decoders (the pipeline has "
                                    f"{self.num_decoders}) and takes no eldr_tau or eldr_fit")
        elif self.routing not in POLICIES:
            raise PipelineError(f"routing must be one of {POLICIES}, got {self.routing!r}")
        if self.routing == "eldr" and self.eldr_fit is None:
            raise PipelineError("routing 'eldr' needs eldr_fit, a fit file made by `moejax "
                                f"eldr-fit TRACES -o PATH --decoders {self.num_decoders}`")
        if self.routing != "eldr":
            given = [n for n in ("eldr_fit", "eldr_tau") if getattr(self, n) is not None]
            if given:
                raise PipelineError(f"{', '.join(given)} apply to routing 'eldr', not "
                                    f"routing {self.routing!r}")
        if self.eldr_tau is not None:
            try:
                check_tau(self.eldr_tau)
            except ValueError as exc:
                raise PipelineError(f"eldr_tau: {exc}") from None
        for index, stage in enumerate(self.decoders):
            if stage.eldr_prior and self.routing != "eldr":
                raise PipelineError(
                    f"decoders[{index}] (placement 'offload'): prefetch_prior='eldr' is the "
                    f"cluster ELDR routes to the decoder, but the pipeline routes with "
                    f"{self.routing if isinstance(self.routing, str) else 'a policy object'!r}"
                    f" (give routing='eldr' and eldr_fit)")
        if not isinstance(self.routing_seed, int) or isinstance(self.routing_seed, bool) \
                or self.routing_seed < 0:
            raise PipelineError(f"routing_seed must be a non-negative integer, got "
                                f"{self.routing_seed!r}")

    @property
    def num_decoders(self) -> int:
        return sum(stage.count for stage in self.decoders)

    def decoder_list(self) -> list[DecoderStage]:
        """One stage per decoder (``count`` expanded), in decoder order."""
        return [stage for stage in self.decoders for _ in range(stage.count)]

    def devices_needed(self) -> int:
        """Devices the stages span (the highest index any stage takes, plus one)."""
        prefill, decoders = self.device_indices()
        return 1 + max(max(prefill), *(max(at) for at in decoders))

    def device_indices(self, num_devices: int | None = None
                       ) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
        """The prefill stage's device indices and each decoder's (module docstring), or a
        PipelineError naming the stage that does not fit in ``num_devices`` (None: no
        limit)."""
        num_devices = 1 << 30 if num_devices is None else num_devices
        prefill = self.prefill
        first = range(prefill.first_device, prefill.first_device + prefill.devices)
        if first.stop > num_devices:
            raise PipelineError(f"prefill (backend {prefill.backend!r}) needs devices "
                                f"{first.start}..{first.stop - 1}, but {num_devices} exist")
        decoders, at = [], 0
        for index, stage in enumerate(self.decoder_list()):
            start = at if stage.first_device is None else stage.first_device
            if start + stage.devices > num_devices:
                raise PipelineError(
                    f"decoder {index} (placement {stage.placement!r}) needs devices "
                    f"{start}..{start + stage.devices - 1}, but {num_devices} exist (the "
                    f"decoders ask for {sum(s.devices for s in self.decoder_list())} in all)")
            decoders.append(tuple(range(start, start + stage.devices)))
            at = start + stage.devices
        return tuple(first), decoders

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "pipeline") -> "PipelineConfig":
        """A config from a parsed file or dict (module docstring); unknown keys are
        refused by name."""
        if not isinstance(data, Mapping):
            raise PipelineError(f"{where} must be a table (a dict), got {type(data).__name__}")
        unknown = sorted(set(data) - {"prefill", "decoders", *ROUTING_KEYS})
        if unknown:
            raise PipelineError(f"{where}: unknown key(s) {', '.join(unknown)}; a pipeline "
                                f"has prefill, decoders, {', '.join(ROUTING_KEYS)}")
        prefill = _stage_from(data.get("prefill", {}), "backend", f"{where}: prefill")
        decoders = data.get("decoders")
        if not isinstance(decoders, Sequence) or isinstance(decoders, (str, bytes)) \
                or not decoders:
            raise PipelineError(f"{where}: decoders must be a non-empty list of tables "
                                f"(one per decoder stage)")
        stages = [_stage_from(d, "placement", f"{where}: decoders[{i}]")
                  for i, d in enumerate(decoders)]
        routing = {k: data[k] for k in ROUTING_KEYS if k in data}
        return cls(prefill=PrefillStage(**prefill),
                   decoders=tuple(DecoderStage(**stage) for stage in stages), **routing)


def _stage_from(data: Any, kind_key: str, where: str) -> dict[str, Any]:
    """A stage's dataclass keywords from its table: the kind, the common keys (and
    ``count`` for decoders), the rest its options."""
    if not isinstance(data, Mapping):
        raise PipelineError(f"{where} must be a table, got {type(data).__name__}")
    keys = (kind_key, *COMMON_KEYS) + (("count",) if kind_key == "placement" else ())
    stage = {k: data[k] for k in keys if k in data}
    options = {k: v for k, v in data.items() if k not in keys}
    if "options" in options:
        raise PipelineError(f"{where}: give a stage's options as keys of its table, not "
                            f"under 'options'")
    return {**stage, "options": options}


def load(path: str | os.PathLike) -> PipelineConfig:
    """The pipeline of a TOML (``.toml``) or JSON file; errors name the file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise PipelineError(f"pipeline file {path!r}: {exc.strerror or exc}") from None
    try:
        data = (tomllib.loads(raw.decode()) if path.endswith(".toml")
                else json.loads(raw.decode()))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        kind = "TOML" if path.endswith(".toml") else "JSON"
        raise PipelineError(f"pipeline file {path!r} is not valid {kind}: {exc}") from None
    return PipelineConfig.from_dict(data, where=f"pipeline file {path!r}")


def as_config(value: Any) -> PipelineConfig:
    """A ``pipeline=`` option as a :class:`PipelineConfig`: itself, a dict, or a file
    path."""
    if isinstance(value, PipelineConfig):
        return value
    if isinstance(value, Mapping):
        return PipelineConfig.from_dict(value)
    if isinstance(value, (str, os.PathLike)):
        return load(value)
    raise PipelineError(f"pipeline must be a PipelineConfig, a dict or a file path, got "
                        f"{type(value).__name__}")
