"""One process of a multi-process test job (started by ``moejax launch``, which adds the
``--coordinator/--num-processes/--process-id`` flags): scores fixed requests with
``async_ep`` and ``sync_ep`` and generates with ``sync_ep`` over every process's devices;
process 0 writes what it got as JSON to the path given.

    moejax launch --processes 2 -- python tests/multi_process_job.py OUT.json --devices 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moejax import configure_xla  # noqa: E402
from serving.cli.distributed import (add_distributed_options, distributed_options,  # noqa: E402
                                     host_devices_per_process)

SCORE_REQUESTS = [{"id": i, "prompt": "def add(a, b):\n    return a + b\n" * (1 + i % 3)
                   + f"# case {i}", "candidates": [" yes", " no", " maybe"]}
                  for i in range(10)]
GENERATE_REQUESTS = [{"id": "a", "prompt": "def add(a, b):", "max_new_tokens": 6},
                     {"id": "b", "prompt": "12 + 30 =", "max_new_tokens": 4}]


def run(devices: int, distributed: object) -> dict:
    """The job's results (the same call runs single-process for the reference)."""
    from serving import Generator, Scorer

    out: dict = {}
    for backend in ("async_ep", "sync_ep"):
        scorer = Scorer("demo", backend=backend, devices=devices, distributed=distributed)
        out[backend] = [r.to_dict() for r in scorer.score(SCORE_REQUESTS, progress=False)]
        for result in out[backend]:
            result.pop("timings", None)     # wall times differ; everything else must not
    generator = Generator("demo", backend="sync_ep", devices=devices, distributed=distributed)
    out["generate"] = [r.token_ids for r in generator.generate(GENERATE_REQUESTS)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--devices", type=int, default=8)
    add_distributed_options(parser)
    args = parser.parse_args()
    configure_xla(host_devices=host_devices_per_process(args))
    out = run(args.devices, distributed_options(args))
    import jax

    if jax.process_index() == 0:
        Path(args.output).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
