"""The issue's headline figures from one GPU suite run, in one flat ``summary.json``.

Reads the JSON files ``benchmarks/gpu_suite.sh`` wrote into OUT_DIR and writes
OUT_DIR/summary.json with exactly these keys (each a number, or absent):

    resident_mfu_qwen3_30b             backends*.json: resident_mfu of a run of >= 131072
                                       padded tokens (Qwen3-30B-A3B shape, 8 layers)
    gmm_qwen3_fraction_of_matmul       gmm*.json: qwen3_16384_best_fraction_of_matmul,
    gmm_mixtral_fraction_of_matmul     else ..._pallas_fraction_of_matmul (same for mixtral)
    offload_exposed_transfer_fraction  backends*.json: offload_exposed_transfer_fraction and
    offload_over_resident_at_1p5_theta offload_over_resident of the run whose
                                       offload_batch_over_theta is the smallest >= 1.5
    metro_kernel_device_us             metro.json: metro_kernel_device_us
    full_model_tokens_per_s            full_model.json: full_model_tokens_per_s

plus ``missing``: key -> why it is absent (no file, no such key, no run that qualifies).
Nothing is invented: a figure is copied from its file or reported missing. The source
of each figure is printed.

    python -m benchmarks.gpu_summary OUT_DIR [--json PATH]   (default OUT_DIR/summary.json)
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any, Callable, Mapping

from benchmarks.lib.cli import bench_parser, parse_args
from benchmarks.lib.meta import write_json

GMM_TOKENS = 16384
RESIDENT_TOKENS = 131072
THETA_MULTIPLE = 1.5
KEYS = ("resident_mfu_qwen3_30b", "gmm_qwen3_fraction_of_matmul",
        "gmm_mixtral_fraction_of_matmul", "offload_exposed_transfer_fraction",
        "offload_over_resident_at_1p5_theta", "metro_kernel_device_us",
        "full_model_tokens_per_s")

Files = Mapping[str, Mapping[str, Any]]       # file name -> its JSON object
Found = tuple[Any, str]                        # (value, source) or (None, reason)


def load_dir(out_dir: str) -> dict[str, dict[str, Any]]:
    """Every ``*.json`` in ``out_dir`` but the summary, by file name (unreadable files are
    kept as an object naming the error, so a figure's reason can say so)."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        name = os.path.basename(path)
        if name == "summary.json":
            continue
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            files[name] = data if isinstance(data, dict) else {"_error": "not a JSON object"}
        except (OSError, ValueError) as exc:
            files[name] = {"_error": f"{type(exc).__name__}: {exc}"}
    return files


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def from_file(files: Files, name: str, key: str) -> Found:
    """``files[name][key]`` when it is a number, else (None, why not)."""
    if name not in files:
        return None, f"{name} not found"
    data = files[name]
    if "_error" in data:
        return None, f"{name} unreadable ({data['_error']})"
    if not is_number(data.get(key)):
        return None, f"{name} has no number under {key}"
    return data[key], f"{name}:{key}"


def matching(files: Files, prefix: str) -> list[str]:
    """The readable files whose name starts with ``prefix``, sorted."""
    return [n for n in sorted(files) if n.startswith(prefix) and "_error" not in files[n]]


def resident_mfu(files: Files) -> Found:
    """resident_mfu of the backends run with the most padded tokens, if >= 131072."""
    runs = [n for n in matching(files, "backends") if is_number(files[n].get("resident_mfu"))]
    if not runs:
        return None, "no backends*.json with resident_mfu"
    best = max(runs, key=lambda n: files[n].get("padded_tokens") or 0)
    tokens = files[best].get("padded_tokens") or 0
    if tokens < RESIDENT_TOKENS:
        return None, (f"largest resident run ({best}) has {tokens} padded tokens, "
                      f"< {RESIDENT_TOKENS}")
    return files[best]["resident_mfu"], f"{best}:resident_mfu ({tokens} padded tokens)"


def gmm_fraction(files: Files, model: str) -> Found:
    """The model's fraction of the matmul rate at 16384 tokens: the best kernel's when
    recorded, else the Pallas kernel's (first gmm*.json that has one)."""
    reasons = []
    for suffix in ("best", "pallas"):
        key = f"{model}_{GMM_TOKENS}_{suffix}_fraction_of_matmul"
        for name in matching(files, "gmm"):
            value, source = from_file(files, name, key)
            if value is not None:
                return value, source
        reasons.append(key)
    return None, f"no gmm*.json has {' or '.join(reasons)}"


def theta_run(files: Files) -> tuple[str | None, str]:
    """The backends run with the smallest offload batch/Θ that is >= 1.5: (file name, or
    None with the reason)."""
    runs = [n for n in matching(files, "backends")
            if is_number(files[n].get("offload_batch_over_theta"))]
    if not runs:
        return None, "no backends*.json with offload_batch_over_theta"
    qualifying = [n for n in runs if files[n]["offload_batch_over_theta"] >= THETA_MULTIPLE]
    if not qualifying:
        best = max(files[n]["offload_batch_over_theta"] for n in runs)
        return None, (f"no offload run at >= {THETA_MULTIPLE} Θ (largest batch/Θ seen: "
                      f"{best:.3g}); rerun backends.py with a larger --batch-tokens")
    return min(qualifying, key=lambda n: files[n]["offload_batch_over_theta"]), ""


def offload_at_theta(files: Files, key: str) -> Found:
    """``key`` of the offload run at >= 1.5 Θ (the issue's targets are set there)."""
    name, reason = theta_run(files)
    if name is None:
        return None, reason
    value, source = from_file(files, name, key)
    if value is None:
        return None, source
    return value, f"{source} (batch = {files[name]['offload_batch_over_theta']:.3g} Θ)"


FINDERS: dict[str, Callable[[Files], Found]] = {
    "resident_mfu_qwen3_30b": resident_mfu,
    "gmm_qwen3_fraction_of_matmul": lambda f: gmm_fraction(f, "qwen3"),
    "gmm_mixtral_fraction_of_matmul": lambda f: gmm_fraction(f, "mixtral"),
    "offload_exposed_transfer_fraction":
        lambda f: offload_at_theta(f, "offload_exposed_transfer_fraction"),
    "offload_over_resident_at_1p5_theta": lambda f: offload_at_theta(f, "offload_over_resident"),
    "metro_kernel_device_us": lambda f: from_file(f, "metro.json", "metro_kernel_device_us"),
    "full_model_tokens_per_s":
        lambda f: from_file(f, "full_model.json", "full_model_tokens_per_s"),
}


def summarize(files: Files) -> tuple[dict[str, Any], dict[str, str]]:
    """(summary: the found figures and ``missing``, key -> source of each found one)."""
    summary: dict[str, Any] = {}
    missing: dict[str, str] = {}
    sources: dict[str, str] = {}
    for key in KEYS:
        value, note = FINDERS[key](files)
        if value is None:
            missing[key] = note
        else:
            summary[key], sources[key] = value, note
    summary["missing"] = missing
    return summary, sources


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, quick_help="no effect (the summary only reads the files; "
                                              "accepted as every benchmark accepts it)")
    parser.add_argument("out_dir", help="the directory a gpu_suite.sh run wrote (--json "
                                        "default: OUT_DIR/summary.json)")
    args = parse_args(parser, argv)
    summary, sources = summarize(load_dir(args.out_dir))
    for key in KEYS:
        if key in summary:
            print(f"{key:<36} {summary[key]:<12.6g} from {sources[key]}")
        else:
            print(f"{key:<36} {'missing':<12} {summary['missing'][key]}")
    # summary.json holds the figures only (each run's own JSON keeps its metadata).
    write_json(args.json_path or os.path.join(args.out_dir, "summary.json"), summary)
    return summary


if __name__ == "__main__":
    main()
