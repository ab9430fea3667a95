"""``benchmarks/http_serving.py`` runs end to end (a reduced --quick) and reports the
issue's keys; the figures themselves are measurements, recorded in docs/PERF.md."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")


@pytest.mark.slow
def test_quick_run_reports_the_issue_keys(tmp_path):
    from benchmarks import http_serving

    path = tmp_path / "http.json"
    http_serving.main(["--quick", "--requests", "48", "--streams", "1", "--new-tokens", "4",
                       "--json", str(path)])
    figures = json.loads(path.read_text())
    for key in ("http_served_over_inprocess_32", "openai_stream_ttft_p50_ms",
                "openai_stream_tpot_p50_ms", "inprocess_ttft_p50_ms", "metrics_scrape_ms"):
        assert figures[key] > 0, key
    assert figures["metrics_scrapes"] >= 1
