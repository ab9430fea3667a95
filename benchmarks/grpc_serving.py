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

    python -m benchmarks.grpc_serving [--quick] [--model demo|DIR] [--json PATH]

Overload (after the throughput levels, same server): a burst of ``--burst`` large requests
(long prompts, ``BURST_CANDIDATES`` two-token candidates each) sent at once, plus a steady
trickle of small requests (one every ``TRICKLE_SECONDS``) and health probes (one every
``HEALTH_SECONDS``) until the burst is answered. Refused calls (RESOURCE_EXHAUSTED) are
retried after the server's ``retry-after-ms`` hint, as a well-behaved client does; a call
that fails otherwise, or is still unanswered at the deadline, is lost.

JSON keys (flat): requests_per_s_{1,8,32}_clients, p50_ms_{c}_clients, p99_ms_{c}_clients,
mean_batch_requests_{c}_clients (requests per model call on the server),
inprocess_requests_per_s, served_over_inprocess_32, requests_per_level, prompt_words,
mean_prompt_tokens, max_batch_tokens, load_average_at_start, cpus; overload:
small_request_p99_ms_under_burst, small_request_p50_ms_under_burst,
health_p99_ms_under_burst (target <= 1000), health_max_ms_under_burst, peak_rss_mib,
rss_before_burst_mib, requests_lost (target 0), burst_requests, burst_prompt_tokens,
burst_seconds, burst_retries (refusals retried), small_requests_under_burst,
health_checks_under_burst, health_checks_failed.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

from benchmarks.lib.cli import bench_parser, parse_args, run_shape
from benchmarks.lib.compiles import timed_pass
from benchmarks.lib.load import closed_loop, in_child_process
from benchmarks.lib.meta import finish_run
from benchmarks.lib.timing import percentile, sample_seconds

CONCURRENCY = (1, 8, 32)
FULL = dict(requests=2000, prompt_words=48, burst=1000, burst_words=300)
QUICK = dict(requests=256, prompt_words=48, burst=100, burst_words=150)
BURST_CANDIDATES = 16     # two-token candidates of each large request
TRICKLE_SECONDS = 0.05    # one small request every ...
HEALTH_SECONDS = 0.05     # one health probe every ...
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

    def make_sender():
        def send(index: int) -> str | None:
            try:
                call(payloads[index], timeout=120)
            except grpc.RpcError as exc:
                return exc.code().name
            return None
        return send

    out.put(closed_loop(len(payloads), concurrency, make_sender))


def drive(target: str, payloads: list[bytes], concurrency: int) -> dict:
    """Run the clients in a child process; their wall time, latencies and failures."""
    return in_child_process(_client_process, target, payloads, concurrency)


# ----------------------------------------------------------------------------- overload
def burst_workload(count: int, words: int, seed: int = 1) -> list[dict]:
    """Large requests: long distinct prompts, each with BURST_CANDIDATES two-token
    candidates (token ids), so every request shares its prompt among its candidates."""
    import numpy as np

    rng = np.random.default_rng(seed)
    span = 1000 - 64    # candidate token ids in [64, 1000): distinct pairs per request

    def candidates() -> list[list[int]]:
        pairs = rng.choice(span * span, BURST_CANDIDATES, replace=False)
        return [[int(64 + p // span), int(64 + p % span)] for p in pairs]

    return [{"id": f"large-{i}", "prompt": "Review: " + " ".join(rng.choice(WORDS, words))
             + "\nVerdict:", "candidate_token_ids": candidates()} for i in range(count)]


def _retry_hint_ms(exc) -> float:
    metadata = dict(exc.trailing_metadata() or ())
    return float(metadata.get("retry-after-ms", 100))


def _small_call(call, payload: bytes, stop, latencies: list, lost: list) -> None:
    """One small Score; latency from the first send to the answer, refusals retried after
    their hint."""
    import grpc

    start = time.perf_counter()
    while True:
        try:
            call(payload, timeout=120)
            latencies.append(time.perf_counter() - start)
            return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                lost.append(exc.code().name)
                return
            time.sleep(_retry_hint_ms(exc) / 1000)


def _small_trickle(call, payloads: list[bytes], stop, latencies: list, lost: list) -> None:
    """A small Score every TRICKLE_SECONDS (each in its own thread: the trickle does not
    wait for answers) until ``stop``; then waits for the ones in flight."""
    threads = []
    for payload in payloads:
        if stop.is_set():
            break
        thread = threading.Thread(target=_small_call, args=(call, payload, stop, latencies, lost))
        thread.start()
        threads.append(thread)
        time.sleep(TRICKLE_SECONDS)
    for thread in threads:
        thread.join()


def _health_probes(target: str, stop, latencies: list, failures: list) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    check = health_pb2_grpc.HealthStub(grpc.insecure_channel(target)).Check
    while not stop.is_set():
        start = time.perf_counter()
        try:
            check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            latencies.append(time.perf_counter() - start)
        except grpc.RpcError as exc:
            failures.append(exc.code().name)
        time.sleep(HEALTH_SECONDS)


def _overload_process(target: str, large: list[bytes], small: list[bytes], deadline: float,
                      out) -> None:
    """Child process: the burst (all at once, refusals retried after their hint), the
    trickle of small requests and the health probes, until the burst is answered."""
    import heapq
    import random

    import grpc

    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", -1)])
    call = channel.unary_unary("/moejax.v1.Scoring/Score")
    stop = threading.Event()
    small_latencies, small_lost, health_latencies, health_failures = [], [], [], []
    helpers = [threading.Thread(target=_small_trickle,
                                args=(call, small, stop, small_latencies, small_lost)),
               threading.Thread(target=_health_probes,
                                args=(target, stop, health_latencies, health_failures))]
    for thread in helpers:
        thread.start()
    lock = threading.Condition()
    due: list[tuple[float, int]] = [(0.0, i) for i in range(len(large))]  # (time, index)
    answered: set[int] = set()
    lost: dict[int, str] = {}
    retries = [0]

    def on_done(index: int, future) -> None:
        with lock:
            error = future.exception()
            if error is None:
                answered.add(index)
            elif error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                retries[0] += 1
                wait = _retry_hint_ms(error) / 1000 * (1 + 0.2 * random.random())
                heapq.heappush(due, (time.perf_counter() + wait, index))
            else:
                lost[index] = error.code().name
            lock.notify()

    start = time.perf_counter()
    end = start + deadline
    with lock:
        while len(answered) + len(lost) < len(large) and time.perf_counter() < end:
            now = time.perf_counter()
            while due and due[0][0] <= now:
                _, index = heapq.heappop(due)
                future = call.future(large[index], timeout=max(1.0, end - now))
                future.add_done_callback(lambda f, i=index: on_done(i, f))
            lock.wait(min(0.05, max(0.0, due[0][0] - now)) if due else 0.05)
        burst_seconds = time.perf_counter() - start
        unanswered = len(large) - len(answered) - len(lost)
    stop.set()
    for thread in helpers:
        thread.join()
    out.put({"burst_seconds": burst_seconds, "answered": len(answered),
             "lost": len(lost) + unanswered + len(small_lost), "lost_codes": sorted(
                 set(lost.values()) | set(small_lost)), "retries": retries[0],
             "small": small_latencies, "health": health_latencies,
             "health_failures": health_failures})


def overload(target: str, large: list[bytes], small: list[bytes], deadline: float) -> dict:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=_overload_process, args=(target, large, small, deadline, out))
    child.start()
    result = out.get(timeout=deadline + 300)
    child.join(60)
    return result


def rss_mib(peak: bool = False) -> float:
    """This process's resident memory now (or its peak), MiB."""
    if peak:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure_overload(target: str, scorer, shape: dict, figures: dict) -> None:
    """The overload part (see the module docstring) -> its figures."""
    from serving.grpc import convert
    from serving.requests import parse_request

    large = burst_workload(shape["burst"], shape["burst_words"])
    payloads = [convert.request_to_proto(parse_request(r, i)).SerializeToString()
                for i, r in enumerate(large)]
    small = [convert.request_to_proto(parse_request(r, i)).SerializeToString()
             for i, r in enumerate(workload(100_000, 12, seed=2))]
    figures["burst_requests"] = len(large)
    figures["burst_prompt_tokens"] = scorer.prepare(large[0]).prompt_tokens
    # A first burst compiles the shapes that mixed batches need (seconds each on a CPU);
    # the figures are of the second.
    overload(target, payloads, small[len(small) // 2:], deadline=600.0)
    figures["rss_before_burst_mib"] = rss_mib()
    with timed_pass("overload_burst"):
        result = overload(target, payloads, small, deadline=600.0)
    figures["peak_rss_mib"] = rss_mib(peak=True)
    figures.update(
        small_request_p99_ms_under_burst=1000 * percentile(result["small"], 99),
        small_request_p50_ms_under_burst=1000 * percentile(result["small"], 50),
        health_p99_ms_under_burst=1000 * percentile(result["health"], 99),
        health_max_ms_under_burst=1000 * percentile(result["health"], 100),
        requests_lost=result["lost"], burst_seconds=result["burst_seconds"],
        burst_retries=result["retries"], small_requests_under_burst=len(result["small"]),
        health_checks_under_burst=len(result["health"]),
        health_checks_failed=len(result["health_failures"]))
    print(f"overload: {len(large)} large requests ({figures['burst_prompt_tokens']} prompt "
          f"tokens, {BURST_CANDIDATES} candidates) at once, answered in "
          f"{result['burst_seconds']:.1f} s ({result['retries']} refusals retried after their "
          f"hint); lost {result['lost']} {result['lost_codes'] or ''}")
    print(f"  small requests under the burst: {len(result['small'])}, p50 "
          f"{figures['small_request_p50_ms_under_burst']:.0f} ms, p99 "
          f"{figures['small_request_p99_ms_under_burst']:.0f} ms")
    print(f"  health: {len(result['health'])} probes, p99 "
          f"{figures['health_p99_ms_under_burst']:.1f} ms, max "
          f"{figures['health_max_ms_under_burst']:.1f} ms, {len(result['health_failures'])} "
          f"failed (target p99 <= 1000 ms)")
    print(f"  resident memory: {figures['rss_before_burst_mib']:.0f} MiB before, peak "
          f"{figures['peak_rss_mib']:.0f} MiB")


# ----------------------------------------------------------------------------- server side
def warm_shapes(scorer, requests: list[dict], largest: int) -> None:
    """Compile the batch shapes that micro-batches of 1..``largest`` requests produce
    (token and position buckets are powers of two), outside the timed runs. Each size
    runs twice, on its shortest and on its longest requests (by prompt tokens): a batch
    of n of these prompts (lengths within a factor 2 of each other) needs the token
    buckets of the n shortest or of the n longest, and the first n requests alone may
    miss one (a lone 124-token prompt needs a 128-token bucket, the first one 256)."""
    sizes = sorted({1, 2, 3, 4, 6, 8, 9, 12, 16, 17, 24, 32, 33, largest} - {0})
    by_length = sorted(requests, key=lambda request: scorer.prepare(request).prompt_tokens)
    for size in sizes:
        if size <= largest:
            for group in (by_length[:size], by_length[-size:]):
                scorer.score(group, progress=False)


def inprocess_rate(scorer, requests: list[dict]) -> float:
    """Requests/s of ``Scorer.score`` on the whole list; best of two after a warm-up."""
    seconds = sample_seconds(lambda: scorer.score(requests, progress=False), 2,
                             label="inprocess")
    return len(requests) / min(seconds)


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, quick_help="fewer requests (under a minute)", model="demo")
    parser.add_argument("--requests", type=int, help="timed calls per concurrency level")
    parser.add_argument("--prompt-words", type=int, help="words per prompt")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="Scorer max_batch_tokens (default: the Scorer's)")
    parser.add_argument("--burst", type=int, help="large requests in the overload burst "
                                                 "(0: no overload part)")
    args = parse_args(parser, argv)
    shape = run_shape(args, QUICK, FULL, ("burst", "requests", "prompt_words"))

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
            with timed_pass(f"{concurrency}_clients"):
                result = drive(target, payloads, concurrency)
            after = server.stats()
            if result["failures"]:
                raise RuntimeError(f"{len(result['failures'])} calls failed at {concurrency} "
                                   f"clients: {sorted(set(result['failures']))}")
            latencies = result["latencies"]
            key = f"{concurrency}_clients"
            figures[f"requests_per_s_{key}"] = len(latencies) / result["wall"]
            figures[f"p50_ms_{key}"] = 1000 * percentile(latencies, 50)
            figures[f"p99_ms_{key}"] = 1000 * percentile(latencies, 99)
            batches = after["batches"] - before["batches"]
            figures[f"mean_batch_requests_{key}"] = (after["requests"] - before["requests"]) / \
                max(batches, 1)
            print(f"{concurrency:2d} clients: {figures[f'requests_per_s_{key}']:8.1f} requests/s, "
                  f"p50 {figures[f'p50_ms_{key}']:7.1f} ms, "
                  f"p99 {figures[f'p99_ms_{key}']:7.1f} ms, "
                  f"{figures[f'mean_batch_requests_{key}']:.1f} requests per Scorer call")
        if shape["burst"]:
            measure_overload(target, scorer, shape, figures)
    finally:
        server.stop(5)
    ratio = figures["requests_per_s_32_clients"] / figures["inprocess_requests_per_s"]
    figures["served_over_inprocess_32"] = ratio
    verdict = "meets" if ratio >= 0.8 else "MISSES"
    print(f"served at 32 clients / in-process: {ratio:.2f} (target ≥ 0.8: {verdict})")
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
