"""Regenerate the checked-in Python stubs of ``serving/grpc/scoring.proto``.

Run from anywhere (needs ``grpcio-tools``, in the ``dev`` extra)::

    python -m serving.grpc.codegen            # rewrite serving/grpc/scoring_pb2{.py,.pyi,_grpc.py}
    python -m serving.grpc.codegen --check    # exit 1 if the checked-in stubs are stale

which runs the equivalent of (from the repository root; OUT a temporary directory whose
``serving/grpc/`` files are then copied over the checked-in ones)::

    python -m grpc_tools.protoc -I . --python_out=OUT --pyi_out=OUT --grpc_python_out=OUT \\
        serving/grpc/scoring.proto

The include root is the repository root, so the proto's name is
``serving/grpc/scoring.proto`` and the generated ``scoring_pb2_grpc.py`` imports
``from serving.grpc import scoring_pb2``: the stubs work as a package. The only
post-processing is a first line ``# ruff: noqa`` in the generated ``.py`` files (protoc's
code has an unused import). The output depends on the grpcio-tools version (it records the
protobuf and grpcio versions it needs at run time): the stubs need a protobuf runtime at
least as new as the gencode version in ``scoring_pb2.py`` and grpcio at least
``GRPC_GENERATED_VERSION`` of ``scoring_pb2_grpc.py``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent.parent
PROTO = "serving/grpc/scoring.proto"
OUTPUTS = ("scoring_pb2.py", "scoring_pb2.pyi", "scoring_pb2_grpc.py")
NOQA = b"# ruff: noqa\n"


def protoc_args(out_dir: str | Path) -> list[str]:
    """The protoc command line (after ``python -m grpc_tools.protoc``), with absolute paths
    (the include root is the repository root, whatever the current directory)."""
    return ["-I", str(REPO_ROOT), f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(REPO_ROOT / PROTO)]


def generate(out_dir: str | Path) -> dict[str, bytes]:
    """Compile the proto into ``out_dir``; returns {file name: contents} of the stubs."""
    from grpc_tools import protoc

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    code = protoc.main(["grpc_tools.protoc", *protoc_args(out_dir)])
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code} on {PROTO}")
    generated = out_dir / Path(PROTO).parent
    return {name: _post_process(name, (generated / name).read_bytes()) for name in OUTPUTS}


def _post_process(name: str, data: bytes) -> bytes:
    """Generated code is not linted: mark the ``.py`` files for ruff."""
    return NOQA + data if name.endswith(".py") else data


def compiled_descriptor(out_dir: str | Path) -> Any:
    """The proto's ``FileDescriptorProto`` as the installed protoc compiles it (the schema,
    independent of the generator's version)."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    path = Path(out_dir).resolve() / "scoring.desc"
    code = protoc.main(["grpc_tools.protoc", "-I", str(REPO_ROOT),
                        f"--descriptor_set_out={path}", str(REPO_ROOT / PROTO)])
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code} on {PROTO}")
    proto = descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes()).file[0]
    _clear_json_names(proto.message_type)  # the stubs embed the descriptor without them
    return proto


def _clear_json_names(messages: Any) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _clear_json_names(message.nested_type)


def stale_files() -> list[str]:
    """Names of the checked-in stubs that differ from a fresh compilation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(tmp)
    return [name for name, data in fresh.items()
            if not (PACKAGE_DIR / name).is_file() or (PACKAGE_DIR / name).read_bytes() != data]


def regenerate() -> list[str]:
    """Rewrite the checked-in stubs; returns the names of the files that changed."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(tmp)
    changed = []
    for name, data in fresh.items():
        path = PACKAGE_DIR / name
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)
            changed.append(name)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="only report stale stubs (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        print("stale: " + ", ".join(stale) if stale else "stubs are up to date")
        return 1 if stale else 0
    changed = regenerate()
    print("rewrote " + ", ".join(changed) if changed else "stubs were already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
