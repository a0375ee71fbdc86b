"""Request bodies in a content coding (RFC 9110 8.4.1): gzip and deflate, decoded once they
have arrived whole, a slice at a time, within a bound on what they decode to.

A few kilobytes of gzip can stand for gigabytes. So nothing is decoded before the body has
arrived (a client that never finishes one holds only what it sent, as with any other body); the
decoded size is bounded as it is made (``zlib``'s ``max_length``), never after; it is made in
slices, so that the caller can let other work run between them; and the compressed bytes are
bounded too, since deflate's empty blocks decode to nothing however many arrive. ``deflate`` is
the zlib format (RFC 1950), as HTTP defines it and as tritonclient sends it; ``gzip`` one gzip
member.
"""

from __future__ import annotations

import zlib

from trio_infer.transport.quoting import shown

__all__ = ["BodyDecoder", "ContentCodingError", "body_decoder", "is_coded"]

#: Codings by name (RFC 9110 8.4.1; ``x-gzip`` is gzip's old name), as zlib's window bits.
_WINDOW_BITS = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": zlib.MAX_WBITS,
}
#: What names no coding: no header, an empty one, or ``identity``.
_UNCODED = frozenset(("", "identity"))
#: Compressed bytes given to zlib at a time: what it leaves unconsumed when a slice of output
#: is full is copied, so a bounded piece keeps that copy small.
_INPUT_SLICE = 64 * 1024


class ContentCodingError(Exception):
    """A body that cannot be decoded: its HTTP status (400, 413, 415) and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message


def body_decoder(content_encoding: str | None, limit: int) -> BodyDecoder | None:
    """The decoder for a body sent with ``content_encoding`` (the header's values, joined with
    commas), or None when it is sent as it is (no header, ``identity``).

    Args:
        content_encoding: The ``Content-Encoding`` header's value, if any.
        limit: The most bytes the body may take, compressed and decoded alike.

    Raises:
        ContentCodingError: 415 for a coding not decoded here (brotli, zstd, several codings).
    """
    name = _coding(content_encoding)
    if name in _UNCODED:
        return None
    bits = _WINDOW_BITS.get(name)
    if bits is None:
        assert content_encoding is not None
        raise ContentCodingError(
            415,
            f"the request body's Content-Encoding {shown(content_encoding)!r} is not supported: "
            f"send it as gzip, deflate or uncompressed",
        )
    return BodyDecoder(name, bits, limit)


def is_coded(content_encoding: str | None) -> bool:
    """Whether a ``Content-Encoding`` value names a coding: not absent, empty or ``identity``."""
    return _coding(content_encoding) not in _UNCODED


def _coding(content_encoding: str | None) -> str:
    """The coding a ``Content-Encoding`` value names, lower-case, HTTP's whitespace only
    stripped around it (RFC 9110 5.6.3); ``""`` without the header."""
    return "" if content_encoding is None else content_encoding.strip(" \t").lower()


class BodyDecoder:
    """One body: its compressed bytes kept as they arrive (:meth:`add`), then decoded a slice at
    a time (:meth:`decode`), within ``limit`` bytes in and out."""

    def __init__(self, name: str, window_bits: int, limit: int) -> None:
        self.name = name
        """The coding, lower-case."""
        self._limit = limit
        self._decoder = zlib.decompressobj(window_bits)
        self._sent = bytearray()
        self._taken = 0  # bytes of _sent given to zlib
        self._tail = b""  # of those, what zlib left unconsumed
        self._decoded = 0

    def add(self, piece: bytes) -> None:
        """Keep ``piece``, the next bytes of the body as sent.

        Raises:
            ContentCodingError: 413 past the limit.
        """
        if len(self._sent) + len(piece) > self._limit:
            raise self._too_large("sent")
        self._sent += piece

    @property
    def done(self) -> bool:
        """Whether every byte added has been decoded."""
        return not self._tail and self._taken == len(self._sent)

    def decode(self, max_output: int) -> bytes:
        """The next slice of the decoded body: at most ``max_output`` bytes (empty when zlib
        consumed input without output, e.g. a header).

        Raises:
            ContentCodingError: 413 past the limit, 400 for corrupt data or bytes after the end
                of the compressed stream.
        """
        if self._tail:
            data = self._tail
        else:
            data = bytes(self._sent[self._taken : self._taken + _INPUT_SLICE])
            self._taken += len(data)
        if self._decoder.eof:
            raise self._trailing()
        room = self._limit - self._decoded
        try:
            decoded = self._decoder.decompress(data, min(max_output, room + 1))
        except zlib.error as exc:
            raise ContentCodingError(
                400, f"malformed request body: its {self.name} data is corrupt ({exc})"
            ) from None
        self._tail = self._decoder.unconsumed_tail
        if len(decoded) > room:
            raise self._too_large("decoded")
        if self._decoder.unused_data:
            raise self._trailing()
        self._decoded += len(decoded)
        return decoded

    def finish(self) -> None:
        """Check that the body ended where its compressed stream does (an empty body is
        empty: no stream at all).

        Raises:
            ContentCodingError: 400 for a stream cut short.
        """
        if self._sent and not self._decoder.eof:
            raise ContentCodingError(
                400, f"malformed request body: its {self.name} data ends before its stream does"
            )

    def _too_large(self, how: str) -> ContentCodingError:
        return ContentCodingError(
            413, f"the request body is larger than the maximum of {self._limit} bytes {how}"
        )

    def _trailing(self) -> ContentCodingError:
        return ContentCodingError(
            400, f"malformed request body: bytes after the end of its {self.name} data"
        )
