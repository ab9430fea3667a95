"""Offline scoring on Ray Data (``serving.ray_data``, ``moejax batch --ray``): the
pipeline's throughput with one actor against the in-process Scorer on the same requests,
the actor's start-up time and the pipeline's cost per batch.

The requests (``benchmarks.grpc_serving``'s single-token classification over random-word
reviews) are written to a Parquet file; the in-process Scorer scores them in one call and
in the actor's batches (after a warm-up, which also puts the programs of those batches in
the compilation cache the actor opens; the better of a measurement before the job and one
after it). Then a local Ray cluster (every core) runs a one-request job (the start-up: the
actor process, JAX, the model, one tiny batch) and the whole job with one actor, Parquet to
Parquet, in input order. The first result block carries the start-up, so the pipeline's
throughput is that of the blocks after it: (rows after the first block) / (time after it).
The cost per batch is what a batch takes in the pipeline over what the same batch takes in
process.

One actor only: on a machine of few cores, more actors share the same cores and cannot
show scaling, so no scaling figure is measured or claimed here.

    python -m benchmarks.ray_batch [--quick] [--model demo|DIR] [--requests N]
                                   [--batch-size N] [--json PATH]

JSON keys (flat): ``ray_over_inprocess_1actor`` (target ≥ 0.8: against the in-process
Scorer's one call on all the requests), ``ray_over_inprocess_batches_1actor`` (against the
in-process Scorer on the same batches), ``ray_requests_per_s_1actor``,
``inprocess_requests_per_s``, ``inprocess_batches_requests_per_s``,
``ray_end_to_end_requests_per_s`` (start-up included), ``ray_job_s``,
``ray_first_result_s``, ``actor_startup_s``, ``per_batch_overhead_ms``, ``ray_batch_ms``,
``inprocess_batch_ms``, ``requests``, ``batch_size``, ``batches``, ``prompt_words``,
``cpus``, ``load_average_at_start``.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from benchmarks.grpc_serving import inprocess_rate, workload
from benchmarks.lib.cli import bench_parser, parse_args, run_shape
from benchmarks.lib.compiles import timed_pass
from benchmarks.lib.meta import finish_run

FULL = dict(requests=4000, prompt_words=48, batch_size=1024)
QUICK = dict(requests=800, prompt_words=32, batch_size=200)
SCALING_NOTE = ("one actor: on {cpus} cores more actors would share the same cores, so no "
                "scaling is measured or claimed here")


def write_requests(requests: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(requests), path)
    return path


def chunks(requests: list[dict], size: int) -> list[list[dict]]:
    return [requests[i:i + size] for i in range(0, len(requests), size)]


def inprocess_batch_seconds(scorer, batches: list[list[dict]]) -> list[float]:
    """Seconds of each batch scored in process (the better of two passes, batch by batch,
    after a warm-up pass)."""
    for batch in batches:                                   # warm-up: their shapes
        scorer.score(batch, progress=False)
    best = [float("inf")] * len(batches)
    for attempt in range(2):
        with timed_pass(f"inprocess_batches_{attempt}"):
            for i, batch in enumerate(batches):
                start = time.perf_counter()
                scorer.score(batch, progress=False)
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def ray_job(ray_data, source: Path, out: Path, model: str, batch_size: int, options: dict):
    summary = ray_data.score(str(source), str(out), model=model, actors=1,
                             batch_size=batch_size, progress=False, **options)
    if summary.errors:
        raise RuntimeError(f"{summary.errors} of {summary.rows} requests failed in {out}")
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, quick_help="fewer requests (under a minute with a warm "
                                              "compilation cache)", model="demo")
    parser.add_argument("--requests", type=int, help="requests scored each way")
    parser.add_argument("--batch-size", type=int, help="rows per actor call")
    # (The overlap flags as the actor sets them on a GPU: XLA_FLAGS is part of the keys of
    # the compilation cache through which the actor loads what this process compiled.)
    args = parse_args(parser, argv, gpu_overlap_flags=True)
    shape = run_shape(args, QUICK, FULL, ("requests", "batch_size"))
    # Every program this process compiles goes to the cache (JAX keeps only those over a
    # second), so the actor loads the shapes of its batches instead of compiling them in the
    # timed job; the local cluster's processes inherit the setting.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

    from serving import Scorer, ray_data

    ray = ray_data.require_ray()
    load, cpus = os.getloadavg()[0], os.cpu_count()
    options = {"compilation_cache": "auto"}      # the actor loads what this process compiled
    requests = workload(shape["requests"], shape["prompt_words"])
    batches = chunks(requests, shape["batch_size"])
    figures: dict = {"requests": len(requests), "batch_size": shape["batch_size"],
                     "batches": len(batches), "prompt_words": shape["prompt_words"],
                     "cpus": cpus, "load_average_at_start": load}

    scorer = Scorer(args.model, **options)
    per_batch = inprocess_batch_seconds(scorer, batches)
    inprocess = inprocess_rate(scorer, requests)

    with tempfile.TemporaryDirectory(prefix="moejax-ray-batch-") as tmp:
        source = write_requests(requests, Path(tmp) / "requests.parquet")
        one = write_requests(requests[:1], Path(tmp) / "one.parquet")
        ray.init(address="local", num_cpus=cpus, include_dashboard=False)
        try:
            startup = ray_job(ray_data, one, Path(tmp) / "one_out.parquet", args.model,
                              shape["batch_size"], options)
            job = ray_job(ray_data, source, Path(tmp) / "out.parquet", args.model,
                          shape["batch_size"], options)
        finally:
            ray.shutdown()
    # In process again, after the job: the better of before and after, so that a moment of
    # load from elsewhere on the machine does not favour the pipeline.
    per_batch = [min(a, b) for a, b in zip(per_batch, inprocess_batch_seconds(scorer, batches))]
    figures["inprocess_requests_per_s"] = max(inprocess, inprocess_rate(scorer, requests))
    figures["inprocess_batches_requests_per_s"] = len(requests) / sum(per_batch)

    steady_seconds = job.seconds - job.first_result_seconds
    steady_rows = job.rows - job.first_result_rows
    figures.update(actor_startup_s=startup.seconds, ray_job_s=job.seconds,
                   ray_first_result_s=job.first_result_seconds,
                   ray_requests_per_s_1actor=steady_rows / steady_seconds,
                   ray_end_to_end_requests_per_s=job.rows / job.seconds)
    # The batches after the first one, in the pipeline and in process.
    figures["ray_batch_ms"] = 1000 * steady_seconds / (len(batches) - 1)
    figures["inprocess_batch_ms"] = 1000 * sum(per_batch[1:]) / (len(batches) - 1)
    figures["per_batch_overhead_ms"] = figures["ray_batch_ms"] - figures["inprocess_batch_ms"]
    figures["ray_over_inprocess_1actor"] = (figures["ray_requests_per_s_1actor"]
                                            / figures["inprocess_requests_per_s"])
    figures["ray_over_inprocess_batches_1actor"] = (figures["ray_requests_per_s_1actor"]
                                                    / figures["inprocess_batches_requests_per_s"])
    print(f"in process: {figures['inprocess_requests_per_s']:.1f} requests/s in one call, "
          f"{figures['inprocess_batches_requests_per_s']:.1f} in batches of "
          f"{shape['batch_size']}")
    print(f"Ray Data, 1 actor: {figures['ray_requests_per_s_1actor']:.1f} requests/s after "
          f"the first block: {figures['ray_over_inprocess_1actor']:.2f} of in-process "
          f"(target ≥ 0.8), {figures['ray_over_inprocess_batches_1actor']:.2f} of the same "
          f"batches in process; {figures['ray_end_to_end_requests_per_s']:.1f} requests/s "
          f"end to end ({job.seconds:.1f} s, start-up included)")
    print(f"actor start-up (a one-request job): {startup.seconds:.1f} s; per batch: "
          f"{figures['ray_batch_ms']:.0f} ms in the pipeline, {figures['inprocess_batch_ms']:.0f} "
          f"ms in process, overhead {figures['per_batch_overhead_ms']:.0f} ms")
    print(SCALING_NOTE.format(cpus=cpus))
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
