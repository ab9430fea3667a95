"""Parsing incoming messages so that text that is not UTF-8 is an error naming its field.

proto3 ``string`` fields must hold UTF-8; the protobuf runtime refuses a message with
invalid UTF-8 as a whole, and gRPC's default deserializer would turn that into an opaque
``INTERNAL`` status. Here a message that fails strict parsing is parsed again with a
*lenient* twin of the message type (the same wire format, every ``string`` field declared
``bytes``), and its text fields are checked one by one: the result is an
:class:`Undecodable` naming each bad field ("candidates[1]: is not valid UTF-8 ..."),
and in a batch only the bad items are refused.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from serving.grpc import scoring_pb2 as pb

_PACKAGE = pb.DESCRIPTOR.package
_LENIENT_PACKAGE = _PACKAGE + ".lenient"


@dataclasses.dataclass
class Undecodable:
    """A message that could not be parsed: ``problems`` are (field path, problem) pairs;
    ``lenient`` is the message parsed with bytes for text (None if not protobuf at all)."""

    problems: list[tuple[str, str]]
    lenient: Any | None = None

    def describe(self, strip: str = "") -> str:
        """``"field: problem"`` of the first problem (``strip``: a path prefix to drop)."""
        path, problem = self.problems[0]
        if strip and path.startswith(strip):
            path = path[len(strip):]
        return f"{path}: {problem}" if path else problem

    def request_id(self, prefix: str = "") -> str | int | None:
        """The request id, when it is readable (``prefix``: path to the ScoreRequest)."""
        request = self.lenient
        for name in filter(None, prefix.split(".")):
            if request is None or not request.HasField(name):
                return None
            request = getattr(request, name)
        if request is None:
            return None
        which = request.WhichOneof("id")
        if which is None:
            return None
        value = getattr(request, which)
        if isinstance(value, bytes):
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError:
                return None
        return value


@lru_cache(maxsize=1)
def _lenient_pool() -> descriptor_pool.DescriptorPool:
    """A private pool holding the proto with every string field turned into bytes."""
    proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(proto)
    proto.name = proto.name.replace(".proto", "_lenient.proto")
    proto.package = _LENIENT_PACKAGE
    del proto.service[:]
    for message in proto.message_type:
        for field in message.field:
            if field.type == FieldDescriptor.TYPE_STRING:
                field.type = FieldDescriptor.TYPE_BYTES
            if field.type_name.startswith(f".{_PACKAGE}."):
                field.type_name = f".{_LENIENT_PACKAGE}." + field.type_name[len(_PACKAGE) + 2:]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return pool


def lenient_class(message_class: type[Message]) -> type[Message]:
    """The bytes-for-text twin of a message class of ``scoring.proto``."""
    name = message_class.DESCRIPTOR.full_name[len(_PACKAGE) + 1:]
    descriptor = _lenient_pool().FindMessageTypeByName(f"{_LENIENT_PACKAGE}.{name}")
    return message_factory.GetMessageClass(descriptor)


def _text_problems(strict: Any, lenient: Message, path: str) -> list[tuple[str, str]]:
    """Invalid UTF-8 in the text fields of ``lenient`` (``strict``: the real descriptor)."""
    problems = []
    for field, value in lenient.ListFields():
        real = strict.fields_by_name[field.name]
        name = path + ("id" if field.name == "string_id" else field.name)
        repeated = field.is_repeated
        values = list(value) if repeated else [value]
        for i, item in enumerate(values):
            where = f"{name}[{i}]" if repeated else name
            if real.type == FieldDescriptor.TYPE_STRING:
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError as exc:
                    problems.append((where, f"is not valid UTF-8 (invalid at byte {exc.start})"))
            elif real.type == FieldDescriptor.TYPE_MESSAGE:
                problems.extend(_text_problems(real.message_type, item, where + "."))
    return problems


def parse(message_class: type[Message], data: bytes) -> Any:
    """``message_class`` parsed from ``data``, or an :class:`Undecodable`."""
    try:
        return message_class.FromString(data)
    except DecodeError:
        pass
    try:
        lenient = lenient_class(message_class).FromString(data)
    except DecodeError:
        return Undecodable([("", f"not a valid {message_class.DESCRIPTOR.full_name} message")])
    problems = _text_problems(message_class.DESCRIPTOR, lenient, "")
    return Undecodable(problems or [("", "could not be parsed")], lenient)


def parse_batch(data: bytes) -> list[Any] | Undecodable:
    """The items of a ``ScoreBatchRequest``: each a ``ScoreRequest`` or an
    :class:`Undecodable` (with paths relative to the item); the whole batch is an
    Undecodable only when it is not protobuf at all."""
    batch = parse(pb.ScoreBatchRequest, data)
    if isinstance(batch, pb.ScoreBatchRequest):
        return list(batch.requests)
    if batch.lenient is None:
        return batch
    return [parse(pb.ScoreRequest, item.SerializeToString()) for item in batch.lenient.requests]
