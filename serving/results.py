"""Turning the engine's outputs back into one :class:`ScoreResult` per request.

The log-probability rules (normalisation over candidates or the vocabulary,
sums over multi-token candidates, the binary siblings of multi-selection) are
documented in :mod:`serving.requests`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping, Sequence

import numpy as np

from serving.multi_process import collective_failure, is_collective_failure
from serving.requests import (ClassifierHead, OpOutput, PrefillOp, ScoreRequest, ScoreResult,
                              parse_request, request_id_of, request_label)


def _check_output(op: PrefillOp, out: OpOutput) -> None:
    """An output that does not match its op is an engine bug, not a user error."""
    if len(out.logits) != len(op.score_positions):
        raise ValueError(f"op of request #{op.request_index} has {len(op.score_positions)} "
                         f"score positions but its output has {len(out.logits)} logit rows")
    for i, (row, ids) in enumerate(zip(out.logits, op.score_token_ids)):
        if np.shape(row) != (len(ids),):
            raise ValueError(f"op of request #{op.request_index}: logits[{i}] has shape "
                             f"{np.shape(row)}, expected ({len(ids)},)")
    if out.logsumexp is None:
        if op.full_vocab:
            raise ValueError(f"op of request #{op.request_index} needs logsumexp, got None")
    elif np.shape(out.logsumexp) != (len(op.score_positions),):
        raise ValueError(f"op of request #{op.request_index}: logsumexp has shape "
                         f"{np.shape(out.logsumexp)}, expected ({len(op.score_positions)},)")
    top = (len(op.score_positions), op.top_k)
    if op.top_k and (np.shape(out.top_ids) != top or np.shape(out.top_logits) != top):
        raise ValueError(f"op of request #{op.request_index}: top ids/logits have shapes "
                         f"{np.shape(out.top_ids)}/{np.shape(out.top_logits)}, expected {top}")


def _joint_scores(out: OpOutput) -> np.ndarray:
    """Per-candidate scores at the single position: vocab log-probs when logsumexp is given.

    Subtracting the (shared) logsumexp leaves the candidate log-softmax unchanged.
    """
    scores = np.asarray(out.logits[0], dtype=np.float64)
    if out.logsumexp is not None:
        scores = scores - float(np.asarray(out.logsumexp, dtype=np.float64)[0])
    return scores


def _sequence_logprob(out: OpOutput) -> float:
    """Sum over positions of log P(next token) = logit - logsumexp."""
    lse = np.asarray(out.logsumexp, dtype=np.float64)
    return float(sum(float(np.asarray(row, dtype=np.float64)[0]) - lse[i]
                     for i, row in enumerate(out.logits)))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax of a 1-D float64 array."""
    shift = np.max(x)
    if not np.isfinite(shift):
        shift = 0.0
    return x - (shift + np.log(np.sum(np.exp(x - shift))))


def _outputs_by_candidate(pairs: list[tuple[PrefillOp, OpOutput]], n: int) -> list[OpOutput]:
    """Outputs of sibling ops ordered by candidate_index, which must be exactly 0..n-1."""
    by_candidate = {op.candidate_index: out for op, out in pairs}
    if len(pairs) != n or sorted(by_candidate) != list(range(n)):
        got = sorted(op.candidate_index for op, _ in pairs)
        raise ValueError(f"request #{pairs[0][0].request_index}: expected one op per "
                         f"candidate 0..{n - 1}, got candidate indices {got}")
    return [by_candidate[k] for k in range(n)]


def _candidate_scores(pairs: list[tuple[PrefillOp, OpOutput]], n: int) -> np.ndarray:
    """Scores of the n candidates of a classify/choice request (joint or sequence ops)."""
    if len(pairs) == 1 and pairs[0][0].candidate_index == -1:
        scores = _joint_scores(pairs[0][1])
    else:
        scores = np.array([_sequence_logprob(out) for out in _outputs_by_candidate(pairs, n)])
    if scores.shape != (n,):
        raise ValueError(f"request #{pairs[0][0].request_index}: {scores.shape[0]} scores "
                         f"for {n} candidates")
    return scores


def _classify_result(req: ScoreRequest, pairs: list[tuple[PrefillOp, OpOutput]],
                     n: int) -> ScoreResult:
    """logprobs/label of a classify or choice request."""
    scores = _candidate_scores(pairs, n)
    logprobs = _log_softmax(scores) if req.normalize == "candidates" else scores
    return ScoreResult(id=req.id, logprobs=[float(v) for v in logprobs],
                       label=int(np.argmax(logprobs)))


def _multi_result(req: ScoreRequest, pairs: list[tuple[PrefillOp, OpOutput]],
                  n: int) -> ScoreResult:
    """logprobs (log P(yes) per candidate), label and selected of a multi request."""
    logprobs, selected = [], []
    for k, out in enumerate(_outputs_by_candidate(pairs, n)):
        yes_no = _joint_scores(out)  # [yes, no]
        binary = _log_softmax(yes_no)
        logprobs.append(float(binary[0] if req.normalize == "candidates" else yes_no[0]))
        if binary[0] > binary[1]:
            selected.append(k)
    return ScoreResult(id=req.id, logprobs=logprobs, label=int(np.argmax(logprobs)),
                       selected=selected)


def _prompt_logprobs_result(req: ScoreRequest, op: PrefillOp, out: OpOutput) -> ScoreResult:
    """Each prompt token's log-probability after the ones before it, and the most likely
    tokens at each position (kind "prompt_logprobs")."""
    lse = np.asarray(out.logsumexp, np.float64)
    logprobs = [float(np.float64(row[0]) - lse[i]) for i, row in enumerate(out.logits)]
    result = ScoreResult(id=req.id, logprobs=logprobs,
                         token_ids=[int(op.token_ids[0])] + [ids[0] for ids in
                                                             op.score_token_ids])
    if op.top_k:
        result.top_token_ids = np.asarray(out.top_ids).astype(int).tolist()
        result.top_logprobs = (np.asarray(out.top_logits, np.float64)
                               - lse[:, None]).tolist()
    return result


def _head_result(req: ScoreRequest, out: OpOutput, head: ClassifierHead) -> ScoreResult:
    """A classifier's answer (kind "head"): its raw outputs; with a softmax head the
    log-probabilities over the labels and the best; with a sigmoid head each label's own
    log-probability and those above one half (``selected``); one output (a reward model)
    or a regression: the score alone."""
    scores = np.asarray(out.logits[0], np.float64)
    result = ScoreResult(id=req.id, scores=[float(v) for v in scores])
    if head.activation == "softmax":
        result.logprobs = [float(v) for v in _log_softmax(scores)]
        result.label = int(np.argmax(scores))
    elif head.activation == "sigmoid":
        result.logprobs = [float(v) for v in -np.logaddexp(0.0, -scores)]   # log sigmoid
        result.label = int(np.argmax(scores))
        result.selected = [int(i) for i in np.flatnonzero(scores > 0)]
    return result


def _has_nan(pairs: list[tuple[PrefillOp, OpOutput]]) -> bool:
    """NaN logits mean the forward pass broke; -inf (masked tokens) is legitimate."""
    for _, out in pairs:
        if any(np.isnan(np.asarray(row, dtype=np.float64)).any() for row in out.logits):
            return True
        if out.logsumexp is not None and np.isnan(np.asarray(out.logsumexp, np.float64)).any():
            return True
    return False


def _request_result(req: ScoreRequest, index: int, pairs: list[tuple[PrefillOp, OpOutput]],
                    head: ClassifierHead | None) -> ScoreResult:
    """Result of one request that produced ops."""
    if not pairs:
        raise ValueError(f"request #{index} has neither ops nor an error")
    if _has_nan(pairs):
        return ScoreResult(id=req.id, error=f"{request_label(req.id, index)}: the model produced "
                                            "NaN logits")
    if req.kind == "prompt_logprobs":
        ((op, out),) = pairs
        return _prompt_logprobs_result(req, op, out)
    if req.kind == "head":
        ((_, out),) = pairs
        return _head_result(req, out, head)
    n = len(req.candidates if req.candidates is not None else req.candidate_token_ids)
    if req.kind == "multi":
        return _multi_result(req, pairs, n)
    return _classify_result(req, pairs, n)


def _failed_requests(requests: Sequence[ScoreRequest | Mapping[str, Any]],
                     ops: Sequence[PrefillOp], outputs: Sequence[OpOutput | Exception]
                     ) -> dict[int, str]:
    """Requests with an op whose step raised (its output is the exception) -> an error
    naming the request and the failure (its first line: a device error can be long).
    A failed collective between processes raises
    :class:`serving.multi_process.CollectiveFailure` instead."""
    failed: dict[int, str] = {}
    for op, out in zip(ops, outputs):
        if isinstance(out, Exception) and is_collective_failure(out):
            # A lost peer process, not these requests' fault: no result for any of them
            # (a rerun scores them), and this process stops.
            raise collective_failure(out) from out
        if isinstance(out, Exception) and op.request_index not in failed:
            label = request_label(request_id_of(requests[op.request_index]), op.request_index)
            detail = next(iter(str(out).splitlines()), "")
            failed[op.request_index] = (f"{label}: scoring failed ({type(out).__name__}"
                                        f"{': ' + detail if detail else ''})")
    return failed


def combine_results(requests: Sequence[ScoreRequest | Mapping[str, Any]],
                    ops: Sequence[PrefillOp], outputs: Sequence[OpOutput | Exception],
                    errors: Mapping[int, str], prompt_tokens: Mapping[int, int],
                    head: ClassifierHead | None = None) -> list[ScoreResult]:
    """One result per request, in request order.

    ``head``: the model's classification head (kind "head"), when it is a classifier.
    ``outputs[i]`` must belong to ``ops[i]``; the pairs may come in any order
    (ops are matched to candidates by ``candidate_index``). An output may be the
    exception its step raised: its request then gets an error result (its other
    ops' outputs are not used), as do the requests in ``errors``. Raises ValueError
    when outputs do not match their ops (an engine bug), and
    :class:`serving.multi_process.CollectiveFailure` when an exception is a failed
    collective between processes (a lost peer: no request's fault, and fatal).
    """
    if len(ops) != len(outputs):
        raise ValueError(f"{len(ops)} ops but {len(outputs)} outputs")
    errors = {**errors, **_failed_requests(requests, ops, outputs)}
    pairs_by_request: dict[int, list[tuple[PrefillOp, OpOutput]]] = defaultdict(list)
    for op, out in zip(ops, outputs):
        if op.request_index in errors:
            continue
        _check_output(op, out)
        pairs_by_request[op.request_index].append((op, out))
    results = []
    for index, obj in enumerate(requests):
        if index in errors:
            results.append(ScoreResult(id=request_id_of(obj), error=errors[index]))
            continue
        result = _request_result(parse_request(obj, index), index, pairs_by_request[index],
                                 head)
        if result.error is None:
            result.prompt_tokens = prompt_tokens[index]
        results.append(result)
    return results
