"""One prefill→decode pipeline (``serving.pipeline_config``, built by
``serving.generation_runtime``): the matrix of prefill backend × decoder placement ×
decode replica router × decoder routing policy on 8 CPU host devices, each run's greedy
float32 tokens against one resident decoder's; the signature cache on multi-device
prefill stages; speculative prefetch against its own definition; the config file, the
CLI flag, and refusals naming both parts of a combination that cannot work.

Routing changes where a sequence decodes, never its tokens (every row of a step is
computed on its own; the hand-off copies the prompt's KV blocks between pools of any
layout), so every combination must give the resident tokens exactly. The matrix is
covered by a few pipelines that each hold several placements at once (round-robin and
the recording policy send requests to every decoder), since each distinct placement
compiles its own programs.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from benchmarks import pipeline as pipeline_bench
from moejax import checkpoint
from moejax.eldr import fitfile
from moejax.eldr.fitfile import EldrFit, FitError
from moejax.eldr.policies import Policy
from serving import Generator
from serving.generation_options import GeneratorOptions
from serving.api import resolve_model_dir
from serving.pipeline_config import (DecoderStage, PipelineConfig, PipelineError,
                                     PrefillStage, load)

LENGTHS = (5, 40, 17, 33, 9, 24, 12)
NEW_TOKENS = (6, 4, 7, 3, 5, 6, 2)
DOMAINS = ("a", "b", "a", "b", "a", "b", "a")
SMALL = {"dtype": "float32", "max_prefill_tokens": 32, "max_batch_size": 2,
         "compilation_cache": "off"}


def _requests() -> list[dict]:
    rng = np.random.default_rng(11)
    return [{"id": i, "prompt_token_ids": [int(t) for t in rng.integers(3, 1000, n)],
             "max_new_tokens": m, "stop_token_ids": [], "domain": d}
            for i, (n, m, d) in enumerate(zip(LENGTHS, NEW_TOKENS, DOMAINS))]


def _tokens(gen: Generator, count: int = len(LENGTHS)) -> list[list[int]]:
    results = gen.generate(_requests()[:count])
    assert [r.error for r in results] == [None] * count
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def resident() -> list[list[int]]:
    return _tokens(Generator("demo", **SMALL))


@pytest.fixture(scope="module")
def demo_fingerprint():
    cfg, params, _ = checkpoint.load_model_dir(resolve_model_dir("demo")[0], "float32")
    return cfg, fitfile.model_fingerprint(cfg, params["layers"]["router"])


def _fit_file(path, cfg, fingerprint, decoders: int):
    rng = np.random.default_rng(5)
    layers = tuple(range(min(3, cfg.num_layers)))
    fitfile.save(path, EldrFit(
        model="demo", fingerprint=fingerprint, num_layers=cfg.num_layers,
        num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        idf=rng.uniform(0.1, 2.0, (cfg.num_layers, cfg.num_experts)), layers=layers,
        centroids=rng.uniform(0, 1, (decoders, len(layers) * cfg.num_experts)),
        calibration_requests=10, rho=0.5))
    return path


class RecordingRoundRobin(Policy):
    """Round robin over the decoders, keeping every prompt's raw signature it is shown
    (it reads counts, so the prefill stage keeps the signature cache)."""

    name = "recording_round_robin"
    reads_counts = True

    def __init__(self, num_decoders: int):
        super().__init__(num_decoders)
        self.seen: list[np.ndarray] = []

    def _choose(self, request, loads):
        self.seen.append(np.asarray(request.counts))
        return (len(self.seen) - 1) % self.num_decoders


def _counts_by_sequence(gen: Generator, policy: RecordingRoundRobin) -> dict[int, np.ndarray]:
    routes = list(gen.scheduler.routes)
    assert len(routes) == len(policy.seen) == len(LENGTHS)
    return {route.seq_id: counts for route, counts in zip(routes, policy.seen)}


# Decoders of every placement, packed from device 0 (resident 0, offload 1, offload with
# exact prefetch 2, sync_ep without replicas 3-4, async_ep 5-6), and sync_ep decoders with
# replicas under each decode replica router beside others: the benchmark's.
EVERY_PLACEMENT = list(pipeline_bench.EVERY_PLACEMENT)
REPLICA_ROUTERS = list(pipeline_bench.REPLICA_ROUTERS)

MATRIX = [
    pytest.param({"backend": "resident"}, EVERY_PLACEMENT, "round_robin",
                 id="resident-prefill/every-placement/round_robin"),
    pytest.param({"backend": "async_ep", "devices": 2}, EVERY_PLACEMENT, "recording",
                 id="async_ep-prefill/every-placement/counts"),
    pytest.param({"backend": "sync_ep", "devices": 2, "replicas": 1.5, "router": "eplb_even"},
                 REPLICA_ROUTERS, "eldr", id="sync_ep-eplb-prefill/metro+eplb-decoders/eldr"),
    pytest.param({"backend": "offload"},
                 [{"placement": "async_ep", "devices": 2}, {"placement": "resident"},
                  {"placement": "sync_ep", "devices": 2, "replicas": 2, "router": "metro"}],
                 "p2c", id="offload-prefill/mixed/p2c"),
    pytest.param({"backend": "async_ep", "devices": 4, "first_device": 4},
                 [{"placement": "resident", "count": 2}, {"placement": "sync_ep",
                                                          "devices": 2}],
                 "domain", id="async_ep-4-apart/resident+sync_ep/domain"),
]


@pytest.mark.parametrize("prefill, decoders, routing", MATRIX)
def test_every_combination_gives_the_resident_tokens(prefill, decoders, routing, resident,
                                                     demo_fingerprint, tmp_path):
    cfg, fingerprint = demo_fingerprint
    count = sum(d.get("count", 1) for d in decoders)
    description = {"prefill": prefill, "decoders": decoders}
    policy = None
    if routing == "recording":
        policy = RecordingRoundRobin(count)
        config = PipelineConfig.from_dict(description)
        config = PipelineConfig(prefill=config.prefill, decoders=config.decoders,
                                routing=policy)
    else:
        description["routing"] = routing
        if routing == "eldr":
            description["eldr_fit"] = str(_fit_file(tmp_path / "fit.npz", cfg, fingerprint,
                                                    count))
        if routing == "p2c":
            description["routing_seed"] = 3
        config = description
    gen = Generator("demo", pipeline=config, **SMALL)
    assert _tokens(gen) == resident
    pool = gen.scheduler
    assert pool.occupancy() == 0 and not pool.busy
    assert len(pool.decoders) == count and len(pool.routes) == len(LENGTHS)
    if routing in ("round_robin", "recording"):      # every placement decoded something
        assert all(n > 0 for n in pool.stats()["routed"])
    stage = PrefillStage(**{"options": {k: v for k, v in prefill.items()
                                        if k not in ("backend", "devices", "first_device")},
                            **{k: v for k, v in prefill.items()
                               if k in ("backend", "devices", "first_device")}})
    assert pool.prefill.runner.name == stage.backend
    assert pool.prefill.runner.num_ranks == (stage.devices if stage.devices > 1 else 1)
    first = stage.first_device
    prefill_devices = set(jax.devices()[first:first + stage.devices])
    assert set(pool.prefill.kv.keys.devices()) == prefill_devices
    names = [d.runner.name for d in pool.decoders]
    assert names == [s.placement for s in PipelineConfig.from_dict(
        {"decoders": decoders}).decoder_list()]
    for decoder, want in zip(pool.decoders, decoders_with_counts(decoders)):
        if want.get("router") is not None:        # the decode router, apart from prefill's
            assert set(decoder.runner.router_steps) == {want["router"]}
    if prefill["backend"] == "sync_ep":
        assert set(pool.prefill.runner.router_steps) == {prefill["router"]}
    if policy is not None:
        counts = _counts_by_sequence(gen, policy)
        # The multi-rank signature cache: every prompt's counts equal a one-device
        # prefill's (each prompt token names k experts per layer).
        for seq_id, seq_counts in counts.items():
            assert seq_counts.shape == (cfg.num_layers, cfg.num_experts)
            assert (seq_counts.sum(axis=1) == LENGTHS[seq_id] * cfg.num_experts_per_tok).all()
        reference = RecordingRoundRobin(count)
        one_device = Generator("demo", pipeline=PipelineConfig(
            decoders=config.decoders, routing=reference), **SMALL)
        assert _tokens(one_device) == resident
        for seq_id, want in _counts_by_sequence(one_device, reference).items():
            np.testing.assert_array_equal(counts[seq_id], want)


def decoders_with_counts(decoders: list[dict]) -> list[dict]:
    """The decoder tables, one per decoder (``count`` expanded)."""
    return [d for d in decoders for _ in range(d.get("count", 1))]


def test_speculative_prefetch_decoders_equal_speculative_decode_alone():
    """Speculative prefetch changes tokens by definition (layer l >= 1 computes with the
    predicted experts); its definition is per row, so in a pipeline each request gets
    the tokens that one speculative offload decoder gives it."""
    alone = _tokens(Generator("demo", backend="offload", prefetch="router",
                              prefetch_mode="speculative", **SMALL), count=3)
    gen = Generator("demo", pipeline={
        "routing": "round_robin",
        "decoders": [{"placement": "offload", "prefetch": "router",
                      "prefetch_mode": "speculative", "count": 2}]}, **SMALL)
    assert _tokens(gen, count=3) == alone
    assert all(n > 0 for n in gen.scheduler.stats()["routed"])


def test_an_eldr_cluster_prior_for_each_decoders_prefetch(tmp_path, demo_fingerprint,
                                                         resident):
    """Offload decoders whose prefetch predictor mixes in the expert frequencies of the
    cluster ELDR routes to them (``prefetch_prior = "eldr"``): each decoder's prior is
    its own cluster's (``moejax.eldr.priors``), and exact prefetch keeps the resident
    tokens."""
    from moejax import traces
    from moejax.eldr.priors import prior_from_files

    cfg, fingerprint = demo_fingerprint
    traced = Generator("demo", trace_experts=True, **SMALL)
    results = traced.generate(_requests())
    trace_path = tmp_path / "calibration.npz"
    traces.save(trace_path, traces.from_results(
        results, [r["prompt_token_ids"] for r in _requests()], config=cfg, model="demo"))
    fit = _fit_file(tmp_path / "fit.npz", cfg, fingerprint, 2)
    gen = Generator("demo", pipeline={
        "routing": "eldr", "eldr_fit": str(fit), "eldr_tau": 1.0,
        "decoders": [{"placement": "offload", "prefetch": "router", "count": 2,
                      "prefetch_prior": "eldr", "prefetch_prior_weight": 0.5,
                      "prefetch_prior_traces": [str(trace_path)]}]}, **SMALL)
    assert _tokens(gen) == resident
    priors = [np.asarray(d.runner.tables.prior) for d in gen.scheduler.decoders]
    for index, got in enumerate(priors):
        want = prior_from_files(fit, trace_path, index, cfg)
        np.testing.assert_allclose(got, want / want.sum(axis=1, keepdims=True), rtol=1e-6)
        assert float(gen.scheduler.decoders[index].runner.tables.prior_weight) == 0.5
    assert not np.allclose(priors[0], priors[1])        # each decoder its own cluster's


def test_a_precompiled_pipeline_compiles_nothing_later():
    """Precompile covers every program a pipeline's steps run, the token feed of its
    pipelined decoders at every shape included (before it, the feed compiled during
    serving: 3 and 2 programs in `benchmarks/pipeline.py`'s timed calls)."""
    from compile_events import backend_compiles

    gen = Generator("demo", pipeline={
        "routing": "round_robin", "prefill": {"backend": "async_ep", "devices": 2},
        "decoders": [{"placement": "resident", "first_device": 2},
                     {"placement": "sync_ep", "devices": 2, "first_device": 3}]},
        precompile=True, **{**SMALL, "max_prefill_tokens": 16})
    with backend_compiles() as compiles:
        results = gen.generate(_requests())
    assert [r.error for r in results] == [None] * len(LENGTHS)
    assert compiles == []


def test_decoders_k_is_the_pipeline_of_k_decoders_alike():
    opts = GeneratorOptions(decoders=3, backend="offload", routing="p2c",
                                    prefetch="router")
    pipeline = opts.resolved_pipeline()
    assert pipeline.num_decoders == 3 and pipeline.routing == "p2c"
    assert [s.placement for s in pipeline.decoder_list()] == ["offload"] * 3
    assert pipeline.device_indices(8) == ((0,), [(0,), (1,), (2,)])
    assert pipeline.decoder_list()[0].runner_options() == {
        "prefetch": "router", "prefetch_mode": "exact", "prefetch_files": ()}
    assert GeneratorOptions().resolved_pipeline() is None
    assert opts.splits and not GeneratorOptions().splits


def test_the_benchmark_quick_run_writes_its_keys(tmp_path):
    path = tmp_path / "pipeline.json"
    figures = pipeline_bench.main(["--quick", "--requests", "3", "--json", str(path)])
    assert json.loads(path.read_text())["pipeline_tokens_equal"] == 1
    assert figures["pipeline_combinations"] == len(pipeline_bench.QUICK)
    for name in pipeline_bench.QUICK:
        assert figures[f"pipeline_tokens_equal_{name}"] == 1
        assert figures[f"pipeline_decoders_{name}"] == len(
            pipeline_bench.COMBINATIONS[name]["decoders"])
        assert figures[f"pipeline_tokens_per_s_{name}"] > 0
        assert figures[f"pipeline_over_resident_tokens_per_s_{name}"] > 0


# ----------------------------------------------------------------------------- the file
PIPELINE_TOML = """
routing = "round_robin"

[prefill]
backend = "async_ep"
devices = 2

[[decoders]]
placement = "resident"

[[decoders]]
placement = "sync_ep"
devices = 2
first_device = 2
"""


def test_a_toml_file_and_the_generate_command(tmp_path, resident):
    from serving import cli

    path = tmp_path / "pipeline.toml"
    path.write_text(PIPELINE_TOML)
    config = load(path)
    assert config.prefill == PrefillStage(backend="async_ep", devices=2)
    assert config.decoders == (DecoderStage(), DecoderStage(placement="sync_ep", devices=2,
                                                            first_device=2))
    assert config.device_indices(8) == ((0, 1), [(0,), (2, 3)])
    assert config.devices_needed() == 4
    as_json = tmp_path / "pipeline.json"
    as_json.write_text(json.dumps({"routing": "round_robin",
                                   "prefill": {"backend": "async_ep", "devices": 2},
                                   "decoders": [{"placement": "resident"},
                                                {"placement": "sync_ep", "devices": 2,
                                                 "first_device": 2}]}))
    assert load(as_json) == config
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps(r) + "\n" for r in _requests()))
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", str(requests), "-o", str(out), "--model", "demo",
                     "--dtype", "float32", "--max-batch-size", "2", "--max-prefill-tokens",
                     "32", "--pipeline", str(path)]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in results] == resident
    # A bad file: a clear one-line error naming it, exit status 2.
    bad = tmp_path / "bad.toml"
    bad.write_text("[prefill]\nbackend = 'tp'\n[[decoders]]\nplacement = 'resident'\n")
    assert cli.main(["generate", str(requests), "-o", str(tmp_path / "x.jsonl"), "--model",
                     "demo", "--pipeline", str(bad)]) == 2


def test_serve_takes_the_pipeline_file(tmp_path):
    """``moejax serve --pipeline FILE`` (gRPC and HTTP): the Generator gets the pipeline
    instead of the Scorer's backend and devices, and generation is served even beside a
    scoring backend that cannot decode; the CLI asks for the devices the file spans."""
    from serving.cli import build_parser
    from serving.cli.distributed import host_devices_per_process
    from serving.grpc.cli import _generator_options, _serves_generation

    path = tmp_path / "pipeline.toml"
    path.write_text(PIPELINE_TOML)
    parse = build_parser().parse_args
    args = parse(["serve", "--backend", "tp", "--devices", "2", "--pipeline", str(path)])
    assert _serves_generation(args)
    options = _generator_options(args)
    assert options["pipeline"] == str(path) and "backend" not in options
    assert host_devices_per_process(args) == 4
    generate = parse(["generate", "in.jsonl", "--pipeline", str(path)])
    assert host_devices_per_process(generate) == 4


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("description, message", [
    ({"decoders": [{"placement": "resident"},
                   {"placement": "sync_ep", "devices": 2, "prefetch": "router"}]},
     r"decoders\[1\] \(placement 'sync_ep'\) does not take prefetch \(prefetch: placement "
     r"offload\); it takes replicas, router, prefill_router"),
    ({"decoders": [{"placement": "mu_queue", "scheduler": "fifo"}]},
     r"decoders\[0\] \(placement 'mu_queue'\).scheduler must be one of"),
    ({"prefill": {"backend": "offload", "devices": 2}, "decoders": [{}]},
     r"prefill \(backend 'offload'\): devices=2, but backend 'offload' runs on one device"),
    ({"prefill": {"backend": "tp"}, "decoders": [{}]}, r"prefill.backend must be one of"),
    ({"decoders": [{"placement": "sync_ep", "devices": 2, "step": "layerwise"}]},
     r"decoders\[0\] \(placement 'sync_ep'\): placement 'sync_ep' runs fused steps"),
    ({"decoders": [{"placement": "offload", "step": "fused"}]},
     r"decoders\[0\] \(placement 'offload'\): placement 'offload' runs layerwise steps"),
    ({"decoders": [{"placement": "sync_ep", "devices": 2, "router": "metro"}]},
     r"decoders\[0\] \(placement 'sync_ep'\).router picks among an expert's replicas: give "
     r"decoders\[0\] \(placement 'sync_ep'\).replicas too"),
    ({"decoders": [{"placement": "sync_ep", "devices": 2, "replicas": 3}]},
     r"replicas must be a number in \[1, devices=2\]"),
    ({"decoders": [{"placement": "offload", "prefetch": "layer",
                    "prefetch_mode": "speculative"}]},
     r"decoders\[0\] \(placement 'offload'\): prefetch_mode='speculative' computes with "
     r"predicted experts"),
    ({"decoders": [{}], "routing": "eldr"}, r"routing 'eldr' needs eldr_fit"),
    ({"decoders": [{"placement": "offload", "prefetch": "router", "prefetch_prior": "eldr",
                    "prefetch_prior_traces": ["t.npz"]}], "routing": "jsq"},
     r"decoders\[0\] \(placement 'offload'\): prefetch_prior='eldr' is the cluster ELDR "
     r"routes to the decoder, but the pipeline routes with 'jsq'"),
    ({"decoders": [{"placement": "offload", "prefetch": "router", "prefetch_prior": "eldr"}]},
     r"prefetch_prior='eldr' needs prefetch_prior_traces"),
    ({"decoders": [{"placement": "resident", "prefetch_prior": "eldr"}]},
     r"decoders\[0\] \(placement 'resident'\) does not take prefetch_prior \(prefetch_prior: "
     r"placement offload\)"),
    ({"decoders": [{}, {}], "routing": "jsq", "eldr_tau": 0.1},
     r"eldr_tau apply to routing 'eldr', not routing 'jsq'"),
    ({"decoders": []}, r"decoders must be a non-empty list"),
    ({"decoders": [{}], "prefil": {}}, r"unknown key\(s\) prefil"),
    ({"decoders": [{"placement": "resident", "options": {}}]}, r"not under 'options'"),
])
def test_a_combination_that_cannot_work_is_refused_by_name(description, message):
    with pytest.raises(PipelineError, match=message):
        PipelineConfig.from_dict(description)


def test_refusals_beside_the_generator_options():
    pipe = {"decoders": [{"placement": "resident", "count": 2}]}
    with pytest.raises(ValueError, match=r"pipeline describes the prefill stage.*does not "
                                         r"take decoders, routing, backend='offload'"):
        Generator("demo", pipeline=pipe, decoders=2, routing="jsq", backend="offload")
    with pytest.raises(ValueError, match=r"pipeline describes the prefill stage.*does not "
                                         r"take routing_seed=3 beside it"):
        Generator("demo", pipeline=pipe, routing_seed=3)    # the pipeline's own seed rules
    with pytest.raises(ValueError, match=r"weights_dtype='fp8' .* does not take pipeline"):
        GeneratorOptions(pipeline=pipe, weights_dtype="fp8")
    with pytest.raises(PipelineError, match=r"decoder 4 \(placement 'sync_ep'\) needs devices "
                                            r"8\.\.9, but 8 exist \(the decoders ask for 10"):
        Generator("demo", pipeline={"decoders": [{"placement": "sync_ep", "devices": 2,
                                                  "count": 5}]}, **SMALL)
    with pytest.raises(PipelineError, match=r"pipeline file .*none.toml"):
        Generator("demo", pipeline="/nonexistent/none.toml")


def test_an_eldr_fit_for_another_decoder_count_names_both(tmp_path, demo_fingerprint):
    cfg, fingerprint = demo_fingerprint
    fit = _fit_file(tmp_path / "three.npz", cfg, fingerprint, 3)
    with pytest.raises(FitError, match="refit with --decoders 2"):
        Generator("demo", pipeline={"routing": "eldr", "eldr_fit": str(fit),
                                    "decoders": [{"placement": "resident", "count": 2}]},
                  **SMALL)
