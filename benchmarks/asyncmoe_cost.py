"""Cost tables of the AsyncMoE simulator (``moejax.asyncmoe.simulator.CostTables``),
measured on this machine for one model's layers.

What each entry times (the layerwise decode programs of ``moejax.decode.programs``, the
ones a μ-queue execution runs; one jitted call each, median of ``--repeats`` after a
compile, host wall including dispatch):

* ``attention``: one layer's attention half and router (``programs.BEGIN`` +
  ``programs.ATTENTION``) over B decode rows, each with C tokens of paged context;
* ``expert``: one (layer, expert) pair on B rows (``programs.MOE`` with a one-expert stack
  and every row routed to it with weight 1);
* ``head``: the final norm, LM head and greedy sampling of B rows (``programs.HEAD``);
* ``link``: a [n, d] array moved device to device (``jax.device_put`` between two
  devices), fitted as latency + bytes / bandwidth over n (least squares, non-negative).

``batch_overhead_s`` is 0: the dispatch cost is inside every measured entry.

    python -m benchmarks.asyncmoe_cost [--quick] [--model demo-e32] [--json PATH]
        [--cost-out benchmarks/data/asyncmoe_cost_cpu_demo-e32.json] [--repeats N]
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from benchmarks.lib.cli import REPO_ROOT, bench_parser, parse_args, run_shape
from benchmarks.lib.meta import finish_run
from benchmarks.lib.timing import median_seconds

LINK_DEVICES = 2        # the link is timed between two CPU devices
FULL = dict(batches=(1, 4, 16, 64), contexts=(64, 256, 1024), expert_batches=(1, 4, 16, 64, 256),
            link_rows=(1, 16, 256, 4096), repeats=30)
QUICK = dict(batches=(1, 16), contexts=(64, 256), expert_batches=(1, 16, 64),
             link_rows=(1, 256), repeats=5)
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "data" / "asyncmoe_cost_cpu_demo-e32.json"


def decode_batch(rows: int, context: int) -> Any:
    """The runtime's decode batch (``moejax.asyncmoe.runtime.decode_rows``) of ``rows``
    rows, row b at position context - 1 over its own blocks (b·nb .. b·nb + nb - 1)."""
    from moejax.asyncmoe.runtime import decode_rows
    from moejax.prefix_hash import BLOCK_SIZE

    blocks = -(-context // BLOCK_SIZE)
    tables = np.arange(rows * blocks, dtype=np.int32).reshape(rows, blocks)
    return decode_rows(list(tables), [context - 1] * rows, [5] * rows, [0] * rows, rows,
                       blocks, rows * blocks * BLOCK_SIZE)


def attention_table(cfg: Any, dense: Any, batches: Sequence[int], contexts: Sequence[int],
                    repeats: int) -> list[list[float]]:
    import jax

    from moejax.decode import programs
    from moejax.kv import empty_pool
    from moejax.prefix_hash import BLOCK_SIZE

    opts = programs.StepOptions()
    table = []
    for rows in batches:
        line = []
        for context in contexts:
            kv = empty_pool(cfg, rows * -(-context // BLOCK_SIZE), "float32")
            batch = jax.device_put(decode_batch(rows, context))

            def run():
                x, attn = programs.BEGIN(dense, kv, batch, cfg=cfg, opts=opts)
                out = programs.ATTENTION(dense, np.int32(0), x, kv, attn, cfg=cfg)
                jax.block_until_ready(out[0])

            line.append(median_seconds(run, repeats, label=f"attention_b{rows}_c{context}"))
        table.append(line)
    return table


def expert_table(cfg: Any, params: Any, batches: Sequence[int], repeats: int) -> list[float]:
    import jax
    import jax.numpy as jnp

    from moejax import moe
    from moejax.decode import programs

    one = {k: jnp.asarray(params["layers"][k][:1, :1]) for k in ("w_gate", "w_up", "w_down")}
    opts = programs.StepOptions()
    out = []
    for rows in batches:
        x = jnp.ones((rows, cfg.hidden_size), jnp.float32)
        routing = moe.Routing(weights=jnp.ones((rows, 1), jnp.float32),
                              experts=jnp.zeros((rows, 1), jnp.int32))
        valid = jnp.ones(rows, bool)
        out.append(median_seconds(lambda: jax.block_until_ready(
            programs.MOE(one, np.int32(0), x, x, routing, valid, opts=opts)), repeats,
            label=f"expert_b{rows}"))
    return out


def head_table(cfg: Any, dense: Any, batches: Sequence[int], repeats: int) -> list[float]:
    import jax
    import jax.numpy as jnp

    from moejax import sampling
    from moejax.decode import programs

    out = []
    for rows in batches:
        batch = jax.device_put(decode_batch(rows, 16))
        samp = jax.device_put(sampling.make_sampling_params([0.0] * rows, [1.0] * rows,
                                                            list(range(rows))))
        x = jnp.ones((rows, cfg.hidden_size), jnp.float32)
        out.append(median_seconds(lambda: jax.block_until_ready(
            programs.HEAD(dense, x, batch, samp, cfg=cfg)), repeats, label=f"head_b{rows}"))
    return out


def link_fit(hidden: int, rows: Sequence[int], repeats: int) -> dict[str, float]:
    """latency_s and bandwidth_Bps of a device-to-device copy, fitted over sizes."""
    import jax
    import jax.numpy as jnp

    devices = jax.devices()
    if len(devices) < 2:
        raise RuntimeError("the link needs two devices (XLA_FLAGS "
                           "--xla_force_host_platform_device_count >= 2)")
    sizes, seconds = [], []
    for n in rows:
        x = jax.device_put(jnp.ones((n, hidden), jnp.float32), devices[0])
        seconds.append(median_seconds(
            lambda: jax.block_until_ready(jax.device_put(x, devices[1])), repeats,
            label=f"link_n{n}"))
        sizes.append(x.nbytes)
    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(seconds), 1)
    slope = max(float(slope), 1e-15)
    return {"latency_s": max(float(intercept), 0.0), "bandwidth_Bps": 1.0 / slope,
            "sizes_bytes": [int(s) for s in sizes], "seconds": seconds}


def measure(model: str, shape: dict[str, Any]) -> dict[str, Any]:
    from moejax.decode.programs import dense_params
    from moejax.prefetch.train import load_model

    cfg, params = load_model(model)
    dense = dense_params(params)
    link = link_fit(cfg.hidden_size, shape["link_rows"], shape["repeats"])
    return {
        "attention": {"batch": list(shape["batches"]), "context": list(shape["contexts"]),
                      "seconds": attention_table(cfg, dense, shape["batches"], shape["contexts"],
                                                 shape["repeats"])},
        "expert": {"batch": list(shape["expert_batches"]),
                   "seconds": expert_table(cfg, params, shape["expert_batches"],
                                           shape["repeats"])},
        "head": {"batch": list(shape["batches"]),
                 "seconds": head_table(cfg, dense, shape["batches"], shape["repeats"])},
        "batch_overhead_s": 0.0,
        "link": {"latency_s": link["latency_s"], "bandwidth_Bps": link["bandwidth_Bps"]},
        "meta": {"model": model, "hidden": cfg.hidden_size, "dtype": "float32",
                 "link_sizes_bytes": link["sizes_bytes"], "link_seconds": link["seconds"],
                 "machine": f"{platform.machine()} {os.cpu_count()} cpus, "
                            f"{platform.python_version()}",
                 "date": datetime.date.today().isoformat(),
                 "command": " ".join(["python", "-m", "benchmarks.asyncmoe_cost", *sys.argv[1:]])},
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, quick_help="two sizes per axis, 5 repeats", model="demo-e32",
                          repeats_help="timed calls per entry, median kept (default 30; "
                                       "quick 5)")
    parser.add_argument("--cost-out", default=None,
                        help=f"write the cost tables here (default with a full run: {DEFAULT_OUT})")
    args = parse_args(parser, argv, host_devices=LINK_DEVICES)
    shape = run_shape(args, QUICK, FULL, ("repeats",))
    from moejax.asyncmoe.simulator import CostTables

    tables = measure(args.model, shape)
    CostTables.from_dict(tables)                       # the simulator accepts them
    out = args.cost_out or (None if args.quick else str(DEFAULT_OUT))
    if out:
        Path(out).write_text(json.dumps(tables, indent=1) + "\n")
    att = tables["attention"]
    figures = {"attention_us_b1_c64": 1e6 * att["seconds"][0][0],
               "attention_us_bmax_cmax": 1e6 * att["seconds"][-1][-1],
               "expert_us_b1": 1e6 * tables["expert"]["seconds"][0],
               "expert_us_bmax": 1e6 * tables["expert"]["seconds"][-1],
               "head_us_b1": 1e6 * tables["head"]["seconds"][0],
               "link_latency_us": 1e6 * tables["link"]["latency_s"],
               "link_gbps": tables["link"]["bandwidth_Bps"] / 1e9}
    for key, value in figures.items():
        print(f"{key:>24} {value:10.2f}")
    if out:
        print(f"cost tables -> {out}")
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
