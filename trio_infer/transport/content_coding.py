"""Request bodies in a content coding (RFC 9110 8.4.1): gzip and deflate, decoded piece by
piece as they arrive, within a bound on what they decode to.

A few kilobytes of gzip can stand for gigabytes, so the decoded size is bounded as it is made
(``zlib``'s ``max_length``), never after; and the compressed bytes are bounded too, since
deflate's empty blocks decode to nothing however many arrive. ``deflate`` is the zlib format
(RFC 1950), as HTTP defines it and as tritonclient sends it; ``gzip`` one gzip member.
"""

from __future__ import annotations

import zlib

__all__ = ["BodyDecoder", "ContentCodingError", "body_decoder"]

#: Codings by name (RFC 9110 8.4.1; ``x-gzip`` is gzip's old name), as zlib's window bits.
_WINDOW_BITS = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": zlib.MAX_WBITS,
}


class ContentCodingError(Exception):
    """A body that cannot be decoded: its HTTP status (400, 413, 415) and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message


def body_decoder(content_encoding: str | None, limit: int) -> BodyDecoder | None:
    """The decoder for a body sent with ``content_encoding`` (a header's value), or None when
    it is sent as it is (no header, ``identity``).

    Args:
        content_encoding: The ``Content-Encoding`` header's value, if any.
        limit: The most bytes the body may take, compressed and decoded alike.

    Raises:
        ContentCodingError: 415 for a coding not decoded here (brotli, zstd, several codings).
    """
    if content_encoding is None:
        return None
    name = content_encoding.strip().lower()
    if name in ("", "identity"):
        return None
    bits = _WINDOW_BITS.get(name)
    if bits is None:
        shown = content_encoding if len(content_encoding) <= 64 else content_encoding[:64] + "..."
        raise ContentCodingError(
            415,
            f"the request body's Content-Encoding {shown!r} is not supported: send it as gzip, "
            f"deflate or uncompressed",
        )
    return BodyDecoder(name, bits, limit)


class BodyDecoder:
    """Decodes one body's pieces in order, within ``limit`` bytes in and out."""

    def __init__(self, name: str, window_bits: int, limit: int) -> None:
        self.name = name
        """The coding, lower-case."""
        self._limit = limit
        self._decoder = zlib.decompressobj(window_bits)
        self._received = 0
        self._decoded = 0

    def feed(self, piece: bytes) -> bytes:
        """What ``piece`` (the next bytes of the body as sent) decodes to.

        Raises:
            ContentCodingError: 413 past the limit (sent or decoded), 400 for corrupt data or
                bytes after the end of the compressed stream.
        """
        self._received += len(piece)
        if self._received > self._limit:
            raise self._too_large("sent")
        if self._decoder.eof:
            if piece:
                raise self._trailing()
            return b""
        room = self._limit - self._decoded
        try:
            decoded = self._decoder.decompress(piece, room + 1)
        except zlib.error as exc:
            raise ContentCodingError(
                400, f"malformed request body: its {self.name} data is corrupt ({exc})"
            ) from None
        if len(decoded) > room or self._decoder.unconsumed_tail:
            raise self._too_large("decoded")
        if self._decoder.unused_data:
            raise self._trailing()
        self._decoded += len(decoded)
        return decoded

    def finish(self) -> None:
        """Check that the body ended where its compressed stream does.

        Raises:
            ContentCodingError: 400 for a stream cut short.
        """
        if not self._decoder.eof:
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
