"""Decoding compressed request bodies piece by piece, within a bound: trio_infer/transport/
content_coding.py, without sockets (the REST port's own tests send them over HTTP)."""

from __future__ import annotations

import gzip
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_infer.transport.content_coding import BodyDecoder, ContentCodingError, body_decoder

CODERS = {"gzip": gzip.compress, "deflate": zlib.compress}


def decode(decoder: BodyDecoder, sent: bytes, cuts: list[int]) -> bytes:
    pieces = [sent[a:b] for a, b in zip([0, *cuts], [*cuts, len(sent)], strict=True)]
    decoded = b"".join(decoder.feed(piece) for piece in pieces)
    decoder.finish()
    return decoded


@given(
    data=st.binary(max_size=5000),
    coding=st.sampled_from(sorted(CODERS)),
    cuts=st.lists(st.integers(min_value=0, max_value=6000), max_size=8),
)
def test_a_body_decodes_the_same_whatever_pieces_it_arrives_in(
    data: bytes, coding: str, cuts: list[int]
) -> None:
    sent = CODERS[coding](data)
    cuts = sorted({min(cut, len(sent)) for cut in cuts})
    decoder = body_decoder(coding, limit=len(data) + len(sent))
    assert decoder is not None
    assert decode(decoder, sent, cuts) == data


@pytest.mark.parametrize("coding", sorted(CODERS))
def test_the_limit_holds_for_what_is_decoded_and_for_what_is_sent(coding: str) -> None:
    data = bytes(10_000)
    sent = CODERS[coding](data)
    # Exactly the limit decoded: taken; a byte over: 413, before more is decoded.
    decoder = body_decoder(coding, limit=len(data))
    assert decoder is not None
    assert decode(decoder, sent, [len(sent) // 2]) == data
    decoder = body_decoder(coding, limit=len(data) - 1)
    assert decoder is not None
    with pytest.raises(ContentCodingError) as refused:
        decoder.feed(sent)
    assert refused.value.status == 413
    assert refused.value.message.endswith("bytes decoded")
    # What is sent counts too: random bytes compress to more than they are.
    noise = zlib.compress(bytes(range(256)) * 4, 0)
    decoder = body_decoder("deflate", limit=len(noise) - 1)
    assert decoder is not None
    with pytest.raises(ContentCodingError) as refused:
        decoder.feed(noise)
    assert refused.value.message.endswith("bytes sent")


@pytest.mark.parametrize(
    ("header", "coding"),
    [(None, None), ("identity", None), (" Identity ", None), ("", None), ("GZIP", "gzip")],
)
def test_which_headers_mean_a_coding(header: str | None, coding: str | None) -> None:
    decoder = body_decoder(header, limit=100)
    assert (decoder.name if decoder else None) == coding


@pytest.mark.parametrize("header", ["br", "zstd", "gzip, deflate", "compress", "x" * 5000])
def test_codings_not_decoded_here_are_415_and_name_a_short_header(header: str) -> None:
    with pytest.raises(ContentCodingError) as refused:
        body_decoder(header, limit=100)
    assert refused.value.status == 415
    assert len(refused.value.message) < 200
