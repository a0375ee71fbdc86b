"""Decoding compressed request bodies a slice at a time, within a bound: trio_infer/transport/
content_coding.py, without sockets (the REST port's own tests send them over HTTP)."""

from __future__ import annotations

import gzip
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_infer.transport.content_coding import BodyDecoder, ContentCodingError, body_decoder

CODERS = {"gzip": gzip.compress, "deflate": zlib.compress}


def decode_all(decoder: BodyDecoder, slice_size: int) -> bytes:
    decoded = bytearray()
    while not decoder.done:
        piece = decoder.decode(slice_size)
        assert len(piece) <= slice_size
        decoded += piece
    decoder.finish()
    return bytes(decoded)


def decode(decoder: BodyDecoder, sent: bytes, cuts: list[int], slice_size: int) -> bytes:
    for a, b in zip([0, *cuts], [*cuts, len(sent)], strict=True):
        decoder.add(sent[a:b])
    return decode_all(decoder, slice_size)


@given(
    data=st.binary(max_size=5000),
    zeros=st.sampled_from([0, 300_000]),  # a body that decodes to many slices
    coding=st.sampled_from(sorted(CODERS)),
    cuts=st.lists(st.integers(min_value=0, max_value=6000), max_size=8),
    slice_size=st.integers(min_value=1, max_value=100_000),
)
def test_a_body_decodes_the_same_whatever_pieces_and_slices(
    data: bytes, zeros: int, coding: str, cuts: list[int], slice_size: int
) -> None:
    data += bytes(zeros)
    slice_size = max(slice_size, zeros // 100)  # at most a hundred slices of the zeros
    sent = CODERS[coding](data)
    cuts = sorted({min(cut, len(sent)) for cut in cuts})
    decoder = body_decoder(coding, limit=len(data) + len(sent))
    assert decoder is not None
    assert decode(decoder, sent, cuts, slice_size) == data


@pytest.mark.parametrize("coding", sorted(CODERS))
def test_the_limit_holds_for_what_is_decoded_and_for_what_is_sent(coding: str) -> None:
    data = bytes(10_000)
    sent = CODERS[coding](data)
    # Exactly the limit decoded: taken; a byte over: 413, before more is decoded.
    decoder = body_decoder(coding, limit=len(data))
    assert decoder is not None
    assert decode(decoder, sent, [len(sent) // 2], 4096) == data
    decoder = body_decoder(coding, limit=len(data) - 1)
    assert decoder is not None
    decoder.add(sent)
    with pytest.raises(ContentCodingError) as refused:
        decode_all(decoder, 1 << 20)
    assert refused.value.status == 413
    assert refused.value.message.endswith("bytes decoded")
    # What is sent counts too: stored blocks are larger than what they hold.
    stored = zlib.compress(bytes(range(256)) * 4, 0)
    decoder = body_decoder("deflate", limit=len(stored) - 1)
    assert decoder is not None
    with pytest.raises(ContentCodingError) as refused:
        decoder.add(stored)
    assert refused.value.message.endswith("bytes sent")


@pytest.mark.parametrize(
    ("sent", "message"),
    [
        (b"not deflate at all", "its deflate data is corrupt"),
        (zlib.compress(b"{}")[:-2], "its deflate data ends before its stream does"),
        (zlib.compress(b"{}") + b"x", "bytes after the end of its deflate data"),
        (zlib.compress(b"{}") * 2, "bytes after the end of its deflate data"),
    ],
)
def test_corrupt_cut_short_or_trailing_data_is_400(sent: bytes, message: str) -> None:
    decoder = body_decoder("deflate", limit=1000)
    assert decoder is not None
    decoder.add(sent)
    with pytest.raises(ContentCodingError) as refused:
        decode_all(decoder, 1000)
    assert refused.value.status == 400
    assert message in refused.value.message


def test_an_empty_body_is_empty_whatever_its_coding() -> None:
    decoder = body_decoder("gzip", limit=100)
    assert decoder is not None
    assert decoder.done
    decoder.finish()


@pytest.mark.parametrize(
    ("header", "coding"),
    [(None, None), ("identity", None), (" Identity\t", None), ("", None), ("GZIP", "gzip")],
)
def test_which_headers_mean_a_coding(header: str | None, coding: str | None) -> None:
    decoder = body_decoder(header, limit=100)
    assert (decoder.name if decoder else None) == coding


@pytest.mark.parametrize(
    "header",
    ["br", "zstd", "gzip, deflate", "gzip, br", "compress", "gzip\xa0", "gzip\x85", "x" * 5000],
)
def test_codings_not_decoded_here_are_415_and_name_a_short_header(header: str) -> None:
    # Only space and tab are HTTP's whitespace: "gzip" and a no-break space is another word.
    with pytest.raises(ContentCodingError) as refused:
        body_decoder(header, limit=100)
    assert refused.value.status == 415
    assert len(refused.value.message) < 200
