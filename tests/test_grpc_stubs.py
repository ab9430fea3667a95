"""The checked-in gRPC stubs match serving/grpc/scoring.proto (regenerate them with
``python -m serving.grpc.codegen``)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) compiles the proto")

from google.protobuf import descriptor_pb2  # noqa: E402

from serving.grpc import codegen, scoring_pb2, scoring_pb2_grpc  # noqa: E402


def _generator_versions(files: dict[str, bytes]) -> tuple[str, str]:
    """(protobuf gencode version, grpcio generated version) recorded in a set of stubs."""
    return (re.search(rb"# Protobuf Python Version: (\S+)", files["scoring_pb2.py"]).group(1),
            re.search(rb"GRPC_GENERATED_VERSION = '([^']+)'",
                      files["scoring_pb2_grpc.py"]).group(1))


def test_checked_in_schema_matches_the_proto(tmp_path):
    """Whatever grpcio-tools is installed: the stubs' schema is the .proto's."""
    checked_in = descriptor_pb2.FileDescriptorProto()
    scoring_pb2.DESCRIPTOR.CopyToProto(checked_in)
    assert checked_in == codegen.compiled_descriptor(tmp_path), \
        "stale stubs: run `python -m serving.grpc.codegen`"


def test_checked_in_stubs_are_byte_identical_to_a_regeneration(tmp_path):
    fresh = codegen.generate(tmp_path)
    checked_in = {name: (codegen.PACKAGE_DIR / name).read_bytes() for name in codegen.OUTPUTS}
    if _generator_versions(fresh) != _generator_versions(checked_in):
        pytest.skip(f"the installed grpcio-tools writes versions {_generator_versions(fresh)}, "
                    f"the stubs were generated with {_generator_versions(checked_in)}")
    stale = [name for name in codegen.OUTPUTS if fresh[name] != checked_in[name]]
    assert not stale, f"stale stubs {stale}: run `python -m serving.grpc.codegen`"


def test_stubs_work_as_a_package():
    assert scoring_pb2.DESCRIPTOR.name == codegen.PROTO
    assert scoring_pb2_grpc.serving_dot_grpc_dot_scoring__pb2 is scoring_pb2
    methods = {m.name for m in scoring_pb2.DESCRIPTOR.services_by_name["Scoring"].methods}
    assert methods == {"Score", "ScoreBatch", "ScoreStream", "ModelInfo"}
