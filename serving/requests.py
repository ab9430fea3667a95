"""Scoring requests: validation, expansion into prefill operations, and results.

A scoring request is answered by ONE prefill forward pass per operation; the
answer is read from next-token logits at a few positions, restricted to a set of
candidate tokens. This module is the boundary between users and the engine:

* :func:`parse_request` checks one request (a dict from JSONL or a
  :class:`ScoreRequest`) without needing a tokenizer;
* :func:`normalize_requests` tokenizes the valid requests and expands each into
  atomic :class:`PrefillOp` s (``moejax.ops``: the one record the router, prefix
  cache, packer and engine read; keyed ``OpKey(request_index, candidate_index)``);
  bad requests are reported in ``errors`` and get no ops, so one bad line never
  sinks the batch;
* the engine runs every op and hands back one :class:`OpOutput` per op;
* :func:`serving.results.combine_results` turns the outputs back into one :class:`ScoreResult`
  per request, in request order.

Semantics
---------
Tokenization. Text is encoded WITHOUT special tokens (see
:class:`TokenizerAdapter`), except that a text prompt starts with the special tokens the
tokenizer config asks for (a BOS: ``tokenizer_config.json``'s ``add_bos_token``, else
the tokenizer's post-processor; ``add_special_tokens: false`` leaves them out). A prompt
of ids, or rendered from ``messages`` by the chat template (which writes its own BOS), is
taken as it is. The prompt and every candidate are encoded
*separately*, so all ops of a request share the prompt tokens exactly (that is
what ``PrefillOp.prefix_len`` advertises to the prefix cache) and a candidate scores
the same tokens whatever prompt precedes it. Consequently candidates must carry
the leading space the tokenizer expects (``" Paris"``, not ``"Paris"``).

Boundary warnings. Where a text candidate of a "classify" request tokenizes
differently after its text prompt than apart (``encode(prompt + candidate) !=
encode(prompt) + encode(candidate)``, e.g. a prompt ending in a space, ``"Answer: "``
+ ``"yes"``, which together read ``" yes"``), the candidate is still scored as
tokenized apart, unchanged, and the result carries a warning naming the candidate
and the ids at the boundary (``ScoreResult.warnings``, ``"warnings"`` in JSON:
:func:`boundary_warnings`). The comparison reads the prompt's last
:data:`BOUNDARY_WINDOW_CHARS` characters (a boundary merge never reaches further
with a tokenizer that splits words first, and a long prompt is not encoded again).

kind ``"classify"`` (prompt + candidates):

* every candidate is one token -> ONE op (``candidate_index=-1``): token_ids =
  prompt, score position = last prompt token, ``score_token_ids`` = (all
  candidate ids,);
* any candidate has more tokens -> one sibling op per candidate (all candidates,
  single-token ones included, are then treated uniformly as sequences):
  token_ids = prompt + candidate[:-1], score positions = last prompt token and
  every candidate token but the last, each scoring the next candidate token,
  ``full_vocab=True``. Sequence log-prob = sum(logit - logsumexp).

normalize ``"candidates"``: logprobs = log-softmax over the candidates (of the
single-token logits, or of the sequence log-probs); they sum to one in
probability space. normalize ``"vocab"``: single-token: logit - logsumexp over
the full vocabulary (``full_vocab=True``); multi-token: the raw
sequence log-prob. ``label`` = index of the best candidate (first on ties).

kind ``"choice"`` (multiple choice; text only): the prompt is rendered as
``"{prompt}\\nA. {opt1}\\nB. {opt2}\\n...\\nAnswer:"`` and the scored candidates
are the identifiers ``" A"``, ``" B"``, ... (templates and labels live in
:class:`NormalizeOptions`; at most ``len(choice_labels)`` = 26 options). Then
the classify rules apply, including the multi-token fallback when an identifier
is not a single token for this tokenizer.

kind ``"multi"`` (multi-selection): candidate k becomes a binary sibling op:
token_ids = prompt tokens + encode(``multi_template.format(candidate=...)``),
one score position (the last token) scoring ``(yes_id, no_id)`` =
encode(" yes"), encode(" no") (``NormalizeOptions.multi_answers``; both must be
single tokens). ``logprobs[k]`` = log P(yes) normalised over {yes, no}
("candidates") or over the vocabulary ("vocab"); ``label`` = argmax over k;
``selected`` = [k with P(yes) > P(no)], always under the binary normalisation.
By construction this equals ``logprobs[0]`` of a "classify" request whose
``prompt_token_ids`` are the sibling's token_ids and whose candidates are
``[" yes", " no"]``. With token-id input (``prompt_token_ids``), candidates must
be ``candidate_token_ids``; they are inserted where ``{candidate}`` sits in the
template, the template text around them being encoded on its own.

kind ``"prompt_logprobs"`` (the prompt's own log-probabilities, as lm-evaluation-harness's
loglikelihood and perplexity tasks read them; no candidates): ONE op, token_ids = the
prompt but its last token, score positions = every token, each scoring the token after
it, ``full_vocab=True`` and ``top_k = top_logprobs``. ``logprobs[i]`` = log P(token
i + 1 | tokens 0..i) over the vocabulary, for i < n - 1 (a prompt of n >= 2 tokens has
n - 1; the first token has none); ``token_ids`` = the prompt's n tokens; with
``top_logprobs`` = k (1..:data:`MAX_TOP_LOGPROBS`), ``top_token_ids[i]`` and
``top_logprobs[i]`` = the k most likely tokens at position i + 1 and their
log-probabilities, best first. ``label`` is null and ``normalize`` does not apply. The
whole vocabulary row is read at every position: memory grows with the prompt's length
times the vocabulary size, so long prompts should be few per batch.

``ScoreResult.prompt_tokens`` is the number of prompt tokens (after the choice
formatting; without the multi suffix). Failed requests get ``error`` set,
``logprobs=None`` and ``prompt_tokens=0``.

Every validation error is a :class:`RequestError` whose message reads
``"request 'ID': FIELD: problem"`` (``request #INDEX`` when the id is absent or
unusable). An ``id`` is echoed into JSON output, so it must be null, a string of
valid UTF-8 (no lone surrogates such as ``"\\udc80"``) or an integer that Python
can write out; token ids are Python or NumPy integers (bools and floats are
refused); ``kind`` and ``normalize`` are strings (a NumPy array is refused, not
compared). Whatever else a request holds, :func:`normalize_requests` turns it into
an error for that request alone: an exception other than RequestError while
checking it (a user object that breaks its own protocol) becomes the error
``"request 'ID': request: could not be validated (TYPE: message)"``.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import string
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from moejax.ops import OpKey, OpOutput, PrefillOp  # (OpOutput: re-exported, the engine's answer)

KINDS = ("classify", "choice", "multi", "prompt_logprobs", "head")
# The kinds that read the prompts' own tokens (no candidates).
PROMPT_ONLY_KINDS = ("prompt_logprobs", "head")
MAX_TOP_LOGPROBS = 20          # the most alternatives a "prompt_logprobs" request reads
NORMALIZATIONS = ("candidates", "vocab")


class RequestError(ValueError):
    """A request that cannot be scored; the message names the request and the field."""

    def __init__(self, message: str, *, index: int | None = None, field: str | None = None):
        super().__init__(message)
        self.index = index
        self.field = field


class Tokenizer(Protocol):
    """Anything that turns text into token ids (no special tokens added)."""

    def encode(self, text: str) -> list[int]: ...


# ----------------------------------------------------------------------------- types
@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    """One scoring request, as the user wrote it (see the module docstring)."""

    id: str | int | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    candidates: list[str] | None = None
    candidate_token_ids: list[list[int]] | None = None
    kind: str = "classify"
    normalize: str = "candidates"
    # Chat messages instead of a prompt: rendered with the model's chat template
    # (serving.chat), the assistant's turn opened, then scored as the prompt text.
    messages: list[dict[str, Any]] | None = None
    # This request's "choice"/"multi" templates over the server's (NormalizeOptions fields).
    templates: dict[str, Any] | None = None
    # kind "prompt_logprobs": the most likely tokens to report at each position.
    top_logprobs: int | None = None
    # A text prompt starts with the tokenizer's special prefix (a BOS, as its config says):
    # None as the config says, False never, True always.
    add_special_tokens: bool | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], index: int | None = None) -> ScoreRequest:
        """Build from a JSON object; unknown keys are an error (they are usually typos)."""
        if not isinstance(d, Mapping):
            raise RequestError(f"{request_label(None, index)}: expected an object (dict), "
                               f"got {type(d).__name__}", index=index)
        label = request_label(d.get("id"), index)
        unknown = unknown_fields(d, _FIELD_NAMES)
        if unknown:
            raise RequestError(f"{label}: unknown field(s) "
                               f"{', '.join(show(k) for k in unknown)} "
                               f"(accepted: {', '.join(_FIELD_NAMES)})",
                               index=index, field=unknown[0])
        return cls(**{name: d[name] for name in _FIELD_NAMES if name in d})


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(ScoreRequest))


@dataclasses.dataclass
class ScoreResult:
    """The answer to one request; ``selected`` is set for kinds "multi" and multi-label
    "head" only, ``token_ids`` (with ``top_token_ids`` and ``top_logprobs`` when asked) for
    kind "prompt_logprobs" only, and ``scores`` for kind "head" only."""

    id: str | int | None = None
    logprobs: list[float] | None = None
    label: int | None = None
    prompt_tokens: int = 0
    error: str | None = None
    selected: list[int] | None = None
    timings: dict[str, Any] | None = None
    # Problems that did not stop the scoring (candidate tokenization boundaries).
    warnings: list[str] | None = None
    token_ids: list[int] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # Kind "head": the classifier head's raw outputs, one per label (a reward model's score).
    scores: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``selected`` (kind "multi"), the prompt's tokens and their
        alternatives (kind "prompt_logprobs"), ``timings`` and ``warnings`` appear only when
        set."""
        d: dict[str, Any] = {"id": self.id, "logprobs": self.logprobs, "label": self.label,
                             "prompt_tokens": self.prompt_tokens, "error": self.error}
        if self.selected is not None:
            d["selected"] = self.selected
        for name in ("token_ids", "top_token_ids", "top_logprobs", "scores"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        if self.timings is not None:
            d["timings"] = self.timings
        if self.warnings:
            d["warnings"] = list(self.warnings)
        return d


@dataclasses.dataclass(frozen=True)
class ClassifierHead:
    """A sequence classifier's head (``*ForSequenceClassification``): its label names and
    how its outputs read (:attr:`activation`)."""

    labels: tuple[str, ...]
    problem_type: str = ""

    @classmethod
    def of(cls, cfg: Any) -> "ClassifierHead | None":
        """The head of a model config (``moejax.config.ModelConfig``), None for a language
        model."""
        return cls(cfg.id2label, cfg.problem_type) if cfg.num_labels else None

    @property
    def activation(self) -> str:
        """"none" (one output: a reward model's score; or a regression), "sigmoid" (each
        label on its own: multi-label), else "softmax" (one label of all), as transformers'
        text-classification pipeline reads a head."""
        if len(self.labels) == 1 or self.problem_type == "regression":
            return "none"
        return "sigmoid" if self.problem_type == "multi_label_classification" else "softmax"


class TemplateError(ValueError):
    """A bad prompt template option: ``field`` (``templates.multi_template``, ...) and what
    is wrong with it (``problem``)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


@dataclasses.dataclass(frozen=True)
class NormalizeOptions:
    """Prompt templates for kinds "choice" and "multi"."""

    choice_template: str = "{prompt}\n{options}\nAnswer:"
    choice_option_template: str = "{label}. {option}"
    choice_option_separator: str = "\n"
    choice_labels: tuple[str, ...] = tuple(string.ascii_uppercase)
    choice_identifier_template: str = " {label}"
    multi_template: str = "\nCandidate: {candidate}\nRelevant (yes/no):"
    multi_answers: tuple[str, str] = (" yes", " no")

    def __post_init__(self) -> None:
        for name, needed in _TEMPLATE_FIELDS.items():
            for field in needed:
                if getattr(self, name).count("{" + field + "}") != 1:
                    raise TemplateError(name, f"must contain '{{{field}}}' exactly once")
        if not self.choice_labels or len(set(self.choice_labels)) != len(self.choice_labels):
            raise TemplateError("choice_labels", "must be non-empty and distinct")
        if len(self.multi_answers) != 2 or self.multi_answers[0] == self.multi_answers[1]:
            raise TemplateError("multi_answers", "must be two distinct strings (yes, no)")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], base: "NormalizeOptions | None" = None,
                     where: str = "templates") -> "NormalizeOptions":
        """``base`` (default: the defaults) with the fields of ``values`` replaced (the
        per-server ``templates`` option, a request's ``templates``). Unknown keys, values
        of the wrong type and templates without their placeholders raise TemplateError
        naming ``where.KEY``."""
        if not isinstance(values, Mapping):
            raise TemplateError(where, f"must be an object of template fields, got "
                                       f"{type(values).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        changes: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                raise TemplateError(where, f"unknown field {show(key)} (accepted: "
                                           f"{', '.join(known)})")
            if key in ("choice_labels", "multi_answers"):
                if not isinstance(value, (list, tuple)) or not all(isinstance(v, str)
                                                                   for v in value):
                    raise TemplateError(f"{where}.{key}", "must be a list of strings")
                value = tuple(value)
            elif not isinstance(value, str):
                raise TemplateError(f"{where}.{key}",
                                    f"must be a string, got {type(value).__name__}")
            changes[key] = value
        try:
            return dataclasses.replace(base or cls(), **changes)
        except TemplateError as exc:
            raise TemplateError(f"{where}.{exc.field}", exc.problem) from None


# The placeholders each template must hold exactly once.
_TEMPLATE_FIELDS = {"choice_template": ("prompt", "options"),
                    "choice_option_template": ("label", "option"),
                    "choice_identifier_template": ("label",),
                    "multi_template": ("candidate",)}


class TokenizerAdapter:
    """Wraps a ``tokenizers.Tokenizer``: encodes without special tokens, checks the text;
    a text prompt starts with the special tokens the tokenizer config asks for
    (:meth:`encode_prompt`).

    Candidates and templates are encoded without special tokens because prompt and
    candidates are encoded separately and concatenated: a BOS in front of each candidate
    would corrupt the sequence. A prompt given as ids, or rendered by a chat template
    (which writes its own BOS), is taken as it is.
    """

    def __init__(self, tokenizer: Any, chat_template: Any = None,
                 prompt_prefix: Sequence[int] = ()):
        self.tokenizer = tokenizer
        # The model's serving.chat.ChatTemplate (None: it has none), for ``messages``.
        self.chat_template = chat_template
        # The special tokens a text prompt starts with (serving.special_tokens: a BOS).
        self.prompt_prefix = tuple(int(t) for t in prompt_prefix)

    @classmethod
    def from_file(cls, path: str) -> TokenizerAdapter:
        """Load a ``tokenizer.json``."""
        from tokenizers import Tokenizer as HFTokenizer
        return cls(HFTokenizer.from_file(path))

    @classmethod
    def from_model_dir(cls, model_dir: Any, tokenizer: Any) -> TokenizerAdapter:
        """``tokenizer`` with what the directory says about prompts: its chat template and
        the special tokens a text prompt starts with (``tokenizer_config.json``)."""
        from serving.chat import ChatTemplate
        from serving.special_tokens import prompt_prefix, read_tokenizer_config

        return cls(tokenizer, ChatTemplate.from_model_dir(model_dir),
                   prompt_prefix(tokenizer, read_tokenizer_config(model_dir)))

    def encode_prompt(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of a text prompt: :attr:`prompt_prefix` first unless
        ``add_special_tokens`` is False (None: as the tokenizer config says)."""
        ids = self.encode(text)
        if add_special_tokens is False:
            return ids
        return [*self.prompt_prefix, *ids]

    @property
    def vocab_size(self) -> int:
        """Size of the tokenizer's vocabulary, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; raises TypeError / ValueError on non-str or non-UTF-8 text."""
        problem = text_problem(text)
        if problem is not None:
            raise (TypeError if not isinstance(text, str) else ValueError)(f"text {problem}")
        # encode_batch releases the GIL while it works (encode holds it: a long prompt would
        # stall every other thread of a server, its health checks included).
        return list(self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)


# ----------------------------------------------------------------------------- parsing
FLOAT32 = np.finfo(np.float32)   # sampling's dtype: the bounds of a number field
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = 6


def show(value: Any) -> str:
    """A short repr of a user's value for an error message (long values are elided, huge
    integers summarised; never raises)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<integer of {value.bit_length()} bits>"
    try:
        return _REPR.repr(value)
    except Exception:  # noqa: BLE001  (a user's object with a broken __repr__)
        return f"<{type(value).__name__}>"


def unknown_fields(d: Mapping[Any, Any], accepted: Sequence[str]) -> list[str]:
    """The keys of ``d`` that are not field names, sorted, as strs (a non-str key as its
    short repr)."""
    return sorted(str.__str__(k) if isinstance(k, str) else show(k)
                  for k in d if not (isinstance(k, str) and k in accepted))


def id_problem(request_id: Any) -> str | None:
    """Why ``request_id`` cannot be a request id, or None when it can. Ids are echoed into
    JSON output, so only null, a str of valid UTF-8 (no lone surrogates) and an integer
    that Python can write out in decimal are accepted."""
    if request_id is None:
        return None
    if isinstance(request_id, str):
        return text_problem(request_id)
    if isinstance(request_id, int) and not isinstance(request_id, bool):
        try:
            int.__repr__(request_id)
        except ValueError:   # past sys.get_int_max_str_digits(): json.dumps would fail too
            return f"{show(request_id)} has too many digits to be written out"
        return None
    return f"must be a string, an integer or null, got {type(request_id).__name__}"


def request_label(request_id: Any, index: int | None) -> str:
    """How messages name a request: by its id when it has a usable one, else by index."""
    if request_id is not None and id_problem(request_id) is None:
        text = (str.__str__(request_id) if isinstance(request_id, str)
                else int.__repr__(request_id))
        return f"request {text!r}"
    return f"request #{index}" if index is not None else "request"


def renamed(message: str | None, index: int, label: str) -> str | None:
    """``message`` with its leading name of an id-less request, ``"request #INDEX:"`` (the
    request's position in the list a library was given), replaced by ``label`` (its
    position in the caller's list, its input line, ...); other messages unchanged."""
    old = request_label(None, index) + ":"
    if message is not None and message.startswith(old):
        return f"{label}:" + message[len(old):]
    return message


def _field_of(obj: Any, name: str, broken: Any = None) -> Any:
    """Field ``name`` of a request (a dict or a dataclass), else None; ``broken`` for a
    mapping that raises (its request fails on its own)."""
    try:
        return (obj.get(name) if isinstance(obj, Mapping)
                else getattr(obj, name, None) if dataclasses.is_dataclass(obj) else None)
    except Exception:  # noqa: BLE001
        return broken


def request_kind(obj: Any) -> str:
    """The kind of a request (a dict or a dataclass with ``kind``): one of :data:`KINDS`
    (absent: "classify"), or "unknown" for anything else (for metrics labels: never a
    value a client wrote)."""
    kind = _field_of(obj, "kind", broken="unknown")
    if kind is None:
        return "classify"
    if not isinstance(kind, str):    # (``in`` would compare an array element-wise)
        return "unknown"
    kind = kind or "classify"
    return kind if kind in KINDS else "unknown"


def request_id_of(obj: Any) -> str | int | None:
    """The usable id of a request (a dict or a dataclass with ``id``), else None; for the
    result of a request that failed validation, so it never raises."""
    request_id = _field_of(obj, "id")
    return request_id if request_id is not None and id_problem(request_id) is None else None


def text_problem(value: Any) -> str | None:
    """Why ``value`` is not usable text (None when it is a str of valid UTF-8)."""
    if isinstance(value, (bytes, bytearray)):
        try:
            bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"is not valid UTF-8 (bytes, invalid at byte {exc.start})"
        return "must be a str, got bytes (decode it as UTF-8 first)"
    if not isinstance(value, str):
        return f"must be a str, got {type(value).__name__}"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        # Lone surrogates (e.g. from a bad JSON "\udc80" escape) are not encodable.
        return f"is not valid UTF-8 text (lone surrogate {value[exc.start]!r} at index {exc.start})"
    return None


class FieldChecker:
    """Checks the fields of one request, scoring or generation alike: each failure is a
    :class:`RequestError` that names the request and the offending field."""

    def __init__(self, request_id: Any, index: int | None):
        self.index = index
        self.label = request_label(request_id, index)

    def fail(self, field: str, problem: str) -> RequestError:
        """The error to raise for ``field`` (returned so callers write ``raise check.fail``)."""
        return RequestError(f"{self.label}: {field}: {problem}", index=self.index, field=field)

    def request_id(self, value: Any) -> None:
        """The request's ``id``: ids end up in JSONL output, so only JSON scalars of valid
        UTF-8 are allowed (:func:`id_problem`)."""
        problem = id_problem(value)
        if problem is not None:
            raise self.fail("id", problem)

    def text(self, value: Any, field: str) -> str:
        """A str of valid UTF-8 (a str subclass comes back as a plain str)."""
        problem = text_problem(value)
        if problem is not None:
            raise self.fail(field, problem)
        return str.__str__(value)

    def integer(self, value: Any, field: str, low: int | None = None,
                high: int | None = None) -> int:
        """An integer (not a bool) in [low, high) (a bound that is None: none that side)."""
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise self.fail(field, f"must be an integer, got {type(value).__name__}")
        value = int(value)
        if (low is not None and value < low) or (high is not None and value >= high):
            bound = (f"< {high}" if low is None else f">= {low}" if high is None
                     else f"in [{low}, {high})")
            raise self.fail(field, f"must be {bound}, got {show(value)}")
        return value

    def number(self, value: Any, field: str) -> float:
        """A finite real number that float32 (the sampling dtype) can hold."""
        if (isinstance(value, (bool, np.bool_))
                or not isinstance(value, (int, float, np.integer, np.floating))):
            raise self.fail(field, f"must be a number, got {type(value).__name__}")
        try:
            number = float(value)
        except OverflowError:   # an int past float64's range
            raise self.fail(field, f"must fit in float32 (at most {FLOAT32.max:.7g}), "
                                   f"got {show(value)}") from None
        if not math.isfinite(number):
            raise self.fail(field, f"must be finite, got {number}")
        with np.errstate(over="ignore"):
            too_big = not np.isfinite(np.float32(number))
        if too_big:
            raise self.fail(field, f"must fit in float32 (at most {FLOAT32.max:.7g}), "
                                   f"got {number:g}")
        return number

    def token_ids(self, value: Any, field: str, *, vocab_size: int | None = None,
                  allow_empty: bool = False) -> list[int]:
        """A list of integer token ids, each in [0, vocab_size) when that is given (a
        scoring request's are checked against the model later, after tokenizing)."""
        if not isinstance(value, (list, tuple)):
            raise self.fail(field, f"must be a list of integers, got {type(value).__name__}")
        if not value and not allow_empty:
            raise self.fail(field, "is empty")
        low = None if vocab_size is None else 0
        return [self.integer(v, f"{field}[{i}]", low, vocab_size) for i, v in enumerate(value)]

    def choice_of(self, value: Any, field: str, accepted: tuple[str, ...]) -> str:
        """One of ``accepted`` (the type is checked first: ``in`` would compare a NumPy
        array element-wise, and an array's truth value raises)."""
        if not isinstance(value, str) or value not in accepted:
            raise self.fail(field, f"{show(value)} is not one of "
                                   f"{', '.join(repr(a) for a in accepted)}")
        return str.__str__(value)


def _parse_prompt(check: FieldChecker, req: ScoreRequest) -> tuple[str | None, list[int] | None]:
    """Exactly one non-empty prompt, as text, as token ids or as chat messages (checked
    here, rendered with the model's template when the request is expanded)."""
    has_text, has_ids = req.prompt is not None, req.prompt_token_ids is not None
    if req.messages is not None and (has_text or has_ids):
        other = "prompt" if has_text else "prompt_token_ids"
        raise check.fail("messages", f"give only one of prompt, prompt_token_ids or messages "
                                     f"(got messages and {other})")
    if req.messages is None and has_text == has_ids:
        raise check.fail("prompt", "give exactly one of prompt or prompt_token_ids "
                                   f"(got {'both' if has_text else 'neither'})")
    if req.messages is not None:
        from serving.chat import MessagesError, check_messages

        try:
            check_messages(req.messages)
        except MessagesError as exc:
            raise check.fail(exc.field, exc.problem) from None
        return None, None
    if req.prompt_token_ids is not None:
        return None, check.token_ids(req.prompt_token_ids, "prompt_token_ids")
    text = check.text(req.prompt, "prompt")
    if not text:
        raise check.fail("prompt", "is empty")
    return text, None


def _parse_candidates(check: FieldChecker, req: ScoreRequest
                      ) -> tuple[list[str] | None, list[list[int]] | None]:
    """Exactly one non-empty, duplicate-free candidate list, as text or as token ids."""
    has_text, has_ids = req.candidates is not None, req.candidate_token_ids is not None
    if has_text == has_ids:
        problem = ("give only one of candidates or candidate_token_ids (got both)" if has_text
                   else "no candidates (give candidates or candidate_token_ids)")
        raise check.fail("candidates", problem)
    field = "candidates" if has_text else "candidate_token_ids"
    values = req.candidates if has_text else req.candidate_token_ids
    if not isinstance(values, (list, tuple)):
        raise check.fail(field, f"must be a list, got {type(values).__name__}")
    if not values:
        raise check.fail(field, "is empty")
    if has_text:
        parsed: list[Any] = [check.text(v, f"{field}[{i}]") for i, v in enumerate(values)]
    else:
        parsed = [check.token_ids(v, f"{field}[{i}]") for i, v in enumerate(values)]
    _check_distinct(check, field, [p if has_text else tuple(p) for p in parsed])
    return (parsed, None) if has_text else (None, parsed)


def _no_candidates(check: FieldChecker, req: ScoreRequest) -> None:
    """Kinds "prompt_logprobs" and "head" read the prompt alone."""
    what = {"prompt_logprobs": "scores the prompt's own tokens",
            "head": "answers with the model's classification head's labels"}[req.kind]
    for field in ("candidates", "candidate_token_ids"):
        if getattr(req, field) is not None:
            raise check.fail(field, f"kind {req.kind!r} {what}: give no candidates")


def _check_distinct(check: FieldChecker, field: str, values: Sequence[Any]) -> None:
    """Duplicates would split probability mass between identical answers."""
    first: dict[Any, int] = {}
    for i, v in enumerate(values):
        if v in first:
            shown = list(v) if isinstance(v, tuple) else v
            raise check.fail(field, f"candidates {first[v]} and {i} are duplicates ({shown!r})")
        first[v] = i


def _check_kind_inputs(check: FieldChecker, req: ScoreRequest) -> None:
    """Input forms that a kind cannot use."""
    if req.top_logprobs is not None and req.kind != "prompt_logprobs":
        raise check.fail("top_logprobs", "only kind 'prompt_logprobs' reads it")
    if req.kind == "choice":
        # The options are rendered into the prompt as text; ids cannot be rendered.
        if req.prompt_token_ids is not None:
            raise check.fail("prompt_token_ids", "kind 'choice' needs text: "
                                                 "give prompt, not prompt_token_ids")
        if req.candidate_token_ids is not None:
            raise check.fail("candidate_token_ids", "kind 'choice' needs text: "
                                                    "give candidates, not candidate_token_ids")
        for i, option in enumerate(req.candidates or ()):
            if not option.strip():
                raise check.fail(f"candidates[{i}]", "is blank")
    if req.kind == "choice" and req.messages is not None:
        raise check.fail("messages", "kind 'choice' renders its own prompt: give prompt")
    if req.kind == "multi" and req.prompt_token_ids is not None and req.candidates is not None:
        raise check.fail("candidates", "kind 'multi' with prompt_token_ids needs the candidates "
                                       "as candidate_token_ids too")


def parse_request(obj: ScoreRequest | Mapping[str, Any], index: int) -> ScoreRequest:
    """Validate one request (everything that needs no tokenizer) and return it cleaned.

    Token ids come back as lists of Python ints, texts, kind and normalize as plain strs.
    Raises :class:`RequestError`.
    """
    req = obj if isinstance(obj, ScoreRequest) else ScoreRequest.from_dict(obj, index)
    check = FieldChecker(req.id, index)
    check.request_id(req.id)
    kind = check.choice_of(req.kind, "kind", KINDS)
    normalize = check.choice_of(req.normalize, "normalize", NORMALIZATIONS)
    prompt, prompt_ids = _parse_prompt(check, req)
    if kind in PROMPT_ONLY_KINDS:
        candidates, candidate_ids = _no_candidates(check, req), None
        if req.top_logprobs is not None:
            req = dataclasses.replace(req, top_logprobs=check.integer(
                req.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS + 1))
    else:
        candidates, candidate_ids = _parse_candidates(check, req)
    req = dataclasses.replace(req, kind=kind, normalize=normalize, prompt=prompt,
                              prompt_token_ids=prompt_ids, candidates=candidates,
                              candidate_token_ids=candidate_ids)
    _check_kind_inputs(check, req)
    if req.add_special_tokens is not None and not isinstance(req.add_special_tokens, bool):
        raise check.fail("add_special_tokens", f"must be true or false, got "
                                               f"{type(req.add_special_tokens).__name__}")
    if req.templates is not None:
        try:
            NormalizeOptions.from_mapping(req.templates)
        except TemplateError as exc:
            raise check.fail(exc.field, exc.problem) from None
    return req


# ----------------------------------------------------------------------------- expansion
class _Encoder:
    """Encodes text for one request, turning tokenizer failures into RequestErrors."""

    def __init__(self, tokenizer: Tokenizer, check: FieldChecker, vocab_size: int):
        self.tokenizer, self.check, self.vocab_size = tokenizer, check, vocab_size

    def encode(self, text: str, field: str, *, allow_empty: bool = False,
               prompt_of: ScoreRequest | None = None) -> list[int]:
        """Token ids of ``text`` (``field`` names it in errors); ``prompt_of``: ``text`` is
        that request's prompt, which starts with the tokenizer's prompt prefix (a BOS) as
        its ``add_special_tokens`` says (a tokenizer without ``encode_prompt`` has none)."""
        encode_prompt = getattr(self.tokenizer, "encode_prompt", None)
        try:
            if prompt_of is not None and encode_prompt is not None:
                ids = [int(t) for t in encode_prompt(text, prompt_of.add_special_tokens)]
            else:
                ids = [int(t) for t in self.tokenizer.encode(text)]
        except Exception as exc:  # any tokenizer failure is this request's problem only
            raise self.check.fail(field, f"could not be tokenized ({exc})") from exc
        if not ids and not allow_empty:
            raise self.check.fail(field, f"{text!r} tokenizes to no tokens")
        self.in_vocab(ids, field, "the tokenizer produced id")
        return ids

    def in_vocab(self, ids: Sequence[int], field: str, what: str = "token id") -> None:
        """Ids the model has embeddings for."""
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise self.check.fail(field, f"{what} {show(t)} (position {i}) is outside the "
                                             f"vocabulary [0, {self.vocab_size})")


def _joint_op(index: int, candidate_index: int, context: Sequence[int], prefix_len: int,
              continuations: Sequence[Sequence[int]], need_vocab: bool) -> PrefillOp:
    """All continuations are single tokens: read them all at the context's last position."""
    return PrefillOp(key=OpKey(index, candidate_index),
                     token_ids=np.asarray(context, np.int32), prefix_len=prefix_len,
                     score_positions=(len(context) - 1,),
                     score_token_ids=(tuple(c[0] for c in continuations),),
                     full_vocab=need_vocab)


def _sequence_op(index: int, candidate_index: int, context: Sequence[int],
                 continuation: Sequence[int]) -> PrefillOp:
    """Teacher-force ``continuation`` after ``context``, reading each of its tokens."""
    start = len(context) - 1
    return PrefillOp(key=OpKey(index, candidate_index),
                     token_ids=np.asarray([*context, *continuation[:-1]], np.int32),
                     prefix_len=len(context),
                     score_positions=tuple(range(start, start + len(continuation))),
                     score_token_ids=tuple((t,) for t in continuation),
                     # log P(token) needs the full-vocabulary normaliser.
                     full_vocab=True)


def _prompt_logprobs_op(index: int, prompt: list[int], top_k: int) -> PrefillOp:
    """Each prompt token after the first, read at the position before it."""
    return PrefillOp(key=OpKey(index, -1), token_ids=np.asarray(prompt[:-1], np.int32),
                     score_positions=tuple(range(len(prompt) - 1)),
                     score_token_ids=tuple((t,) for t in prompt[1:]), full_vocab=True,
                     top_k=top_k)


def _classify_ops(index: int, prompt: list[int], continuations: list[list[int]],
                  need_vocab: bool) -> list[PrefillOp]:
    """One joint op when every candidate is one token, else one sequence op per candidate."""
    if all(len(c) == 1 for c in continuations):
        return [_joint_op(index, -1, prompt, len(prompt), continuations, need_vocab)]
    return [_sequence_op(index, k, prompt, c) for k, c in enumerate(continuations)]


def _classify_candidates(req: ScoreRequest, enc: _Encoder) -> list[list[int]]:
    """Candidate token sequences of a classify request, distinct after tokenization."""
    if req.candidate_token_ids is not None:
        for k, ids in enumerate(req.candidate_token_ids):
            enc.in_vocab(ids, f"candidate_token_ids[{k}]")
        return req.candidate_token_ids
    continuations = [enc.encode(c, f"candidates[{k}]") for k, c in enumerate(req.candidates)]
    # Two texts with the same tokens (e.g. both [UNK]) would share probability mass.
    first: dict[tuple[int, ...], int] = {}
    for k, c in enumerate(continuations):
        if tuple(c) in first:
            j = first[tuple(c)]
            raise enc.check.fail("candidates", f"candidates {j} ({req.candidates[j]!r}) and "
                                               f"{k} ({req.candidates[k]!r}) tokenize identically")
        first[tuple(c)] = k
    return continuations


def _choice_prompt(req: ScoreRequest, options: NormalizeOptions) -> str:
    """The question with lettered options and the answer cue."""
    rendered = options.choice_option_separator.join(
        options.choice_option_template.format(label=label, option=option)
        for label, option in zip(options.choice_labels, req.candidates))
    return options.choice_template.format(prompt=req.prompt, options=rendered)


def _choice_ops(index: int, req: ScoreRequest, enc: _Encoder, options: NormalizeOptions,
                need_vocab: bool) -> tuple[list[PrefillOp], int]:
    """Ops of a multiple-choice request: classify over the option identifiers."""
    if len(req.candidates) > len(options.choice_labels):
        raise enc.check.fail("candidates", f"kind 'choice' takes at most "
                                           f"{len(options.choice_labels)} options, "
                                           f"got {len(req.candidates)}")
    prompt = enc.encode(_choice_prompt(req, options), "prompt", prompt_of=req)
    labels = options.choice_labels[:len(req.candidates)]
    identifiers = [enc.encode(options.choice_identifier_template.format(label=label),
                              f"choice identifier {label!r}") for label in labels]
    return _classify_ops(index, prompt, identifiers, need_vocab), len(prompt)


def _multi_suffix(req: ScoreRequest, k: int, enc: _Encoder, options: NormalizeOptions
                  ) -> list[int]:
    """Tokens appended to the prompt for candidate k: the rendered multi template."""
    if req.candidates is not None:
        enc.encode(req.candidates[k], f"candidates[{k}]")  # refuses empty tokenizations
        return enc.encode(options.multi_template.format(candidate=req.candidates[k]),
                          f"candidates[{k}]")
    # Token-id candidates: encode the template around them, insert the ids verbatim.
    before, after = options.multi_template.split("{candidate}")
    ids = req.candidate_token_ids[k]
    enc.in_vocab(ids, f"candidate_token_ids[{k}]")
    return (enc.encode(before, "multi_template", allow_empty=True) + list(ids)
            + enc.encode(after, "multi_template", allow_empty=True))


def _multi_answer_ids(enc: _Encoder, options: NormalizeOptions) -> tuple[int, int]:
    """The (yes, no) token ids; each answer must be a single token."""
    ids = []
    for answer in options.multi_answers:
        tokens = enc.encode(answer, "kind")
        if len(tokens) != 1:
            raise enc.check.fail("kind", f"kind 'multi' needs single-token answers, but "
                                         f"{answer!r} is {len(tokens)} tokens for this "
                                         f"tokenizer (NormalizeOptions.multi_answers)")
        ids.append(tokens[0])
    if ids[0] == ids[1]:
        raise enc.check.fail("kind", f"multi answers {options.multi_answers!r} tokenize "
                                     "identically")
    return ids[0], ids[1]


def _multi_ops(index: int, req: ScoreRequest, prompt: list[int], enc: _Encoder,
               options: NormalizeOptions, need_vocab: bool) -> list[PrefillOp]:
    """One binary (yes/no) op per candidate, all sharing the prompt tokens as prefix."""
    yes_no = _multi_answer_ids(enc, options)
    n = len(req.candidates if req.candidates is not None else req.candidate_token_ids)
    ops = []
    for k in range(n):
        context = prompt + _multi_suffix(req, k, enc, options)
        ops.append(_joint_op(index, k, context, len(prompt), [[yes_no[0]], [yes_no[1]]],
                             need_vocab))
    return ops


def _prompt_ids(req: ScoreRequest, enc: _Encoder) -> list[int]:
    """Prompt token ids of a classify / multi request."""
    if req.prompt_token_ids is not None:
        enc.in_vocab(req.prompt_token_ids, "prompt_token_ids")
        return req.prompt_token_ids
    if req.messages is not None:
        # A conversation scored as it stands gets no opened assistant turn after it.
        opened = req.kind != "prompt_logprobs"
        return enc.encode(_rendered_chat(req.messages, enc, opened), "messages")
    return enc.encode(req.prompt, "prompt", prompt_of=req)


def _rendered_chat(messages: list[dict[str, Any]], enc: _Encoder,
                   add_generation_prompt: bool = True) -> str:
    """The prompt text of chat ``messages`` by the tokenizer's chat template."""
    from serving.chat import ChatTemplateError

    template = getattr(enc.tokenizer, "chat_template", None)
    if template is None:
        raise enc.check.fail("messages", "the model has no chat template (chat_template.jinja "
                                         "or tokenizer_config.json's chat_template): give "
                                         "prompt instead")
    try:
        return template.render(messages, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as exc:
        raise enc.check.fail("messages", str(exc)) from None


def _check_prompt_len(check: FieldChecker, prompt_len: int, max_context: int) -> None:
    """The prompt alone must fit in the model's context window."""
    if prompt_len > max_context:
        raise check.fail("prompt", f"has {prompt_len} tokens, more than "
                                   f"max_context ({max_context})")


def _check_context(check: FieldChecker, ops: list[PrefillOp], prompt_len: int,
                   max_context: int) -> None:
    """Every op must fit in the model's context window."""
    _check_prompt_len(check, prompt_len, max_context)
    longest = max(ops, key=lambda op: len(op.token_ids))
    if len(longest.token_ids) > max_context:
        extra = len(longest.token_ids) - prompt_len
        raise check.fail("candidates", f"prompt ({prompt_len} tokens) + the "
                                       f"{extra} token(s) appended for candidate "
                                       f"{longest.candidate_index} = "
                                       f"{len(longest.token_ids)} tokens, more than "
                                       f"max_context ({max_context})")


def _check_head(check: FieldChecker, kind: str, head: ClassifierHead | None) -> None:
    """A classifier answers kind "head" only, and only a classifier does."""
    if head is not None and kind != "head":
        raise check.fail("kind", f"{kind!r} needs a language-model head; this model is a "
                                 f"sequence classifier ({len(head.labels)} labels: "
                                 f"{show(list(head.labels))}): use kind 'head'")
    if head is None and kind == "head":
        raise check.fail("kind", "'head' needs a classification head (a "
                                 "*ForSequenceClassification checkpoint's score.weight); "
                                 "this model is a language model: use 'classify' with "
                                 "candidates")


def _head_op(index: int, prompt: list[int], head: ClassifierHead) -> PrefillOp:
    """The head's outputs at the last prompt token (transformers pools the last token)."""
    return PrefillOp(key=OpKey(index, -1), token_ids=np.asarray(prompt, np.int32),
                     score_positions=(len(prompt) - 1,),
                     score_token_ids=(tuple(range(len(head.labels))),))


def _request_ops(index: int, req: ScoreRequest, tokenizer: Tokenizer, vocab_size: int,
                 max_context: int, options: NormalizeOptions,
                 head: ClassifierHead | None = None) -> tuple[list[PrefillOp], int]:
    """Ops and prompt length of one parsed request; raises RequestError."""
    check = FieldChecker(req.id, index)
    enc = _Encoder(tokenizer, check, vocab_size)
    if req.templates is not None:     # (checked by parse_request)
        options = NormalizeOptions.from_mapping(req.templates, options)
    need_vocab = req.normalize == "vocab"
    if req.kind == "choice":
        ops, prompt_len = _choice_ops(index, req, enc, options, need_vocab)
    else:
        prompt = _prompt_ids(req, enc)
        prompt_len = len(prompt)
        # Before building ops: every multi op would copy an over-long prompt.
        _check_prompt_len(check, prompt_len, max_context)
        if req.kind == "prompt_logprobs":
            if len(prompt) < 2:
                raise check.fail("prompt", f"has {len(prompt)} token: prompt log-probabilities "
                                           f"need at least 2 (the first token has none)")
            ops = [_prompt_logprobs_op(index, prompt, req.top_logprobs or 0)]
        elif req.kind == "head":
            ops = [_head_op(index, prompt, head)]
        elif req.kind == "multi":
            ops = _multi_ops(index, req, prompt, enc, options, need_vocab)
        else:
            ops = _classify_ops(index, prompt, _classify_candidates(req, enc), need_vocab)
    _check_context(check, ops, prompt_len, max_context)
    return ops, prompt_len


def normalize_requests(requests: Sequence[ScoreRequest | Mapping[str, Any]],
                       tokenizer: Tokenizer, *, vocab_size: int, max_context: int,
                       options: NormalizeOptions = NormalizeOptions(), start: int = 0,
                       head: ClassifierHead | None = None,
                       ) -> tuple[list[PrefillOp], dict[int, str], dict[int, int]]:
    """Expand requests into prefill ops (``head``: the model's classification head, when
    it is a sequence classifier).

    Returns ``(ops, errors, prompt_tokens)``: ops in request order (siblings
    adjacent), ``errors[i]`` = message for each bad request (which gets no ops),
    ``prompt_tokens[i]`` = prompt length of each good request. Requests are indexed from
    ``start`` (keys, ``errors``, ``prompt_tokens`` and the names in messages): a slice of
    a caller's list keeps the caller's indices.
    """
    ops: list[PrefillOp] = []
    errors: dict[int, str] = {}
    prompt_tokens: dict[int, int] = {}
    for index, obj in enumerate(requests, start=start):
        try:
            kind = request_kind(obj)
            if kind in KINDS:      # (before the kind's own checks: a classifier's first)
                _check_head(FieldChecker(request_id_of(obj), index), kind, head)
            req = parse_request(obj, index)
            request_ops, prompt_tokens[index] = _request_ops(
                index, req, tokenizer, vocab_size, max_context, options, head)
        except RequestError as exc:
            errors[index] = str(exc)
            prompt_tokens.pop(index, None)
            continue
        except Exception as exc:  # noqa: BLE001  (safety net: one request never sinks the batch)
            errors[index] = unexpected_error(obj, index, exc)
            prompt_tokens.pop(index, None)
            continue
        ops.extend(request_ops)
    return ops, errors, prompt_tokens


# How much of a prompt's end the boundary check re-encodes with each candidate.
BOUNDARY_WINDOW_CHARS = 256


def boundary_warnings(obj: ScoreRequest | Mapping[str, Any], index: int,
                      tokenizer: Tokenizer) -> list[str]:
    """Warnings for the text candidates of a valid "classify" request that tokenize
    differently after the prompt than apart (see "Boundary warnings" in the module
    docstring); [] for other requests (ids, kinds "choice"/"multi", invalid ones)."""
    try:
        req = parse_request(obj, index)
    except RequestError:
        return []
    if req.kind != "classify" or req.prompt is None or req.candidates is None:
        return []
    tail = req.prompt[-BOUNDARY_WINDOW_CHARS:]
    tail_ids = list(tokenizer.encode(tail))
    label = request_label(req.id, index)
    warnings = []
    for k, candidate in enumerate(req.candidates):
        apart = tail_ids + list(tokenizer.encode(candidate))
        together = list(tokenizer.encode(tail + candidate))
        if together != apart:
            warnings.append(_boundary_warning(label, k, candidate, tail, apart, together))
    return warnings


def _boundary_warning(label: str, k: int, candidate: str, prompt_tail: str,
                      apart: list[int], together: list[int]) -> str:
    """The message of one mismatch: the ids from where the two tokenizations part."""
    same = 0
    while same < min(len(apart), len(together)) and apart[same] == together[same]:
        same += 1
    hint = ""
    if prompt_tail[-1:].isspace() and not candidate[:1].isspace():
        hint = (f"; end the prompt without its trailing whitespace and start the candidate "
                f"with it (e.g. {prompt_tail[-1] + candidate!r})")
    return (f"{label}: candidates[{k}] ({candidate!r}): tokenizes differently after the "
            f"prompt: together {together[same:]}, apart {apart[same:]} (from the boundary "
            f"on); scored as tokenized apart{hint}")


def unexpected_error(obj: Any, index: int, exc: BaseException) -> str:
    """The error message of a request whose validation raised something other than a
    RequestError (a bug, or a user object that breaks its own protocol): named by its
    index or usable id, with the exception's type and first line (as valid UTF-8)."""
    try:
        detail = next(iter(str(exc).splitlines()), "")
    except Exception:  # noqa: BLE001  (an exception whose __str__ raises)
        detail = ""
    detail = detail[:200].encode("utf-8", "backslashreplace").decode("utf-8")
    return (f"{request_label(request_id_of(obj), index)}: request: could not be validated "
            f"({type(exc).__name__}{': ' + detail if detail else ''})")
