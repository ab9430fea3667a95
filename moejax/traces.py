"""Expert traces: the one on-disk format of routing decisions that every simulator and
estimator reads (``moejax trace`` writes it, :func:`load` reads it back).

A trace records, for each request of a generation run, its id, an optional domain label,
its prompt token ids and generated token ids, and for every token that ran through the
model the top-k expert ids and gate weights at every layer (prefill: every prompt token;
decode: every generated token that was fed back, i.e. all but the last one), and
optionally the router input (the normed hidden state the router reads) of those tokens.
Writing a trace never changes the tokens: the routing comes from the same compiled
programs as an untraced run (``serving.Generator(trace_experts=True)``).

File: one ``.npz`` (``numpy.savez``, uncompressed, no pickled objects: read it with
``numpy.load(path)`` and no moejax), format version 1. Ragged data is concatenated over
the requests, in request order, and cut by offsets: request ``i`` owns
``X[offsets[i]:offsets[i + 1]]``. Per-token arrays are LAYER-MAJOR, ``[L, tokens, ...]``,
as the Generator returns them: ``prefill_experts[l]`` is one contiguous [tokens, k] block
per layer (what per-layer statistics and per-layer predictors read), and a request's
slice ``prefill_experts[:, a:b]`` has the shape of its Generator result.

Keys (R requests, P prompt tokens, G generated tokens, D decode tokens = fed-back
generated tokens, in all requests; L layers, k experts per token, d hidden size):

==========================  ============  ===================================================
key                         dtype, shape  meaning
==========================  ============  ===================================================
``format``                  str, ()       ``"moejax-expert-trace"``
``version``                 int64, ()     1 (:data:`VERSION`)
``model``                   str, ()       the model the trace was made with ("" unknown)
``num_layers``              int64, ()     L
``top_k``                   int64, ()     k
``num_experts``             int64, ()     E (expert ids lie in [0, E))
``request_ids``             str, [R]      the request's id as text (an integer id in
                                          decimal); "" when it had none
``domains``                 str, [R]      the domain label; "" when it had none
``finish_reasons``          str, [R]      "stop" | "length"; "" for an errored request
``errors``                  str, [R]      why the request failed; "" when it ran
``prompt_offsets``          int64, [R+1]  cuts ``prompt_token_ids`` and the prefill arrays
``generated_offsets``       int64, [R+1]  cuts ``generated_token_ids``
``decode_offsets``          int64, [R+1]  cuts the decode arrays
``prompt_token_ids``        int32, [P]    prompt ids (text prompts are encoded WITHOUT
                                          special tokens, as the Generator encodes them)
``generated_token_ids``     int32, [G]    generated ids, a stop token that ended the
                                          request included
``prefill_experts``         int32, [L,P,k]  top-k expert ids, descending router probability
``prefill_weights``         float32, [L,P,k]  their gate weights (what the MoE layer mixes
                                          the k expert outputs with)
``decode_experts``          int32, [L,D,k]  as ``prefill_experts``, for the decode tokens
``decode_weights``          float32, [L,D,k]  as ``prefill_weights``
``prefill_router_inputs``   float32, [L,P,d]  optional (both or neither): the router input
``decode_router_inputs``    float32, [L,D,d]  of every token at every layer
==========================  ============  ===================================================

A request that ran has at least one prompt token and one generated token, and
``decode_offsets`` advance by (generated tokens - 1). An errored request (a bad input
line or an invalid request; ``errors`` says why) has no tokens at all, so that the
trace's requests stay one-to-one with the input lines.

Size: uncompressed, each token that ran costs :func:`bytes_per_token` =
``L * (8 * k + (4 * d with router inputs)) + 4`` bytes (4-byte expert ids and weights, the
router input, and the token id itself); each request adds 4 bytes for its last
generated token, 24 bytes of offsets and 4 bytes per character of its id, domain and
error (numpy's UCS-4 strings, padded to the longest). E.g. the demo model (L=4, k=2,
d=128): 68 B/token, 2116 B/token with router inputs; Qwen3-30B-A3B (L=48, k=8,
d=2048): 3076 B/token, about 396 KB/token with router inputs.

API: :func:`from_results` (Generator results -> :class:`Trace`), :func:`save`,
:func:`load` (checks version, dtypes, shapes, offsets and id ranges; a malformed file
raises :class:`TraceFormatError` naming the key), :meth:`Trace.request` /
:attr:`Trace.requests` (:class:`RequestTrace`: one request's arrays, shaped as in its
Generator result) and :func:`activation_counts` (per-request, per-layer expert counts).
"""

from __future__ import annotations

import dataclasses
import os
import types
import zipfile
from typing import Any, BinaryIO, Mapping, Sequence

import numpy as np

from moejax.config import ModelConfig

FORMAT = "moejax-expert-trace"
VERSION = 1
FINISH_REASONS = ("stop", "length")

_META_INTS = ("num_layers", "top_k", "num_experts")
_META_STRS = ("format", "model")
_REQUEST_STRS = ("request_ids", "domains", "finish_reasons", "errors")
_OFFSETS = ("prompt_offsets", "generated_offsets", "decode_offsets")
_TOKEN_IDS = {"prompt_token_ids": "prompt_offsets", "generated_token_ids": "generated_offsets"}
_PHASES = ("prefill", "decode")
_ROUTER_INPUTS = tuple(f"{phase}_router_inputs" for phase in _PHASES)
_ROUTING = tuple(f"{phase}_{kind}" for phase in _PHASES for kind in ("experts", "weights"))
REQUIRED_KEYS = (("version",) + _META_STRS + _META_INTS + _REQUEST_STRS + _OFFSETS
                 + tuple(_TOKEN_IDS) + _ROUTING)
"""The keys every trace file holds."""
KEYS = REQUIRED_KEYS + _ROUTER_INPUTS
"""Every key a trace file may hold (the router inputs are optional)."""


class TraceFormatError(ValueError):
    """A trace file or trace arrays that do not follow the format (the message names the
    key and, from :func:`load`, the file)."""


def bytes_per_token(num_layers: int, k: int, d: int, router_inputs: bool) -> int:
    """Bytes of a trace per token that ran through the model (see the module docstring):
    per layer k expert ids and k gate weights (4 bytes each) and, with router inputs, the
    d float32 router input; plus the 4-byte token id."""
    per_layer = 8 * k + (4 * d if router_inputs else 0)
    return num_layers * per_layer + 4


# ----------------------------------------------------------------------------- one request
@dataclasses.dataclass(frozen=True, eq=False)
class RequestTrace:
    """One request of a trace; arrays shaped as in its Generator result: ``prefill_*``
    [L, n_prompt, ...], ``decode_*`` [L, n_generated - 1, ...] ([L, 0, ...] for an errored
    request, which has no tokens). Router inputs are None when the trace has none."""

    id: str
    domain: str | None
    prompt_token_ids: np.ndarray
    generated_token_ids: np.ndarray
    prefill_experts: np.ndarray
    prefill_weights: np.ndarray
    decode_experts: np.ndarray
    decode_weights: np.ndarray
    prefill_router_inputs: np.ndarray | None = None
    decode_router_inputs: np.ndarray | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the request ran (it has tokens and routing)."""
        return self.error is None

    @property
    def num_decode_tokens(self) -> int:
        """Generated tokens that ran through the model (all but the last one)."""
        return max(len(self.generated_token_ids) - 1, 0)

    @classmethod
    def failed(cls, request_id: str | int | None, error: str, *, num_layers: int, top_k: int,
               router_input_dim: int | None = None, domain: str | None = None
               ) -> RequestTrace:
        """An errored request: its id, domain and error, no tokens."""
        empty_ids = np.zeros((num_layers, 0, top_k), np.int32)
        empty_weights = np.zeros((num_layers, 0, top_k), np.float32)
        empty_inputs = (None if router_input_dim is None
                        else np.zeros((num_layers, 0, router_input_dim), np.float32))
        return cls(id=id_text(request_id), domain=domain,
                   prompt_token_ids=np.zeros(0, np.int32),
                   generated_token_ids=np.zeros(0, np.int32),
                   prefill_experts=empty_ids, prefill_weights=empty_weights,
                   decode_experts=empty_ids, decode_weights=empty_weights,
                   prefill_router_inputs=empty_inputs, decode_router_inputs=empty_inputs,
                   error=error)


def id_text(request_id: str | int | None) -> str:
    """A request id as a trace stores it: a str as is, an int in decimal, None as ""."""
    if request_id is None:
        return ""
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int, np.integer)):
        raise TypeError(f"a request id must be a str, an int or None, got "
                        f"{type(request_id).__name__}")
    return str(request_id) if isinstance(request_id, str) else int.__repr__(int(request_id))


def request_trace(result: Any, prompt_token_ids: Sequence[int] | None,
                  domain: str | None = None, *, router_inputs: bool = False,
                  num_layers: int | None = None, top_k: int | None = None,
                  router_input_dim: int | None = None) -> RequestTrace:
    """The :class:`RequestTrace` of one ``serving.GenerationResult`` (from a Generator
    made with ``trace_experts=True``, and ``trace_router_inputs=True`` for
    ``router_inputs``) and its prompt ids. An errored result needs no prompt ids but
    ``num_layers`` and ``top_k`` (and ``router_input_dim`` with router inputs)."""
    if result.error is not None:
        if num_layers is None or top_k is None:
            raise ValueError("an errored result needs num_layers and top_k")
        return RequestTrace.failed(result.id, str(result.error), num_layers=num_layers,
                                   top_k=top_k, domain=domain,
                                   router_input_dim=router_input_dim if router_inputs else None)
    label = f"result {id_text(result.id)!r}" if result.id is not None else "result"
    experts = result.experts
    if experts is None:
        raise ValueError(f"{label}: has no expert trace (make the Generator with "
                         f"trace_experts=True)")
    if prompt_token_ids is None or len(prompt_token_ids) != result.prompt_tokens:
        got = "none" if prompt_token_ids is None else len(prompt_token_ids)
        raise ValueError(f"{label}: {result.prompt_tokens} prompt tokens, but {got} prompt "
                         f"ids were given")
    names = ["prefill", "prefill_weights", "decode", "decode_weights"]
    if router_inputs:
        names += ["prefill_router_inputs", "decode_router_inputs"]
    missing = [name for name in names if name not in experts]
    if missing:
        hint = " (trace_router_inputs=True)" if "prefill_router_inputs" in missing else ""
        raise ValueError(f"{label}: its expert trace has no {', '.join(missing)}{hint}")
    inputs = ({phase: np.asarray(experts[f"{phase}_router_inputs"], np.float32)
               for phase in _PHASES} if router_inputs else {})
    return RequestTrace(
        id=id_text(result.id), domain=domain,
        prompt_token_ids=np.asarray(prompt_token_ids, np.int32),
        generated_token_ids=np.asarray(result.token_ids, np.int32),
        prefill_experts=np.asarray(experts["prefill"], np.int32),
        prefill_weights=np.asarray(experts["prefill_weights"], np.float32),
        decode_experts=np.asarray(experts["decode"], np.int32),
        decode_weights=np.asarray(experts["decode_weights"], np.float32),
        prefill_router_inputs=inputs.get("prefill"), decode_router_inputs=inputs.get("decode"),
        finish_reason=result.finish_reason)


# ----------------------------------------------------------------------------- the trace
@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """A whole trace: ``arrays`` holds exactly the keys of the file (module docstring),
    checked on construction and kept read-only. Build one with :func:`from_results` or
    :meth:`from_requests`; read one with :func:`load`."""

    arrays: Mapping[str, np.ndarray]

    def __post_init__(self) -> None:
        validate(self.arrays)
        frozen = {}
        for key, value in self.arrays.items():
            view = value.view()
            view.setflags(write=False)
            frozen[key] = view
        object.__setattr__(self, "arrays", types.MappingProxyType(frozen))

    # ------------------------------------------------------------------ building
    @classmethod
    def from_requests(cls, requests: Sequence[RequestTrace], *, num_layers: int, top_k: int,
                      num_experts: int, router_input_dim: int | None = None,
                      model: str = "") -> Trace:
        """Concatenate request traces (``router_input_dim`` = d when they carry router
        inputs, None when not)."""
        for index, req in enumerate(requests):
            _check_request(req, index, num_layers, top_k, router_input_dim)
        arrays = _metadata(num_layers, top_k, num_experts, model)
        arrays.update(_request_strings(requests))
        arrays.update(_ragged(requests, num_layers, top_k, router_input_dim))
        return cls(arrays)

    # ------------------------------------------------------------------ metadata
    def _int(self, key: str) -> int:
        return int(self.arrays[key])

    @property
    def num_layers(self) -> int:
        return self._int("num_layers")

    @property
    def top_k(self) -> int:
        return self._int("top_k")

    @property
    def num_experts(self) -> int:
        return self._int("num_experts")

    @property
    def model(self) -> str:
        return str(self.arrays["model"])

    @property
    def num_requests(self) -> int:
        return len(self.arrays["request_ids"])

    def __len__(self) -> int:
        return self.num_requests

    @property
    def has_router_inputs(self) -> bool:
        return "prefill_router_inputs" in self.arrays

    @property
    def router_input_dim(self) -> int | None:
        """d when the trace holds router inputs, else None."""
        return self.arrays["prefill_router_inputs"].shape[2] if self.has_router_inputs else None

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.arrays["prompt_token_ids"])

    @property
    def num_decode_tokens(self) -> int:
        return self.arrays["decode_experts"].shape[1]

    @property
    def ids(self) -> list[str]:
        return self.arrays["request_ids"].tolist()

    @property
    def domains(self) -> list[str | None]:
        return [domain or None for domain in self.arrays["domains"].tolist()]

    @property
    def bytes_per_token(self) -> int:
        """:func:`bytes_per_token` of this trace's shape."""
        return bytes_per_token(self.num_layers, self.top_k, self.router_input_dim or 0,
                               self.has_router_inputs)

    # ------------------------------------------------------------------ requests
    def span(self, phase: str, index: int) -> slice:
        """The token range of request ``index`` in the ``phase`` arrays ("prefill",
        "decode" or "generated")."""
        key = {"prefill": "prompt_offsets", "decode": "decode_offsets",
               "generated": "generated_offsets"}[phase]
        offsets = self.arrays[key]
        return slice(int(offsets[index]), int(offsets[index + 1]))

    def request(self, index: int) -> RequestTrace:
        """Request ``index`` (negative counts from the end) as a :class:`RequestTrace`."""
        if not -self.num_requests <= index < self.num_requests:
            raise IndexError(f"request {index} of a trace of {self.num_requests}")
        index %= self.num_requests
        a, prefill, decode = self.arrays, self.span("prefill", index), self.span("decode", index)
        error = str(a["errors"][index])
        router = ({phase: a[f"{phase}_router_inputs"][:, span]
                   for phase, span in (("prefill", prefill), ("decode", decode))}
                  if self.has_router_inputs else {})
        return RequestTrace(
            id=str(a["request_ids"][index]), domain=str(a["domains"][index]) or None,
            prompt_token_ids=a["prompt_token_ids"][prefill],
            generated_token_ids=a["generated_token_ids"][self.span("generated", index)],
            prefill_experts=a["prefill_experts"][:, prefill],
            prefill_weights=a["prefill_weights"][:, prefill],
            decode_experts=a["decode_experts"][:, decode],
            decode_weights=a["decode_weights"][:, decode],
            prefill_router_inputs=router.get("prefill"), decode_router_inputs=router.get("decode"),
            finish_reason=str(a["finish_reasons"][index]) or None, error=error or None)

    @property
    def requests(self) -> list[RequestTrace]:
        """Every request, in order."""
        return [self.request(i) for i in range(self.num_requests)]


def from_results(results: Sequence[Any], prompts: Sequence[Sequence[int] | None],
                 domains: Sequence[str | None] | None = None, *, config: ModelConfig,
                 router_inputs: bool = False, model: str = "") -> Trace:
    """A :class:`Trace` of ``serving.Generator`` results (``trace_experts=True``; and
    ``trace_router_inputs=True`` for ``router_inputs``), in order. ``prompts[i]`` is
    result i's prompt token ids (ignored for an errored result: it is recorded with its
    error and no tokens); ``domains[i]`` its label or None."""
    if len(prompts) != len(results) or (domains is not None and len(domains) != len(results)):
        raise ValueError(f"{len(results)} results, {len(prompts)} prompts"
                         + ("" if domains is None else f", {len(domains)} domains"))
    dim = config.hidden_size if router_inputs else None
    requests = [request_trace(result, prompt, None if domains is None else domains[i],
                              router_inputs=router_inputs, num_layers=config.num_layers,
                              top_k=config.num_experts_per_tok, router_input_dim=dim)
                for i, (result, prompt) in enumerate(zip(results, prompts))]
    return Trace.from_requests(requests, num_layers=config.num_layers,
                               top_k=config.num_experts_per_tok,
                               num_experts=config.num_experts, router_input_dim=dim,
                               model=model)


def activation_counts(trace: Trace, phase: str = "prefill") -> np.ndarray:
    """Per-request expert activation counts [R, L, E] int64 of one phase ("prefill" or
    "decode"): how many of the request's tokens chose expert e at layer l (each token
    counts once for each of its k experts; gate weights are ignored)."""
    if phase not in _PHASES:
        raise ValueError(f"phase must be one of {_PHASES}, got {phase!r}")
    ids = trace.arrays[f"{phase}_experts"]                      # [L, N, k]
    offsets = trace.arrays["prompt_offsets" if phase == "prefill" else "decode_offsets"]
    num_layers, (R, E) = trace.num_layers, (trace.num_requests, trace.num_experts)
    owner = np.repeat(np.arange(R), np.diff(offsets))          # [N]: request of each token
    layer = np.arange(num_layers)[:, None, None]
    flat = (owner[None, :, None] * num_layers + layer) * E + ids
    return np.bincount(flat.reshape(-1), minlength=R * num_layers * E).reshape(R, num_layers, E)


# ----------------------------------------------------------------------------- assembling
def _check_request(req: RequestTrace, index: int, num_layers: int, top_k: int,
                   router_input_dim: int | None) -> None:
    """A request's arrays have the trace's shape (so a mistake names the request)."""
    label = f"request {index} ({req.id!r})"
    n, m = len(req.prompt_token_ids), req.num_decode_tokens
    want = {"prefill_experts": (num_layers, n, top_k), "prefill_weights": (num_layers, n, top_k),
            "decode_experts": (num_layers, m, top_k), "decode_weights": (num_layers, m, top_k)}
    if router_input_dim is not None:
        want.update(prefill_router_inputs=(num_layers, n, router_input_dim),
                    decode_router_inputs=(num_layers, m, router_input_dim))
    elif req.prefill_router_inputs is not None or req.decode_router_inputs is not None:
        raise ValueError(f"{label}: has router inputs, but the trace is made without them")
    for name, shape in want.items():
        value = getattr(req, name)
        if value is None:
            raise ValueError(f"{label}: {name}: missing (the trace has router inputs)")
        if np.shape(value) != shape:
            raise ValueError(f"{label}: {name}: shape {np.shape(value)}, expected {shape} "
                             f"(L, tokens, k or d)")


def _metadata(num_layers: int, top_k: int, num_experts: int, model: str) -> dict[str, np.ndarray]:
    return {"format": np.array(FORMAT), "version": np.array(VERSION, np.int64),
            "model": _string_array([model], "model").reshape(()),
            "num_layers": np.array(num_layers, np.int64), "top_k": np.array(top_k, np.int64),
            "num_experts": np.array(num_experts, np.int64)}


def _string_array(values: Sequence[str], key: str) -> np.ndarray:
    """A numpy str array of ``values``; numpy drops trailing NUL characters, so a value
    that would not come back exactly is refused (named by key and index)."""
    array = np.array(list(values), dtype=str) if values else np.zeros(0, "<U1")
    for i, (stored, value) in enumerate(zip(array.tolist(), values)):
        if stored != value:
            raise ValueError(f"{key}[{i}]: {value!r} ends with a NUL character, which a "
                             f"trace cannot store")
    return array


def _request_strings(requests: Sequence[RequestTrace]) -> dict[str, np.ndarray]:
    columns = {"request_ids": [r.id for r in requests],
               "domains": [r.domain or "" for r in requests],
               "finish_reasons": [r.finish_reason or "" for r in requests],
               "errors": [r.error or "" for r in requests]}
    return {key: _string_array(values, key) for key, values in columns.items()}


def _offsets(counts: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)


def _concat(parts: list[np.ndarray], empty_shape: tuple[int, ...], dtype: Any,
            axis: int) -> np.ndarray:
    if not parts:
        return np.zeros(empty_shape, dtype)
    return np.concatenate([np.asarray(p, dtype) for p in parts], axis=axis)


def _ragged(requests: Sequence[RequestTrace], num_layers: int, top_k: int,
            router_input_dim: int | None) -> dict[str, np.ndarray]:
    """Offsets and concatenated per-token arrays."""
    arrays = {"prompt_offsets": _offsets([len(r.prompt_token_ids) for r in requests]),
              "generated_offsets": _offsets([len(r.generated_token_ids) for r in requests]),
              "decode_offsets": _offsets([r.num_decode_tokens for r in requests])}
    for key in _TOKEN_IDS:
        arrays[key] = _concat([getattr(r, key) for r in requests], (0,), np.int32, 0)
    for phase in _PHASES:
        for kind, dtype, width in (("experts", np.int32, top_k), ("weights", np.float32, top_k),
                                   ("router_inputs", np.float32, router_input_dim)):
            if width is None:
                continue
            key = f"{phase}_{kind}"
            arrays[key] = _concat([getattr(r, key) for r in requests],
                                  (num_layers, 0, width), dtype, 1)
    return arrays


# ----------------------------------------------------------------------------- checking
def _fail(key: str, problem: str) -> TraceFormatError:
    return TraceFormatError(f"key {key!r}: {problem}")


def _check_array(arrays: Mapping[str, np.ndarray], key: str, dtype: Any,
                 shape: tuple[int | None, ...]) -> np.ndarray:
    """``arrays[key]`` of dtype ``dtype`` (a numpy dtype, or "U" for str) and ``shape``
    (None: any length on that axis)."""
    value = arrays[key]
    if not isinstance(value, np.ndarray):
        raise _fail(key, f"expected a numpy array, got {type(value).__name__}")
    if dtype == "U":
        if value.dtype.kind != "U":
            raise _fail(key, f"dtype {value.dtype}, expected str")
    elif value.dtype != np.dtype(dtype):
        raise _fail(key, f"dtype {value.dtype}, expected {np.dtype(dtype)}")
    if len(value.shape) != len(shape) or any(
            want is not None and got != want for got, want in zip(value.shape, shape)):
        shown = tuple("*" if s is None else s for s in shape)
        raise _fail(key, f"shape {value.shape}, expected {shown}")
    return value


def _check_header(arrays: Mapping[str, np.ndarray]) -> None:
    for key in ("format", "version"):
        if key not in arrays:
            raise _fail(key, "missing: not a moejax expert trace")
    fmt = _check_array(arrays, "format", "U", ())
    if str(fmt) != FORMAT:
        raise _fail("format", f"{str(fmt)!r}, expected {FORMAT!r}: not a moejax expert trace")
    version = _check_array(arrays, "version", np.int64, ())
    if int(version) != VERSION:
        raise _fail("version", f"the file is version {int(version)}; this reader reads "
                               f"version {VERSION}")


def _check_keys(arrays: Mapping[str, np.ndarray]) -> None:
    missing = [key for key in REQUIRED_KEYS if key not in arrays]
    if missing:
        raise _fail(missing[0], "missing" + (f" (and {', '.join(map(repr, missing[1:]))})"
                                             if missing[1:] else ""))
    unknown = sorted(set(arrays) - set(KEYS))
    if unknown:
        raise _fail(unknown[0], f"unknown in format version {VERSION}")
    inputs = [key for key in _ROUTER_INPUTS if key in arrays]
    if len(inputs) == 1:
        other = next(key for key in _ROUTER_INPUTS if key not in arrays)
        raise _fail(other, f"missing (router inputs come in pairs: {inputs[0]!r} is there)")


def _check_meta(arrays: Mapping[str, np.ndarray]) -> dict[str, int]:
    _check_array(arrays, "model", "U", ())
    meta = {key: int(_check_array(arrays, key, np.int64, ())) for key in _META_INTS}
    for key, value in meta.items():
        if value < 1:
            raise _fail(key, f"must be >= 1, got {value}")
    if meta["top_k"] > meta["num_experts"]:
        raise _fail("top_k", f"{meta['top_k']} is more than num_experts {meta['num_experts']}")
    return meta


def _check_offsets(arrays: Mapping[str, np.ndarray], key: str, num_requests: int) -> np.ndarray:
    offsets = _check_array(arrays, key, np.int64, (num_requests + 1,))
    if offsets[0] != 0:
        raise _fail(key, f"must start at 0, starts at {offsets[0]}")
    steps = np.diff(offsets)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise _fail(key, f"must not decrease: [{i}] = {offsets[i]} > [{i + 1}] = "
                         f"{offsets[i + 1]}")
    return offsets


def _check_requests(arrays: Mapping[str, np.ndarray]) -> None:
    """Per-request strings and offsets, and that they agree: a request that ran has
    prompt and generated tokens and a finish reason, an errored one none of them, and
    every request has one decode token fewer than it generated (none with none)."""
    num_requests = len(_check_array(arrays, "request_ids", "U", (None,)))
    strings = {key: _check_array(arrays, key, "U", (num_requests,)) for key in _REQUEST_STRS}
    counts = {key: np.diff(_check_offsets(arrays, key, num_requests)) for key in _OFFSETS}
    prompt, generated = counts["prompt_offsets"], counts["generated_offsets"]
    decode, failed = counts["decode_offsets"], strings["errors"] != ""
    _first_bad("decode_offsets", decode != np.maximum(generated - 1, 0),
               "decode tokens must be one fewer than the generated tokens (0 for none)")
    _first_bad("errors", failed & ((prompt > 0) | (generated > 0)
                                   | (strings["finish_reasons"] != "")),
               "failed but has tokens or a finish reason")
    _first_bad("finish_reasons", ~failed & ~np.isin(strings["finish_reasons"], FINISH_REASONS),
               f"must be one of {FINISH_REASONS} for a request that ran")
    _first_bad("prompt_offsets", ~failed & (prompt < 1), "ran but has no prompt tokens")
    _first_bad("generated_offsets", ~failed & (generated < 1),
               "ran but has no generated tokens")


def _first_bad(key: str, bad: np.ndarray, problem: str) -> None:
    if bad.any():
        raise _fail(key, f"request {int(np.argmax(bad))}: {problem}")


def _check_tokens(arrays: Mapping[str, np.ndarray], meta: dict[str, int],
                  router_input_dim: int | None) -> None:
    for key, offsets_key in _TOKEN_IDS.items():
        ids = _check_array(arrays, key, np.int32, (int(arrays[offsets_key][-1]),))
        if ids.size and ids.min() < 0:
            raise _fail(key, f"negative token id {ids.min()}")
    L, k, E = meta["num_layers"], meta["top_k"], meta["num_experts"]
    for phase, offsets_key in (("prefill", "prompt_offsets"), ("decode", "decode_offsets")):
        n = int(arrays[offsets_key][-1])
        ids = _check_array(arrays, f"{phase}_experts", np.int32, (L, n, k))
        if ids.size and (ids.min() < 0 or ids.max() >= E):
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise _fail(f"{phase}_experts", f"expert id {bad} outside [0, {E})")
        weights = _check_array(arrays, f"{phase}_weights", np.float32, (L, n, k))
        _check_finite(weights, f"{phase}_weights")
        key = f"{phase}_router_inputs"
        if key in arrays:
            inputs = _check_array(arrays, key, np.float32, (L, n, router_input_dim))
            _check_finite(inputs, key)


def _check_finite(value: np.ndarray, key: str) -> None:
    if not np.isfinite(value).all():
        raise _fail(key, "holds a NaN or an infinity")


def validate(arrays: Mapping[str, np.ndarray]) -> None:
    """Check trace arrays against the format (module docstring); raises
    :class:`TraceFormatError` naming the first offending key."""
    _check_header(arrays)
    _check_keys(arrays)
    meta = _check_meta(arrays)
    _check_requests(arrays)
    dim = None
    if "prefill_router_inputs" in arrays:
        dim = _check_array(arrays, "prefill_router_inputs", np.float32, (None,) * 3).shape[2]
        if dim < 1:
            raise _fail("prefill_router_inputs", "router inputs of width 0")
    _check_tokens(arrays, meta, dim)


# ----------------------------------------------------------------------------- files
def save(path: str | os.PathLike | BinaryIO, trace: Trace) -> None:
    """Write ``trace`` as an uncompressed ``.npz`` to ``path`` (exactly that name: no
    ``.npz`` is appended) or to a binary file object."""
    if hasattr(path, "write"):
        np.savez(path, **trace.arrays)
        return
    with open(path, "wb") as fh:
        np.savez(fh, **trace.arrays)


def _read_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` (no pickles), or a TraceFormatError naming the key."""
    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise TraceFormatError(f"not an .npz file ({exc})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise TraceFormatError("a single .npy array, not an .npz trace")
    with archive:
        arrays = {}
        for key in archive.files:
            try:
                arrays[key] = archive[key]
            except (ValueError, EOFError, zipfile.BadZipFile) as exc:
                raise _fail(key, f"unreadable ({exc})") from None
    return arrays


def load(path: str | os.PathLike) -> Trace:
    """Read a trace written by :func:`save` (or ``moejax trace``); raises
    :class:`TraceFormatError` (a ValueError) naming the file and key when it is
    malformed, OSError (FileNotFoundError, ...) when it cannot be read."""
    try:
        return Trace(_read_arrays(path))
    except TraceFormatError as exc:
        raise TraceFormatError(f"{os.fspath(path)}: {exc}") from None
