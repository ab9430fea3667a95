"""Beyond one machine, measured with local processes: the gRPC router in front of several
``moejax serve`` upstreams, its overhead and failover, and one model over 2 processes.

Four parts, each against its baseline in the same run (the built-in demo model, float32):

* **Routing** (``router_high_share_over_round_robin``). ``--upstreams`` ``moejax serve``
  processes (one CPU device each, prefix cache on, 32K token-equivalents per model call)
  behind two ``moejax router`` processes
  over the same upstreams: ``--routing prefix`` (Algorithm 1) and ``--routing
  round_robin``. A pass sends one QuALITY-shaped high-share workload
  (``benchmarks/workloads.py``: long documents, many questions each) through a router as
  one stream; throughput = prompt tokens of the requests / wall seconds of the pass. Each
  pass draws new documents (seed = pass index, the same for both routers), so no pass
  reads blocks an earlier pass cached; ``warmups`` passes per router on other documents
  compile the shapes first (new lengths can still compile in a timed pass: the per-pass
  seconds are in the JSON).
  Passes alternate between the routers; the medians' ratio is the figure.
* **Overhead** (``router_overhead_us``): one short request at a time, unary ``Score``,
  through the prefix router and straight to an upstream, alternating; the difference of the
  medians in microseconds (the router's parse, route, forward and answer).
* **Failover** (``failover_lost_requests``, ``failover_duplicated_requests``): a stream of
  short requests through the prefix router; one upstream is killed (SIGKILL) once a
  quarter of the results are back. Lost = requests with no result or an error result;
  duplicated = requests answered more than once.
* **Multi-process** (``multiprocess_equals_single``): ``moejax launch --processes 2 --
  moejax score --backend async_ep --devices 8`` (2 processes × 4 CPU devices, gloo)
  against ``moejax score`` in one process over 8 devices: 1 if every result is equal
  (timings aside), else 0. ``multiprocess_seconds`` / ``single_process_seconds``: their
  wall times (start-up included; the 2-process run pays gloo collectives on CPU).

    python -m benchmarks.multi_host [--quick] [--json PATH] [--upstreams N] [--repeats N]
                                    [--requests N] [--scale X]

JSON keys: the four above, ``router_prefix_tokens_per_s``, ``router_round_robin_tokens_per_s``,
``router_{prefix|round_robin}_pass{i}_seconds``,
``router_overhead_direct_us``, ``router_overhead_routed_us``, ``failover_requests``,
``multiprocess_seconds``, ``single_process_seconds``, and the run's settings.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks import workloads
from benchmarks.lib.cli import REPO_ROOT, bench_parser, parse_args, run_shape
from benchmarks.lib.compiles import timed_pass
from benchmarks.lib.meta import finish_run
from benchmarks.lib.timing import median, timed_call

FULL = dict(upstreams=4, requests=48, scale=0.1, repeats=3, warmups=2, overhead_calls=200,
            failover_requests=400, multiprocess_requests=24)
QUICK = dict(upstreams=2, requests=12, scale=0.04, repeats=1, warmups=1, overhead_calls=40,
             failover_requests=120, multiprocess_requests=4)
START_SECONDS = 240
# Token-equivalents per model call of an upstream: room for a document's queued questions
# in one call (the default, 4 x max_batch_tokens, takes one long-document request a call),
# so that in-call prompt sharing works for both routers as it does in one process.
UPSTREAM_BATCH_TOKENS = 32_768


def child_env() -> dict[str, str]:
    """The environment of a child process: no inherited XLA_FLAGS (each command sets the
    host devices it needs) and the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def moejax_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "serving.cli", *args]


class Process:
    """A ``moejax serve`` / ``moejax router`` child that prints its port first."""

    def __init__(self, args: Sequence[str], log_path: Path):
        self.log = open(log_path, "w")
        self.popen = subprocess.Popen(moejax_command(*args), cwd=REPO_ROOT, env=child_env(),
                                      stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.popen.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"{args[0]} did not start; see {log_path}")
        self.port = int(line)
        self.target = f"127.0.0.1:{self.port}"

    def wait_serving(self) -> None:
        from serving.grpc.client import Client

        deadline = time.monotonic() + START_SECONDS
        with Client(self.target) as client:
            while True:
                try:
                    if client.health(timeout=5) == "SERVING":
                        return
                except Exception:   # noqa: BLE001  (not listening yet)
                    pass
                if time.monotonic() > deadline or self.popen.poll() is not None:
                    raise RuntimeError(f"{self.target} never became SERVING")
                time.sleep(0.3)

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self.log.close()


def demo_shape() -> tuple[int, int]:
    """(vocab size, context) of the demo model (the workloads' token ids fit them)."""
    from moejax.checkpoint import load_model_config
    from moejax.model_dirs import resolve_model_dir

    cfg = load_model_config(resolve_model_dir("demo")[0])
    return cfg.vocab_size, cfg.max_context


def high_share(count: int, scale: float, seed: int) -> list[dict[str, Any]]:
    vocab, context = demo_shape()
    return workloads.generate("quality", count, vocab_size=vocab, max_context=context,
                              seed=seed, scale=scale)


def prompt_tokens(requests: Sequence[dict[str, Any]]) -> int:
    return sum(len(r["prompt_token_ids"]) for r in requests)


def score_pass(target: str, requests: list[dict[str, Any]]) -> float:
    """Seconds to score ``requests`` through ``target`` as one stream (all must succeed)."""
    from serving.grpc.client import Client

    with Client(target) as client:
        # (The upstreams compile in their own processes, which this count does not see.)
        seconds, results = timed_call(
            lambda: client.score(requests, progress=False, timeout=1800), label=f"score_{target}")
    failed = [r.error for r in results if r.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed through {target}: {failed[0]}")
    return seconds


def bench_routing(routers: dict[str, Process], shape: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for warmup in range(shape["warmups"]):
        # Compiles the shapes (per upstream; later passes' new documents have new lengths,
        # whose buckets mostly appeared by now) on workloads no timed pass reads.
        warm = high_share(shape["requests"], shape["scale"], seed=10_000 + warmup)
        for router in routers.values():
            score_pass(router.target, warm)
    seconds: dict[str, list[float]] = {name: [] for name in routers}
    tokens: list[int] = []
    for repeat in range(shape["repeats"]):
        requests = high_share(shape["requests"], shape["scale"], seed=repeat)
        tokens.append(prompt_tokens(requests))
        order = list(routers) if repeat % 2 == 0 else list(reversed(routers))
        for name in order:
            seconds[name].append(score_pass(routers[name].target, requests))
    for name in routers:
        rates = [t / s for t, s in zip(tokens, seconds[name])]
        out[f"router_{name}_tokens_per_s"] = median(rates)
        out.update({f"router_{name}_pass{i}_seconds": s for i, s in enumerate(seconds[name])})
    out["router_high_share_over_round_robin"] = (out["router_prefix_tokens_per_s"]
                                                 / out["router_round_robin_tokens_per_s"])
    out["high_share_prompt_tokens_per_pass"] = statistics.mean(tokens)
    return out


def bench_overhead(router: Process, upstream: Process, calls: int) -> dict[str, float]:
    from serving.grpc.client import Client

    request = {"prompt_token_ids": list(range(5, 21)), "candidate_token_ids": [[7], [9]]}
    times: dict[str, list[float]] = {"routed": [], "direct": []}
    with Client(router.target) as routed, Client(upstream.target) as direct:
        for client in (routed, direct):            # warm: channels, compiled shape
            client.score([request] * 3, progress=False)
        with timed_pass("router_overhead"):
            for _ in range(calls):
                for name, client in (("routed", routed), ("direct", direct)):
                    start = time.perf_counter()
                    client.score([request], progress=False)
                    times[name].append(time.perf_counter() - start)
    routed_us = median(times["routed"]) * 1e6
    direct_us = median(times["direct"]) * 1e6
    return {"router_overhead_us": routed_us - direct_us, "router_overhead_routed_us": routed_us,
            "router_overhead_direct_us": direct_us}


def bench_failover(router: Process, victim: Process, count: int) -> dict[str, int]:
    from serving.grpc.client import Client

    requests = [{"id": i, "prompt_token_ids": [3 + (i * 7 + j) % 900 for j in range(24)],
                 "candidate_token_ids": [[5], [6]]} for i in range(count)]
    answers: dict[int, int] = {}
    errors = 0
    killed = threading.Event()
    with Client(router.target) as client:
        for index, result in client.stream(enumerate(requests), timeout=600):
            answers[index] = answers.get(index, 0) + 1
            errors += result.error is not None
            if not killed.is_set() and len(answers) >= count // 4:
                victim.kill()
                killed.set()
    lost = sum(1 for i in range(count) if i not in answers) + errors
    duplicated = sum(1 for n in answers.values() if n > 1)
    return {"failover_lost_requests": lost, "failover_duplicated_requests": duplicated,
            "failover_requests": count, "failover_killed_after": count // 4}


def bench_multiprocess(count: int, workdir: Path) -> dict[str, Any]:
    requests = workdir / "mp_in.jsonl"
    requests.write_text("".join(json.dumps({"id": i, "prompt": f"value = {i} * {i + 3}\n",
                                            "candidates": [" yes", " no"]}) + "\n"
                                for i in range(count)))
    outputs = {"multi": workdir / "mp_multi.jsonl", "single": workdir / "mp_single.jsonl"}
    commands = {
        "multi": moejax_command("launch", "--processes", "2", "--", "moejax", "score",
                                str(requests), "-o", str(outputs["multi"]), "--backend",
                                "async_ep", "--devices", "8", "--no-progress"),
        "single": moejax_command("score", str(requests), "-o", str(outputs["single"]),
                                 "--backend", "async_ep", "--devices", "8", "--no-progress")}
    seconds = {}
    for name, command in commands.items():
        seconds[name], done = timed_call(
            lambda command=command: subprocess.run(command, cwd=REPO_ROOT, env=child_env(),
                                                   capture_output=True, text=True, timeout=900),
            label=f"{name}_process_scoring")
        if done.returncode != 0:
            raise RuntimeError(f"{name}-process scoring failed: {done.stderr[-2000:]}")

    def rows(path: Path) -> list[dict[str, Any]]:
        out = [json.loads(line) for line in path.read_text().splitlines()]
        for row in out:
            row.pop("timings", None)
        return out

    equal = rows(outputs["multi"]) == rows(outputs["single"]) and len(rows(outputs["multi"])) \
        == count
    return {"multiprocess_equals_single": int(equal), "multiprocess_seconds": seconds["multi"],
            "single_process_seconds": seconds["single"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, quick_help="small shapes (about a minute)",
                          repeats_help="timed passes per router")
    parser.add_argument("--upstreams", type=int, default=None, help="moejax serve upstreams")
    parser.add_argument("--requests", type=int, default=None, help="requests per pass")
    parser.add_argument("--scale", type=float, default=None, help="workload length scale")
    args = parse_args(parser, argv)
    shape = run_shape(args, QUICK, FULL, ("upstreams", "repeats", "requests", "scale"))
    if shape["upstreams"] < 2:
        parser.error("--upstreams must be >= 2 (failover kills one)")
    figures: dict[str, Any] = {**{f"setting_{k}": v for k, v in shape.items()},
                               "quick": args.quick,
                               "load_average_at_start": os.getloadavg()[0]}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        upstreams: list[Process] = []
        routers: dict[str, Process] = {}
        try:
            for i in range(shape["upstreams"]):
                upstreams.append(Process(
                    ["serve", "--model", "demo", "--port", "0", "--prefix-cache-blocks", "auto",
                     "--no-generation", "--max-queued-tokens", "4000000",
                     "--batch-tokens", str(UPSTREAM_BATCH_TOKENS)],
                    workdir / f"upstream{i}.log"))
            for upstream in upstreams:
                upstream.wait_serving()
            targets = ",".join(u.target for u in upstreams)
            for name in ("prefix", "round_robin"):
                routers[name] = Process(["router", "--model", "demo", "--upstream", targets,
                                         "--port", "0", "--routing", name],
                                        workdir / f"router_{name}.log")
                routers[name].wait_serving()
            figures.update(bench_routing(routers, shape))
            figures.update(bench_overhead(routers["prefix"], upstreams[0],
                                          shape["overhead_calls"]))
            figures.update(bench_failover(routers["prefix"], upstreams[-1],
                                          shape["failover_requests"]))
        finally:
            for process in [*routers.values(), *upstreams]:
                process.stop()
        figures.update(bench_multiprocess(shape["multiprocess_requests"], workdir))
    figures["wall_seconds"] = time.perf_counter() - start
    print(f"router, high share ({shape['upstreams']} upstreams, {shape['requests']} requests, "
          f"scale {shape['scale']}): prefix {figures['router_prefix_tokens_per_s']:.0f} "
          f"tokens/s, round-robin {figures['router_round_robin_tokens_per_s']:.0f} tokens/s: "
          f"router_high_share_over_round_robin = "
          f"{figures['router_high_share_over_round_robin']:.2f}")
    print(f"router_overhead_us = {figures['router_overhead_us']:.0f} (routed "
          f"{figures['router_overhead_routed_us']:.0f} us, direct "
          f"{figures['router_overhead_direct_us']:.0f} us per call)")
    print(f"failover: {figures['failover_requests']} requests, one upstream killed after "
          f"{figures['failover_killed_after']}: failover_lost_requests = "
          f"{figures['failover_lost_requests']}, duplicated = "
          f"{figures['failover_duplicated_requests']}")
    print(f"multiprocess_equals_single = {figures['multiprocess_equals_single']} (2 x 4 "
          f"devices {figures['multiprocess_seconds']:.1f} s, 1 x 8 "
          f"{figures['single_process_seconds']:.1f} s)")
    print(f"wall {figures['wall_seconds']:.0f} s")
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
