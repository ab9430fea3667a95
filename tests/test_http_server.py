"""The HTTP door (serving/http): a real uvicorn server on a real socket, on the gRPC
server's engine, driven with curl and urllib. Results equal the in-process Scorer's and
the gRPC door's; errors come in the OpenAI error shape with the right status; the two
doors share one admission bound; /ready follows loading and draining; /metrics counts
the HTTP calls."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serving import Scorer  # noqa: E402
from serving.grpc import Client  # noqa: E402
from serving.grpc.server import ScoringServer, ServerOptions  # noqa: E402
from serving.http import HttpOptions, HttpServer  # noqa: E402

T = 60
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUESTS = [
    {"id": "q1", "prompt": "Is the sky blue?", "candidates": [" yes", " no"]},
    {"id": 7, "kind": "choice", "prompt": "Which is a number?",
     "candidates": ["seven", "table"]},
    {"id": "m", "kind": "multi", "prompt": "Article: the team won the final.",
     "candidates": ["sports", "music"]},
    {"id": "ids", "prompt_token_ids": [5, 6, 7, 8], "candidate_token_ids": [[9], [10, 11]],
     "normalize": "vocab"},
]


class GatedScorer:
    """The Scorer with a gate that can hold model calls (to fill the queue)."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def run_ops(self, ops, on_batch_done=None):
        self.entered.set()
        assert self.gate.wait(T), "the test left the gate closed"
        return self.scorer.run_ops(ops, on_batch_done)


@pytest.fixture(scope="module")
def scorer() -> GatedScorer:
    return GatedScorer(Scorer("demo", max_batch_tokens=64, calibrate=False))


@contextlib.contextmanager
def doors(scorer, attach=True, token=None, **grpc_options):
    grpc_server = ScoringServer(ServerOptions(port=0, grace_seconds=5, token=token,
                                              **grpc_options))
    grpc_port = grpc_server.start()
    http = HttpServer(grpc_server, HttpOptions(port=0, token=token))
    http.start()
    if attach:
        grpc_server.attach(scorer)
    try:
        yield grpc_server, http, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http.port}"
    finally:
        scorer.gate.set()
        grpc_server.stop(2)
        http.stop(5)


def call(url: str, body=None, token=None, method=None):
    """(status, headers, parsed JSON or text) of one request (urllib: a real socket)."""
    data = None if body is None else (body if isinstance(body, bytes)
                                      else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method or (
        "GET" if data is None else "POST"))
    request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=T) as response:
            status, headers, raw = response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        status, headers, raw = error.code, error.headers, error.read()
    text = raw.decode()
    try:
        return status, headers, json.loads(text)
    except json.JSONDecodeError:
        return status, headers, text


def curl(url: str, body: dict) -> dict:
    """A curl-shaped request, by curl itself (by urllib, the same request, where the
    machine has no curl)."""
    if shutil.which("curl") is None:
        return call(url, body)[2]
    out = subprocess.run(["curl", "-sS", "-X", "POST", url, "-H",
                          "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, timeout=T, check=True)
    return json.loads(out.stdout)


def same(got: dict, want) -> None:
    assert (got["id"], got["error"], got["label"], got.get("selected")) == (
        want.id, want.error, want.label, want.selected)
    if want.logprobs is not None:
        np.testing.assert_allclose(got["logprobs"], want.logprobs, rtol=1e-5, atol=1e-6)


def test_score_over_http_equals_the_scorer_and_the_grpc_door(scorer):
    reference = scorer.scorer.score(REQUESTS)
    with doors(scorer) as (_, _, grpc_target, base):
        url = base + "/v1/moejax/score"
        for request, want in zip(REQUESTS, reference):
            same(curl(url, request), want)                       # one object, one result
        bad = {"id": "bad", "prompt": "", "candidates": [" a"]}
        status, _, body = call(url, {"requests": REQUESTS[:2] + [bad] + REQUESTS[2:]})
        assert status == 200
        results = body["results"]
        assert [r["id"] for r in results] == ["q1", 7, "bad", "m", "ids"]
        assert "prompt" in results[2]["error"]                  # its own error, named
        for got, want in zip(results[:2] + results[3:], reference):
            same(got, want)
        with Client(grpc_target) as client:                     # the other door, same engine
            for got, want in zip(client.score(REQUESTS, timeout=T), results[:2] + results[3:]):
                assert got.label == want["label"]
                np.testing.assert_allclose(got.logprobs, want["logprobs"], rtol=1e-5,
                                           atol=1e-6)


def test_sglang_and_vllm_shapes_give_the_native_numbers(scorer):
    """SGLang's /v1/score, vLLM's /score and /rerank, and /classify, each against the
    native request it maps onto (serving/http/shapes.py), on one server."""
    with doors(scorer) as (_, _, _, base):
        def native(request):
            status, _, body = call(base + "/v1/moejax/score", request)
            assert status == 200, body
            return np.exp(body["logprobs"])

        def post(path, body):
            status, _, answer = call(base + path, body)
            assert status == 200, answer
            return answer

        # SGLang: query + item, label token probabilities (vocab, or softmax over labels).
        got = post("/v1/score", {"query": [5, 6, 7], "items": [[8], [8, 9]],
                                 "label_token_ids": [9, 10, 11], "model": "demo"})
        for item, scores in zip([[8], [8, 9]], got["scores"]):
            want = native({"prompt_token_ids": [5, 6, 7] + item, "normalize": "vocab",
                           "candidate_token_ids": [[9], [10], [11]]})
            np.testing.assert_allclose(scores, want, rtol=1e-5)
        got = post("/v1/score", {"query": " blue?", "items": ["Is the sky", "Is grass"],
                                 "label_token_ids": [9, 10], "apply_softmax": True,
                                 "item_first": True})
        want = native({"prompt": "Is grass blue?", "candidate_token_ids": [[9], [10]],
                       "normalize": "candidates"})
        np.testing.assert_allclose(got["scores"][1], want, rtol=1e-5)
        assert abs(sum(got["scores"][0]) - 1) < 1e-6
        # vLLM /score and /rerank: relevance = P(yes) of the "multi" kind.
        docs = ["The team won the final.", "A new album came out.", "Rain is likely."]
        want = native({"kind": "multi", "prompt": "Query: sports news", "candidates": docs})
        got = post("/score", {"text_1": "Query: sports news", "text_2": docs})
        np.testing.assert_allclose([d["score"] for d in got["data"]], want, rtol=1e-5)
        assert [d["index"] for d in got["data"]] == [0, 1, 2]
        got = post("/score", {"text_1": ["Query: sports news"] * 2 + ["Query: weather"],
                              "text_2": docs})
        np.testing.assert_allclose([d["score"] for d in got["data"]][:2], want[:2], rtol=1e-5)
        got = post("/rerank", {"query": "Query: sports news", "top_n": 2,
                               "documents": [docs[0], {"text": docs[1]}, docs[2]]})
        order = list(np.argsort(-want, kind="stable")[:2])
        assert [r["index"] for r in got["results"]] == order
        np.testing.assert_allclose([r["relevance_score"] for r in got["results"]],
                                   want[order], rtol=1e-5)
        assert got["results"][0]["document"]["text"] == docs[order[0]]
        # /classify: probabilities over the label candidates.
        inputs = ["Article: the team won.", "Article: a new album."]
        got = post("/classify", {"input": inputs, "labels": ["sports", "music", "weather"]})
        for text, entry in zip(inputs, got["data"]):
            want = native({"prompt": text, "candidates": ["sports", "music", "weather"],
                           "normalize": "candidates"})
            np.testing.assert_allclose(entry["probs"], want, rtol=1e-5)
            assert entry["label"] == ["sports", "music", "weather"][int(np.argmax(want))]
        # Bad bodies: 400 naming the field.
        status, _, body = call(base + "/v1/score", {"query": "q", "items": [[1]],
                                                    "label_token_ids": [1]})
        assert status == 400 and "token ids" in body["error"]["message"]
        status, _, body = call(base + "/classify", {"input": "x", "labels": ["one"]})
        assert status == 400 and body["error"]["param"] == "labels"
        status, _, body = call(base + "/rerank", {"query": "q", "documents": ["d"], "topn": 1})
        assert status == 400 and body["error"]["param"] == "topn"
        status, _, body = call(base + "/score", {"text_1": ["a", "b"], "text_2": ["c"]})
        assert status == 400 and "equal lengths" in body["error"]["message"]
        status, _, body = call(base + "/v1/score", {"query": [5], "items": [[6]],
                                                    "label_token_ids": [10 ** 9]})
        assert status == 400 and "candidate_token_ids" in body["error"]["message"]


def test_errors_come_in_the_openai_shape_with_their_status(scorer):
    with doors(scorer) as (_, _, _, base):
        url = base + "/v1/moejax/score"
        status, _, body = call(url, {"prompt": "x", "candidates": [" a"], "kind": "sideways"})
        assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
        assert "kind" in body["error"]["message"]
        status, _, body = call(url, b"{not json")
        assert status == 400 and "not JSON" in body["error"]["message"]
        status, _, body = call(url, {"requests": {"prompt": "x"}})
        assert status == 400 and body["error"]["param"] == "requests"
        status, _, body = call(url, {"requests": [], "extra": 1})
        assert status == 400 and body["error"]["param"] == "extra"
        status, _, body = call(url, {"requests": [REQUESTS[0]] * 300})
        assert status == 413 and body["error"]["code"] == "batch_too_large"
        status, _, body = call(base + "/v1/nothing-here")
        assert status == 404 and body["error"]["type"] == "not_found_error"
        status, _, body = call(url, {"requests": []})
        assert status == 200 and body == {"results": []}


def test_ready_follows_loading_and_draining_and_health_is_always_up(scorer):
    with doors(scorer, attach=False) as (grpc_server, _, _, base):
        assert call(base + "/health")[0] == 200
        assert call(base + "/ready")[0] == 503
        assert call(base + "/v1/models")[0] == 503
        status, _, body = call(base + "/v1/moejax/score", REQUESTS[0])
        assert status == 503 and body["error"]["code"] == "not_ready"
        grpc_server.attach(scorer)
        assert call(base + "/ready")[0] == 200
        status, _, body = call(base + "/v1/models")
        assert status == 200 and [m["id"] for m in body["data"]] == ["demo"]
        grpc_server.draining.set()             # what a stop does first: not ready, but
        assert call(base + "/ready")[0] == 503  # calls are answered through the drain
        assert call(base + "/v1/moejax/score", REQUESTS[0])[0] == 200
        grpc_server.service.stopping.set()     # after the drain: refused
        assert call(base + "/v1/moejax/score", REQUESTS[0])[0] == 503
        assert call(base + "/health")[0] == 200


def test_bearer_token_and_one_admission_bound_for_both_doors(scorer):
    token = "s3cret"
    with doors(scorer, token=token, max_queued_tokens=64) as (grpc_server, _, _, base):
        url = base + "/v1/moejax/score"
        status, _, body = call(url, REQUESTS[0])
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert call(url, REQUESTS[0], token="wrong")[0] == 401
        assert call(base + "/health")[0] == 200 and call(base + "/metrics")[0] == 200
        assert call(url, REQUESTS[0], token=token)[0] == 200
        # The worker holds one request; the queue's bound is then full for another.
        scorer.gate.clear()
        scorer.entered.clear()
        first = threading.Thread(target=call, args=(url, {"prompt": "a" * 30, "candidates":
                                                          [" a", " b"]}, token))
        first.start()
        assert scorer.entered.wait(T)
        status, headers, body = call(url, {"prompt": "b" * 40, "candidates": [" a", " b"]},
                                     token=token)
        assert status == 429 and body["error"]["code"] == "overloaded"
        assert int(headers["Retry-After"]) >= 1 and int(headers["retry-after-ms"]) > 0
        status, _, body = call(url, {"prompt": "c" * 200, "candidates": [" a"]}, token=token)
        assert status == 413 and "split" in body["error"]["message"]   # over the whole bound
        scorer.gate.set()
        first.join(T)
        assert grpc_server.stats()["peak_queued_tokens"] <= 64


def test_metrics_count_the_http_calls(scorer):
    from prometheus_client.parser import text_string_to_metric_families

    def samples(base):
        text = call(base + "/metrics")[2]
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    with doors(scorer) as (_, _, _, base):
        before = samples(base)
        call(base + "/v1/moejax/score", {"requests": REQUESTS[:2] + [{"prompt": ""}]})
        after = samples(base)

    def moved(**labels):
        key = ("moejax_requests_total", tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    endpoint = "/v1/moejax/score"
    assert moved(endpoint=endpoint, kind="classify", status="ok") == 1
    assert moved(endpoint=endpoint, kind="choice", status="ok") == 1
    assert moved(endpoint=endpoint, kind="classify", status="error") == 1


@pytest.mark.slow
def test_moejax_serve_http_port_serves_then_drains_on_sigterm():
    """``moejax serve --port 0 --http-port 0``: the second stdout line is the HTTP port;
    /ready turns 200 once loaded; after SIGTERM it says 503 through the drain window while
    calls are still answered; then the process exits 0."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    process = subprocess.Popen(
        [sys.executable, "-m", "serving.cli", "serve", "--model", "demo", "--port", "0",
         "--http-port", "0", "--max-batch-tokens", "64", "--drain-seconds", "3",
         "--grace-seconds", "5", "--no-generation"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        int(process.stdout.readline())
        base = f"http://127.0.0.1:{int(process.stdout.readline())}"
        deadline = time.monotonic() + 150
        while call(base + "/ready")[0] != 200:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        assert curl(base + "/v1/moejax/score", REQUESTS[0])["error"] is None
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while call(base + "/ready")[0] != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert curl(base + "/v1/moejax/score", REQUESTS[1])["error"] is None   # draining
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


@pytest.mark.slow
def test_64_clients_a_burst_over_the_bound_each_request_answered_once(scorer):
    """The HTTP twin of the gRPC bounded-load test: 64 clients at once (single requests
    and batches, valid and not) against a small admission bound. Each request is answered
    exactly once: its result (equal to the in-process Scorer's), its own error, or the
    call's 429 with Retry-After; /health answers throughout; the bound holds."""
    valid = [{"prompt": f"w{k} w{k % 7}", "candidates": [" yes", " no"]} for k in range(12)]
    invalid = [{"prompt": "", "candidates": [" yes"]}, {"prompt": "x", "candidates": [" a", ""]}]
    expected = {json.dumps(r, sort_keys=True): res
                for r, res in zip(valid, scorer.scorer.score(valid))}
    clients, calls, bound = 64, 6, 256
    answers: dict[str, list] = {}
    lock = threading.Lock()
    health: list[int] = []
    done = threading.Event()

    def record(request, what, value):
        with lock:
            answers.setdefault(request["id"], []).append((what, request, value))

    def client(c: int, url: str) -> None:
        rng = np.random.default_rng(c)
        for k in range(calls):
            chunk = []
            for j in range(1 if k % 2 else 3):
                pool = valid if rng.random() < 0.85 else invalid
                chunk.append({"id": f"{c}-{k}-{j}", **pool[int(rng.integers(len(pool)))]})
            body = chunk[0] if len(chunk) == 1 else {"requests": chunk}
            status, headers, answer = call(url, body)
            if status == 429:
                assert int(headers["Retry-After"]) >= 1
                for request in chunk:
                    record(request, "busy", None)
            elif len(chunk) == 1:
                record(chunk[0], "result" if status == 200 else "invalid",
                       answer.get("logprobs") if status == 200 else status)
            else:
                assert status == 200, answer
                for request, result in zip(chunk, answer["results"], strict=True):
                    record(request, "result" if result["error"] is None else "error",
                           result["logprobs"])

    def watch(base: str) -> None:
        while not done.is_set():
            health.append(call(base + "/health")[0])
            time.sleep(0.05)

    with doors(scorer, max_queued_tokens=bound) as (grpc_server, _, _, base):
        watcher = threading.Thread(target=watch, args=(base,))
        watcher.start()
        workers = [threading.Thread(target=client, args=(c, base + "/v1/moejax/score"))
                   for c in range(clients)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(240)
        done.set()
        watcher.join(T)
        assert not any(worker.is_alive() for worker in workers)
        stats = grpc_server.stats()
    sent = sum(3 if k % 2 == 0 else 1 for k in range(calls)) * clients
    assert len(answers) == sent and all(len(v) == 1 for v in answers.values())
    outcomes = {"result": 0, "error": 0, "invalid": 0, "busy": 0}
    for [(what, request, value)] in answers.values():
        outcomes[what] += 1
        key = json.dumps({k: v for k, v in request.items() if k != "id"}, sort_keys=True)
        if what == "result":
            np.testing.assert_allclose(value, expected[key].logprobs, rtol=1e-5, atol=1e-6)
        elif what in ("error", "invalid"):
            assert key not in expected and (what == "error" or value == 400)
    assert outcomes["result"] > 0 and outcomes["busy"] > 0, outcomes   # a real burst
    assert health and set(health) == {200}
    assert stats["peak_queued_tokens"] <= bound and stats["queued_tokens"] == 0
