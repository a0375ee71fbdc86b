"""Regenerate the modules in ``trio_infer/protobuf/_proto/`` from the ``.proto`` files here.

Run from the repository root, in the project's environment::

    python protos/generate.py

For each ``protos/NAME.proto`` this writes ``trio_infer/protobuf/_proto/NAME_pb2.py`` (messages),
``NAME_pb2.pyi`` (their type stubs), ``NAME_pb2_grpc.py`` (grpcio stubs, for tests and clients)
and ``NAME_grpc.py`` (purerpc stubs, for the server). It uses ``grpc_tools.protoc`` and the
``protoc-gen-purerpc`` plugin of the running interpreter's environment, so the output depends
only on the ``.proto`` files and on the pinned grpcio-tools and purerpc versions.

The protos are compiled under the virtual path ``trio_infer/protobuf/_proto/``: the descriptors
are then named ``trio_infer/protobuf/_proto/NAME.proto`` and every import the generators emit is
package-absolute (``trio_infer.protobuf._proto.NAME_pb2``) rather than a top-level ``NAME_pb2``
that would not resolve. A proto imports another of ours by that virtual path (``import
"trio_infer/protobuf/_proto/model_config.proto";``).

Each ``NAME_pb2.py`` is then rewritten to add its file to trio_infer's private descriptor pool
(``trio_infer/protobuf/_pool.py``) instead of protobuf's default one, where it would collide with
the copies of the same protocol in tritonclient, MLServer or grpcio-health-checking (same full
names, which the wire format requires). protoc's Python generator has no option for this: its
only parameters are ``pyi_out``, ``annotate_code`` and
``experimental_strip_nonfunctional_codegen``, and it always emits
``_descriptor_pool.Default().AddSerializedFile(...)``. The rewrite replaces exact lines of that
output and fails if any is missing, so a grpcio-tools whose output differs is noticed here rather
than at import time. The ``.pyi`` stubs and both kinds of gRPC stubs only name the message
classes and are written as protoc emits them.

``--output-root DIR`` writes under ``DIR/trio_infer/protobuf/_proto/`` instead; the
generated-code test uses it to check that the committed modules are current.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent
#: Where the modules live inside the package, and so the virtual path the protos compile under.
PACKAGE_PATH = "trio_infer/protobuf/_proto"
#: The protos compiled, in any order: one that imports another (``grpc_predict_v2.proto`` imports
#: ``model_config.proto``) gets an import of the other's module, which adds that file to the
#: private pool before its own.
PROTOS = ("grpc_predict_v2.proto", "health.proto", "model_config.proto")
#: The suffixes written for each proto, replacing ``.proto``. A proto without services
#: (``model_config.proto``) still gets both stub modules, empty of stubs: protoc writes them.
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_grpc.py")
#: The import that each rewritten ``_pb2`` module gains, and the name it binds.
POOL_IMPORT = "from trio_infer.protobuf import _pool as _private_pool\n"
POOL_ALIAS = "_private_pool"


def _purerpc_plugin() -> str:
    # Prefer the plugin installed beside this interpreter so a stray one on PATH from another
    # environment (another purerpc version) cannot change the output.
    beside = Path(sys.executable).parent / "protoc-gen-purerpc"
    if beside.exists():
        return str(beside)
    found = shutil.which("protoc-gen-purerpc")
    if found is None:
        raise SystemExit("protoc-gen-purerpc not found: install purerpc in this environment")
    return found


def expected_files() -> list[str]:
    """Return the generated files' paths relative to the output root, sorted."""
    return sorted(
        f"{PACKAGE_PATH}/{proto.removesuffix('.proto')}{suffix}"
        for proto in PROTOS
        for suffix in SUFFIXES
    )


def generate(output_root: Path) -> list[Path]:
    """Compile every proto, writing under ``output_root / PACKAGE_PATH``.

    Args:
        output_root: The directory that plays the repository root for the output.

    Returns:
        The generated files, sorted.

    Raises:
        SystemExit: If protoc fails or a plugin is missing, if a proto imports a file from outside
            ``protos/``, or if protoc's output is not what :func:`use_private_pool` rewrites.
    """
    from grpc_tools import protoc  # imported late so ``--help`` works without grpcio-tools

    out = str(output_root)
    (output_root / PACKAGE_PATH).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        descriptor_set = Path(scratch) / "protos.binpb"
        args = [
            "grpc_tools.protoc",
            f"-I{PACKAGE_PATH}={PROTO_DIR}",
            f"--plugin=protoc-gen-purerpc={_purerpc_plugin()}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            f"--purerpc_out={out}",
            f"--descriptor_set_out={descriptor_set}",
            *(f"{PACKAGE_PATH}/{proto}" for proto in PROTOS),
        ]
        status = protoc.main(args)
        if status != 0:
            raise SystemExit(f"protoc failed with status {status}")
        check_dependencies(descriptor_set.read_bytes())
    files = [output_root / name for name in expected_files()]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"protoc did not write: {', '.join(missing)}")
    for proto in PROTOS:
        path = output_root / PACKAGE_PATH / f"{proto.removesuffix('.proto')}_pb2.py"
        # Bytes, not text: the rewrite must not change protoc's line endings or encoding.
        rewritten = use_private_pool(path.read_bytes().decode("utf-8"), proto)
        path.write_bytes(rewritten.encode("utf-8"))
    return files


def check_dependencies(serialized_set: bytes) -> None:
    """Refuse a proto that imports a file from outside ``protos/``.

    The private pool starts empty, so a file added to it must find every dependency there: one
    of ours is (its module is imported first and adds it), a well-known type such as
    ``google/protobuf/timestamp.proto`` is not, and the import would fail.

    Args:
        serialized_set: The ``FileDescriptorSet`` protoc wrote for ``PROTOS``, serialized.

    Raises:
        SystemExit: Naming each file and the dependency of it that is not one of ``PROTOS``.
    """
    ours = {f"{PACKAGE_PATH}/{proto}" for proto in PROTOS}
    files = descriptor_pb2.FileDescriptorSet.FromString(serialized_set).file
    outside = sorted(
        f"{file.name} imports {dependency}"
        for file in files
        for dependency in file.dependency
        if dependency not in ours
    )
    if outside:
        raise SystemExit(
            "the private descriptor pool holds only the protos in protos/: " + "; ".join(outside)
        )


def _replace_once(text: str, old: str, new: str, proto: str) -> str:
    count = text.count(old)
    if count != 1:
        raise SystemExit(
            f"{proto}: expected protoc's Python output to contain {old!r} once, found {count}"
            " times; protos/generate.py must be updated for this grpcio-tools"
        )
    return text.replace(old, new)


def use_private_pool(text: str, proto: str) -> str:
    """Rewrite protoc's ``NAME_pb2.py`` for ``proto`` to register in the private pool.

    Three exact edits, each of a line protoc emits once: import the pool module beside
    protobuf's builder, add the file to ``POOL`` rather than ``descriptor_pool.Default()``, and
    after the message classes are built make the nested ones pickle by class (see
    ``trio_infer/protobuf/_pool.py``). Everything else is protoc's output byte for byte.

    Args:
        text: The module as protoc wrote it.
        proto: The ``.proto`` file's name in ``protos/``, for the module name and for errors.

    Returns:
        The rewritten module.

    Raises:
        SystemExit: If a line to rewrite is not there exactly once.
    """
    module = f"{PACKAGE_PATH}/{proto.removesuffix('.proto')}_pb2".replace("/", ".")
    builder_import = "from google.protobuf.internal import builder as _builder\n"
    text = _replace_once(text, builder_import, builder_import + POOL_IMPORT, proto)
    text = _replace_once(
        text,
        "\nDESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(",
        f"\n# Added to trio_infer's private pool by protos/generate.py, not the default pool.\n"
        f"DESCRIPTOR = {POOL_ALIAS}.POOL.AddSerializedFile(",
        proto,
    )
    build = f"_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, '{module}', _globals)\n"
    text = _replace_once(
        text, build, f"{build}{POOL_ALIAS}.pickle_nested_by_class(DESCRIPTOR, _globals)\n", proto
    )
    if "_descriptor_pool.Default()" in text:
        raise SystemExit(f"{proto}: protoc's output still adds to the default pool")
    return text


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and generate."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output-root",
        type=Path,
        default=REPO_ROOT,
        help="write under DIR/trio_infer/protobuf/_proto/ (default: the repository root)",
    )
    options = parser.parse_args(argv)
    for path in generate(options.output_root):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
