"""Serving layer of moejax: request handling, batching and scoring.

Public API: :class:`Scorer` (``Scorer(model="demo" | dir, **options).score(requests)``),
:class:`ScoreRequest`, :class:`ScoreResult`.
"""

from serving.api import Scorer
from serving.requests import RequestError, ScoreRequest, ScoreResult

__all__ = ["Scorer", "ScoreRequest", "ScoreResult", "RequestError"]
