"""Start Triton's own ``tritonserver``, from the ``nvidia-pytriton`` wheel, with ``dense``,
``sleep``, ``add_sub`` and ``ticks`` (decoupled) on its Python backend (runs in Triton's venv:
``bench/.venvs/triton``).

Usage: ``python triton_server.py GRPC_PORT HTTP_PORT WORKERS [--no-batching]``.

The wheel ships Triton (2.51.0 in ``nvidia-pytriton`` 0.7.0) under ``pytriton/tritonserver``:
``bin/tritonserver``, ``backends/python`` and one Python backend stub per Python version. As
PyTriton does, this copies the backends to a directory of its own with the stub of this Python
next to ``libtriton_python.so`` (where the Python backend looks for it), puts the wheel's
bundled libraries (``nvidia_pytriton.libs``) and this Python's ``libpython`` directory on
``LD_LIBRARY_PATH`` and this venv's ``bin`` first on ``PATH``, writes a model repository
(``config.pbtxt`` from :func:`model_configs`, ``model.py`` from ``triton_models/``), and then
*replaces itself* with ``tritonserver`` (``os.execve``): the benchmark's server pid is Triton's,
and the stub processes (``triton_python_backend_stub``, one per model instance) are its
children. The directory is ``<tmp>/bench-triton-<pid>``; one left by a Triton that is gone is
removed at the next start, with the shared memory regions its stubs left in ``/dev/shm``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytriton

MODELS = Path(__file__).resolve().parent / "triton_models"
PREFIX = "bench-triton-"


def model_configs(workers: int, batching: bool) -> dict[str, str]:
    """``config.pbtxt`` of each model: ``workers`` CPU instances each (one stub process each).

    ``dense``: rows of FP32[256] in batches of up to 64 rows, with Triton's dynamic batcher
    (no queue delay, as trio-infer's ``max_batch_time`` 0) unless ``batching`` is off.
    ``sleep``: one request per call (``max_batch_size`` 1, so a request is ``[1, n]``); its
    dynamic batcher has two priority levels, so that request parameter ``priority`` 1 goes
    ahead of the default (2), as in trio-infer.
    ``add_sub``: rows of two FP32[16] inputs, batched as ``dense`` (always, as trio-infer's).
    ``ticks``: decoupled (``model_transaction_policy``), one request per call, several responses.
    """
    instances = f"instance_group [{{ count: {workers} kind: KIND_CPU }}]"
    batcher = "dynamic_batching { max_queue_delay_microseconds: 0 }"
    dense_batcher = batcher if batching else ""
    return {
        "dense": f"""name: "dense"
backend: "python"
max_batch_size: 64
input [{{ name: "x" data_type: TYPE_FP32 dims: [ 256 ] }}]
output [{{ name: "y" data_type: TYPE_FP32 dims: [ 256 ] }}]
{instances}
{dense_batcher}
""",
        "sleep": f"""name: "sleep"
backend: "python"
max_batch_size: 1
input [{{ name: "x" data_type: TYPE_FP32 dims: [ -1 ] }}]
output [{{ name: "x" data_type: TYPE_FP32 dims: [ -1 ] }}]
{instances}
dynamic_batching {{ priority_levels: 2 default_priority_level: 2 }}
""",
        "add_sub": f"""name: "add_sub"
backend: "python"
max_batch_size: 64
input [{{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }},
       {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] }}]
output [{{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }},
        {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] }}]
{instances}
{batcher}
""",
        "ticks": f"""name: "ticks"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [{{ name: "x" data_type: TYPE_FP32 dims: [ -1, 16 ] }}]
output [{{ name: "y" data_type: TYPE_FP32 dims: [ -1, 16 ] }}]
{instances}
""",
    }


def _remove_stale(tmp: Path) -> None:
    """Remove the directories and the Python backend's shared memory regions
    (``/dev/shm/bench-triton-<pid>_*``, left behind by a stub that was killed) of earlier runs
    whose Triton (the pid in the name) is gone."""
    for path in [*tmp.glob(f"{PREFIX}*"), *Path("/dev/shm").glob(f"{PREFIX}*")]:
        pid = path.name.removeprefix(PREFIX).partition("_")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def prepare(root: Path, workers: int, batching: bool) -> tuple[Path, Path]:
    """Write the backends and the model repository under ``root``; return both folders."""
    dist = Path(pytriton.__file__).resolve().parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    backends = root / "backends"
    shutil.copytree(dist / "backends", backends)
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    shutil.copy2(stub, backends / "python" / stub.name)
    repository = root / "models"
    for name, config in model_configs(workers, batching).items():
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(config)
        shutil.copy(MODELS / f"{name}.py", repository / name / "1" / "model.py")
    return backends, repository


def main() -> None:
    """Prepare, then exec ``tritonserver``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("grpc_port", type=int)
    parser.add_argument("http_port", type=int, help="REST (HTTP/1.1) port")
    parser.add_argument("workers", type=int, help="instances of each model (stub processes)")
    parser.add_argument("--no-batching", action="store_true", help="dense without its batcher")
    args = parser.parse_args()

    tmp = Path(tempfile.gettempdir())
    _remove_stale(tmp)
    root = tmp / f"{PREFIX}{os.getpid()}"  # the pid stays Triton's after execve
    shutil.rmtree(root, ignore_errors=True)
    backends, repository = prepare(root, args.workers, batching=not args.no_batching)

    dist = Path(pytriton.__file__).resolve().parent / "tritonserver"
    libs = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    env = dict(os.environ)
    library_path = [str(libs), str(sysconfig.get_config_var("LIBDIR"))]
    if env.get("LD_LIBRARY_PATH"):
        library_path.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(library_path)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    binary = dist / "bin" / "tritonserver"
    command = [
        str(binary),
        f"--model-repository={repository}",
        f"--backend-directory={backends}",
        f"--backend-config=python,shm-region-prefix-name={PREFIX}{os.getpid()}_",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={args.grpc_port}",
        "--allow-http=true",  # its HTTP threads at their default (--http-thread-count)
        "--http-address=127.0.0.1",
        f"--http-port={args.http_port}",
        "--allow-metrics=false",  # as MLServer's
        "--exit-timeout-secs=2",  # as trio-infer's --grace-period 2
        "--log-verbose=0",
    ]
    sys.stdout.flush()
    os.execve(binary, command, env)


if __name__ == "__main__":
    main()
