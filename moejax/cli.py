"""The ``moejax`` command line.

    moejax score IN.jsonl [-o OUT.jsonl] [--model DIR|demo] [--dtype float32|bfloat16]
    moejax convert HF_DIR OUT_DIR [--dtype bfloat16]
    moejax info [--model DIR|demo]

``score`` reads one JSON request per line (fields of ``serving.ScoreRequest``:
id, prompt | prompt_token_ids, candidates | candidate_token_ids, kind, normalize)
and writes one JSON result per input line, in input order (fields of
``serving.ScoreResult``). A line that is not valid JSON, or a request that is
invalid, gets a result with ``error`` set; the other lines are still scored.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any, Sequence


def _read_jsonl(path: str) -> tuple[list[Any], dict[int, str]]:
    """Parsed lines, and an error message for each line that is not a JSON object."""
    requests: list[Any] = []
    bad: dict[int, str] = {}
    stream = sys.stdin if path == "-" else open(path, encoding="utf-8", errors="surrogateescape")
    with stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            index = len(requests)
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                bad[index] = f"line {number}: invalid JSON: {exc.msg} (column {exc.colno})"
                obj = None
            else:
                if not isinstance(obj, dict):
                    bad[index] = f"line {number}: expected a JSON object, got {type(obj).__name__}"
                    obj = None
            requests.append(obj)
    return requests, bad


def _scorer_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"dtype": args.dtype, "max_batch_tokens": args.max_batch_tokens,
            "expert_impl": args.expert_impl}


def cmd_score(args: argparse.Namespace) -> int:
    from serving import Scorer
    from serving.requests import ScoreResult

    requests, bad = _read_jsonl(args.input)
    scorer = Scorer(args.model, **_scorer_options(args))
    good_index = [i for i in range(len(requests)) if i not in bad]
    start = time.perf_counter()
    scored = scorer.score([requests[i] for i in good_index], progress=args.progress)
    elapsed = time.perf_counter() - start
    results: list[ScoreResult | None] = [None] * len(requests)
    for i, message in bad.items():
        results[i] = ScoreResult(error=message)
    for i, result in zip(good_index, scored):
        results[i] = result
    lines = "".join(json.dumps(r.to_dict(), ensure_ascii=False) + "\n" for r in results)
    if args.output in (None, "-"):
        sys.stdout.write(lines)
    else:
        with open(args.output, "w", encoding="utf-8") as out:
            out.write(lines)
    errors = sum(1 for r in results if r.error)
    stats = scorer.engine.stats
    rate = stats.real_tokens / elapsed if elapsed > 0 else 0.0
    print(f"scored {len(results) - errors} of {len(results)} requests ({errors} with errors) in "
          f"{elapsed:.2f}s: {stats.real_tokens} tokens, {rate:.0f} tokens/s, "
          f"{stats.batches} batches, {stats.compiles} compiled shapes"
          + (f", results in {args.output}" if args.output not in (None, "-") else ""),
          file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from moejax import checkpoint

    out = checkpoint.convert_checkpoint(args.model_dir, args.out_dir, dtype=args.dtype,
                                        overwrite=args.overwrite)
    print(f"converted {args.model_dir} -> {out} ({args.dtype})", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from serving import Scorer

    scorer = Scorer(args.model, **_scorer_options(args))
    info = dict(scorer.info)
    cfg = scorer.config
    info.update(params=cfg.num_params(), linear_flops_per_token=cfg.linear_flops_per_token,
                token_buckets=scorer.engine.policy.token_buckets(cfg.max_context))
    print(json.dumps(info, indent=2))
    return 0


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo",
                   help="local Hugging Face model directory, converted moejax directory, or "
                        "'demo' (built-in untrained model; default)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default=None,
                   help="compute dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="tokens per packed batch (default: configs/scoring.yaml)")
    p.add_argument("--expert-impl", default=None,
                   choices=["auto", "fused_tiles", "gmm", "ragged_dot", "dense"],
                   help="expert computation path (default: auto)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moejax", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log compiles and batches")
    sub = parser.add_subparsers(dest="command", required=True)

    score = sub.add_parser("score", help="score a JSONL file of requests")
    score.add_argument("input", help="JSONL requests ('-' for stdin)")
    score.add_argument("-o", "--output", default=None, help="JSONL results (default: stdout)")
    score.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bar (default: on for large inputs on a terminal)")
    _add_model_options(score)
    score.set_defaults(func=cmd_score)

    convert = sub.add_parser("convert", help="convert a HF checkpoint to moejax params (orbax)")
    convert.add_argument("model_dir")
    convert.add_argument("out_dir")
    convert.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    convert.add_argument("--overwrite", action="store_true")
    convert.set_defaults(func=cmd_convert)

    info = sub.add_parser("info", help="print what a model directory holds and how it is served")
    _add_model_options(info)
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"moejax: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
