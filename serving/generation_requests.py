"""Generation requests and results: the request schema, its validation into a
:class:`moejax.sequences.SequenceSpec` (one field checker for scoring and generation,
:class:`serving.requests.FieldChecker`), the model's stop ids, and the result and event
records a :class:`serving.Generator` returns (field rules: ``serving.generate``'s module
docstring)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import numpy as np

from moejax.sampling import MAX_SEED
from moejax.sequences import SequenceSpec
from serving.requests import (FLOAT32, FieldChecker, RequestError, TokenizerAdapter,
                              request_label, show, unexpected_error, unknown_fields)

DEFAULT_MAX_NEW_TOKENS = 16
MAX_DOMAIN_CHARS = 256


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One generation request, as the user wrote it (see the module docstring)."""

    id: str | int | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    domain: str | None = None
    # A text prompt starts with the tokenizer's special prefix (a BOS) as its config says
    # (None), never (False) or always (True).
    add_special_tokens: bool | None = None


_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationRequest))


@dataclasses.dataclass
class GenerationResult:
    """The answer to one request. ``experts`` is set only with ``trace_experts``."""

    id: str | int | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    experts: dict[str, np.ndarray] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``experts`` (nested lists [L][n][k]) appears only when set."""
        d: dict[str, Any] = {"id": self.id, "token_ids": self.token_ids, "text": self.text,
                             "finish_reason": self.finish_reason, "error": self.error,
                             "prompt_tokens": self.prompt_tokens}
        if self.experts is not None:
            d["experts"] = {name: np.asarray(ids).tolist() for name, ids in self.experts.items()}
        return d


def model_eos_ids(model_dir: str, vocab_size: int) -> frozenset[int]:
    """The model's EOS id(s): generation_config.json wins over config.json (as in
    transformers); ids outside the vocabulary are dropped (they cannot be generated)."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as fh:
                config = json.load(fh)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(f"{path}: not a valid JSON file ({exc})") from None
        eos = config.get("eos_token_id") if isinstance(config, dict) else None
        if eos is None:
            continue
        ids = eos if isinstance(eos, list) else [eos]
        return frozenset(int(t) for t in ids if isinstance(t, int) and 0 <= t < vocab_size)
    return frozenset()


# ----------------------------------------------------------------------------- parsing
def as_generation_request(obj: Any, index: int) -> GenerationRequest:
    """A dict (JSON object) or a GenerationRequest -> GenerationRequest; unknown keys are
    an error (they are usually typos)."""
    if isinstance(obj, GenerationRequest):
        return obj
    if not isinstance(obj, Mapping):
        raise RequestError(f"{request_label(None, index)}: expected an object (dict), "
                           f"got {type(obj).__name__}", index=index)
    unknown = unknown_fields(obj, _FIELDS)
    if unknown:
        raise RequestError(f"{request_label(obj.get('id'), index)}: unknown field(s) "
                           f"{', '.join(show(k) for k in unknown)} (accepted: "
                           f"{', '.join(_FIELDS)})", index=index, field=unknown[0])
    return GenerationRequest(**{name: obj[name] for name in _FIELDS if name in obj})


def _prompt_ids(check: FieldChecker, req: GenerationRequest, tokenizer: TokenizerAdapter,
                vocab_size: int) -> list[int]:
    """Exactly one of prompt / prompt_token_ids, as non-empty vocabulary ids."""
    if (req.prompt is None) == (req.prompt_token_ids is None):
        raise check.fail("prompt", "give exactly one of prompt or prompt_token_ids (got "
                                   f"{'neither' if req.prompt is None else 'both'})")
    if req.prompt_token_ids is not None:
        return check.token_ids(req.prompt_token_ids, "prompt_token_ids", vocab_size=vocab_size)
    if not isinstance(req.prompt, str):
        raise check.fail("prompt", f"must be a str, got {type(req.prompt).__name__}")
    if not req.prompt:
        raise check.fail("prompt", "is empty")
    if req.add_special_tokens is not None and not isinstance(req.add_special_tokens, bool):
        raise check.fail("add_special_tokens", f"must be true or false, got "
                                               f"{type(req.add_special_tokens).__name__}")
    try:
        ids = tokenizer.encode_prompt(req.prompt, req.add_special_tokens)
    except Exception as exc:  # noqa: BLE001  (any tokenizer failure is this request's only)
        raise check.fail("prompt", str(exc)) from exc
    if not ids:
        raise check.fail("prompt", f"{req.prompt!r} tokenizes to no tokens")
    return check.token_ids(ids, "prompt (tokenized)", vocab_size=vocab_size)


def parse_generation_request(obj: Any, index: int, tokenizer: TokenizerAdapter, *,
                             vocab_size: int, max_context: int,
                             default_stop: frozenset[int]) -> SequenceSpec:
    """Validate and tokenize one request -> :class:`SequenceSpec`; raises RequestError
    (only: anything else a request makes the checks raise becomes one, so that one bad
    request never sinks the batch)."""
    try:
        return _parse(obj, index, tokenizer, vocab_size=vocab_size, max_context=max_context,
                      default_stop=default_stop)
    except RequestError:
        raise
    except Exception as exc:  # noqa: BLE001  (safety net)
        raise RequestError(unexpected_error(obj, index, exc), index=index) from exc


def _parse(obj: Any, index: int, tokenizer: TokenizerAdapter, *, vocab_size: int,
           max_context: int, default_stop: frozenset[int]) -> SequenceSpec:
    """:func:`parse_generation_request` without the safety net."""
    req = as_generation_request(obj, index)
    check = FieldChecker(req.id, index)
    check.request_id(req.id)
    prompt = _prompt_ids(check, req, tokenizer, vocab_size)
    max_new = DEFAULT_MAX_NEW_TOKENS if req.max_new_tokens is None else check.integer(
        req.max_new_tokens, "max_new_tokens", 1)
    if len(prompt) + max_new > max_context:
        raise check.fail("max_new_tokens", f"prompt ({len(prompt)} tokens) + max_new_tokens "
                                           f"({max_new}) = {len(prompt) + max_new}, more than "
                                           f"the model's context ({max_context})")
    temperature = 0.0 if req.temperature is None else check.number(req.temperature,
                                                                    "temperature")
    if temperature < 0:
        raise check.fail("temperature", f"must be >= 0 (0 = greedy), got {temperature}")
    if 0 < temperature < FLOAT32.tiny:
        # A subnormal float32 (or 0 after rounding) would not divide the logits sanely.
        raise check.fail("temperature", f"must be 0 (greedy) or at least {FLOAT32.tiny:.7g} "
                                        f"(the smallest normal float32), got {temperature:g}")
    top_p = 1.0 if req.top_p is None else check.number(req.top_p, "top_p")
    if not 0 < top_p <= 1:
        raise check.fail("top_p", f"must lie in (0, 1], got {top_p}")
    if np.float32(top_p) == 0:
        raise check.fail("top_p", f"must not round to 0 in float32, got {top_p:g}")
    seed = 0 if req.seed is None else check.integer(req.seed, "seed", 0, MAX_SEED)
    stop = default_stop if req.stop_token_ids is None else frozenset(
        check.token_ids(req.stop_token_ids, "stop_token_ids", vocab_size=vocab_size,
                        allow_empty=True))
    domain = req.domain
    if domain is not None and (not isinstance(domain, str) or len(domain) > MAX_DOMAIN_CHARS):
        raise check.fail("domain", f"must be a string of at most {MAX_DOMAIN_CHARS} "
                                   f"characters, got {show(domain)}")
    return SequenceSpec(prompt=tuple(prompt), max_new_tokens=max_new, temperature=temperature,
                        top_p=top_p, seed=seed, stop_token_ids=stop, domain=domain)


@dataclasses.dataclass(frozen=True)
class GenerationEvent:
    """New tokens of request ``index`` (its position in the ``stream`` call, or the
    handle's for a loop submission); ``result`` is set on the request's last event."""

    index: int
    token_ids: list[int]
    result: GenerationResult | None = None
