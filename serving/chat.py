"""Chat templates: a model's ``chat_template`` (jinja2), rendered the way ``transformers``'
``apply_chat_template`` renders it, so an instruct model gets the prompt it was trained
on.

Where the template comes from (as ``transformers`` saves it): ``chat_template.jinja`` in the
model directory, else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
``{"name", "template"}`` from which "default" is taken). The special tokens the template
may read (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``) come from
``tokenizer_config.json`` (a string or an added-token object with ``content``).

The environment is jinja2's immutable sandbox (templates from a model hub are untrusted
code) with ``trim_blocks`` and ``lstrip_blocks``, the loop controls (``break``,
``continue``), ``raise_exception(message)``, ``strftime_now(format)``, a ``tojson`` that
keeps non-ASCII text, and the ``{% generation %}`` block (rendered as its body), as
``transformers`` provides them.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from serving.special_tokens import read_tokenizer_config, token_text

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
ROLES_HINT = "a list of {\"role\": ..., \"content\": ...} objects"


class ChatTemplateError(ValueError):
    """The template cannot render these messages (its own ``raise_exception``, a jinja2
    error), or the model has no template."""


class MessagesError(ChatTemplateError):
    """``messages`` is malformed: ``field`` (``messages``, ``messages[1].role``, ...) and
    what is wrong with it (``problem``)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


def _environment() -> Any:
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %} … {% endgeneration %}``: its body, unchanged (transformers
        marks the assistant's tokens with it; rendering is the same)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class ChatTemplate:
    """One model's chat template and the special tokens it may read."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        import jinja2

        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template does not parse: {exc}") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "ChatTemplate | None":
        """The directory's template (module docstring), or None when it has none."""
        directory = Path(model_dir)
        config = read_tokenizer_config(directory)
        tokens = {name: text for name in SPECIAL_TOKENS
                  if (text := token_text(config.get(name))) is not None}
        template_path = directory / TEMPLATE_FILE
        if template_path.is_file():
            return cls(template_path.read_text(), tokens)
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {entry.get("name"): entry.get("template") for entry in source
                     if isinstance(entry, Mapping)}
            source = named.get("default")
        return cls(source, tokens) if isinstance(source, str) else None

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text of ``messages`` (``extra``: more variables the template reads,
        e.g. ``tools``, ``enable_thinking``). Raises :class:`ChatTemplateError`."""
        import jinja2

        check_messages(messages)
        variables = {**self.special_tokens, **extra, "messages": [dict(m) for m in messages],
                     "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None


def check_messages(messages: Any) -> None:
    """``messages`` is a non-empty list of objects with a string ``role`` and a string (or
    list of parts) ``content``; raises MessagesError naming the first problem."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise MessagesError("messages", f"must be {ROLES_HINT}, non-empty")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise MessagesError(f"messages[{i}]", "must be an object with role and content")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise MessagesError(f"messages[{i}].role", "must be a non-empty string")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise MessagesError(f"messages[{i}].content", "must be a string or a list of parts")


__all__ = ("ChatTemplate", "ChatTemplateError", "MessagesError", "check_messages")
