"""Accuracy of prefill-only scoring against greedy decoding (MoE-Prefill §8.6, Tier 2).

On held-out labelled items of every task of the demo model (``moejax.demo.heldout``: domain
question, arithmetic yes/no, arithmetic true/false claim, multiple choice, multi-selection,
one-digit products with multi-token candidates), one model answers each item twice, in one
run:

* **prefill** -- ``serving.Scorer.score`` on the item's scoring request: the label is the
  argmax of the candidates' log-probabilities (no token is generated);
* **generate** -- ``serving.Generator.generate``, greedy (temperature 0), at most
  ``--max-new-tokens`` tokens (default 4; stops at the model's EOS), from *exactly the token
  ids the Scorer reads its answer logits after*: for every prefill op of the request
  (``serving.requests.normalize_requests``), ``op.token_ids[:op.score_positions[0] + 1]``.
  So a "choice" item generates from the rendered ``Q\\nA. ..\\nB. ..\\nAnswer:`` prompt, and a
  "multi" item from each of its yes/no siblings (prompt tokens + the encoded
  ``\\nCandidate: X\\nRelevant (yes/no):``), as the Scorer runs them.

Parsing a generation (:func:`parse_answer`): the first whitespace-separated word of the
generated text, trailing punctuation removed, compared case-insensitively with the stripped
candidates (classify; for the product task the candidates are numbers, so the generated
number must be one of the four options), the option identifiers ``A``..``D`` or, failing
that, an option's own text (choice), ``yes``/``no`` (each multi sibling; the item's answer
is the set of siblings answered ``yes``). A generation that matches no candidate is
*unparsed*: it counts as wrong and is reported separately (``unparsed_*``). No task is
skipped: every task has a fixed answer format the demo was trained on; "multi" is adapted
(one generation per candidate) and "product" is parsed as a number.

Figures: per task and overall (every task has the same number of items, so overall is
also the mean over tasks) -- ``accuracy_prefill``, ``accuracy_generate``, ``agreement``
(both modes give the same answer; an unparsed generation disagrees), ``unparsed``, and
``majority`` (the share of the most common expected answer: what always answering it
scores). Throughput, measured in the same run on the same items, after one untimed warm-up
pass of each mode (it compiles every shape bucket the timed passes use); ``--repeats``
timed passes alternate prefill, generate, prefill, ...; the median of each is reported:

* prefill: tokens of all prefill ops (each op counted in full) / wall s, and items / wall s;
* generate: (prompt + generated tokens of all generations) / wall s, and items / wall s;
* ``speedup_prefill_over_generate`` = items/s of prefill / items/s of generate (the time to
  answer the same items), and ``tokens_per_s_ratio`` = prefill tok/s / generate tok/s (what
  the paper's 5.5x compares).

Both run float32 on this machine's default JAX device; the Scorer with its default options
(prefix cache off), the Generator with ``--gen-batch`` rows per decode batch, a fresh one
for every pass (built outside the clock): a Generator keeps the prompt blocks it prefilled,
so a second pass on it would skip the prompts' prefill, which the Scorer does every pass,
and would run step programs of shapes the warm-up never compiled. Every timed pass counts
its compiles (``compiles_in_timed_passes``; a pass that compiled is flagged).

    python -m benchmarks.reformulation_accuracy [--quick] [--json PATH] [--model DIR|demo]
        [--per-task N] [--max-new-tokens N] [--gen-batch N] [--repeats N] [--seed N]
        [--tasks domain_question,multiple_choice,...]

JSON keys (flat): accuracy_prefill, accuracy_generate, agreement, unparsed,
speedup_prefill_over_generate, tokens_per_s_ratio, prefill_tokens_per_s,
generate_tokens_per_s, prefill_items_per_s, generate_items_per_s, prefill_seconds,
generate_seconds, prefill_run{i}_seconds, generate_run{i}_seconds, prefill_tokens,
generate_prompt_tokens, generate_new_tokens, generate_sequences, prefill_ops,
warmup_seconds_{prefill,generate}; per task ``{figure}_{task}`` for figure in accuracy_prefill,
accuracy_generate, agreement, unparsed, majority, items; and the run's settings.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from typing import Any, Hashable, Sequence

from benchmarks.lib.cli import bench_parser, parse_args, run_shape
from benchmarks.lib.meta import finish_run
from benchmarks.lib.timing import median, timed_call
from serving.requests import NormalizeOptions, PrefillOp, normalize_requests

FULL = dict(per_task=100, repeats=3)
QUICK = dict(per_task=12, repeats=1)
_TRAILING = ".,;:!?)]}\"'"

Answer = Hashable          # a candidate index (int) or, for kind "multi", a tuple of indices


# ------------------------------------------------------------------------------ parsing
def first_word(text: str) -> str:
    """The first whitespace-separated word of ``text`` without trailing punctuation
    (``""`` when there is none)."""
    words = text.split()
    return words[0].rstrip(_TRAILING) if words else ""


def parse_answer(text: str, answers: Sequence[str], aliases: Sequence[str] = ()) -> int | None:
    """Index of the answer a generated ``text`` gives, or None (unparsed).

    The first word of ``text`` (:func:`first_word`) is compared case-insensitively with the
    stripped ``answers``; if none matches, with the stripped ``aliases`` (``aliases[i]``
    stands for answer i, e.g. a multiple-choice option's own text). A word that matches
    several answers is ambiguous, hence unparsed.
    """
    word = first_word(text).casefold()
    if not word:
        return None
    for table in (answers, aliases):
        hits = [i for i, answer in enumerate(table) if answer.strip().casefold() == word]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            return None
    return None


def generation_prompts(ops: Sequence[PrefillOp]) -> dict[int, list[tuple[int, ...]]]:
    """Per request index, the distinct prompts (token ids) the Scorer reads answers after:
    ``op.token_ids[:op.score_positions[0] + 1]`` of each op, in op order. A classify
    request with multi-token candidates has one op per candidate but a single prompt; a
    "multi" request has one prompt per candidate (its yes/no siblings)."""
    out: dict[int, list[tuple[int, ...]]] = {}
    for op in ops:
        prompt = tuple(op.token_ids[:op.score_positions[0] + 1].tolist())
        prompts = out.setdefault(op.request_index, [])
        if prompt not in prompts:
            prompts.append(prompt)
    return out


def answer_table(request: dict[str, Any], options: NormalizeOptions
                 ) -> tuple[list[str], list[str]]:
    """(answers, aliases) a generation of ``request`` is parsed against (see
    :func:`parse_answer`): the candidates (classify), the option identifiers and, as
    aliases, the options (choice), or the yes/no answers of each sibling (multi)."""
    kind = request.get("kind", "classify")
    if kind == "choice":
        labels = list(options.choice_labels[:len(request["candidates"])])
        return labels, list(request["candidates"])
    if kind == "multi":
        return list(options.multi_answers), []
    return list(request["candidates"]), []


def generated_answer(kind: str, parsed: Sequence[int | None]) -> Answer | None:
    """The item's answer from its parsed generations (None = unparsed). Kinds "classify"
    and "choice" have one generation; "multi" one per candidate, each parsed as 0 = yes,
    1 = no: the answer is the sorted tuple of candidates answered yes."""
    if any(p is None for p in parsed):
        return None
    if kind == "multi":
        return tuple(k for k, p in enumerate(parsed) if p == 0)
    if len(parsed) != 1:
        raise ValueError(f"kind {kind!r} has one generation per item, got {len(parsed)}")
    return parsed[0]


def accuracy_figures(expected: Sequence[Answer], prefill: Sequence[Answer],
                     generated: Sequence[Answer | None]) -> dict[str, float]:
    """Accuracy of each mode, their agreement and the unparsed share over aligned lists
    (``generated[i] is None``: unparsed, wrong and disagreeing); ``majority`` is the share
    of the most common expected answer."""
    n = len(expected)
    if not n or len(prefill) != n or len(generated) != n:
        raise ValueError("expected, prefill and generated must be non-empty and aligned")
    return {
        "accuracy_prefill": sum(p == e for p, e in zip(prefill, expected)) / n,
        "accuracy_generate": sum(g is not None and g == e for g, e in zip(generated, expected)) / n,
        "agreement": sum(g is not None and g == p for g, p in zip(generated, prefill)) / n,
        "unparsed": sum(g is None for g in generated) / n,
        "majority": Counter(expected).most_common(1)[0][1] / n,
        "items": n,
    }


# ------------------------------------------------------------------------------ running
def expected_answer(item) -> Answer:
    return item.label if item.selected is None else tuple(item.selected)


def prefill_answer(result) -> Answer:
    if result.error is not None:
        raise RuntimeError(f"{result.id}: {result.error}")
    return result.label if result.selected is None else tuple(result.selected)


def run_prefill(scorer, requests: list[dict], label: str | None) -> tuple[list, float]:
    seconds, results = timed_call(lambda: scorer.score(requests, progress=False), label=label)
    return results, seconds


def run_generate(new_generator, gen_requests: list[dict], label: str | None
                 ) -> tuple[list, float]:
    """One generate pass on a Generator made for it (outside the clock): a Generator keeps
    the prompt blocks it prefilled cached in its KV pool, so a second pass on the same one
    would skip the prompts' prefill (not the work the Scorer repeats every pass) and run
    step programs of other shapes than the warm-up compiled. Its compiled step programs
    are JAX's, shared by every Generator of the same options: a fresh one compiles
    nothing."""
    generator = new_generator()
    seconds, results = timed_call(lambda: generator.generate(gen_requests), label=label)
    for r in results:
        if r.error is not None:
            raise RuntimeError(f"{r.id}: {r.error}")
    return results, seconds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, quick_help="12 items per task, 1 timed pass", model="demo",
                          model_help="model directory, or 'demo' (the built-in model; default)",
                          repeats_help="timed passes per mode (median kept; default 3, quick 1)")
    parser.add_argument("--per-task", type=int, help="held-out items per task (default 100; "
                                                     "quick 12)")
    parser.add_argument("--max-new-tokens", type=int, default=4,
                        help="generation budget per answer (default 4)")
    parser.add_argument("--gen-batch", type=int, default=16,
                        help="Generator max_batch_size: rows decoded together (default 16)")
    parser.add_argument("--seed", type=int, help="held-out item seed (default "
                                                 "moejax.demo.heldout.HELDOUT_SEED)")
    parser.add_argument("--tasks", help="comma-separated subset of the held-out tasks "
                                        "(default: all)")
    args = parse_args(parser, argv)
    shape = run_shape(args, QUICK, FULL, ("per_task", "repeats"))
    if shape["per_task"] < 1 or shape["repeats"] < 1 or args.max_new_tokens < 1:
        parser.error("--per-task, --repeats and --max-new-tokens must be positive")

    run_start = time.perf_counter()
    from moejax.demo import corpus, heldout
    from serving import Generator, Scorer

    tasks = list(heldout.TASKS) if not args.tasks else args.tasks.split(",")
    unknown = sorted(set(tasks) - set(heldout.TASKS))
    if unknown:
        parser.error(f"unknown tasks {unknown}; choose from {list(heldout.TASKS)}")

    logging.getLogger("moejax.scorer").setLevel(logging.ERROR)   # the demo notice, once:
    if args.model == "demo":
        from moejax.demo import DEMO_NOTICE

        print(f"note: {DEMO_NOTICE}")
    seed = heldout.HELDOUT_SEED if args.seed is None else args.seed
    src = corpus.sources("eval")
    items = [item for task in tasks
             for item in heldout.heldout_items(task, shape["per_task"], seed=seed, src=src)]
    requests = [item.request for item in items]

    scorer = Scorer(args.model, dtype="float32", compilation_cache="auto")

    def new_generator() -> Generator:
        return Generator(args.model, dtype="float32", max_batch_size=args.gen_batch)

    cfg = scorer.config
    options = scorer.normalize_options
    ops, errors, _ = normalize_requests(requests, scorer.tokenizer, vocab_size=cfg.vocab_size,
                                        max_context=cfg.max_context, options=options)
    if errors:
        raise RuntimeError(f"held-out requests failed to normalise: {errors}")
    prompts = generation_prompts(ops)
    gen_requests, owners = [], []          # owners[j] = request index of generation j
    for index in range(len(requests)):
        for sibling, ids in enumerate(prompts[index]):
            gen_requests.append({"id": f"{index}.{sibling}", "prompt_token_ids": list(ids),
                                 "max_new_tokens": args.max_new_tokens})
            owners.append(index)
    prefill_tokens = sum(len(op.token_ids) for op in ops)
    print(f"reformulation accuracy: {args.model} ({cfg.num_layers} layers, d={cfg.hidden_size}, "
          f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}), float32 on "
          f"{scorer.info['device']}; {shape['per_task']} held-out items x {len(tasks)} "
          f"tasks (seed {seed}): {len(ops)} prefill ops, {len(gen_requests)} greedy generations "
          f"of <= {args.max_new_tokens} tokens (batches of {args.gen_batch}); median of "
          f"{shape['repeats']} timed passes after a warm-up; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")

    _, warm_prefill = run_prefill(scorer, requests, label=None)           # warm-ups
    _, warm_generate = run_generate(new_generator, gen_requests, label=None)
    prefill_times, generate_times = [], []
    for _ in range(shape["repeats"]):
        score_results, seconds = run_prefill(scorer, requests, label="prefill")
        prefill_times.append(seconds)
        gen_results, seconds = run_generate(new_generator, gen_requests, label="generate")
        generate_times.append(seconds)

    # answers
    texts: dict[int, list[str]] = {}
    for owner, result in zip(owners, gen_results):
        texts.setdefault(owner, []).append(result.text)
    by_task: dict[str, dict[str, list]] = {}
    for index, item in enumerate(items):
        answers, aliases = answer_table(item.request, options)
        kind = item.request.get("kind", "classify")
        parsed = [parse_answer(text, answers, aliases) for text in texts[index]]
        slot = by_task.setdefault(item.task, {"expected": [], "prefill": [], "generated": []})
        slot["expected"].append(expected_answer(item))
        slot["prefill"].append(prefill_answer(score_results[index]))
        slot["generated"].append(generated_answer(kind, parsed))

    figures: dict[str, Any] = {"model": args.model, "per_task": shape["per_task"],
                               "repeats": shape["repeats"], "seed": seed,
                               "max_new_tokens": args.max_new_tokens,
                               "gen_batch": args.gen_batch, "tasks": tasks,
                               "load_average_at_start": os.getloadavg()[0]}
    print(f"\n{'task':<18} {'items':>5} {'prefill':>8} {'generate':>9} {'agree':>6} "
          f"{'unparsed':>8} {'majority':>8}")
    everything = {"expected": [], "prefill": [], "generated": []}
    for task in tasks:
        slot = by_task[task]
        for key in everything:
            everything[key].extend(slot[key])
        f = accuracy_figures(slot["expected"], slot["prefill"], slot["generated"])
        for key, value in f.items():
            figures[f"{key}_{task}"] = value
        print(f"{task:<18} {f['items']:>5} {f['accuracy_prefill']:>8.1%} "
              f"{f['accuracy_generate']:>9.1%} {f['agreement']:>6.1%} {f['unparsed']:>8.1%} "
              f"{f['majority']:>8.1%}")
    overall = accuracy_figures(everything["expected"], everything["prefill"],
                               everything["generated"])
    overall.pop("majority")   # over mixed tasks it means nothing
    figures.update(overall)
    print(f"{'overall':<18} {overall['items']:>5} {overall['accuracy_prefill']:>8.1%} "
          f"{overall['accuracy_generate']:>9.1%} {overall['agreement']:>6.1%} "
          f"{overall['unparsed']:>8.1%}")
    gap = overall["accuracy_prefill"] - overall["accuracy_generate"]
    figures["accuracy_gap_pp"] = 100 * gap
    print(f"prefill - generate: {100 * gap:+.1f} pp (the paper: within ~1 pp, same model)")

    # throughput
    prefill_s = median(prefill_times)
    generate_s = median(generate_times)
    prompt_tokens = sum(r.prompt_tokens for r in gen_results)
    new_tokens = sum(len(r.token_ids) for r in gen_results)
    n_items = len(items)
    figures.update({
        "prefill_ops": len(ops), "prefill_tokens": prefill_tokens,
        "generate_sequences": len(gen_results), "generate_prompt_tokens": prompt_tokens,
        "generate_new_tokens": new_tokens,
        "prefill_seconds": prefill_s, "generate_seconds": generate_s,
        "prefill_tokens_per_s": prefill_tokens / prefill_s,
        "generate_tokens_per_s": (prompt_tokens + new_tokens) / generate_s,
        "prefill_items_per_s": n_items / prefill_s,
        "generate_items_per_s": n_items / generate_s,
        "warmup_seconds_prefill": warm_prefill, "warmup_seconds_generate": warm_generate,
    })
    for i, (p, g) in enumerate(zip(prefill_times, generate_times)):
        figures[f"prefill_run{i}_seconds"], figures[f"generate_run{i}_seconds"] = p, g
    figures["speedup_prefill_over_generate"] = (figures["prefill_items_per_s"]
                                                / figures["generate_items_per_s"])
    figures["tokens_per_s_ratio"] = (figures["prefill_tokens_per_s"]
                                     / figures["generate_tokens_per_s"])
    print(f"\nprefill : {len(ops)} ops, {prefill_tokens} tokens in {prefill_s:.3f} s -> "
          f"{figures['prefill_tokens_per_s']:.0f} tok/s, {figures['prefill_items_per_s']:.1f} "
          f"items/s (warm-up {warm_prefill:.1f} s)")
    print(f"generate: {len(gen_results)} sequences, {prompt_tokens} prompt + {new_tokens} new "
          f"tokens in {generate_s:.3f} s -> {figures['generate_tokens_per_s']:.0f} tok/s, "
          f"{figures['generate_items_per_s']:.1f} items/s (warm-up {warm_generate:.1f} s)")
    print(f"speedup (items/s, prefill over generate): "
          f"{figures['speedup_prefill_over_generate']:.2f}x; tokens/s ratio "
          f"{figures['tokens_per_s_ratio']:.2f}x (the paper: 5.5x tokens/s)")
    figures["total_seconds"] = time.perf_counter() - run_start
    print(f"total {figures['total_seconds']:.0f} s")
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
