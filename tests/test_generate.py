"""Generation (prefill + KV-cache decode): parity with Hugging Face ``generate``, expert
tracing, sampling, stop tokens, request errors, compile counts and the CLI.

The tiny random Qwen3-MoE and Mixtral models are built as in ``test_parity.py`` (router
weights ×20 so top-k choices are well separated, q/k and experts scaled up so mistakes
show), saved with ``save_pretrained`` next to a word-level ``tokenizer.json`` ("t0" ..
"t127"), and loaded through ``serving.Generator`` like any model directory.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="generation parity needs torch (the 'parity' extra)")
transformers = pytest.importorskip(
    "transformers", reason="generation parity needs transformers (the 'parity' extra)")


from moejax import checkpoint  # noqa: E402
from moejax import expert_trace  # noqa: E402
from moejax.static import decode as static_decode  # noqa: E402
from moejax.decode import programs as decode_programs  # noqa: E402
from moejax import sampling  # noqa: E402
from moejax.sequences import SequenceSpec  # noqa: E402
from serving.cli import main as cli_main  # noqa: E402
from serving import GenerationResult, Generator  # noqa: E402

from hf_tiny_models import E, K, L, V, build_torch_model as _hf_model  # noqa: E402
from hf_tiny_models import word_tokenizer  # noqa: E402
LENGTHS = (5, 17, 9, 30)
NEW = 12
MODELS = {"qwen3": ("qwen3_moe", dict(norm_topk_prob=True, tie_word_embeddings=False), 0),
          "mixtral": ("mixtral", dict(tie_word_embeddings=False), 4)}


# ----------------------------------------------------------------------------- models

class Model:
    def __init__(self, name: str, tmp_path_factory):
        kind, overrides, seed = MODELS[name]
        self.hf = _hf_model(kind, overrides, seed)
        self.path = str(tmp_path_factory.mktemp(name))
        self.hf.save_pretrained(self.path)
        word_tokenizer().save(f"{self.path}/tokenizer.json")
        rng = np.random.default_rng(seed)
        self.prompts = [[int(t) for t in rng.integers(3, V, n)] for n in LENGTHS]
        self.counts_before = decode_programs.compiled_program_counts()
        self.gen = Generator(self.path, dtype="float32", trace_experts=True,
                             compilation_cache="off")
        self.greedy = self.gen.generate([{"id": i, "prompt_token_ids": p, "max_new_tokens": NEW}
                                         for i, p in enumerate(self.prompts)])
        self.counts_after = decode_programs.compiled_program_counts()
        self.params = checkpoint.load_model_dir(self.path, "float32")[1]

    def hf_greedy(self, prompt: list[int], eos: int | None = None) -> list[int]:
        extra = {} if eos is None else {"eos_token_id": eos}
        with torch.no_grad():
            out = self.hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                   pad_token_id=0, **extra)
        return [int(t) for t in out[0, len(prompt):]]

    def hf_topk(self, tokens: list[int]) -> np.ndarray:
        """HF router top-k ids [L, n, k] of every token of ``tokens`` (one forward)."""
        with torch.no_grad():
            out = self.hf(torch.tensor([tokens]), output_router_logits=True)
        return np.stack([torch.topk(r, K, dim=-1).indices.numpy() for r in out.router_logits])


_MODELS: dict[str, Model] = {}


@pytest.fixture(scope="module", params=list(MODELS))
def built(request, tmp_path_factory) -> Model:
    if request.param not in _MODELS:
        _MODELS[request.param] = Model(request.param, tmp_path_factory)
    return _MODELS[request.param]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Model:
    if "qwen3" not in _MODELS:
        _MODELS["qwen3"] = Model("qwen3", tmp_path_factory)
    return _MODELS["qwen3"]


def _run(gen: Generator, requests: list[dict]) -> list[GenerationResult]:
    results = gen.generate(requests)
    for r in results:
        assert r.error is None, r.error
    return results


# ----------------------------------------------------------------------------- parity
def test_greedy_equals_hugging_face_generate(built):
    """Four prompts of different lengths in one batch, token for token (HF includes the
    EOS it stopped on, and so do we: Mixtral's config has eos_token_id 2)."""
    for prompt, result in zip(built.prompts, built.greedy):
        want = built.hf_greedy(prompt)
        assert result.token_ids == want, (built.path, len(prompt))
        stopped = len(want) < NEW
        assert result.finish_reason == ("stop" if stopped else "length")
        assert result.prompt_tokens == len(prompt)
    assert len({tuple(r.token_ids) for r in built.greedy}) == len(LENGTHS)


def test_continuous_batching_under_pressure_equals_hugging_face(built):
    """Staggered arrivals, prompts sharing a 32-token prefix (reused from the pool), a
    16-token prefill budget and a pool too small for all of them (preemption): every
    request still gets Hugging Face's greedy tokens."""
    gen = Generator(built.path, dtype="float32", kv_cache_blocks=6, max_prefill_tokens=16,
                    max_batch_size=4, compilation_cache="off")
    shared = built.prompts[3][:32]
    prompts = [shared + [5, 6, 7], built.prompts[1], shared + [9], built.prompts[0],
               shared + built.prompts[2]]
    scheduler = gen.scheduler
    sequences = []
    for prompt in prompts:
        spec = gen.parse({"prompt_token_ids": prompt, "max_new_tokens": NEW,
                          "stop_token_ids": []}, 0)
        sequences.append(scheduler.submit(spec))
        scheduler.step()
    scheduler.run_until_idle()
    assert scheduler.stats["preemptions"] > 0 and scheduler.stats["prefix_hit_tokens"] >= 32
    for prompt, seq in zip(prompts, sequences):
        assert seq.output.token_ids == built.hf_greedy(prompt), prompt
    assert scheduler.occupancy() == 0


def test_offload_and_layerwise_decode_equal_resident(built):
    """The offload backend (experts copied per layer from host buffers, layerwise) and the
    resident layerwise step give the fused resident tokens and routing."""
    requests = [{"prompt_token_ids": p, "max_new_tokens": NEW} for p in built.prompts]
    for options in ({"backend": "offload"}, {"step": "layerwise"}):
        gen = Generator(built.path, dtype="float32", trace_experts=True,
                        compilation_cache="off", **options)
        for ours, ref in zip(_run(gen, requests), built.greedy):
            assert ours.token_ids == ref.token_ids, options
            np.testing.assert_array_equal(ours.experts["decode"], ref.experts["decode"])


def test_stop_token_equals_hugging_face_eos(built):
    """A stop token that some rows generate mid-way: HF generate with it as EOS stops at
    the same place and includes it, like us; the other rows run to max_new_tokens."""
    stop = built.greedy[2].token_ids[4]
    results = _run(built.gen, [{"prompt_token_ids": p, "max_new_tokens": NEW,
                                "stop_token_ids": [stop]} for p in built.prompts])
    reasons = []
    for prompt, result in zip(built.prompts, results):
        assert result.token_ids == built.hf_greedy(prompt, eos=stop)
        reasons.append(result.finish_reason)
    assert "stop" in reasons


def test_traced_experts_equal_hf_router_topk(built):
    """Prefill ids of every prompt token and decode ids of every fed-back generated token
    equal the HF router's top-k (as sets: the order of near-equal weights may differ)."""
    for prompt, result in zip(built.prompts, built.greedy):
        n, m = len(prompt), len(result.token_ids)
        prefill, decode = result.experts["prefill"], result.experts["decode"]
        assert prefill.shape == (L, n, K) and decode.shape == (L, m - 1, K)
        ref = built.hf_topk(prompt + result.token_ids[:-1])
        ours = np.concatenate([prefill, decode], axis=1)
        assert ours.shape == ref.shape
        np.testing.assert_array_equal(np.sort(ours, axis=-1), np.sort(ref, axis=-1))


def test_continuous_steps_compile_per_bucket_only(built):
    """4 prompts and 11 decode steps compile one program per (rows, chunk, table) bucket
    the steps met — at most a few — and another call within those buckets compiles
    nothing."""
    before, after = built.counts_before, built.counts_after
    fused = after.get("fused_step", 0) - before.get("fused_step", 0)
    # Prefill: one chunk bucket of <= 4 rows; decode: 1..4 rows as sequences finish.
    assert 1 <= fused <= 5
    lengths = (3, 20, 12, 7)
    built.gen.generate([{"prompt_token_ids": list(range(3, 3 + n)), "max_new_tokens": NEW}
                        for n in lengths])
    warm = decode_programs.compiled_program_counts()
    built.gen.generate([{"prompt_token_ids": list(range(40, 40 + n)), "max_new_tokens": NEW}
                        for n in lengths[::-1]])
    assert decode_programs.compiled_program_counts() == warm


def test_static_batching_compiles_once(built):
    """The static baseline: one batch of 4 prompts and 11 decode steps compile one prefill
    and one decode program; another batch in the same buckets compiles nothing; its
    tokens equal continuous batching's."""
    before = static_decode.compiled_program_counts()
    static = Generator(built.path, dtype="float32", batching="static", compilation_cache="off")
    requests = [{"prompt_token_ids": p, "max_new_tokens": NEW} for p in built.prompts]
    assert [r.token_ids for r in _run(static, requests)] == [r.token_ids for r in built.greedy]
    after = static_decode.compiled_program_counts()
    assert after["decode_step"] - before["decode_step"] == 1
    assert after["prefill"] - before["prefill"] == 1
    others = [[int(t) for t in np.arange(3, 3 + n)] for n in (3, 20, 12)]
    static.generate([{"prompt_token_ids": p, "max_new_tokens": 7} for p in others])
    assert static_decode.compiled_program_counts() == after


def test_shape_buckets(qwen):
    """Batch, prompt and cache sizes are powers of two (the cache capped at the context,
    but never below the prompt bucket, which the attention tiling needs whole)."""
    cfg = dataclasses.replace(qwen.gen.config, max_context=100)
    engine = static_decode.DecodeEngine(qwen.params, cfg, max_batch_size=8)
    spec = SequenceSpec
    assert engine.shapes([spec((1,) * 5, 3)] * 3) == (4, 16, 64)
    assert engine.shapes([spec((1,) * 40, 30)] * 5) == (8, 64, 100)
    assert engine.shapes([spec((1,) * 70, 20)]) == (1, 128, 128)
    with pytest.raises(ValueError, match="cache slots"):
        engine.shapes([spec((1,) * 90, 20)])


def test_trace_prefill_experts_function(qwen):
    prompt = qwen.prompts[1]
    ids = expert_trace.trace_prefill_experts(qwen.params, qwen.gen.config, prompt)
    np.testing.assert_array_equal(ids, qwen.greedy[1].experts["prefill"])
    counts = expert_trace.expert_counts(ids, E)
    assert counts.shape == (L, E) and (counts.sum(axis=1) == len(prompt) * K).all()


def test_tracing_does_not_change_outputs(qwen):
    requests = [{"prompt_token_ids": p, "max_new_tokens": 6, "temperature": 1.0, "seed": i}
                for i, p in enumerate(qwen.prompts)]
    plain = Generator(qwen.path, dtype="float32", compilation_cache="off")
    untraced = _run(plain, requests)
    traced = _run(qwen.gen, requests)
    assert [r.token_ids for r in untraced] == [r.token_ids for r in traced]
    assert all(r.experts is None for r in untraced)
    assert "experts" not in untraced[0].to_dict() and "experts" in traced[0].to_dict()


# ----------------------------------------------------------------------------- sampling
def test_seeded_sampling_is_reproducible_and_batch_independent(qwen):
    """The same request in two batches (other companions, other row) gives the same
    tokens; another seed gives others. (Batches of 4 rows reuse the compiled programs.)"""
    req = {"prompt_token_ids": qwen.prompts[0], "max_new_tokens": NEW, "temperature": 1.5,
           "top_p": 0.95, "seed": 1234}
    greedy_others = [{"prompt_token_ids": p, "max_new_tokens": NEW} for p in qwen.prompts[1:]]
    sampled_others = [dict(r, temperature=0.8, seed=7, max_new_tokens=5)
                      for r in greedy_others[::-1]]
    first = _run(qwen.gen, [req] + greedy_others)[0].token_ids
    second = _run(qwen.gen, sampled_others + [req])[-1].token_ids
    assert first == second
    other_seed = _run(qwen.gen, [dict(req, seed=99)] + greedy_others)[0].token_ids
    assert other_seed != first
    assert first != qwen.greedy[0].token_ids


def test_tiny_top_p_is_greedy(qwen):
    requests = [{"prompt_token_ids": p, "max_new_tokens": NEW, "temperature": 5.0,
                 "top_p": 1e-6, "seed": i} for i, p in enumerate(qwen.prompts)]
    assert [r.token_ids for r in _run(qwen.gen, requests)] == [r.token_ids for r in qwen.greedy]


_next_tokens = jax.jit(sampling.next_tokens)


@pytest.mark.parametrize("temperature,top_p,expected", [
    (1.0, 1.0, [0.5, 0.3, 0.2, 0.0]),
    (0.5, 1.0, np.array([25, 9, 4, 0]) / 38),          # p^(1/T), renormalised
    (1.0, 0.6, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),      # the smallest set holding 0.6
])
def test_sampling_distribution(temperature, top_p, expected):
    """4000 rows with seeds 0..3999 draw from one tiny distribution; frequencies match."""
    rows = 4000
    logits = jnp.log(jnp.tile(jnp.array([0.5, 0.3, 0.2, 1e-30]), (rows, 1)))
    params = sampling.make_sampling_params([temperature] * rows, [top_p] * rows, range(rows))
    tokens = np.asarray(_next_tokens(logits, params, jnp.zeros(rows, jnp.int32)))
    freq = np.bincount(tokens, minlength=4) / rows
    np.testing.assert_allclose(freq, expected, atol=0.03)
    again = np.asarray(_next_tokens(logits, params, jnp.zeros(rows, jnp.int32)))
    np.testing.assert_array_equal(tokens, again)
    step1 = np.asarray(_next_tokens(logits, params, jnp.ones(rows, jnp.int32)))
    assert (step1 != tokens).mean() > 0.2   # the step is folded into the key


def test_the_smallest_accepted_temperature_samples_the_top_token_without_nan():
    """1.2e-38 (about the smallest normal float32) passes the request parser: logits over
    it would overflow to inf; shifted first, the draw is the top token."""
    logits = jnp.array([[3.0, 7.5, -2.0, 7.0], [0.1, -40.0, 0.2, 0.0]])
    params = sampling.make_sampling_params([1.2e-38, 1.2e-38], [1.0, 1.0], [0, 1])
    tokens = np.asarray(_next_tokens(logits, params, jnp.zeros(2, jnp.int32)))
    np.testing.assert_array_equal(tokens, [1, 2])


# ----------------------------------------------------------------------------- stopping
def test_stop_tokens_and_max_new_tokens(qwen):
    greedy = qwen.greedy[3].token_ids
    stop = greedy[4]
    first = greedy.index(stop)
    stop_result, short, one, full = _run(qwen.gen, [
        {"prompt_token_ids": qwen.prompts[3], "max_new_tokens": NEW, "stop_token_ids": [stop]},
        {"prompt_token_ids": qwen.prompts[3], "max_new_tokens": 3},
        {"prompt": "t5 t9 t11", "max_new_tokens": 1},
        {"prompt_token_ids": qwen.prompts[1], "max_new_tokens": NEW, "stop_token_ids": []}])
    assert stop_result.token_ids == greedy[:first + 1]       # the stop token is included
    assert stop_result.finish_reason == "stop"
    assert stop_result.text == " ".join(f"t{t}" for t in greedy[:first])   # ... not in text
    assert short.token_ids == greedy[:3] and short.finish_reason == "length"
    assert len(one.token_ids) == 1 and one.prompt_tokens == 3
    assert one.experts["decode"].shape == (L, 0, K)
    assert full.token_ids == qwen.greedy[1].token_ids and full.finish_reason == "length"


def test_finished_rows_do_not_change_others(qwen):
    """A row that stops at its first token, next to rows that keep going."""
    stop_now = qwen.greedy[0].token_ids[0]
    results = _run(qwen.gen, [{"prompt_token_ids": qwen.prompts[0], "max_new_tokens": NEW,
                               "stop_token_ids": [stop_now]}]
                   + [{"prompt_token_ids": p, "max_new_tokens": NEW} for p in qwen.prompts[1:]])
    assert results[0].token_ids == [stop_now] and results[0].finish_reason == "stop"
    assert results[0].experts["decode"].shape == (L, 0, K)
    assert [r.token_ids for r in results[1:]] == [r.token_ids for r in qwen.greedy[1:]]


# ----------------------------------------------------------------------------- errors
BAD_REQUESTS = [
    ({"prompt": ""}, "prompt: is empty"),
    ({"prompt_token_ids": []}, "prompt_token_ids: is empty"),
    ({"prompt": "t1", "prompt_token_ids": [1]}, "prompt: give exactly one"),
    ({"max_new_tokens": 4}, "prompt: give exactly one"),
    ({"prompt_token_ids": [1] * 100, "max_new_tokens": 29}, "max_new_tokens: prompt (100"),
    ({"prompt_token_ids": [1], "max_new_tokens": 0}, "max_new_tokens: must be >= 1"),
    ({"prompt_token_ids": [1], "max_new_tokens": -3}, "max_new_tokens: must be >= 1"),
    ({"prompt_token_ids": [1], "max_new_tokens": 2.5}, "max_new_tokens: must be an integer"),
    ({"prompt_token_ids": [1], "temperature": -0.1}, "temperature: must be >= 0"),
    ({"prompt_token_ids": [1], "temperature": "hot"}, "temperature: must be a number"),
    ({"prompt_token_ids": [1], "top_p": 0}, "top_p: must lie in (0, 1]"),
    ({"prompt_token_ids": [1], "top_p": 1.5}, "top_p: must lie in (0, 1]"),
    ({"prompt_token_ids": [1, V]}, f"prompt_token_ids[1]: must be in [0, {V})"),
    ({"prompt_token_ids": [1], "stop_token_ids": [-1]}, "stop_token_ids[0]: must be in"),
    ({"prompt_token_ids": [1], "seed": 1.5}, "seed: must be an integer"),
    ({"prompt_token_ids": [1], "seed": True}, "seed: must be an integer"),
    ({"prompt_token_ids": [1], "seed": -1}, "seed: must be in [0, "),
    ({"prompt_token_ids": [1], "max_tokens": 5}, "unknown field(s) 'max_tokens'"),
    ({"prompt_token_ids": [1], "id": [1]}, "id: must be a string, an integer or null"),
    ("t1 t2", "expected an object"),
]


def test_bad_requests_become_error_results(qwen):
    good = [{"id": f"ok{i}", "prompt_token_ids": p, "max_new_tokens": NEW}
            for i, p in enumerate(qwen.prompts)]
    requests = [dict(r, id=f"bad{i}") if isinstance(r, dict) and "id" not in r else r
                for i, (r, _) in enumerate(BAD_REQUESTS)]
    results = qwen.gen.generate(good[:2] + requests[:10] + good[2:] + requests[10:])
    ok = results[:2] + results[12:14]
    results = results[2:12] + results[14:]
    assert [r.id for r in ok] == ["ok0", "ok1", "ok2", "ok3"]
    assert [r.token_ids for r in ok] == [r.token_ids for r in qwen.greedy]
    for i, (result, (request, message)) in enumerate(zip(results, BAD_REQUESTS)):
        assert result.error is not None and message in result.error, (request, result.error)
        assert result.token_ids == [] and result.finish_reason is None
        if isinstance(request, dict) and "id" not in request:
            assert result.id == f"bad{i}" and f"request 'bad{i}'" in result.error


def test_generator_options_are_checked(qwen):
    with pytest.raises(TypeError, match="unknown Generator option"):
        Generator(qwen.path, temperature=1.0)
    with pytest.raises(ValueError, match="dtype"):
        Generator(qwen.path, dtype="float64")
    with pytest.raises(ValueError, match="max_batch_size"):
        Generator(qwen.path, max_batch_size=0)
    with pytest.raises(TypeError, match="list of requests"):
        qwen.gen.generate({"prompt": "t1"})


def test_only_bad_requests(qwen):
    results = qwen.gen.generate([{"prompt": ""}, {"prompt_token_ids": [1], "top_p": 2}])
    assert [r.error is not None for r in results] == [True, True]
    assert qwen.gen.generate([]) == []


def test_more_requests_than_a_batch(qwen):
    """max_batch_size 4: eight requests in two batches, results in request order."""
    small = Generator(qwen.path, dtype="float32", max_batch_size=4, compilation_cache="off")
    picked = [1, 3, 0, 2, 3, 1, 2, 0]   # batches of 4 rows: the programs already compiled
    results = _run(small, [{"id": i, "prompt_token_ids": qwen.prompts[j], "max_new_tokens": NEW}
                           for i, j in enumerate(picked)])
    assert [r.id for r in results] == list(range(8))
    assert [r.token_ids for r in results] == [qwen.greedy[j].token_ids for j in picked]


# ----------------------------------------------------------------------------- CLI
def test_cli_round_trip(qwen, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOEJAX_CACHE", str(tmp_path / "cache"))
    lines = [json.dumps({"id": "a", "prompt_token_ids": qwen.prompts[2], "max_new_tokens": NEW}),
             "{not json",
             "",
             json.dumps({"id": "b", "prompt": "t7 t8 t9", "max_new_tokens": 0}),
             json.dumps({"id": "c", "prompt_token_ids": qwen.prompts[0], "max_new_tokens": NEW}),
             json.dumps({"id": "d", "prompt_token_ids": qwen.prompts[3], "max_new_tokens": NEW})]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    cache_dir = jax.config.jax_compilation_cache_dir
    try:
        # A small pool and prefill budget in rows of 4 tokens, layer by layer: still the
        # same tokens.
        code = cli_main(["generate", str(src), "-o", str(dst), "--model", qwen.path,
                         "--dtype", "float32", "--trace-experts", "--step", "layerwise",
                         "--kv-cache-blocks", "5", "--max-prefill-tokens", "16",
                         "--prefill-row-tokens", "4"])
    finally:   # the CLI turns on the persistent compilation cache; leave no trace of it
        jax.config.update("jax_compilation_cache_dir", cache_dir)
    assert code == 0
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == ["a", None, "b", "c", "d"]
    assert out[0]["token_ids"] == qwen.greedy[2].token_ids and out[0]["error"] is None
    assert np.array_equal(out[0]["experts"]["prefill"], qwen.greedy[2].experts["prefill"])
    assert "line 2: invalid JSON" in out[1]["error"]
    assert "max_new_tokens" in out[2]["error"]
    assert out[3]["token_ids"] == qwen.greedy[0].token_ids
    assert out[4]["token_ids"] == qwen.greedy[3].token_ids
    assert "generated" in capsys.readouterr().err
    refused = cli_main(["generate", str(src), "--model", qwen.path, "--backend", "tp"])
    assert refused == 2 and "'tp' cannot decode" in capsys.readouterr().err
    refused = cli_main(["generate", str(src), "--model", qwen.path, "--window", "2"])
    assert refused == 2 and "--window" in capsys.readouterr().err


def test_cli_help_lists_only_the_options_generate_takes(capsys):
    with pytest.raises(SystemExit):
        cli_main(["generate", "--help"])
    text = capsys.readouterr().out
    assert "--dtype" in text and "--expert-impl" in text and "--trace-experts" in text
    for offered in ("--backend", "--batching", "--step", "--kv-cache-mib", "--replicas",
                    "--precompile", "--prefill-row-tokens"):
        assert offered in text, offered
    for refused in ("--max-batch-tokens", "--window", "--prefix-cache-blocks", "--engines"):
        assert refused not in text, refused


def test_a_broken_generation_config_is_named(tmp_path):
    from serving.generate import model_eos_ids

    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"generation_config\.json: not a valid JSON file"):
        model_eos_ids(str(tmp_path), 100)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [3, 500]}')
    assert model_eos_ids(str(tmp_path), 100) == frozenset({3})
