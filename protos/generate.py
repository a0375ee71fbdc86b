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
that would not resolve.

``--output-root DIR`` writes under ``DIR/trio_infer/protobuf/_proto/`` instead; the
generated-code test uses it to check that the committed modules are current.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent
#: Where the modules live inside the package, and so the virtual path the protos compile under.
PACKAGE_PATH = "trio_infer/protobuf/_proto"
PROTOS = ("grpc_predict_v2.proto", "health.proto")
#: The suffixes written for each proto, replacing ``.proto``.
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_grpc.py")


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
        SystemExit: If protoc fails or a plugin is missing.
    """
    from grpc_tools import protoc  # imported late so ``--help`` works without grpcio-tools

    out = str(output_root)
    (output_root / PACKAGE_PATH).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE_PATH}={PROTO_DIR}",
        f"--plugin=protoc-gen-purerpc={_purerpc_plugin()}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        f"--purerpc_out={out}",
        *(f"{PACKAGE_PATH}/{proto}" for proto in PROTOS),
    ]
    status = protoc.main(args)
    if status != 0:
        raise SystemExit(f"protoc failed with status {status}")
    files = [output_root / name for name in expected_files()]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"protoc did not write: {', '.join(missing)}")
    return files


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
