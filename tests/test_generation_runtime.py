"""The Generator's runtime is looked up by name from its options
(``serving.generation_runtime``): each option set names exactly one runtime, and the
built Generator holds that one only."""

from __future__ import annotations

import pytest

from serving.generation_options import make_options
from serving.generation_runtime import RUNTIMES, runtime_name


@pytest.mark.parametrize("options, name", [
    ({}, "continuous"),
    ({"step": "layerwise"}, "continuous"),
    ({"backend": "offload", "prefetch": "layer"}, "continuous"),
    ({"decoders": 2}, "split"),
    ({"batching": "static"}, "static"),
    ({"runtime": "mu_queue", "devices": 2}, "mu_queue"),
])
def test_options_name_one_runtime(options, name):
    assert runtime_name(make_options(options)) == name
    assert name in RUNTIMES


def test_a_generator_holds_only_its_runtime(demo_generator):
    from serving import Generator

    assert demo_generator.runtime_name == "continuous"
    assert demo_generator.scheduler is not None
    assert demo_generator.engine is None and demo_generator.mu_queue is None
    static = Generator("demo", batching="static", dtype="float32", compilation_cache="off")
    assert static.runtime_name == "static" and static.engine is not None
    assert static.scheduler is None and static.mu_queue is None
