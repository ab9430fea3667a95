"""Serving layer of moejax: request handling, batching, scoring and generation.

Public API: :class:`Scorer` (``Scorer(model="demo" | dir, **options).score(requests)``),
:class:`ScoreRequest`, :class:`ScoreResult`; :class:`Generator`
(``Generator(model="demo" | dir, **options).generate(requests)``), :class:`GenerationResult`;
:func:`enable_compilation_cache` (JAX's persistent compilation cache, process-wide).
"""

from serving.api import Scorer
from serving.compilation_cache import enable_compilation_cache
from serving.generate import GenerationRequest, GenerationResult, Generator
from serving.requests import RequestError, ScoreRequest, ScoreResult

__all__ = ["Scorer", "ScoreRequest", "ScoreResult", "RequestError", "Generator",
           "GenerationRequest", "GenerationResult", "enable_compilation_cache"]
