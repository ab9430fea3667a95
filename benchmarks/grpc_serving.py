"""gRPC serving: requests/s and p50/p99 latency at 1, 8 and 32 concurrent clients, and
served throughput over in-process ``Scorer.score`` throughput on the same workload.

The server (``serving.grpc.server.ScoringServer``, default options) runs in this process
with a Scorer; the clients run in a child process (so they do not compete for this
process's GIL, as real clients would not): ``C`` threads each send unary ``Score`` calls
back to back (closed loop) over one channel, ``--requests`` calls per concurrency level;
the batch shapes that micro-batches of 1..32 requests need are compiled first. Latency is
per call, at the client. The workload is single-token classification (two candidates) over
prompts of ``--prompt-words`` random words.

In-process throughput: the same requests through ``Scorer.score`` in one call (the best
case for batching), best of two runs after a warm-up; ``served_over_inprocess_32`` =
requests/s at 32 clients / in-process requests/s (target ≥ 0.8).

    python benchmarks/grpc_serving.py [--quick] [--model demo|DIR] [--json PATH]

JSON keys (flat): requests_per_s_{1,8,32}_clients, p50_ms_{c}_clients, p99_ms_{c}_clients,
mean_batch_requests_{c}_clients (requests per Scorer call on the server),
inprocess_requests_per_s, served_over_inprocess_32, requests_per_level, prompt_words,
mean_prompt_tokens, max_batch_tokens, load_average_at_start, cpus.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.figures import write_json  # noqa: E402

CONCURRENCY = (1, 8, 32)
FULL = dict(requests=2000, prompt_words=48)
QUICK = dict(requests=256, prompt_words=48)
WORDS = ("the", "food", "was", "great", "service", "slow", "price", "fair", "room", "clean",
         "staff", "kind", "view", "nice", "noisy", "street", "bed", "small", "coffee", "cold")


def workload(count: int, words: int, seed: int = 0) -> list[dict]:
    """Classification requests over random-word reviews (distinct prompts)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [{"id": i, "prompt": "Review: " + " ".join(rng.choice(WORDS, words)) + "\nSentiment:",
             "candidates": [" positive", " negative"]} for i in range(count)]


# ----------------------------------------------------------------------------- client side
def _client_process(target: str, payloads: list[bytes], concurrency: int, out) -> None:
    """Child process: ``concurrency`` threads send the payloads as unary Score calls."""
    import grpc

    channel = grpc.insecure_channel(target)
    call = channel.unary_unary("/moejax.v1.Scoring/Score")  # bytes in, bytes out
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    next_index = iter(range(len(payloads)))

    def run() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            start = time.perf_counter()
            try:
                call(payloads[index], timeout=120)
            except grpc.RpcError as exc:
                with lock:
                    failures.append(exc.code().name)
                continue
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)

    threads = [threading.Thread(target=run) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put({"wall": time.perf_counter() - start, "latencies": latencies, "failures": failures})


def drive(target: str, payloads: list[bytes], concurrency: int) -> dict:
    """Run the clients in a child process; their wall time, latencies and failures."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=_client_process, args=(target, payloads, concurrency, out))
    child.start()
    result = out.get(timeout=900)
    child.join(60)
    return result


# ----------------------------------------------------------------------------- server side
def warm_shapes(scorer, requests: list[dict], largest: int) -> None:
    """Compile the batch shapes that micro-batches of 1..``largest`` requests produce
    (token and position buckets are powers of two), outside the timed runs."""
    sizes = sorted({1, 2, 3, 4, 6, 8, 9, 12, 16, 17, 24, 32, 33, largest} - {0})
    for size in sizes:
        if size <= largest:
            scorer.score(requests[:size], progress=False)


def inprocess_rate(scorer, requests: list[dict]) -> float:
    """Requests/s of ``Scorer.score`` on the whole list; best of two after a warm-up."""
    scorer.score(requests, progress=False)
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        scorer.score(requests, progress=False)
        best = max(best, len(requests) / (time.perf_counter() - start))
    return best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (under a minute)")
    parser.add_argument("--json", dest="json_path", help="write the figures to this JSON file")
    parser.add_argument("--model", default="demo", help="model directory or 'demo'")
    parser.add_argument("--requests", type=int, help="timed calls per concurrency level")
    parser.add_argument("--prompt-words", type=int, help="words per prompt")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="Scorer max_batch_tokens (default: the Scorer's)")
    args = parser.parse_args(argv)
    shape = dict(QUICK if args.quick else FULL)
    if args.requests is not None:
        shape["requests"] = args.requests
    if args.prompt_words is not None:
        shape["prompt_words"] = args.prompt_words

    from serving import Scorer
    from serving.grpc import convert
    from serving.grpc.server import ScoringServer, ServerOptions
    from serving.requests import parse_request

    load = os.getloadavg()[0]
    scorer = Scorer(args.model, max_batch_tokens=args.max_batch_tokens,
                    compilation_cache="auto")
    requests = workload(shape["requests"], shape["prompt_words"])
    payloads = [convert.request_to_proto(parse_request(r, i)).SerializeToString()
                for i, r in enumerate(requests)]
    prompt_tokens = [r.prompt_tokens for r in scorer.score(requests[:64], progress=False)]
    figures: dict = {"requests_per_level": shape["requests"],
                     "prompt_words": shape["prompt_words"],
                     "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens),
                     "max_batch_tokens": scorer.info["max_batch_tokens"],
                     "load_average_at_start": load, "cpus": os.cpu_count()}
    print(f"{shape['requests']} unary Score calls per level, prompts of "
          f"{figures['mean_prompt_tokens']:.0f} tokens, 2 candidates; model {args.model}, "
          f"max_batch_tokens {figures['max_batch_tokens']}; load average {load:.2f} on "
          f"{os.cpu_count()} CPUs")
    warm_shapes(scorer, requests, max(CONCURRENCY))
    figures["inprocess_requests_per_s"] = inprocess_rate(scorer, requests)
    print(f"in-process Scorer.score: {figures['inprocess_requests_per_s']:8.1f} requests/s")

    server = ScoringServer(ServerOptions(port=0))
    target = f"127.0.0.1:{server.start()}"
    server.attach(scorer)
    try:
        for concurrency in CONCURRENCY:
            before = server.stats()
            result = drive(target, payloads, concurrency)
            after = server.stats()
            if result["failures"]:
                raise RuntimeError(f"{len(result['failures'])} calls failed at {concurrency} "
                                   f"clients: {sorted(set(result['failures']))}")
            latencies = sorted(result["latencies"])
            key = f"{concurrency}_clients"
            figures[f"requests_per_s_{key}"] = len(latencies) / result["wall"]
            figures[f"p50_ms_{key}"] = 1000 * latencies[len(latencies) // 2]
            figures[f"p99_ms_{key}"] = 1000 * latencies[min(len(latencies) - 1,
                                                            int(0.99 * len(latencies)))]
            batches = after["batches"] - before["batches"]
            figures[f"mean_batch_requests_{key}"] = (after["requests"] - before["requests"]) / \
                max(batches, 1)
            print(f"{concurrency:2d} clients: {figures[f'requests_per_s_{key}']:8.1f} requests/s, "
                  f"p50 {figures[f'p50_ms_{key}']:7.1f} ms, "
                  f"p99 {figures[f'p99_ms_{key}']:7.1f} ms, "
                  f"{figures[f'mean_batch_requests_{key}']:.1f} requests per Scorer call")
    finally:
        server.stop(5)
    ratio = figures["requests_per_s_32_clients"] / figures["inprocess_requests_per_s"]
    figures["served_over_inprocess_32"] = ratio
    verdict = "meets" if ratio >= 0.8 else "MISSES"
    print(f"served at 32 clients / in-process: {ratio:.2f} (target ≥ 0.8: {verdict})")
    write_json(args.json_path, figures)
    return figures


if __name__ == "__main__":
    main()
