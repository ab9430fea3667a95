"""Serving layer of moejax: request handling, batching, scoring and generation.

Public API: :class:`Scorer` (``Scorer(model="demo" | dir, **options).score(requests)``),
:class:`ScoreRequest`, :class:`ScoreResult`; :class:`Generator`
(``Generator(model="demo" | dir, **options).generate(requests)``), :class:`GenerationResult`;
:func:`enable_compilation_cache` (JAX's persistent compilation cache, process-wide).

The names are imported on first use (PEP 562), not with the package: a command that only
talks to a server (``moejax score --target``, ``moejax client``) starts without loading
JAX and the model code, which is most of a cold start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it.
_EXPORTS = {
    "Scorer": "serving.api",
    "enable_compilation_cache": "serving.compilation_cache",
    "GenerationRequest": "serving.generate",
    "GenerationResult": "serving.generate",
    "Generator": "serving.generate",
    "RequestError": "serving.requests",
    "ScoreRequest": "serving.requests",
    "ScoreResult": "serving.requests",
}

__all__ = ["Scorer", "ScoreRequest", "ScoreResult", "RequestError", "Generator",
           "GenerationRequest", "GenerationResult", "enable_compilation_cache"]

if TYPE_CHECKING:
    from serving.api import Scorer
    from serving.compilation_cache import enable_compilation_cache
    from serving.generate import GenerationRequest, GenerationResult, Generator
    from serving.requests import RequestError, ScoreRequest, ScoreResult


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value       # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
