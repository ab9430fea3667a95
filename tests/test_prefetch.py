"""Speculative expert prefetch (``moejax.prefetch``) on the shipped demo model and the tiny
HF models: default vectors and the quasi predictor against NumPy references, exact
prefetch equal to resident decode with deliberately wrong predictions, speculative runs
that never fetch a miss, slot maps that never alias, device expert bytes within two
layers of k experts, the files' and options' errors, and the two commands."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax import checkpoint
from moejax.backends.base import BackendError
from moejax.decode.programs import StepOptions
from moejax.decode.factory import make_runner
from moejax.offload import ExpertSlots, HostExperts, slot_map_is_injective
from moejax.eldr.fitfile import model_fingerprint
from moejax.prefetch import defaults as defaults_lib
from moejax.prefetch import estimator as estimator_lib
from moejax.prefetch import predictors, replay
from moejax.prefetch.defaults import PrefetchFileError
from moejax.sequences import SequenceSpec
from serving.api import resolve_model_dir

from scheduler_runs import scheduler_tokens

PROMPTS_NEW = [(5, 8), (17, 6), (9, 10), (3, 7)]


def _synthetic_requests(rng, vocab: int, lengths=((16, 8),) * 6):
    """Trace-like requests (prompt, then generated tokens) for a replay."""
    return [SimpleNamespace(ok=True, prompt_token_ids=rng.integers(3, vocab, p).astype(np.int32),
                            generated_token_ids=rng.integers(3, vocab, g).astype(np.int32))
            for p, g in lengths]


def _run(runner, specs, batch=4, step="layerwise"):
    return scheduler_tokens(runner, specs, batch, step)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo model, its calibrated default vectors, an untrained (deliberately wrong)
    estimator naming layers 1 and 2 for the hybrid, and resident decode's tokens."""
    cfg, params, _ = checkpoint.load_model_dir(resolve_model_dir("demo")[0], "float32")
    rng = np.random.default_rng(0)
    states = replay.replay(cfg, params, _synthetic_requests(rng, cfg.vocab_size))
    vectors = defaults_lib.calibrate(cfg, params, states.router_input, states.experts,
                                     model="demo", requests=6)
    folder = tmp_path_factory.mktemp("prefetch")
    files = {"defaults": str(folder / "defaults.npz"), "estimator": str(folder / "est.npz")}
    defaults_lib.save(files["defaults"], vectors)
    est_cfg = estimator_lib.EstimatorConfig(hidden_size=cfg.hidden_size,
                                            num_experts=cfg.num_experts,
                                            num_layers=cfg.num_layers, width=32, ffn_width=64)
    estimator_lib.save(files["estimator"], est_cfg, estimator_lib.init_params(est_cfg, 3),
                       {"model": "demo", "hybrid_layers": "1,2",
                        "fingerprint": model_fingerprint(cfg, params["layers"]["router"])})
    specs = [SequenceSpec(prompt=tuple(int(t) for t in rng.integers(3, 1024, n)),
                          max_new_tokens=m) for n, m in PROMPTS_NEW]
    resident = make_runner("resident", cfg, params, dtype="float32", opts=StepOptions())
    return SimpleNamespace(cfg=cfg, params=params, states=states, vectors=vectors,
                           files=files, specs=specs, resident=_run(resident, specs, step="fused"))


def _prefetch_runner(demo, prefetch, mode="exact", **options):
    return make_runner("offload", demo.cfg, demo.params, dtype="float32", opts=StepOptions(),
                       prefetch=prefetch, prefetch_mode=mode,
                       prefetch_files=[demo.files["defaults"], demo.files["estimator"]],
                       **options)


# ----------------------------------------------------------------------------- references
def _swiglu64(x, w_gate, w_up, w_down):
    gate, up = x @ w_gate, x @ w_up
    return (gate / (1.0 + np.exp(-gate)) * up) @ w_down


def test_default_vectors_match_a_numpy_loop(demo):
    """Each expert's mean output over the tokens that chose it, in float64 token by token."""
    layers = {k: np.asarray(v, np.float64) for k, v in demo.params["layers"].items()}
    x, ids = demo.states.router_input[:, :40], demo.states.experts[:, :40]
    got, counts = defaults_lib.default_vectors(demo.params, x, ids)
    num_layers, num_experts = counts.shape
    want = np.zeros((num_layers, num_experts, x.shape[-1]))
    for layer in range(num_layers):
        for t in range(x.shape[1]):
            for e in ids[layer, t]:
                want[layer, e] += _swiglu64(x[layer, t].astype(np.float64), layers["w_gate"][layer, e],
                                            layers["w_up"][layer, e], layers["w_down"][layer, e])
        np.testing.assert_array_equal(counts[layer],
                                      np.bincount(ids[layer].ravel(), minlength=num_experts))
    want /= np.maximum(counts, 1)[..., None]
    np.testing.assert_array_equal(got[counts == 0], 0.0)   # an unchosen expert: zeros
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def _rms64(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _hf_states(hf, tokens):
    """Per layer from PyTorch hooks: the post-attention residual r_l (the input of the
    post-attention norm), the router input (its output), HF's top-k ids and weights."""
    import torch

    seen: dict[str, list] = {"residual": [], "router_input": [], "weights": [], "ids": []}

    def norm_hook(_module, args, out):     # returns None: the output stays as it is
        seen["residual"].append(args[0][0].double().numpy())
        seen["router_input"].append(out[0].double().numpy())

    def gate_hook(_module, _args, out):
        seen["weights"].append(out[1].double().numpy())
        seen["ids"].append(out[2].numpy())

    hooks = []
    for layer in hf.model.layers:
        hooks.append(layer.post_attention_layernorm.register_forward_hook(norm_hook))
        hooks.append(layer.mlp.gate.register_forward_hook(gate_hook))
    try:
        with torch.no_grad():
            hf(torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    return {k: np.stack(v) for k, v in seen.items()}


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_quasi_prediction_matches_numpy_on_hf_models(kind, tmp_path):
    """q_0 = Norm_1(r_0 + Σ g·d_0) and router_1(q_0) in float64 NumPy from the PyTorch
    model's own residual, routing and expert weights, against our replay, calibration
    and predictor."""
    pytest.importorskip("torch", reason="needs torch (the 'parity' extra)")
    pytest.importorskip("transformers", reason="needs transformers (the 'parity' extra)")
    from hf_tiny_models import build_torch_model

    hf = build_torch_model(kind, {"tie_word_embeddings": False}, seed=2)
    hf.save_pretrained(tmp_path)
    cfg = checkpoint.load_model_config(tmp_path)
    params = checkpoint.load_hf_params(tmp_path, cfg, "float32")
    rng = np.random.default_rng(5)
    tokens = [int(t) for t in rng.integers(3, cfg.vocab_size, 24)]
    ref = _hf_states(hf, tokens)

    request = SimpleNamespace(ok=True, prompt_token_ids=np.array(tokens[:10], np.int32),
                              generated_token_ids=np.array(tokens[10:] + [0], np.int32))
    states = replay.replay(cfg, params, [request])
    np.testing.assert_allclose(states.residual, ref["residual"], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.sort(states.experts, -1), np.sort(ref["ids"], -1))

    # Default vectors of layer 0 from the PyTorch experts, on PyTorch's router inputs.
    sd = {k: v.double().numpy() for k, v in hf.state_dict().items()}
    gate_up, down = sd["model.layers.0.mlp.experts.gate_up_proj"], sd["model.layers.0.mlp.experts.down_proj"]
    f = gate_up.shape[1] // 2
    sums = np.zeros((cfg.num_experts, cfg.hidden_size))
    counts = np.zeros(cfg.num_experts)
    for t, chosen in enumerate(ref["ids"][0]):
        for e in chosen:
            sums[e] += _swiglu64(ref["router_input"][0, t], gate_up[e, :f].T, gate_up[e, f:].T,
                                 down[e].T)
            counts[e] += 1
    defaults0 = sums / np.maximum(counts, 1)[:, None]
    vectors = defaults_lib.calibrate(cfg, params, states.router_input, states.experts)
    np.testing.assert_allclose(vectors.defaults[0], defaults0, rtol=1e-4, atol=1e-4)

    # The quasi-hidden state and layer 1's routing on it, in NumPy.
    gates = ref["weights"][0]
    mixed = ref["residual"][0] + np.einsum("tk,tkd->td", gates, defaults0[ref["ids"][0]])
    q = _rms64(mixed, sd["model.layers.1.post_attention_layernorm.weight"], cfg.rms_norm_eps)
    logits = q @ sd["model.layers.1.mlp.gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want_ids = np.argsort(-probs, -1)[:, :cfg.num_experts_per_tok]
    want_w = np.take_along_axis(probs, want_ids, -1)
    if cfg.norm_topk_prob:
        want_w /= want_w.sum(-1, keepdims=True)

    tables = predictors.make_tables(cfg, vectors.defaults)
    weights, ids = predictors.PREDICT(params["layers"], tables, np.int32(0), states.residual[0],
                                      states.experts[0], states.weights[0], kind="quasi", cfg=cfg)
    order = np.argsort(np.asarray(ids), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, -1),
                                  np.sort(want_ids, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(want_w, np.argsort(want_ids, -1), -1),
                               rtol=2e-4, atol=2e-5)
    # The default vectors move the prediction away from the router baseline's.
    base, _ = predictors.PREDICT(params["layers"], tables, np.int32(0), states.residual[0],
                                 states.experts[0], states.weights[0], kind="router", cfg=cfg)
    assert np.abs(np.sort(np.asarray(base), -1) - np.sort(np.asarray(weights), -1)).max() > 1e-3


def test_predict_states_and_floors_agree_with_recall_definition(demo):
    """Offline predictions run the runtime's predictor; recall@k counts set overlap."""
    cfg, s = demo.cfg, demo.states
    tables = predictors.make_tables(cfg, demo.vectors.defaults)
    predicted = predictors.predict_states("router", cfg, demo.params["layers"], tables,
                                          s.residual, s.experts, s.weights)
    _, direct = predictors.PREDICT(demo.params["layers"], tables, np.int32(1), s.residual[1],
                                   s.experts[1], s.weights[1], kind="router", cfg=cfg)
    np.testing.assert_array_equal(predicted[2], np.asarray(direct))
    np.testing.assert_array_equal(predicted[0], s.experts[0])
    true = np.array([[[0, 1], [2, 3]]])
    assert predictors.recall_at_k(np.array([[[1, 5], [4, 6]]]), true).tolist() == [0.25]
    previous = predictors.floor_predictions("previous", s.experts, s.request)
    first = np.flatnonzero(np.r_[True, s.request[1:] != s.request[:-1]])
    assert (previous[1:, first] == -1).all()
    np.testing.assert_array_equal(previous[1:, first[0] + 1], s.experts[1:, first[0]])
    popular = predictors.floor_predictions("popularity", s.experts, s.request,
                                           demo.vectors.counts)
    assert set(popular[1, 0]) == set(np.argsort(-demo.vectors.counts[1], kind="stable")[:2])
    layers, threshold = predictors.hybrid_layers(np.array([1.0, 0.5, 0.9, 0.6]))
    assert layers == (1, 3) and threshold == pytest.approx(2.0 / 3.0)
    assert predictors.hybrid_layers(np.array([1.0, 0.5, 0.9]), 0.95) == ((1, 2), 0.95)


# ----------------------------------------------------------------------------- runtime
@pytest.mark.parametrize("prefetch", ["estimator", "hybrid", "quasi", "router", "oracle",
                                      "layer", "none"])
def test_exact_prefetch_equals_resident(demo, prefetch):
    """Exact mode computes with the true top-k: the untrained estimator predicts badly
    (forced misses, copied on demand) and the tokens still equal resident decode's."""
    runner = _prefetch_runner(demo, prefetch)
    assert _run(runner, demo.specs) == demo.resident
    stats = runner.stats
    assert stats.decode_rows == sum(m - 1 for _, m in PROMPTS_NEW)
    recall = stats.recall()
    if prefetch == "estimator":
        assert recall[1:].max() < 0.7                  # wrong on purpose ...
        assert stats.on_demand_layers[1:].sum() > 0    # ... so misses came on demand
    if prefetch in ("oracle", "layer"):
        np.testing.assert_array_equal(recall[1:], 1.0)
        assert stats.on_demand_layers[1:].sum() == 0
    if prefetch == "none":
        assert stats.prefetched == 0 and stats.on_demand_layers[1:].sum() > 0
    else:
        assert stats.prefetched > 0
    assert stats.on_demand == stats.on_demand_layers.sum()


@pytest.mark.parametrize("prefetch", ["router", "estimator", "oracle"])
def test_speculative_never_fetches_a_miss(demo, prefetch):
    """Speculative mode computes layers >= 1 with the predicted experts and weights: no
    on-demand copy there; the oracle's prediction is the truth, so it equals resident."""
    runner = _prefetch_runner(demo, prefetch, mode="speculative")
    tokens = _run(runner, demo.specs)
    assert [len(t) for t in tokens] == [m for _, m in PROMPTS_NEW]
    stats = runner.stats
    if prefetch == "oracle":
        assert tokens == demo.resident
    else:
        assert stats.on_demand_layers[1:].sum() == 0 and stats.on_demand_layers[0] > 0
    if prefetch == "estimator":
        assert tokens != demo.resident     # an untrained estimator changes the tokens


def test_slot_maps_never_alias(demo, monkeypatch):
    """Random loads into a small slot buffer, and every load of a prefetch run: each
    expert id maps to its own slot, and that slot holds it."""
    rng = np.random.default_rng(1)
    stacks = np.broadcast_to((10 * np.arange(3)[:, None] + np.arange(8)).astype(np.float32)
                             [:, :, None, None], (3, 8, 2, 3))
    for kind in ("auto", None):         # pinned host memory (where JAX has it), and NumPy
        host = HostExperts({"w": stacks}, NamedSharding(Mesh(jax.devices()[:1], ("x",)), P(),
                                                        memory_kind="device"), kind)
        slots = ExpertSlots.empty(host, 4)
        for _ in range(60):
            layer = int(rng.integers(3))
            wanted = rng.choice(8, int(rng.integers(1, 5)), replace=False)
            slot_of, _ = slots.load(host, layer, wanted)
            assert slot_map_is_injective(slots, layer, slot_of)
            assert set(np.flatnonzero(slot_of >= 0)) >= set(wanted.tolist())
            got = np.asarray(slots.buffers["w"])[slot_of[wanted], 0, 0]
            np.testing.assert_array_equal(got, 10 * layer + wanted)
        assert not slot_map_is_injective(slots, 0, np.array([0, 0] + [-1] * 6))

    # Batch 2 of one-token prompts: at most 2k = 4 experts per layer, in 4 slots.
    specs = [SequenceSpec(prompt=(7,), max_new_tokens=8), SequenceSpec(prompt=(9,), max_new_tokens=8)]
    resident = make_runner("resident", demo.cfg, demo.params, dtype="float32",
                           opts=StepOptions())
    runner = _prefetch_runner(demo, "estimator", expert_slots=4)
    checked = []
    load = runner._load

    def checked_load(layer, wanted):
        slot_of, copied = load(layer, wanted)
        checked.append(slot_map_is_injective(runner.slots.slots(layer), layer, slot_of))
        return slot_of, copied

    monkeypatch.setattr(runner, "_load", checked_load)
    assert _run(runner, specs, batch=2) == _run(resident, specs, batch=2, step="fused")
    assert len(checked) > 20 and all(checked)


@pytest.mark.parametrize("mode", ["exact", "speculative"])
def test_device_expert_bytes_stay_within_two_layers_of_k(demo, mode):
    """Batch 1, expert_slots = k: the experts on the device (JAX's live arrays) never
    exceed two layers' worth of k experts, and exact decode still equals resident."""
    k = demo.cfg.num_experts_per_tok
    spec = SequenceSpec(prompt=(7,), max_new_tokens=6)
    resident = make_runner("resident", demo.cfg, demo.params, dtype="float32",
                           opts=StepOptions())
    runner = _prefetch_runner(demo, "estimator", mode, expert_slots=k, track_memory=True)
    tokens = _run(runner, [spec], batch=1)
    if mode == "exact":
        assert tokens == _run(resident, [spec], batch=1, step="fused")
    stats = runner.stats
    assert 0 < stats.peak_expert_bytes <= 2 * k * runner.expert_bytes
    assert runner.expert_bytes == 3 * demo.cfg.hidden_size * demo.cfg.moe_intermediate_size * 4
    with pytest.raises(BackendError, match="expert_slots"):
        _run(runner, [SequenceSpec(prompt=(7, 8, 9, 10), max_new_tokens=2)], batch=1)


# ----------------------------------------------------------------------------- errors
def test_prefetch_files_and_choices_are_checked(demo, tmp_path):
    cfg, params = demo.cfg, demo.params

    def make(prefetch, files, mode="exact"):
        return make_runner("offload", cfg, params, dtype="float32", opts=StepOptions(),
                           prefetch=prefetch, prefetch_mode=mode, prefetch_files=files)

    with pytest.raises(PrefetchFileError, match="needs default vectors"):
        make("quasi", [])
    with pytest.raises(PrefetchFileError, match="needs an estimator"):
        make("hybrid", [demo.files["defaults"]])
    with pytest.raises(PrefetchFileError, match="no such prefetch file"):
        make("quasi", [str(tmp_path / "missing.npz")])
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, x=np.zeros(3))
    with pytest.raises(PrefetchFileError, match="not a prefetch file"):
        make("quasi", [str(foreign)])
    with pytest.raises(PrefetchFileError, match="a second"):
        make("quasi", [demo.files["defaults"], demo.files["defaults"]])
    other = dict(params, layers=dict(params["layers"], router=params["layers"]["router"] * 2))
    with pytest.raises(PrefetchFileError, match="other weights"):
        make_runner("offload", cfg, other, dtype="float32", opts=StepOptions(),
                    prefetch="quasi", prefetch_files=[demo.files["defaults"]])
    with pytest.raises(PrefetchFileError, match="trained for other weights"):
        make_runner("offload", cfg, other, dtype="float32", opts=StepOptions(),
                    prefetch="router", prefetch_files=[demo.files["estimator"]])
    with pytest.raises(BackendError, match="prefetch must be one of"):
        make("psychic", [])
    with pytest.raises(BackendError, match="prefetch_mode must be one of"):
        make("router", [], mode="eager")
    with pytest.raises(BackendError, match="predicts none"):
        make("layer", [], mode="speculative")
    truncated = tmp_path / "bad_defaults.npz"
    arrays = dict(np.load(demo.files["defaults"]))
    arrays["defaults"] = arrays["defaults"][:, :, :5]
    np.savez(truncated, **arrays)
    with pytest.raises(PrefetchFileError, match=r"\[L, E, d\]"):
        make("quasi", [str(truncated)])
    del arrays["counts"]
    np.savez(truncated, **arrays)
    with pytest.raises(PrefetchFileError, match="'counts'"):
        defaults_lib.load(truncated)


def test_generator_prefetch_options(demo):
    from serving import Generator

    files = [demo.files["defaults"], demo.files["estimator"]]
    gen = Generator("demo", backend="offload", prefetch="quasi", prefetch_files=files,
                    dtype="float32", max_batch_size=4, max_prefill_tokens=32)
    requests = [{"id": i, "prompt_token_ids": list(s.prompt), "max_new_tokens": s.max_new_tokens,
                 "stop_token_ids": []} for i, s in enumerate(demo.specs)]
    results = gen.generate(requests)
    assert [list(r.token_ids) for r in results] == demo.resident
    for bad, match in (({"prefetch": "quasi"}, "backend='offload'"),
                       ({"backend": "offload", "prefetch": "psychic"}, "prefetch must be"),
                       ({"backend": "offload", "prefetch": "none",
                         "prefetch_mode": "speculative"}, "predicts none"),
                       ({"backend": "offload", "prefetch": "quasi", "step": "fused"},
                        "layerwise")):
        with pytest.raises(ValueError, match=match):
            Generator("demo", **bad)


# ----------------------------------------------------------------------------- commands
@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory):
    """A small expert trace of the demo model (router inputs included)."""
    from moejax import traces
    from serving import Generator

    gen = Generator("demo", dtype="float32", trace_experts=True, trace_router_inputs=True,
                    max_batch_size=8, max_prefill_tokens=64)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 1024, 12)] for _ in range(8)]
    results = gen.generate([{"id": i, "prompt_token_ids": p, "max_new_tokens": 6,
                             "stop_token_ids": []} for i, p in enumerate(prompts)])
    path = tmp_path_factory.mktemp("trace") / "demo.npz"
    traces.save(path, traces.from_results(results, prompts, config=gen.config,
                                          router_inputs=True, model="demo"))
    return str(path)


def test_calibrate_and_train_commands(demo_trace, tmp_path, capsys):
    from moejax.prefetch import train
    from serving import Generator, cli

    out = tmp_path / "defaults.npz"
    assert cli.main(["prefetch-calibrate", demo_trace, "-o", str(out)]) == 0
    vectors = defaults_lib.load(out)
    assert vectors.model == "demo" and vectors.calibration_requests == 6
    assert vectors.calibration_tokens == 6 * (12 + 5)
    assert "default vectors [4, 8, 128]" in capsys.readouterr().err

    est, summary = tmp_path / "est.npz", tmp_path / "est.json"
    assert train.main(["--model", "demo", "--traces", demo_trace, "-o", str(est),
                       "--defaults", str(out), "--steps", "30", "--batch-size", "64",
                       "--width", "32", "--ffn-width", "64", "--json", str(summary)]) == 0
    est_cfg, _, meta = estimator_lib.load(est)
    figures = json.loads(summary.read_text())
    assert est_cfg.width == 32 and meta["steps"] == 30 and meta["train_requests"] == 6
    assert figures["training_tokens"] == 30 * 64 and figures["param_count"] > 0
    assert figures["train_rows"] == 6 * 17 * 3
    assert train.main(["--model", "demo", "--traces", demo_trace, "-o", str(est),
                       "--steps", "0"]) == 2
    assert train.main(["--model", "demo-e32", "--traces", demo_trace, "-o", str(est)]) == 2
    assert "the model has L=6" in capsys.readouterr().err

    gen = Generator("demo", backend="offload", prefetch="hybrid", prefetch_mode="speculative",
                    prefetch_files=[str(out), str(est)], dtype="float32", max_batch_size=2,
                    max_prefill_tokens=32)
    results = gen.generate([{"id": 0, "prompt_token_ids": [5, 6, 7], "max_new_tokens": 5,
                             "stop_token_ids": []}])
    assert results[0].error is None and len(results[0].token_ids) == 5


def test_generate_command_with_prefetch(demo, tmp_path):
    from serving import cli

    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps({"id": i, "prompt_token_ids": list(s.prompt),
                                            "max_new_tokens": s.max_new_tokens,
                                            "stop_token_ids": []}) + "\n"
                                for i, s in enumerate(demo.specs)))
    out = tmp_path / "out.jsonl"
    argv = ["generate", str(requests), "-o", str(out), "--model", "demo", "--dtype", "float32",
            "--backend", "offload", "--max-prefill-tokens", "32"]
    assert cli.main([*argv, "--prefetch", "quasi", "--prefetch-mode", "exact",
                     "--prefetch-file", demo.files["defaults"]]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in results] == demo.resident
    assert cli.main([*argv, "--prefetch", "quasi"]) == 2           # no default vectors
