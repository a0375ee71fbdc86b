"""Text a client sent, as an error message or a response header may repeat it: bounded, and
printable where a header must be. Shared by the gRPC and HTTP sides of the transport and by the
front-ends above them."""

from __future__ import annotations

from trio_infer.errors import shown

__all__ = ["header_text", "shown"]


def header_text(value: str, limit: int = 1024) -> str:
    """``value`` as a header value may carry it (gRPC text metadata, HTTP/1.1): printable
    ASCII, every other character as ``?``, cut to ``limit`` characters."""
    cut = shown(value, limit)
    if cut.isascii() and cut.isprintable():
        return cut
    return "".join(c if c.isascii() and c.isprintable() else "?" for c in cut)
