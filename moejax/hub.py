"""Hugging Face hub ids as model names: ``ORG/NAME`` or ``ORG/NAME@REVISION`` -> the
directory of that repository's snapshot in the Hugging Face cache, downloaded on first use.

What :func:`moejax.model_dirs.resolve_model_dir` asks when a model name is neither a
built-in model nor a local directory, so that ``Scorer("Qwen/Qwen3-30B-A3B")`` and
``--model Qwen/Qwen3-30B-A3B`` work as they do in ``transformers``.

The settings are the user's and ``huggingface_hub`` reads them itself: where the cache is
(``HF_HOME``, ``HF_HUB_CACHE``), whether to go online (``HF_HUB_OFFLINE``) and the token of a
private or gated repository (``HF_TOKEN``, ``hf auth login``). Nothing here passes a cache
directory or a token, which would override them. ``huggingface_hub`` is imported inside the
functions: ``import moejax`` stays cheap, and a process that never names a hub model never
loads it.

Every failure is a :class:`HubModelError`, a ``FileNotFoundError`` with a one-line message
naming the id (and the revision), so callers that report a missing model directory (the
``moejax`` command: ``error: ...``, exit 2) report it the same way.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

# What moejax reads from a model directory (moejax.checkpoint, moejax.safetensors_io,
# serving.chat, serving.special_tokens); anything else in a repository (PyTorch *.bin,
# GGUF, ONNX) would be downloaded for nothing.
ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "*.safetensors", "model.safetensors.index.json"]
# A checkpoint's shards are plain file names in its directory (safetensors_io refuses any
# other), so a subfolder's files are never read: e.g. gpt-oss's ``original/`` copy of its
# weights. ``consolidated*.safetensors`` is Mistral's own format beside the transformers
# shards of the same weights.
IGNORE_PATTERNS = ["*/*", "consolidated*.safetensors"]
CONFIG_FILE = "config.json"


class HubModelError(FileNotFoundError):
    """A hub id that names no usable model here. A FileNotFoundError, as a missing local
    model directory is, so every caller's handling of a bad model name covers it."""


class HubModelNotCached(HubModelError):
    """Not in the Hugging Face cache, and the hub cannot be reached (offline or no network)."""


class HubRepoNotFound(HubModelError):
    """The hub has no such repository (or it is private and no token grants access)."""


class HubRepoGated(HubModelError):
    """A gated repository whose terms the token's user has not accepted (or no token)."""


class HubRevisionNotFound(HubModelError):
    """The repository exists, the revision (branch, tag or commit) does not."""


class HubModelIncomplete(HubModelError):
    """A snapshot that is not a model moejax can read (no config.json), or a cached one
    missing some of its files while the hub cannot be reached."""


@dataclass(frozen=True)
class HubModelId:
    """A repository id (``ORG/NAME``) and an optional revision (branch, tag or commit)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_model_id(name: str) -> HubModelId | None:
    """``ORG/NAME`` or ``ORG/NAME@REVISION`` -> its parts; None when ``name`` is not one.

    The repository part must pass ``huggingface_hub``'s own validation and name its owner:
    a bare ``NAME`` (which the hub would also accept) is far more often a mistyped local
    directory than a model. The revision is everything after the first ``@`` (a branch may
    hold ``/``: ``refs/pr/3``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_id, at, revision = name.partition("@")
    if repo_id.count("/") != 1 or (at and not revision):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return HubModelId(repo_id, revision or None)


def snapshot_dir(model_id: HubModelId) -> str:
    """The directory of ``model_id``'s snapshot: from the cache when it is there (offline
    too), else downloaded into it (only the files of :data:`ALLOW_PATTERNS`; a tqdm bar per
    file, as ``huggingface_hub`` shows them). Raises a :class:`HubModelError`."""
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(model_id.repo_id, revision=model_id.revision,
                                 allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
    except OSError as exc:   # huggingface_hub's errors are OSErrors (HTTP ones included)
        raise _hub_error(exc, model_id) from exc
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise HubModelIncomplete(f"model {str(model_id)!r}: its Hugging Face snapshot {path} "
                                 f"has no {CONFIG_FILE} (moejax needs a transformers model "
                                 f"repository: config.json, tokenizer.json, *.safetensors)")
    log.debug("model %s: snapshot %s", model_id, path)
    return path


def _hub_error(exc: OSError, model_id: HubModelId) -> HubModelError:
    """``huggingface_hub``'s exception (or a connection's OSError) as a one-line
    :class:`HubModelError` that names the id and, where it matters, the revision."""
    from huggingface_hub import errors

    name = repr(str(model_id))
    token_hint = "a private or gated one needs HF_TOKEN or `hf auth login`"
    if isinstance(exc, errors.GatedRepoError):
        return HubRepoGated(f"model {name}: a gated repository on the Hugging Face hub: accept "
                            f"its terms on huggingface.co and set HF_TOKEN (or `hf auth login`)")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return HubRepoNotFound(f"model {name}: no local directory of that name and no such "
                               f"repository on the Hugging Face hub ({token_hint})")
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubRevisionNotFound(f"model {name}: repository {model_id.repo_id!r} has no "
                                   f"revision {model_id.revision!r} on the Hugging Face hub")
    if isinstance(exc, getattr(errors, "IncompleteSnapshotError", ())):   # newer versions
        return HubModelIncomplete(f"model {name}: its cached snapshot misses files and the "
                                  f"hub cannot be reached ({_unreachable_reason(exc)}): "
                                  f"{_download_hint(model_id)}")
    if isinstance(exc, errors.LocalEntryNotFoundError):
        what = ("not in the Hugging Face cache" if model_id.revision is None
                else f"revision {model_id.revision!r} not in the Hugging Face cache")
        return HubModelNotCached(f"model {name}: not a local directory, {what} ({_cache_dir()}) "
                                 f"and the hub cannot be reached ({_unreachable_reason(exc)}): "
                                 f"{_download_hint(model_id)}")
    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(exc.response, "status_code", "?")
        return HubModelError(f"model {name}: the Hugging Face hub answered HTTP {status}: "
                             f"{_first_line(exc)}")
    return HubModelNotCached(f"model {name}: the Hugging Face hub cannot be reached "
                             f"({type(exc).__name__}: {_first_line(exc)}): "
                             f"{_download_hint(model_id)}")


def _unreachable_reason(exc: BaseException) -> str:
    """Why the hub was not asked: offline mode, else the connection error behind ``exc``."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE=1"
    cause = exc.__cause__ or exc.__context__
    return f"{type(cause).__name__}: {_first_line(cause)}" if cause is not None else "no network"


def _cache_dir() -> str:
    """The Hugging Face cache in use (``HF_HUB_CACHE``, by default ``$HF_HOME/hub``)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _download_hint(model_id: HubModelId) -> str:
    """How to put the model where an offline run finds it."""
    revision = f" --revision {model_id.revision}" if model_id.revision is not None else ""
    return (f"download it first (`hf download {model_id.repo_id}{revision}`, or a run with "
            f"network access) or give a local directory")


def _first_line(exc: BaseException) -> str:
    """An exception's message cut to its first non-blank line (library messages run on)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
