"""The issue's headline figures from one GPU run, in one flat ``summary.json``.

Reads the JSON files a GPU run (``benchmarks/gpu_once.py``, or the parts of
``benchmarks/gpu_suite.sh``) wrote into OUT_DIR and writes OUT_DIR/summary.json with
exactly these keys (each a number, or absent). A run is found by what its file holds, not
by its name:

    resident_mfu_qwen3_30b             resident_mfu of the backends run with the most
                                       padded tokens, if >= 131072 (Qwen3-30B-A3B shape,
                                       8 layers); else breakdown_mfu of a time_breakdown
                                       run of >= 131072 padded tokens
    gmm_qwen3_fraction_of_matmul       qwen3_16384_best_fraction_of_matmul, else
    gmm_mixtral_fraction_of_matmul     ..._pallas_fraction_of_matmul (same for mixtral)
    offload_exposed_transfer_fraction  of the backends run whose offload_batch_over_theta
    offload_over_resident_at_1p5_theta is the smallest >= 1.5 (offload_over_resident), with
    offload_batch_over_theta           that multiple and the exposed transfer's split:
    offload_exposed_step_start_fraction, offload_exposed_between_layers_fraction,
    offload_exposed_other_fraction
    metro_kernel_device_us             metro_kernel_device_us
    full_model_tokens_per_s            full_model_tokens_per_s
    matmul_bf16_tflops                 the measured bf16 matmul rate (device_env) every
                                       fraction of a gpu_once run divides by
    copy_tbps                          the measured memory bandwidth (device_env)
    gmm_qwen3_mosaic_over_triton       qwen3_16384_mosaic_over_triton (same for mixtral):
    gmm_mixtral_mosaic_over_triton     kernels_pallas.gmm_select's rule runs Mosaic on the
                                       device only where both are >= 1.0

plus ``missing``: key -> why it is absent (no file, no such key, no run that qualifies),
and ``measured_backend``: the rule's verdict for this device ("mosaic" or "triton", with
both ratios measured; absent otherwise), the entry to put in
``kernels_pallas.gmm_select.MEASURED_BACKENDS``. Nothing is invented: a figure is copied
from its file or reported missing. The source of each figure is printed.

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
        "full_model_tokens_per_s", "matmul_bf16_tflops", "copy_tbps",
        "offload_batch_over_theta",
        "offload_exposed_step_start_fraction", "offload_exposed_between_layers_fraction",
        "offload_exposed_other_fraction", "gmm_qwen3_mosaic_over_triton",
        "gmm_mixtral_mosaic_over_triton")
GMM_MODELS = ("qwen3", "mixtral")

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


def with_key(files: Files, key: str) -> list[str]:
    """The readable files holding a number under ``key``, sorted by name."""
    return [n for n in sorted(files) if "_error" not in files[n] and is_number(files[n].get(key))]


def from_any(files: Files, key: str) -> Found:
    """``key`` from the first file (by name) that holds it as a number."""
    names = with_key(files, key)
    if not names:
        unreadable = [f"{n} ({d['_error']})" for n, d in sorted(files.items()) if "_error" in d]
        return None, (f"no file has a number under {key}"
                      + (f"; unreadable: {', '.join(unreadable)}" if unreadable else ""))
    return from_file(files, names[0], key)


def resident_mfu(files: Files) -> Found:
    """resident_mfu of the backends run with the most padded tokens, if >= 131072; else
    breakdown_mfu of a time_breakdown run that large."""
    runs = with_key(files, "resident_mfu")
    if runs:
        best = max(runs, key=lambda n: files[n].get("padded_tokens") or 0)
        tokens = files[best].get("padded_tokens") or 0
        if tokens >= RESIDENT_TOKENS:
            return files[best]["resident_mfu"], f"{best}:resident_mfu ({tokens} padded tokens)"
    breakdowns = [n for n in with_key(files, "breakdown_mfu")
                  if (files[n].get("breakdown_padded_tokens") or 0) >= RESIDENT_TOKENS]
    if breakdowns:
        return files[breakdowns[0]]["breakdown_mfu"], (
            f"{breakdowns[0]}:breakdown_mfu ({files[breakdowns[0]]['breakdown_padded_tokens']} "
            f"padded tokens, the resident forward alone)")
    if not runs:
        return None, (f"no backends run with resident_mfu and no time_breakdown run of >= "
                      f"{RESIDENT_TOKENS} padded tokens")
    best = max(runs, key=lambda n: files[n].get("padded_tokens") or 0)
    return None, (f"largest resident run ({best}) has {files[best].get('padded_tokens') or 0} "
                  f"padded tokens, < {RESIDENT_TOKENS}")


def gmm_fraction(files: Files, model: str) -> Found:
    """The model's fraction of the matmul rate at 16384 tokens: the best kernel's when
    recorded, else the Pallas kernel's (first gmm*.json that has one)."""
    reasons = []
    for suffix in ("best", "pallas"):
        key = f"{model}_{GMM_TOKENS}_{suffix}_fraction_of_matmul"
        if with_key(files, key):
            return from_any(files, key)
        reasons.append(key)
    return None, f"no file has {' or '.join(reasons)}"


def theta_run(files: Files) -> tuple[str | None, str]:
    """The backends run with the smallest offload batch/Θ that is >= 1.5: (file name, or
    None with the reason)."""
    runs = with_key(files, "offload_batch_over_theta")
    if not runs:
        return None, "no backends run with offload_batch_over_theta"
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


def mosaic_verdict(summary: Mapping[str, Any]) -> str | None:
    """gmm_select's rule: "mosaic" where Mosaic was at least as fast as Triton on both
    expert shapes in the run, "triton" where either was slower, None unless both ran."""
    ratios = [summary.get(f"gmm_{model}_mosaic_over_triton") for model in GMM_MODELS]
    if not all(is_number(r) for r in ratios):
        return None
    return "mosaic" if min(ratios) >= 1.0 else "triton"


FINDERS: dict[str, Callable[[Files], Found]] = {
    "resident_mfu_qwen3_30b": resident_mfu,
    "gmm_qwen3_fraction_of_matmul": lambda f: gmm_fraction(f, "qwen3"),
    "gmm_mixtral_fraction_of_matmul": lambda f: gmm_fraction(f, "mixtral"),
    "offload_exposed_transfer_fraction":
        lambda f: offload_at_theta(f, "offload_exposed_transfer_fraction"),
    "offload_over_resident_at_1p5_theta": lambda f: offload_at_theta(f, "offload_over_resident"),
    "metro_kernel_device_us": lambda f: from_any(f, "metro_kernel_device_us"),
    "full_model_tokens_per_s": lambda f: from_any(f, "full_model_tokens_per_s"),
    "matmul_bf16_tflops": lambda f: from_any(f, "matmul_bf16_tflops"),
    "copy_tbps": lambda f: from_any(f, "copy_tbps"),
    "offload_batch_over_theta": lambda f: offload_at_theta(f, "offload_batch_over_theta"),
    "offload_exposed_step_start_fraction":
        lambda f: offload_at_theta(f, "offload_exposed_first_layer_fraction"),
    "offload_exposed_between_layers_fraction":
        lambda f: offload_at_theta(f, "offload_exposed_between_layers_fraction"),
    "offload_exposed_other_fraction":
        lambda f: offload_at_theta(f, "offload_exposed_other_fraction"),
    **{f"gmm_{model}_mosaic_over_triton":
       (lambda f, m=model: from_any(f, f"{m}_{GMM_TOKENS}_mosaic_over_triton"))
       for model in GMM_MODELS},
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
    verdict = mosaic_verdict(summary)
    if verdict is not None:
        summary["measured_backend"] = verdict
        sources["measured_backend"] = "gmm_select's rule on the two mosaic_over_triton ratios"
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
            print(f"{key:<40} {summary[key]:<12.6g} from {sources[key]}")
        else:
            print(f"{key:<40} {'missing':<12} {summary['missing'][key]}")
    if "measured_backend" in summary:
        print(f"{'measured_backend':<40} {summary['measured_backend']:<12} from "
              f"{sources['measured_backend']}")
    # summary.json holds the figures only (each run's own JSON keeps its metadata).
    write_json(args.json_path or os.path.join(args.out_dir, "summary.json"), summary)
    return summary


if __name__ == "__main__":
    main()
