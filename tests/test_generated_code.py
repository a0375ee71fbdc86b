"""The committed modules in trio_infer/protobuf/_proto/ are exactly what protos/generate.py writes.

Editing a .proto without regenerating, or regenerating with a different grpcio-tools, fails here.
The fix is always ``python protos/generate.py`` with the pinned test dependencies installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
GENERATED_DIR = REPO_ROOT / "trio_infer" / "protobuf" / "_proto"


def _generate_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "_trio_infer_generate", REPO_ROOT / "protos" / "generate.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _generate_module()


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("regenerated")
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "protos" / "generate.py"), "--output-root", str(out)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.parametrize("relative", generate.expected_files())
def test_committed_code_is_current(regenerated: Path, relative: str) -> None:
    fresh = (regenerated / relative).read_bytes()
    committed_path = REPO_ROOT / relative
    assert committed_path.is_file(), f"{relative} is missing: run python protos/generate.py"
    tools = importlib.metadata.version("grpcio-tools")
    assert committed_path.read_bytes() == fresh, (
        f"{relative} is stale or was generated with another grpcio-tools (installed: {tools});"
        " run python protos/generate.py"
    )


def test_no_stray_generated_files() -> None:
    expected = {Path(name).name for name in generate.expected_files()} | {"__init__.py"}
    present = {p.name for p in GENERATED_DIR.iterdir() if p.name != "__pycache__"}
    assert present == expected


def test_generated_modules_import_cleanly() -> None:
    # In a fresh interpreter with warnings as errors: the protobuf gencode/runtime version check
    # and grpcio's generated-version check both run at import time, and the purerpc stubs import
    # their messages by package-absolute name.
    modules = [
        "trio_infer.protobuf._proto." + Path(name).name.removesuffix(".py")
        for name in generate.expected_files()
        if name.endswith(".py")
    ]
    code = f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
