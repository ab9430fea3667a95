"""Compare the compiled XLA programs of two checkouts of moejax (a refactor's first check).

For each backend named, builds it in a fresh process per checkout (each process has its
checkout first on ``PYTHONPATH``), lowers and compiles one packed scoring step
(``Backend.lowered_steps``) and keeps the optimized HLO text with value names and
source-location metadata stripped. Equal texts mean the refactor changed no computation,
so any timing difference between the two is noise or host-side Python.

    python -m benchmarks.compare_programs --old-root /path/to/old/checkout [--quick] [--json PATH]

(make the old checkout with ``git worktree add /tmp/old <commit>``.)
JSON keys, per backend B: B_old_lines, B_new_lines, B_differing_lines (lines in one
program's multiset and not the other's, both directions).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.lib.cli import REPO_ROOT, bench_parser, parse_args, run_shape
from benchmarks.lib.meta import finish_run

FULL = dict(vocab=4096, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, experts=32,
            top_k=4, intermediate=256, tokens=4096, block=512)
QUICK = dict(vocab=512, hidden=128, layers=4, heads=4, kv_heads=4, head_dim=32, experts=16,
             top_k=2, intermediate=64, tokens=256, block=64)
DEVICES = 4     # the multi-device backends (CPU host devices)


def normalized_hlo(text: str) -> list[str]:
    """HLO lines without value names, numbered instruction names or source metadata."""
    lines, in_tables = [], False
    for line in text.splitlines():
        if line.startswith("FileNames"):          # debug tables before the computations
            in_tables = True
            continue
        if in_tables and (line.startswith("%") or line.startswith("ENTRY")):
            in_tables = False
        if in_tables:
            continue
        line = re.sub(r",?\s*metadata=\{[^}]*\}", "", line)
        line = re.sub(r"%[\w.\-]+", "%v", line)
        line = re.sub(r"\b[a-z_]\w*\.\d+\b", "X", line)
        line = re.sub(r"HloModule \S+", "HloModule", line).strip()
        if line:
            lines.append(line)
    return lines


def dump_program(backend: str, shape: dict) -> list[str]:
    """Runs inside the child process: the normalized program of one step of ``backend``."""
    import numpy as np

    from moejax import model
    from moejax.backends import make_backend
    from moejax.config import ModelConfig

    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=shape["vocab"],
                      hidden_size=shape["hidden"], num_layers=shape["layers"],
                      num_heads=shape["heads"], num_kv_heads=shape["kv_heads"],
                      head_dim=shape["head_dim"], num_experts=shape["experts"],
                      num_experts_per_tok=shape["top_k"],
                      moe_intermediate_size=shape["intermediate"], max_context=4 * shape["block"],
                      norm_topk_prob=True, qk_norm=True, tie_word_embeddings=False,
                      rms_norm_eps=1e-6, rope_theta=10000.0)
    devices = 1 if backend in ("resident", "offload") else DEVICES
    be = make_backend(backend, cfg, model.init_params(cfg, 0), devices=devices)
    tokens, block = shape["tokens"], shape["block"]
    sequences = tokens // block
    rng = np.random.default_rng(0)
    batch = model.PackedBatch(
        tokens=rng.integers(0, cfg.vocab_size, tokens).astype(np.int32),
        positions=np.tile(np.arange(block), sequences).astype(np.int32),
        segment_ids=np.repeat(np.arange(sequences), block).astype(np.int32),
        score_positions=(np.arange(sequences, dtype=np.int32) + 1) * block - 1,
        score_token_ids=np.zeros((sequences, 2), np.int32))
    opts = model.ForwardOptions(attn_block=block, full_vocab=False)
    lowered = be.lowered_steps([batch] * be.num_ranks, opts)
    # The first line names the checkout compiled (the caller checks it).
    return [model.__file__] + normalized_hlo("\n".join(step.compile().as_text()
                                                       for step in lowered))


def program_of(root: Path, backend: str, shape: dict) -> list[str]:
    """The normalized program of ``backend`` as the checkout at ``root`` compiles it."""
    # ``root`` first, so that moejax comes from it; this checkout after it, for this module
    # (a ``benchmarks`` package of ``root`` without it falls through to this one's).
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(root), str(REPO_ROOT)]))
    code = (f"import json; from benchmarks.compare_programs import dump_program; "
            f"print(json.dumps(dump_program({backend!r}, {shape!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=root, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{backend} at {root}: {done.stderr[-2000:]}")
    source, *program = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(source).resolve().is_relative_to(root.resolve()):
        raise RuntimeError(f"the process for {root} imported moejax from {source}")
    return program


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, quick_help="small shapes (seconds)")
    parser.add_argument("--old-root", required=True, type=Path, help="the other checkout")
    parser.add_argument("--backends", default="resident,tp,async_ep,sync_ep",
                        help="comma list of backends")
    args = parse_args(parser, argv)
    if not (args.old_root / "moejax").is_dir():
        parser.error(f"--old-root {args.old_root} has no moejax/ package")
    shape = run_shape(args, QUICK, FULL)
    figures: dict = {}
    print(f"compiled programs, {args.old_root} (old) vs {REPO_ROOT} (new), "
          f"d={shape['hidden']} L={shape['layers']} E={shape['experts']} T={shape['tokens']}")
    for backend in args.backends.split(","):
        old, new = (program_of(args.old_root, backend, shape),
                    program_of(REPO_ROOT, backend, shape))
        a, b = collections.Counter(old), collections.Counter(new)
        differing = sum((a - b).values()) + sum((b - a).values())
        figures.update({f"{backend}_old_lines": len(old), f"{backend}_new_lines": len(new),
                        f"{backend}_differing_lines": differing})
        print(f"  {backend:9s} {len(old):6d} vs {len(new):6d} lines, {differing} differing")
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
