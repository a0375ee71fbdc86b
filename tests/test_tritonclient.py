"""Triton's own Python client (``tritonclient[grpc]``), unchanged, against a real server.

It runs in a subprocess of its own, as any client would (that the two can share a process is
tests/test_coexistence.py's).
"""

from __future__ import annotations

import json
import subprocess
import sys

import trio

from trio_infer.server import RunningServer

CLIENT = r"""
import json
import sys

import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

client = triton.InferenceServerClient(f"127.0.0.1:{sys.argv[1]}")
report = {
    "live": client.is_server_live(),
    "ready": client.is_server_ready(),
    "model_ready": client.is_model_ready("add_sub"),
    "server": client.get_server_metadata(as_json=True)["name"],
    "inputs": [t["name"] for t in client.get_model_metadata("add_sub", as_json=True)["inputs"]],
}

a = np.arange(32, dtype=np.float32).reshape(2, 16)
b = np.full((2, 16), 0.5, dtype=np.float32)
inputs = [triton.InferInput(name, [2, 16], "FP32") for name in ("INPUT0", "INPUT1")]
inputs[0].set_data_from_numpy(a)
inputs[1].set_data_from_numpy(b)
outputs = [triton.InferRequestedOutput("OUTPUT1")]
result = client.infer("add_sub", inputs, outputs=outputs, request_id="triton-1", client_timeout=5)
report["difference_ok"] = bool(np.array_equal(result.as_numpy("OUTPUT1"), a - b))
report["sum_absent"] = result.as_numpy("OUTPUT0") is None
report["id"] = result.get_response().id

text = np.array([b"hello", b"", "h\u00e9".encode()], dtype=np.object_)
echo_input = triton.InferInput("text", [3], "BYTES")
echo_input.set_data_from_numpy(text)
# Triton's priority (sent as a uint64 parameter) is taken as a priority level here too.
echoed = client.infer("echo", [echo_input], priority=1).as_numpy("text")
report["bytes_ok"] = echoed.tolist() == text.tolist()

try:
    client.infer("no_such_model", inputs)
except InferenceServerException as error:
    report["error"] = [error.status(), error.message()]
print(json.dumps(report))
"""


async def test_tritonclient_calls_every_rpc_unchanged(server: RunningServer) -> None:
    completed = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-c", CLIENT, str(server.port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report == {
        "live": True,
        "ready": True,
        "model_ready": True,
        "server": "trio-infer",
        "inputs": ["INPUT0", "INPUT1"],
        "difference_ok": True,
        "sum_absent": True,
        "id": "triton-1",
        "bytes_ok": True,
        "error": [
            "StatusCode.NOT_FOUND",
            "Request for unknown model: 'no_such_model' is not found",
        ],
    }
