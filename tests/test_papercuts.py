"""Issue 37's papercuts: the -v compile log, the examples, --decoders on CPU and candidate
tokenization boundaries."""

from __future__ import annotations

import logging

import pytest

from serving import Scorer
from serving.engine import SHAPE_KEY_FIELDS

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Candidates of several tokens and a "multi" request: ops that continue a shared prompt.
REQUESTS = [{"id": "product", "prompt": "7 * 8 =", "candidates": [" 54", " 56", " 63"]},
            {"id": "tags", "kind": "multi", "prompt": "Text: def area(w, h):\nWhich domains "
             "does it contain?", "candidates": ["code", "prose"]}]


@pytest.mark.parametrize("share_prompts", [True, False], ids=["prefix-pool", "plain"])
def test_compile_log_names_every_shape_field(caplog, share_prompts):
    """`moejax -v` logs each compiled shape; with the prefix pool on (the default) its key
    has seven fields, which the log line once formatted with five placeholders ("--- Logging
    error --- TypeError: not all arguments converted")."""
    scorer = Scorer("demo", share_prompts=share_prompts)
    with caplog.at_level(logging.INFO, logger="moejax.engine"):
        results = scorer.score(REQUESTS)
    assert [r.error for r in results] == [None] * len(REQUESTS)
    compiled = [r for r in caplog.records if r.name == "moejax.engine"
                and r.msg.startswith("compiled forward")]
    assert compiled, "no compile was logged"
    messages = [record.getMessage() for record in compiled]   # raised TypeError before
    for message in messages:
        for name in SHAPE_KEY_FIELDS[:5]:
            assert f" {name}=" in message, message
    pool_steps = [m for m in messages if " context_slots=" in m and " stored_rows=" in m]
    assert bool(pool_steps) == share_prompts, messages
