"""Shared output of the benchmark scripts: ``--json PATH`` writes one flat JSON object of
named figures (every printed ratio included), so runs can be compared and recorded."""

from __future__ import annotations

import json
from typing import Any, Mapping


def write_json(path: str | None, figures: Mapping[str, Any]) -> None:
    """Write ``figures`` to ``path`` (nothing when ``path`` is None or empty)."""
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(figures, fh, indent=2)
