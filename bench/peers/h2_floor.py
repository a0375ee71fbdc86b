"""The floor of a Python HTTP/2 front-end: ServerLive answered by h2 on Trio with nothing else.

Usage: ``python -m bench.peers.h2_floor GRPC_PORT``. One Trio task per connection feeds the
socket's bytes to h2 (the HTTP/2 library trio-infer's transport and purerpc use) and answers
every ServerLive or ServerReady call that has ended with a response and trailers made in
advance: no task, cancel scope, deadline, protobuf decoding, admission or flow-control wait per
call, and every response of one read written in one ``send_all``. Its CPU per call is what h2's
public API costs as it comes (its frame objects, events, header validation and HPACK coding of
every response), not a floor for every server that uses h2: trio-infer parses and packs the
frames of a call itself, and spends less.
"""

from __future__ import annotations

import contextlib
import sys

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import trio

from bench.attacks import grpc_message
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb

#: Bytes read from the socket at a time.
READ_SIZE = 65536
#: The gRPC methods it answers, by path, with their responses.
ANSWERS: dict[bytes, pb.ServerLiveResponse | pb.ServerReadyResponse] = {
    b"/inference.GRPCInferenceService/ServerLive": pb.ServerLiveResponse(live=True),
    b"/inference.GRPCInferenceService/ServerReady": pb.ServerReadyResponse(ready=True),
}
HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
OK_TRAILERS = [(b"grpc-status", b"0")]
UNIMPLEMENTED_TRAILERS = [(b":status", b"200"), (b"grpc-status", b"12")]


#: Each answer as one gRPC length-prefixed message.
FRAMED = {path: grpc_message(message.SerializeToString()) for path, message in ANSWERS.items()}


async def serve_connection(stream: trio.SocketStream) -> None:
    """Answer the calls on one connection until the client closes or breaks it."""
    with contextlib.suppress(trio.BrokenResourceError, h2.exceptions.ProtocolError):
        await _answer(stream)


async def _answer(stream: trio.SocketStream) -> None:
    config = h2.config.H2Configuration(client_side=False, header_encoding=None)
    conn = h2.connection.H2Connection(config=config)
    conn.initiate_connection()
    await stream.send_all(conn.data_to_send())
    paths: dict[int, bytes] = {}
    while data := await stream.receive_some(READ_SIZE):
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                paths[event.stream_id] = dict(event.headers)[b":path"]
            elif isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                answer = FRAMED.get(paths.pop(event.stream_id, b""))
                if answer is None:
                    conn.send_headers(event.stream_id, UNIMPLEMENTED_TRAILERS, end_stream=True)
                    continue
                conn.send_headers(event.stream_id, HEADERS)
                conn.send_data(event.stream_id, answer)
                conn.send_headers(event.stream_id, OK_TRAILERS, end_stream=True)
        if out := conn.data_to_send():
            await stream.send_all(out)


async def serve(port: int) -> None:
    """Serve 127.0.0.1:PORT until the process is interrupted."""
    await trio.serve_tcp(serve_connection, port, host="127.0.0.1")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(serve, int(sys.argv[1]))
