"""The remembering HPACK coders against hpack's own: same blocks in, same headers out."""

from __future__ import annotations

import gc
import tracemalloc

import h2.config
import h2.connection
import h2.events
import hpack
import pytest
from hpack import HeaderTuple, NeverIndexedHeaderTuple
from hpack.hpack import encode_integer
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hyperframe.frame import HeadersFrame, SettingsFrame
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import GRPC_REQUEST, MiB, client_and_server
from trio_infer.errors import StatusCode
from trio_infer.transport.grpc_protocol import _REQUEST_HEADERS, ProtocolLimits, ServerProtocol
from trio_infer.transport.header_blocks import (
    CachingDecoder,
    CachingEncoder,
    never_indexed,
    owed_size_updates,
)

# A small alphabet makes blocks repeat (cache hits) and tables churn (entries added, evicted).
_fields = st.tuples(
    st.sampled_from([":path", "content-type", "grpc-timeout", "x-big"]),
    st.sampled_from(["/a", "application/grpc", "1m", "2m", "v" * 3000]),
)
_blocks = st.lists(st.lists(_fields, min_size=1, max_size=4), min_size=1, max_size=40)
_table_sizes = st.lists(st.sampled_from([0, 64, 4096]), max_size=3)


def _as_str(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(name.decode(), value.decode()) for name, value in headers]


@settings(max_examples=300, deadline=None)
@given(blocks=_blocks, resizes=_table_sizes)
def test_the_caching_decoder_reads_what_hpack_reads(
    blocks: list[list[tuple[str, str]]], resizes: list[int]
) -> None:
    encoder, plain, caching = hpack.Encoder(), hpack.Decoder(), CachingDecoder()
    for i, headers in enumerate(blocks):
        if resizes and i % 7 == 3:
            # The encoder announces a new table size in its next block.
            encoder.header_table_size = resizes.pop()
        block = encoder.encode(headers)
        expected = plain.decode(block, raw=True)
        assert caching.decode(block, raw=True) == expected
        assert _as_str(expected) == headers


@settings(max_examples=300, deadline=None)
@given(
    blocks=_blocks,
    resizes=_table_sizes,
    sensitive=st.sets(st.integers(0, 39)),
    huffman=st.booleans(),
)
def test_the_caching_encoder_writes_what_hpack_writes(
    blocks: list[list[tuple[str, str]]], resizes: list[int], sensitive: set[int], huffman: bool
) -> None:
    plain, caching = hpack.Encoder(), CachingEncoder()
    for i, headers in enumerate(blocks):
        if resizes and i % 7 == 3:
            plain.header_table_size = caching.header_table_size = resizes.pop()
        if i in sensitive:
            # Fields that must never be indexed, which compare equal to plain tuples.
            headers = [hpack.NeverIndexedHeaderTuple(*field) for field in headers]
        assert caching.encode(headers, huffman) == plain.encode(headers, huffman)


@settings(max_examples=300, deadline=None)
@given(picks=st.lists(st.integers(0, 5), min_size=1, max_size=60), resizes=_table_sizes)
def test_the_same_tuples_coded_again_and_again_write_what_hpack_writes(
    picks: list[int], resizes: list[int]
) -> None:
    # The same tuple objects, as a server's constant headers and trailers are, mixed with
    # blocks that change the table and with resizes: a block found by its tuple's identity
    # must be what hpack writes now.
    pool = [
        ((":status", "200"), ("content-type", "application/grpc")),
        (("grpc-status", "0"),),
        (("x-big", "v" * 3000),),
        (("x-a", "1"), ("x-b", "2")),
    ]
    plain, caching = hpack.Encoder(), CachingEncoder()
    for i, pick in enumerate(picks):
        if resizes and i % 7 == 3:
            plain.header_table_size = caching.header_table_size = resizes.pop()
        headers = pool[pick] if pick < len(pool) else ((f"x-{i}", "v"),)
        assert caching.encode(headers) == plain.encode(headers, huffman=False)


def test_a_repeated_block_means_what_the_table_says_now() -> None:
    # The same one byte (dynamic entry 62) names a different header once the table changed.
    encoder, decoder = hpack.Encoder(), CachingDecoder()
    decoder.decode(encoder.encode([("x-a", "1")]))
    indexed = encoder.encode([("x-a", "1")])
    assert decoder.decode(indexed) == decoder.decode(indexed) == [("x-a", "1")]
    decoder.decode(encoder.encode([("x-b", "2")]))
    assert decoder.decode(indexed) == [("x-b", "2")]


def test_a_table_size_update_is_sent_once() -> None:
    plain, caching = hpack.Encoder(), CachingEncoder()
    for encoder in (plain, caching):
        encoder.encode([(":path", "/a")])
        encoder.encode([(":path", "/a")])
        encoder.header_table_size = 64
    after_resize = [caching.encode([(":path", "/a")], True) for _ in range(3)]
    assert after_resize == [plain.encode([(":path", "/a")], True) for _ in range(3)]
    assert after_resize[1] == after_resize[2] != after_resize[0]


@given(st.lists(st.sampled_from([0, 64, 4096, 100_000]), min_size=1, max_size=6))
def test_a_table_size_set_again_before_a_block_is_still_sent(sizes: list[int]) -> None:
    # A client may change SETTINGS_HEADER_TABLE_SIZE several times between two blocks, to the
    # size it set last among them: the next block still tells its decoder the final size.
    encoder, decoder = CachingEncoder(), hpack.Decoder()
    for _ in range(2):  # added to both tables, then indexed
        decoder.decode(encoder.encode([("x-a", "1")]))
    for size in sizes:
        encoder.header_table_size = size
    decoder.max_allowed_table_size = sizes[-1]
    assert decoder.decode(encoder.encode([("x-a", "1")])) == [("x-a", "1")]
    assert decoder.header_table_size == sizes[-1]


@pytest.mark.parametrize(
    ("owed", "size", "updates"),
    [
        ([], 64, [64]),
        ([64], 64, [64]),
        ([64], 0, [0]),
        ([0], 4096, [0, 4096]),
        ([0, 4096], 64, [0, 64]),
        ([64, 4096], 100_000, [64, 100_000]),
    ],
)
def test_the_updates_owed_are_the_smallest_size_then_the_last(
    owed: list[int], size: int, updates: list[int]
) -> None:
    assert owed_size_updates(owed, size) == updates


def test_a_block_that_changes_the_table_is_coded_anew_each_time() -> None:
    encoder = CachingEncoder()
    first = encoder.encode([("x-a", "1")])  # a literal, added to the table
    second = encoder.encode([("x-a", "1")])  # now indexed
    assert first != second
    assert encoder.encode([("x-a", "1")]) == second


# -- the connection's use of them -------------------------------------------------------------


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal without indexing: it leaves the dynamic table as it is."""
    return (
        b"\x00"
        + bytes(encode_integer(len(name), 7))
        + name
        + bytes(encode_integer(len(value), 7))
        + value
    )


def _headers_frame(stream_id: int, fields: bytes) -> bytes:
    frame = HeadersFrame(stream_id)
    frame.data = b"\x83\x86" + _literal(b":path", b"/pkg.S/M") + _literal(b":authority", b"x")
    frame.data += _literal(b"content-type", b"application/grpc") + fields
    frame.flags.add("END_HEADERS")
    frame.flags.add("END_STREAM")
    return bytes(frame.serialize())


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize()


def _bytes_kept_by_a_connection_after(wire: list[bytes]) -> int:
    """Memory a server connection still holds once it has read ``wire``."""
    protocol = ServerProtocol(ProtocolLimits())
    protocol.initiate_connection()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for chunk in wire:
            protocol.receive_data(chunk)
        protocol.data_to_send()
        gc.collect()
        return int(tracemalloc.get_traced_memory()[0] - before)
    finally:
        tracemalloc.stop()


def test_large_header_blocks_are_not_remembered() -> None:
    # 64 distinct header blocks of ~15 KB each, within the header list limit: remembering them
    # would pin about two MiB on one idle connection.
    wire = [_PREFACE]
    wire += [
        _headers_frame(2 * i + 1, _literal(b"x-pad", (b"%06d" % i) * 2_500)) for i in range(64)
    ]
    retained = _bytes_kept_by_a_connection_after(wire)
    assert retained < MiB // 2, f"{retained / MiB:.2f} MiB kept by one idle connection"


def test_blocks_small_on_the_wire_but_large_decoded_are_not_remembered() -> None:
    # One byte of HPACK can name a 4 KB entry of the dynamic table: 64 distinct blocks of a few
    # bytes each decode to 12 KB.
    big = b"x-big"
    indexing = b"\x40" + bytes(encode_integer(len(big), 7)) + big
    indexing += bytes(encode_integer(4000, 7)) + b"v" * 4000  # now dynamic entry 62
    wire = [_PREFACE, _headers_frame(1, indexing)]
    wire += [
        _headers_frame(2 * i + 3, _literal(b"x-n", b"%d" % i) + b"\xbe" * 3) for i in range(64)
    ]
    retained = _bytes_kept_by_a_connection_after(wire)
    assert retained < MiB // 2, f"{retained / MiB:.2f} MiB kept by one idle connection"


def test_blocks_small_decoded_but_large_on_the_wire_are_not_remembered() -> None:
    # Huffman coding gives a rare byte a code of up to 30 bits: a value of 3,500 such bytes is
    # some 13 KB on the wire. 64 distinct blocks, each under the decoded bound, would pin
    # about 850 KB of keys.
    wire = [_PREFACE]
    coded = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode(b"\x0a" * 3_500)
    value = bytes(encode_integer(len(coded), 7))
    value = bytes((value[0] | 0x80,)) + value[1:] + coded  # the H bit: Huffman-coded
    wire += [
        _headers_frame(2 * i + 1, b"\x00" + bytes(encode_integer(4, 7)) + b"x-%02d" % i + value)
        for i in range(64)
    ]
    retained = _bytes_kept_by_a_connection_after(wire)
    assert retained < MiB // 4, f"{retained / MiB:.2f} MiB kept by one idle connection"


def test_a_never_indexed_field_stays_never_indexed() -> None:
    connection = ServerProtocol(ProtocolLimits()).h2_connection
    base = [
        HeaderTuple(b":method", b"POST"),
        HeaderTuple(b":scheme", b"http"),
        HeaderTuple(b":path", b"/a/b"),
        HeaderTuple(b":authority", b"x"),
    ]
    plain = connection._checked([*base, HeaderTuple(b"authorization", b"s")], _REQUEST_HEADERS)
    secret = connection._checked(
        [*base, NeverIndexedHeaderTuple(b"authorization", b"s")], _REQUEST_HEADERS
    )
    assert type(plain[-1]) is HeaderTuple
    assert type(secret[-1]) is NeverIndexedHeaderTuple


def test_an_error_message_reaches_the_client_and_stays_out_of_the_hpack_table() -> None:
    client, server = client_and_server()
    request = GRPC_REQUEST
    trailers: list[dict[bytes, bytes]] = []
    for stream_id, message in [(1, "budget full: 1 of 2 bytes"), (3, "budget full: 2 of 2")]:
        client.send_headers(stream_id, request)
        client.send_data(stream_id, b"\0\0\0\0\0", end_stream=True)
        server.receive_data(client.data_to_send())
        server.end_response(
            stream_id, StatusCode.RESOURCE_EXHAUSTED, message, (), headers_sent=False
        )
        for event in client.receive_data(b"".join(server.data_to_send())):
            if isinstance(event, h2.events.ResponseReceived):
                trailers.append(dict(event.headers))
    assert [t[b"grpc-message"] for t in trailers] == [
        b"budget full: 1 of 2 bytes",
        b"budget full: 2 of 2",
    ]
    table = server.h2_connection.encoder.header_table.dynamic_entries
    assert all(name != b"grpc-message" for name, _ in table)


def test_each_request_is_parsed_for_itself_when_header_lists_repeat() -> None:
    # The parse of a header list is remembered: every request must still get its own stream,
    # timeout and metadata.
    client, server = client_and_server()
    base = GRPC_REQUEST
    sent = [
        (1, [*base, ("grpc-timeout", "5S"), ("x-tag", "a")]),
        (3, [*base, ("grpc-timeout", "5S"), ("x-tag", "a")]),
        (5, [*base, ("grpc-timeout", "7m"), ("x-tag", "a")]),
        (7, [*base, ("grpc-timeout", "5S"), ("x-tag", "b")]),
    ]
    received = []
    for stream_id, headers in sent:
        client.send_headers(stream_id, headers)
        client.send_data(stream_id, b"\0\0\0\0\0", end_stream=True)
        received += [e for e in server.receive_data(client.data_to_send()) if hasattr(e, "timeout")]
    assert [(r.stream_id, r.method_name, r.timeout, r.custom_metadata) for r in received] == [
        (1, "M", 5.0, (("x-tag", "a"),)),
        (3, "M", 5.0, (("x-tag", "a"),)),
        (5, "M", 0.007, (("x-tag", "a"),)),
        (7, "M", 5.0, (("x-tag", "b"),)),
    ]
    assert received[0] is not received[1]


@given(
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300),
    st.integers(min_value=1, max_value=3),
)
def test_a_never_indexed_field_appended_to_remembered_blocks_reads_as_sent(
    value: str, blocks: int
) -> None:
    encoder, decoder = CachingEncoder(), hpack.Decoder()
    fields = [(":status", "200"), ("content-type", "application/grpc")]
    for _ in range(blocks):  # the first indexes the fields, the later ones are remembered
        decoder.decode(encoder.encode(fields))
    table = len(decoder.header_table.dynamic_entries)
    block = encoder.encode(fields) + never_indexed("x-request-id", value)
    assert _as_str(decoder.decode(block, raw=True)) == [*fields, ("x-request-id", value)]
    # Neither table took the field: the next remembered block still means the same.
    assert len(decoder.header_table.dynamic_entries) == table
    assert _as_str(decoder.decode(encoder.encode(fields), raw=True)) == fields
