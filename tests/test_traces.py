"""Expert traces (``moejax.traces``, ``moejax trace``): exact round trips of the ``.npz``
format, clear errors for malformed files, the size per token, the CLI on the demo model
(tracing never changes tokens), and parity of the traced routing with the Hugging Face
router on the tiny Qwen3-MoE and Mixtral models of ``tests/hf_tiny_models.py``."""

from __future__ import annotations

import io
import json
import re

import jax
import numpy as np
import pytest

from moejax import traces
from moejax.traces import RequestTrace, Trace, TraceFormatError

L, K, E, D = 3, 2, 8, 5


# ----------------------------------------------------------------------------- synthetic
def _request(rng: np.random.Generator, request_id: str, n: int, g: int, *,
             domain: str | None = None, router: bool = True) -> RequestTrace:
    m = max(g - 1, 0)
    inputs = {}
    if router:
        inputs = dict(prefill_router_inputs=rng.standard_normal((L, n, D), np.float32),
                      decode_router_inputs=rng.standard_normal((L, m, D), np.float32))
    return RequestTrace(
        id=request_id, domain=domain,
        prompt_token_ids=rng.integers(0, 1000, n).astype(np.int32),
        generated_token_ids=rng.integers(0, 1000, g).astype(np.int32),
        prefill_experts=rng.integers(0, E, (L, n, K)).astype(np.int32),
        prefill_weights=rng.random((L, n, K), np.float32),
        decode_experts=rng.integers(0, E, (L, m, K)).astype(np.int32),
        decode_weights=rng.random((L, m, K), np.float32),
        finish_reason="stop" if g % 2 else "length", **inputs)


def _requests(router: bool = True) -> list[RequestTrace]:
    """Ragged lengths, a request with zero decode tokens (one generated token), an
    errored one, domains and none, an integer id and an empty one."""
    rng = np.random.default_rng(0)
    return [_request(rng, "a", 7, 4, domain="math", router=router),
            _request(rng, "17", 1, 1, router=router),                     # zero decode tokens
            RequestTrace.failed(None, "line 3: invalid JSON", num_layers=L, top_k=K,
                                router_input_dim=D if router else None, domain="code"),
            _request(rng, "", 12, 9, domain="prose", router=router)]


def _trace(router: bool = True) -> Trace:
    return Trace.from_requests(_requests(router), num_layers=L, top_k=K, num_experts=E,
                               router_input_dim=D if router else None, model="tiny")


FIELDS = ("prompt_token_ids", "generated_token_ids", "prefill_experts", "prefill_weights",
          "decode_experts", "decode_weights", "prefill_router_inputs", "decode_router_inputs")


def _assert_same_request(got: RequestTrace, want: RequestTrace) -> None:
    assert (got.id, got.domain, got.finish_reason, got.error) == (
        want.id, want.domain, want.finish_reason, want.error)
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)


# ----------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("router", [True, False])
def test_a_trace_round_trips_exactly(tmp_path, router):
    trace = _trace(router)
    path = tmp_path / "run.trace"          # any name: nothing is appended
    traces.save(path, trace)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.trace"]
    back = traces.load(path)
    assert back.arrays.keys() == trace.arrays.keys()
    for key, value in trace.arrays.items():
        assert back.arrays[key].dtype == value.dtype, key
        np.testing.assert_array_equal(back.arrays[key], value, err_msg=key)
    assert (back.num_layers, back.top_k, back.num_experts, back.model) == (L, K, E, "tiny")
    assert back.has_router_inputs is router and back.router_input_dim == (D if router else None)
    assert back.ids == ["a", "17", "", ""] and back.domains == ["math", None, "code", "prose"]
    assert (back.num_prefill_tokens, back.num_decode_tokens) == (20, 11)
    for got, want in zip(back.requests, _requests(router), strict=True):
        _assert_same_request(got, want)
    one = back.request(1)
    assert one.num_decode_tokens == 0 and one.decode_experts.shape == (L, 0, K)
    assert not back.request(2).ok and back.request(2).prompt_token_ids.size == 0
    _assert_same_request(back.request(-1), back.request(3))
    with pytest.raises(IndexError):
        back.request(4)


def test_numpy_alone_reads_the_documented_keys(tmp_path):
    traces.save(tmp_path / "t.npz", _trace())
    with np.load(tmp_path / "t.npz", allow_pickle=False) as raw:
        assert set(raw.files) == set(traces.KEYS)
        assert str(raw["format"]) == "moejax-expert-trace" and int(raw["version"]) == 1
        a, b = raw["prompt_offsets"][3], raw["prompt_offsets"][4]
        np.testing.assert_array_equal(raw["prefill_experts"][:, a:b],
                                      _requests()[3].prefill_experts)


def test_empty_and_all_errored_traces_round_trip():
    for requests in ([], [RequestTrace.failed(5, "bad", num_layers=L, top_k=K)]):
        trace = Trace.from_requests(requests, num_layers=L, top_k=K, num_experts=E)
        buffer = io.BytesIO()
        traces.save(buffer, trace)
        buffer.seek(0)
        back = traces.load(buffer)
        assert back.num_requests == len(requests)
        assert back.arrays["prefill_experts"].shape == (L, 0, K)
    assert back.ids == ["5"] and back.request(0).error == "bad"


def test_trace_arrays_are_read_only():
    trace = _trace()
    with pytest.raises(ValueError):
        trace.arrays["prefill_experts"][0, 0, 0] = 1
    with pytest.raises(TypeError):
        trace.arrays["model"] = np.array("other")   # type: ignore[index]


def test_a_request_of_the_wrong_shape_is_named():
    requests = _requests()
    bad = requests[3]
    requests[3] = RequestTrace(**{**bad.__dict__, "decode_weights": bad.decode_weights[:, 1:]})
    with pytest.raises(ValueError, match=r"request 3 .*decode_weights: shape \(3, 7, 2\), "
                                         r"expected \(3, 8, 2\)"):
        Trace.from_requests(requests, num_layers=L, top_k=K, num_experts=E, router_input_dim=D)
    with pytest.raises(ValueError, match=r"request 0 .*has router inputs"):
        Trace.from_requests(_requests(), num_layers=L, top_k=K, num_experts=E)
    with pytest.raises(ValueError, match=r"NUL"):
        Trace.from_requests([RequestTrace.failed("a\x00", "bad", num_layers=L, top_k=K)],
                            num_layers=L, top_k=K, num_experts=E)


# ----------------------------------------------------------------------------- malformed
def _mutated(change) -> dict[str, np.ndarray]:
    arrays = {key: np.array(value) for key, value in _trace().arrays.items()}
    change(arrays)
    return arrays


def _set(key, value):
    return lambda arrays: arrays.__setitem__(key, value)


def _drop(key):
    return lambda arrays: arrays.pop(key)


def _edit(key, fn):
    def change(arrays):
        arrays[key] = fn(arrays[key].copy())
    return change


def _poke(key, index, value):
    def fn(a):
        a[index] = value
        return a
    return _edit(key, fn)


MALFORMED = {
    "no format": (_drop("format"), "'format': missing"),
    "other format": (_set("format", np.array("something-else")), "'format': 'something-else'"),
    "newer version": (_set("version", np.array(2, np.int64)), "'version': the file is version 2"),
    "missing key": (_drop("decode_weights"), "'decode_weights': missing"),
    "unknown key": (_set("extra", np.zeros(3)), "'extra': unknown"),
    "one router input": (_drop("decode_router_inputs"), "'decode_router_inputs': missing"),
    "wrong dtype": (_edit("prefill_experts", lambda a: a.astype(np.int64)),
                    "'prefill_experts': dtype int64, expected int32"),
    "wrong shape": (_edit("prefill_weights", lambda a: a[:2]),
                    r"'prefill_weights': shape \(2, 20, 2\), expected \(3, 20, 2\)"),
    "offsets decrease": (_poke("prompt_offsets", 2, 9), "'prompt_offsets': must not decrease"),
    "offsets past the tokens": (_poke("prompt_offsets", 4, 99),
                                r"'prompt_token_ids': shape \(20,\), expected \(99,\)"),
    "offsets start": (_poke("decode_offsets", 0, 1), "'decode_offsets': must start at 0"),
    "decode count": (_edit("decode_offsets", lambda a: np.array([0, 2, 3, 3, 11])),
                     "'decode_offsets': request 0"),
    "expert id": (_poke("decode_experts", (1, 2, 0), E), f"'decode_experts': expert id {E}"),
    "nan weight": (_poke("prefill_weights", (0, 0, 0), np.nan), "'prefill_weights': holds a NaN"),
    "router width": (_edit("decode_router_inputs", lambda a: a[..., :3]),
                     r"'decode_router_inputs': shape \(3, 11, 3\), expected \(3, 11, 5\)"),
    "errored with tokens": (_poke("errors", 0, "oops"), "'errors': request 0: failed"),
    "finish reason": (_poke("finish_reasons", 1, "done"), "'finish_reasons': request 1"),
    "top_k": (_set("top_k", np.array(9, np.int64)), "'top_k': 9 is more than num_experts"),
    "ids not str": (_set("request_ids", np.arange(4)), "'request_ids': dtype int64, expected str"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_files_name_the_file_and_key(tmp_path, case):
    change, message = MALFORMED[case]
    path = tmp_path / "bad.npz"
    np.savez(path, **_mutated(change))
    with pytest.raises(TraceFormatError, match=f"^{re.escape(str(path))}: key {message}"):
        traces.load(path)


def test_files_that_are_not_traces(tmp_path):
    text = tmp_path / "text.npz"
    text.write_text("id,prompt\n")
    with pytest.raises(TraceFormatError, match=f"^{re.escape(str(text))}: not an .npz file"):
        traces.load(text)
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    with pytest.raises(TraceFormatError, match="a single .npy array"):
        traces.load(single)
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, **_mutated(_set("request_ids", np.array([{}, 1, 2, 3], dtype=object))))
    with pytest.raises(TraceFormatError, match="key 'request_ids': unreadable"):
        traces.load(pickled)
    with pytest.raises(FileNotFoundError):
        traces.load(tmp_path / "missing.npz")


# ----------------------------------------------------------------------------- size, counts
def test_bytes_per_token():
    assert traces.bytes_per_token(4, 2, 128, False) == 68            # the demo model
    assert traces.bytes_per_token(4, 2, 128, True) == 68 + 4 * 4 * 128
    assert traces.bytes_per_token(48, 8, 2048, False) == 3076        # Qwen3-30B-A3B
    for router in (True, False):
        trace = _trace(router)
        token_keys = ["prompt_token_ids", "generated_token_ids"] + [
            key for key in trace.arrays
            if key.startswith(("prefill_", "decode_")) and key != "decode_offsets"]
        ran = sum(r.ok for r in trace.requests)   # each adds its last generated token
        tokens = trace.num_prefill_tokens + trace.num_decode_tokens
        assert sum(trace.arrays[key].nbytes for key in token_keys) == (
            tokens * traces.bytes_per_token(L, K, D, router) + 4 * ran)


def test_activation_counts():
    trace = _trace()
    for phase in ("prefill", "decode"):
        counts = traces.activation_counts(trace, phase)
        assert counts.shape == (4, L, E)
        for i, req in enumerate(trace.requests):
            ids = getattr(req, f"{phase}_experts")
            for layer in range(L):
                np.testing.assert_array_equal(
                    counts[i, layer], np.bincount(ids[layer].ravel(), minlength=E))
    with pytest.raises(ValueError, match="phase"):
        traces.activation_counts(trace, "both")


# ----------------------------------------------------------------------------- the CLI
@pytest.fixture()
def cli(tmp_path, monkeypatch):
    """``moejax`` main, leaving JAX's compilation cache setting as it was."""
    from serving.cli import main

    monkeypatch.setenv("MOEJAX_CACHE", str(tmp_path / "cache"))
    cache_dir = jax.config.jax_compilation_cache_dir
    yield main
    jax.config.update("jax_compilation_cache_dir", cache_dir)


def test_cli_traces_the_demo_model_without_changing_tokens(cli, tmp_path, capsys):
    from serving import Generator

    good = [{"id": "x", "prompt": "2+3=", "max_new_tokens": 3, "domain": "math"},
            {"prompt": "def f(x):"},                                   # --max-new-tokens
            {"id": 7, "prompt_token_ids": [5, 6, 7, 8], "max_new_tokens": 1, "domain": None}]
    lines = [json.dumps(good[0]), "{not json", "", json.dumps(good[1]),
             json.dumps({"id": "d", "prompt": "1+1=", "domain": 3}),
             json.dumps({"prompt": ""}), json.dumps(good[2])]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.npz"
    src.write_text("\n".join(lines) + "\n")
    code = cli(["trace", str(src), "-o", str(dst), "--model", "demo", "--dtype", "float32",
                "--max-new-tokens", "2", "--router-inputs"])
    err = capsys.readouterr().err
    assert code == 0, err
    trace = traces.load(dst)
    assert trace.ids == ["x", "", "", "", "", "7"]
    assert trace.domains == ["math", None, None, None, None, None]
    errors = [r.error for r in trace.requests]
    assert errors[0] is None and errors[2] is None and errors[5] is None
    assert errors[1].startswith("line 2: invalid JSON")
    assert errors[3].startswith("line 5: request 'd': domain: must be a non-empty string")
    assert errors[4] == "line 6: prompt: is empty"
    for i in (1, 3, 4):
        assert f"moejax: trace: {errors[i]}" in err
    assert "traced 3 of 6 requests (3 with errors)" in err
    plain = Generator("demo", dtype="float32", compilation_cache="off")
    wanted = plain.generate([{k: v for k, v in g.items() if k != "domain"}
                             | {"max_new_tokens": g.get("max_new_tokens", 2)} for g in good])
    for got, want in zip([trace.request(i) for i in (0, 2, 5)], wanted):
        assert got.generated_token_ids.tolist() == want.token_ids
        assert len(got.prompt_token_ids) == want.prompt_tokens
        assert got.finish_reason == want.finish_reason
        cfg = plain.config
        assert got.prefill_router_inputs.shape == (cfg.num_layers, want.prompt_tokens,
                                                   cfg.hidden_size)
    assert trace.request(0).prompt_token_ids.tolist() == plain.tokenizer.encode("2+3=")
    assert trace.request(5).prompt_token_ids.tolist() == [5, 6, 7, 8]
    assert trace.request(5).num_decode_tokens == 0
    assert trace.bytes_per_token == traces.bytes_per_token(4, 2, 128, True)


def test_cli_checks_files_and_options_before_the_model(cli, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "1+1="}\n')
    assert cli(["trace", str(src), "-o", str(src), "--model", "nowhere"]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert cli(["trace", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "t.npz"),
                "--model", "nowhere"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert cli(["trace", str(src), "-o", "-", "--model", "nowhere"]) == 2
    assert "binary .npz" in capsys.readouterr().err
    assert cli(["trace", str(src), "-o", str(tmp_path / "t.npz"), "--backend", "tp"]) == 2
    assert "--backend" in capsys.readouterr().err
    assert not (tmp_path / "t.npz").exists()
    assert src.read_text() == '{"prompt": "1+1="}\n'


def test_cli_help_lists_only_the_options_trace_takes(cli, capsys):
    with pytest.raises(SystemExit):
        cli(["trace", "--help"])
    text = capsys.readouterr().out
    for option in ("--max-new-tokens", "--router-inputs", "--dtype", "--expert-impl"):
        assert option in text, option
    for refused in ("--max-batch-tokens", "--backend", "--engines"):
        assert refused not in text, refused


# ----------------------------------------------------------------------------- HF parity
def _hf_model_dir(name: str, tmp_path_factory):
    """The tiny HF model ``name`` saved with a word tokenizer ("t0" .. "t127")."""
    pytest.importorskip("torch", reason="HF parity needs torch (the 'parity' extra)")
    pytest.importorskip("transformers", reason="HF parity needs transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from hf_tiny_models import V, build_torch_model

    kind, overrides, seed = {
        "qwen3": ("qwen3_moe", dict(norm_topk_prob=True, tie_word_embeddings=False), 0),
        "mixtral": ("mixtral", dict(tie_word_embeddings=False), 4)}[name]
    hf = build_torch_model(kind, overrides, seed)
    path = str(tmp_path_factory.mktemp(name))
    hf.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(f"{path}/tokenizer.json")
    return hf, path


def _hf_routing(hf, tokens: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """HF's top-k ids, their gate weights (renormalized over the k, as both models mix
    them) [L, n, k], and the router inputs (the MoE block's input) [L, n, d]."""
    import torch

    from hf_tiny_models import K as top_k

    inputs: list[np.ndarray] = []
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda module, args: inputs.append(args[0][0].detach().numpy().copy()))
        for layer in hf.model.layers]
    try:
        with torch.no_grad():
            out = hf(torch.tensor([tokens]), output_router_logits=True)
    finally:
        for hook in hooks:
            hook.remove()
    probs = [torch.softmax(logits.float(), dim=-1) for logits in out.router_logits]
    top = [torch.topk(p, top_k, dim=-1) for p in probs]
    ids = np.stack([t.indices.numpy() for t in top])
    weights = np.stack([(t.values / t.values.sum(-1, keepdim=True)).numpy() for t in top])
    return ids, weights, np.stack(inputs)


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_traced_routing_equals_the_hf_router(name, tmp_path_factory, tmp_path):
    from serving import Generator

    hf, path = _hf_model_dir(name, tmp_path_factory)
    gen = Generator(path, dtype="float32", trace_experts=True, trace_router_inputs=True,
                    compilation_cache="off")
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 128, n)] for n in (5, 13, 2)]
    requests = [{"id": i, "prompt_token_ids": p, "max_new_tokens": 6}
                for i, p in enumerate(prompts)]
    requests.append({"id": "text", "prompt": "t9 t40 t3", "max_new_tokens": 4})
    results = gen.generate(requests)
    assert all(r.error is None for r in results), [r.error for r in results]
    prompts.append([9, 40, 3])
    traces.save(tmp_path / "t.npz", traces.from_results(
        results, prompts, ["a", None, "b", None], config=gen.config, router_inputs=True,
        model=path))
    trace = traces.load(tmp_path / "t.npz")
    assert trace.domains == ["a", None, "b", None] and trace.model == path
    for prompt, result, req in zip(prompts, results, trace.requests, strict=True):
        assert req.generated_token_ids.tolist() == result.token_ids
        ids, weights, inputs = _hf_routing(hf, prompt + result.token_ids[:-1])
        n = len(prompt)
        ours = np.concatenate([req.prefill_experts, req.decode_experts], axis=1)
        np.testing.assert_array_equal(ours, ids)   # the ×20 router: no near-ties to reorder
        np.testing.assert_allclose(np.concatenate([req.prefill_weights, req.decode_weights],
                                                  axis=1), weights, atol=1e-5)
        np.testing.assert_allclose(req.prefill_router_inputs, inputs[:, :n], atol=1e-4)
        np.testing.assert_allclose(req.decode_router_inputs, inputs[:, n:], atol=1e-4)
