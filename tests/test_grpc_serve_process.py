"""``moejax serve`` as a real process: prints its port, turns SERVING once loaded, scores,
and on SIGTERM turns health NOT_SERVING and exits 0. (Set ``MOEJAX_GRPC_TEST_MODEL`` to
run it on another model than the demo.)"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.grpc import Client

MODEL = os.environ.get("MOEJAX_GRPC_TEST_MODEL", "demo")
T = 120  # seconds: bound on every wait (start-up includes loading the model)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(300)


def _lines(stream, sink: queue.Queue) -> None:
    for line in stream:
        sink.put(line)


def test_serve_process_scores_and_exits_0_on_sigterm(tmp_path):
    from serving.cli import main

    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, MOEJAX_TOKEN="t0ken")
    process = subprocess.Popen(
        [sys.executable, "-m", "serving.cli", "serve", "--model", MODEL, "--port", "0",
         "--max-batch-tokens", "32", "--grace-seconds", "10"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout: queue.Queue = queue.Queue()
    stderr: list[str] = []
    threading.Thread(target=_lines, args=(process.stdout, stdout), daemon=True).start()
    threading.Thread(target=lambda: stderr.extend(process.stderr), daemon=True).start()
    try:
        port = int(stdout.get(timeout=T).strip())  # the bound port, alone on one line
        target = f"127.0.0.1:{port}"
        with Client(target) as anonymous:  # health is open, scoring needs the token
            deadline = time.monotonic() + T
            while anonymous.health(timeout=T) != "SERVING":
                assert process.poll() is None and time.monotonic() < deadline, "".join(stderr)
                time.sleep(0.1)
            with pytest.raises(grpc.RpcError) as info:
                anonymous.info(timeout=T)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(target, token="t0ken") as client:  # the server took $MOEJAX_TOKEN
            results = client.score([
                {"id": "q", "prompt": "Is the sky blue?", "candidates": [" yes", " no"]},
                {"id": "bad", "prompt": "", "candidates": [" yes"]}], timeout=T)
            assert results[0].error is None and len(results[0].logprobs) == 2
            assert results[0].label == max(range(2), key=results[0].logprobs.__getitem__)
            assert results[1].error == "request 'bad': prompt: is empty"
            assert client.info(timeout=T)["vocab_size"] > 0
        assert main(["client", "health", "--target", target]) == 0

        watch = health_pb2_grpc.HealthStub(grpc.insecure_channel(target)).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=T)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert process.wait(timeout=T) == 0, "".join(stderr)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=T)
    log = "".join(stderr)
    assert "health SERVING" in log and "stopped" in log
    assert re.search(r"batch 1: \d+ requests", log)  # one log line per batch
