"""Every GPU figure of the project in one prepared device call of at most 8 minutes.

A lent GPU comes with 15 minutes of device time per task, start-up and idle included, so
the figures are taken in one call, most important first, and each is kept the moment it
exists: every step is its own benchmark process writing its own JSON into OUT_DIR, and
after every step this run rewrites ``gpu_once.json`` (what ran, in which order, how it
ended) and ``summary.json`` (the headline figures found so far, and why each missing one
is missing). A timeout, a crash or a lost machine therefore keeps whatever finished.

The steps, in priority order (H200 time limits; a step runs only when at least its
minimum remains of the budget, ``--budget-s``, default 480 s):

 1. ``env``             nvidia-smi, JAX's version and devices, and the measured bf16
                        matmul rate (``benchmarks.device_env``). Every later MFU and
                        fraction-of-matmul divides by this rate (``--peak-tflops`` /
                        ``--matmul-tflops``), not by a datasheet.
 2. ``breakdown_32k``   resident prefill, Qwen3-30B-A3B shape, 8 layers, 32K tokens: MFU
                        and where the device time goes (``benchmarks.time_breakdown``).
 3. ``breakdown_131k``  the same at 131K tokens.
 4. ``gmm_qwen3``       grouped GEMM, Mosaic against Triton against ``ragged_dot``, Qwen3
                        expert shape at 16K tokens, default tiles (``benchmarks.gmm``).
 5. ``gmm_mixtral``     the same on Mixtral's expert shape.
 6. ``offload``         resident and offload (lagged layer loop) at 131K tokens, 1.86 Θ on
                        the H100 (``benchmarks.backends``): offload over resident, the
                        exposed transfer split into step start, between layers and the
                        rest, and the resident MFU of the whole backend path.
 7. ``metro``           METRO's device time at 256 experts × 16 devices, greedy and
                        rounds (``benchmarks.metro_quality --timing``).
 8. ``fp8``             FP8 expert GEMMs against bf16 on the same weights: runs only when
                        ``benchmarks/fp8_gemm.py`` exists (it does once FP8 weights do).
 9. ``full_model``      the 48-layer model at one batch, only when 90 s remain.

Batches are powers of two (the packer's buckets), so offload runs at 131K tokens: one
batch is Θ·(measured ``offload_batch_over_theta``), and the summary names the multiple
its offload figures come from.

``--dry-run`` rehearses the whole run on CPU: the same steps, order, files and summary,
with every benchmark at its ``--quick`` size. ``--only a,b`` runs a subset (in priority
order). Run it through ``benchmarks/gpu_once.sh`` on the device:

    bash benchmarks/gpu_once.sh [OUT_DIR]            # OUT_DIR defaults to $OUT
    python -m benchmarks.gpu_once OUT_DIR [--budget-s S] [--dry-run] [--only STEPS]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from benchmarks import gpu_summary
from benchmarks.lib.cli import REPO_ROOT
from benchmarks.lib.meta import run_metadata, write_json

DEFAULT_BUDGET_S = 480.0
# Kept back from the budget for the last summary and the record.
RESERVE_S = 5.0
# A killed step gets this long between SIGTERM and SIGKILL.
KILL_GRACE_S = 5.0
RECORD = "gpu_once.json"
LOG = "gpu_once.log"
STATUSES = ("ok", "failed", "timed_out", "skipped")

Context = Mapping[str, Any]          # what the steps before have measured (see run_steps)


@dataclasses.dataclass(frozen=True)
class Step:
    """One benchmark process: ``module`` run with ``flags(ctx)`` and its device ``sizes``
    (``--dry-run``: ``--quick`` and ``quick_sizes``), writing ``<name>.json``; given at
    most ``limit_s`` seconds and run only when ``min_s`` remain. ``needs`` says, when it
    returns a reason, why the step cannot run here."""

    name: str
    module: str
    limit_s: float
    min_s: float
    flags: Callable[[Context], list[str]]
    sizes: tuple[str, ...] = ()
    quick_sizes: tuple[str, ...] = ()
    needs: Callable[[], str | None] = lambda: None

    def argv(self, ctx: Context, out_dir: Path, dry_run: bool) -> list[str]:
        sizes = ["--quick", *self.quick_sizes] if dry_run else list(self.sizes)
        return [sys.executable, "-m", self.module, "--json", str(out_dir / f"{self.name}.json"),
                *self.flags(ctx), *sizes]


def no_flags(ctx: Context) -> list[str]:
    return []


def measured_peak(ctx: Context) -> list[str]:
    """``--peak-tflops R``: the env step's measured bf16 matmul rate (nothing when the env
    step did not measure one: the benchmark then falls back to its own table)."""
    rate = ctx.get("matmul_bf16_tflops")
    return ["--peak-tflops", f"{rate:.6g}"] if rate else []


def gmm_flags(ctx: Context) -> list[str]:
    """Default tiles only (no sweep), no slow reference paths, the measured matmul rate."""
    rate = ctx.get("matmul_bf16_tflops")
    return ["--skip", "jax_tiles,dense_onehot"] + (["--matmul-tflops", f"{rate:.6g}"]
                                                    if rate else [])


def offload_flags(ctx: Context) -> list[str]:
    return ["--backends", "resident,offload", *measured_peak(ctx)]


def metro_flags(ctx: Context) -> list[str]:
    return ["--timing"]


def fp8_benchmark_missing() -> str | None:
    if (REPO_ROOT / "benchmarks" / "fp8_gemm.py").exists():
        return None
    return "no FP8 expert weights in the code yet (benchmarks/fp8_gemm.py does not exist)"


# The dry run's gmm steps take the quick tiny shape: at the real expert shapes the
# interpreted Pallas kernels take minutes on CPU.
STEPS: tuple[Step, ...] = (
    Step("env", "benchmarks.device_env", 45, 10, no_flags),
    Step("breakdown_32k", "benchmarks.time_breakdown", 90, 40, measured_peak,
         ("--tokens", "32768")),
    Step("breakdown_131k", "benchmarks.time_breakdown", 110, 50, measured_peak,
         ("--tokens", "131072", "--block", "1024")),
    Step("gmm_qwen3", "benchmarks.gmm", 75, 30, gmm_flags,
         ("--models", "qwen3", "--tokens", "16384", "--repeats", "5")),
    Step("gmm_mixtral", "benchmarks.gmm", 75, 30, gmm_flags,
         ("--models", "mixtral", "--tokens", "16384", "--repeats", "5")),
    Step("offload", "benchmarks.backends", 150, 70, offload_flags,
         ("--batch-tokens", "131072", "--block", "1024", "--steps", "1", "--repeats", "2")),
    Step("metro", "benchmarks.metro_quality", 60, 25, metro_flags),
    Step("fp8", "benchmarks.fp8_gemm", 60, 30, measured_peak, needs=fp8_benchmark_missing),
    Step("full_model", "benchmarks.full_model", 120, 90, measured_peak, ("--tokens", "32768")),
)
STEP_NAMES = tuple(step.name for step in STEPS)


def run_process(argv: Sequence[str], timeout_s: float, log: Any) -> tuple[str, int | None]:
    """Run ``argv`` in its own process group, its output appended to ``log``: (status,
    exit code). On timeout the whole group gets SIGTERM, then SIGKILL after a grace."""
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait()
        return "timed_out", proc.returncode
    return ("ok" if rc == 0 else "failed"), rc


def read_figures(path: Path) -> dict[str, Any]:
    """A step's JSON object, {} when it is absent or unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def refresh_summary(out_dir: Path) -> dict[str, Any]:
    """Recompute ``summary.json`` from every JSON in ``out_dir`` (partial runs included)."""
    summary, _sources = gpu_summary.summarize(gpu_summary.load_dir(str(out_dir)))
    write_json(out_dir / "summary.json", summary)
    return summary


def select_steps(only: str | None) -> list[Step]:
    if not only:
        return list(STEPS)
    names = [n for n in only.split(",") if n]
    unknown = [n for n in names if n not in STEP_NAMES]
    if unknown:
        raise SystemExit(f"--only: unknown step(s) {unknown}; choose from {list(STEP_NAMES)}")
    return [step for step in STEPS if step.name in names]


def run_steps(steps: Sequence[Step], out_dir: Path, budget_s: float, dry_run: bool,
              clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Run ``steps`` in order inside ``budget_s``; after each, rewrite the record and the
    summary. Returns the record."""
    start = clock()
    record: dict[str, Any] = {"budget_s": budget_s, "dry_run": dry_run,
                              "order": [step.name for step in steps], "steps": [],
                              **{f"meta_{k}": v for k, v in run_metadata().items()}}
    ctx: dict[str, Any] = {}
    with open(out_dir / LOG, "a", encoding="utf-8") as log:
        for step in steps:
            left = budget_s - RESERVE_S - (clock() - start)
            entry: dict[str, Any] = {"name": step.name, "module": step.module}
            missing = step.needs()
            if missing:
                entry.update(status="skipped", reason=missing)
            elif left < step.min_s * (0.0 if dry_run else 1.0) or left <= 0:
                entry.update(status="skipped",
                             reason=f"{left:.0f} s left of the budget, the step needs "
                                    f"{step.min_s:.0f}")
            else:
                argv = step.argv(ctx, out_dir, dry_run)
                limit = min(step.limit_s * (3.0 if dry_run else 1.0), left)
                log.write(f"=== {step.name}: {' '.join(argv[1:])} (limit {limit:.0f} s)\n")
                log.flush()
                began = clock()
                status, rc = run_process(argv, limit, log)
                entry.update(status=status, rc=rc, seconds=round(clock() - began, 2),
                             limit_s=round(limit, 1), command=" ".join(argv[1:]))
                log.write(f"=== {step.name}: {status} (rc {rc}) in {entry['seconds']} s\n")
                log.flush()
            json_path = out_dir / f"{step.name}.json"
            figures = read_figures(json_path)
            entry["json"] = json_path.name if figures else None
            if step.name == "env":
                ctx.update({k: figures[k] for k in ("matmul_bf16_tflops", "platform")
                            if k in figures})
            record["steps"].append(entry)
            record["elapsed_s"] = round(clock() - start, 2)
            write_json(out_dir / RECORD, record)
            refresh_summary(out_dir)
            print(f"[gpu_once] {step.name}: {entry['status']}"
                  f"{' in ' + str(entry['seconds']) + ' s' if 'seconds' in entry else ''}"
                  f"{' (' + entry['reason'] + ')' if 'reason' in entry else ''}", flush=True)
            if step.name == "env" and not dry_run and ctx.get("platform") not in ("gpu", "cuda",
                                                                                 "rocm"):
                record["aborted"] = (f"no GPU: the env step found platform "
                                     f"{ctx.get('platform')!r} (use --dry-run on CPU)")
                write_json(out_dir / RECORD, record)
                print(f"[gpu_once] {record['aborted']}", flush=True)
                break
    return record


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default=os.environ.get("OUT"),
                        help="where every JSON goes (default $OUT)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for the whole run (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--dry-run", action="store_true",
                        help="the CPU rehearsal: every step at its --quick size")
    parser.add_argument("--only", help=f"comma list of steps, from {', '.join(STEP_NAMES)}")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    if not args.out_dir:
        parser.error("give OUT_DIR (or set $OUT)")
    if args.budget_s <= RESERVE_S:
        parser.error(f"--budget-s must be more than {RESERVE_S:.0f} s")
    steps = select_steps(args.only)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = run_steps(steps, out_dir, args.budget_s, args.dry_run)
    summary = refresh_summary(out_dir)
    print(f"[gpu_once] {record['elapsed_s']} s of {args.budget_s:.0f}; summary:")
    for key in gpu_summary.KEYS:
        print(f"  {key:<40} {summary.get(key, 'missing: ' + summary['missing'].get(key, '?'))}")
    return record


if __name__ == "__main__":
    main()
