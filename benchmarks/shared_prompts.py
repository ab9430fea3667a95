"""A prompt shared among its candidates: one request of a long prompt and many two-token
candidates, scored with prompt sharing (the default, ``share_prompts``) and without, over
the same prompt scored alone.

Without sharing every candidate recomputes the prompt (each candidate of several tokens is
its own sequence); with it the prompt runs once and each candidate continues it from the
prefix pool. Issue 14's case: a 1,900-token prompt with 200 two-token candidates (target:
within 3x its prompt alone). Times are the best of ``REPEATS`` after a warm-up run (which
compiles), in one process, side by side.

    python -m benchmarks.shared_prompts [--quick] [--model demo|DIR] [--json PATH]

JSON keys (flat): prompt_tokens, candidates, prompt_alone_ms, shared_ms, unshared_ms,
shared_over_prompt (target <= 3), unshared_over_prompt, unshared_over_shared,
shared_cost_token_equivalents, unshared_cost_token_equivalents, load_average_at_start, cpus.
"""

from __future__ import annotations

import os

from benchmarks.lib.cli import bench_parser, parse_args, run_shape
from benchmarks.lib.meta import finish_run
from benchmarks.lib.timing import sample_seconds

FULL = dict(prompt_tokens=1900, candidates=200)
QUICK = dict(prompt_tokens=1900, candidates=50)
REPEATS = 3
WORDS = ("the", "food", "was", "great", "service", "slow", "price", "fair", "room", "clean")


def long_prompt(tokenizer, tokens: int, seed: int = 0) -> str:
    """Random words until the prompt is ``tokens`` tokens long (or just past it)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words: list[str] = []
    while True:
        words.extend(rng.choice(WORDS, 64))
        text = " ".join(words)
        if len(tokenizer.encode(text)) >= tokens:
            break
    while len(tokenizer.encode(" ".join(words[:-1]))) >= tokens:
        words.pop()
    return " ".join(words)


def best_ms(scorer, requests: list[dict], label: str) -> float:
    """The best of :data:`REPEATS` timed calls (after one that compiles), milliseconds."""
    return 1000 * min(sample_seconds(lambda: scorer.score(requests, progress=False), REPEATS,
                                     label=label))


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, quick_help="fewer candidates (under a minute)", model="demo")
    parser.add_argument("--candidates", type=int, help="two-token candidates of the request")
    args = parse_args(parser, argv)
    shape = run_shape(args, QUICK, FULL, ("candidates",))

    from serving import Scorer

    load = os.getloadavg()[0]
    shared = Scorer(args.model, calibrate=False, compilation_cache="auto")
    unshared = Scorer(args.model, calibrate=False, share_prompts=False, compilation_cache="auto")
    tokens = min(shape["prompt_tokens"], shared.config.max_context - 2)
    prompt = long_prompt(shared.tokenizer, tokens)
    vocab = shared.config.vocab_size
    candidates = [[(64 + i) % vocab, (640 + 7 * i) % vocab] for i in range(shape["candidates"])]
    request = {"prompt": prompt, "candidate_token_ids": candidates}
    alone = {"prompt": prompt, "candidate_token_ids": [[64], [65]]}
    figures: dict = {"prompt_tokens": shared.prepare(request).prompt_tokens,
                     "candidates": len(candidates),
                     "shared_cost_token_equivalents": shared.prepare(request).cost,
                     "unshared_cost_token_equivalents": unshared.prepare(request).cost,
                     "load_average_at_start": load, "cpus": os.cpu_count()}
    print(f"one request: a {figures['prompt_tokens']}-token prompt, {len(candidates)} two-token "
          f"candidates; model {args.model}; load average {load:.2f} on {os.cpu_count()} CPUs")
    figures["prompt_alone_ms"] = best_ms(shared, [alone], "prompt_alone")
    figures["shared_ms"] = best_ms(shared, [request], "shared")
    figures["unshared_ms"] = best_ms(unshared, [request], "unshared")
    figures["shared_over_prompt"] = figures["shared_ms"] / figures["prompt_alone_ms"]
    figures["unshared_over_prompt"] = figures["unshared_ms"] / figures["prompt_alone_ms"]
    figures["unshared_over_shared"] = figures["unshared_ms"] / figures["shared_ms"]
    print(f"prompt alone:            {figures['prompt_alone_ms']:9.1f} ms")
    print(f"candidates, shared:      {figures['shared_ms']:9.1f} ms  "
          f"({figures['shared_over_prompt']:.2f}x the prompt alone; target <= 3; cost "
          f"{figures['shared_cost_token_equivalents']} token-equivalents)")
    print(f"candidates, not shared:  {figures['unshared_ms']:9.1f} ms  "
          f"({figures['unshared_over_prompt']:.1f}x the prompt alone; "
          f"{figures['unshared_over_shared']:.1f}x shared; cost "
          f"{figures['unshared_cost_token_equivalents']} token-equivalents)")
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
