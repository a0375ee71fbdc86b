"""HPACK coding that does the work once for header blocks that repeat.

A gRPC client sends the same request headers on every call of a method, and once their entries
are in the connection's HPACK dynamic table, the same bytes; the server answers every call
with the same response headers and, when the call succeeds, the same trailers. hpack decodes
and encodes each block field by field in Python (a linear search of the static table per
field), which was a large share of the server's per-call protocol time.

A block's meaning depends only on its bytes and on the dynamic table, so a remembered result
is reused only while the table is unchanged since the block was coded, and only for a block
whose coding did not change the table itself. Any other block is coded in full, as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import hpack
from hpack.hpack import encode_integer
from hpack.struct import HeaderTuple
from hpack.table import HeaderTable

__all__ = [
    "MAX_REMEMBERED_BYTES",
    "CachingDecoder",
    "CachingEncoder",
    "decoded_size",
    "never_indexed",
    "never_indexed_name",
    "owed_size_updates",
]

#: Distinct blocks remembered per connection; a client sending a different deadline on every
#: call makes every request block distinct, and those must not grow the cache without bound.
_MAX_BLOCKS = 64
#: Blocks larger than this, coded or decoded, are not remembered, so a connection's caches hold
#: at most about a MiB (gRPC request blocks are a few hundred bytes; the limit on a list is
#: 16 KiB, and Huffman coding can make a block's bytes longer than its fields).
MAX_REMEMBERED_BYTES = 4096


def decoded_size(fields: Iterable[Any]) -> int:
    """A header block's size decoded: what remembering it holds (one byte of HPACK can stand
    for a whole field of the dynamic table)."""
    return sum(len(field[0]) + len(field[1]) for field in fields)


def never_indexed(name: str, value: str) -> bytes:
    """One header field coded as a literal never indexed, with a literal name (RFC 7541
    6.2.3), neither Huffman-coded: to append to a remembered block a field that differs call to
    call (a request id) without coding the block again. It leaves both dynamic tables as they
    are, and says that no intermediary may index it either."""
    return never_indexed_name(name) + _literal(value.encode("ascii"))


def never_indexed_name(name: str) -> bytes:
    """What :func:`never_indexed` codes a field with ``name`` as, up to its value's literal: to
    code it once, and a value after it as a string literal (a byte of length, below 127, then
    the value's bytes)."""
    return b"\x10" + _literal(name.encode("ascii"))


def owed_size_updates(owed: list[int], size: int) -> list[int]:
    """The dynamic table size updates to start the next block with, once the size is set to
    ``size`` after the updates already ``owed``: the smallest size since the last block, then
    the final one, or the final one alone when it is the smallest (RFC 7541 §4.2). A decoder
    refuses an update to more than the size its side last set."""
    smallest = min(owed, default=size)
    return [size] if size <= smallest else [smallest, size]


def _literal(raw: bytes) -> bytes:
    # A string literal: its length on a 7-bit prefix (H = 0), then its bytes.
    if len(raw) < 0x7F:
        return bytes((len(raw),)) + raw
    return bytes(encode_integer(len(raw), 7)) + raw


class _VersionedTable(HeaderTable):  # type: ignore[misc]
    """A dynamic table that counts its changes, so a coder can tell it is unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.version += 1
        super().add(name, value)

    @property
    def maxsize(self) -> int:
        return int(self._maxsize)

    @maxsize.setter
    def maxsize(self, newmax: int) -> None:
        self.version += 1
        HeaderTable.maxsize.fset(self, newmax)


class _Memo:
    """Results keyed by block, each valid at one table version."""

    def __init__(self, table: _VersionedTable) -> None:
        self._table = table
        self._results: dict[Any, tuple[int, Any]] = {}

    def get(self, key: Any) -> Any:
        hit = self._results.get(key)
        if hit is not None and hit[0] == self._table.version:
            return hit[1]
        return None

    def put(self, key: Any, version_before: int, result: Any, size: int) -> None:
        if self._table.version != version_before:
            return  # coding this block changed the table: its result cannot be replayed
        if size > MAX_REMEMBERED_BYTES:
            return
        if len(self._results) >= _MAX_BLOCKS:
            self._results.clear()
        self._results[key] = (version_before, result)


class CachingDecoder(hpack.Decoder):  # type: ignore[misc]
    """An HPACK decoder that remembers the blocks which leave the dynamic table unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.header_table = _VersionedTable()
        self._memo = _Memo(self.header_table)

    def decode(self, data: bytes, raw: bool = False) -> list[Any]:
        # The limits a block was checked against are part of its key: a lowered limit must
        # see the block checked again.
        key = (bytes(data), raw, self.max_header_list_size, self.max_allowed_table_size)
        headers = self._memo.get(key)
        if headers is None:
            version = self.header_table.version
            headers = super().decode(data, raw)
            self._memo.put(key, version, headers, max(len(data), decoded_size(headers)))
        # h2 keeps what it is given; a copy keeps the remembered block safe from it.
        return list(headers)


class CachingEncoder(hpack.Encoder):  # type: ignore[misc]
    """An HPACK encoder that remembers the blocks which leave the dynamic table unchanged.

    Literals are not Huffman-coded unless asked: hpack's Huffman coder, in pure Python, costs
    more time than the few bytes it saves are worth, and a literal that repeats is sent indexed
    after its first time anyway.
    """

    #: The table size updates owed to the client, to start the next block with.
    table_size_changes: list[int]

    def __init__(self) -> None:
        super().__init__()
        self.header_table = _VersionedTable()
        self._memo = _Memo(self.header_table)
        #: Remembered blocks of field tuples coded as the caller's own tuple object (the same
        #: one every time, as a server's constant response headers and trailers are), by the
        #: object's id: the tuple itself, its table version and its block. The entry holds the
        #: tuple, so no other object can have its id while the entry is there.
        self._same: dict[int, tuple[tuple[Any, ...], int, bytes]] = {}

    @property
    def header_table_size(self) -> int:
        """The dynamic table's size, as the client's SETTINGS_HEADER_TABLE_SIZE last set it."""
        return self.header_table.maxsize

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        # hpack marks an update owed only when the size changes (and so forgets one still owed
        # when the size is set again to what it now is), and owes every size it was set to.
        table = self.header_table
        owed = table.resized
        table.maxsize = value
        if table.resized or owed:
            table.resized = True
            self.table_size_changes = owed_size_updates(self.table_size_changes, value)

    def encode(self, headers: Iterable[Any], huffman: bool = False) -> bytes:
        table = self.header_table
        if not huffman and not table.resized:
            # The same tuple as a block remembered at this table version: the same block, found
            # without hashing the fields or looking at them one by one.
            same = self._same.get(id(headers))
            if same is not None and same[0] is headers and same[1] == table.version:
                return same[2]
        fields = tuple(headers)
        # A block after a resize starts with the size update, which must be sent once. A
        # field's class says whether it may be indexed, and tuples that compare equal may
        # differ in it. Neither kind of block is remembered. (A loop rather than any() over a
        # generator: this runs for every response's headers and trailers.)
        remembered = not self.header_table.resized
        if remembered:
            for field in fields:
                if isinstance(field, HeaderTuple):
                    remembered = False
                    break
        if not remembered:
            return bytes(super().encode(fields, huffman))
        key = (fields, huffman)
        block: bytes | None = self._memo.get(key)
        if block is None:
            version = self.header_table.version
            block = super().encode(fields, huffman)
            self._memo.put(key, version, block, max(len(block), decoded_size(fields)))
            if self._memo.get(key) is None:  # not remembered (it changed the table, or is large)
                return block
        if fields is headers and not huffman:  # the caller's own tuple, remembered
            if len(self._same) >= _MAX_BLOCKS:
                self._same.clear()
            self._same[id(fields)] = (fields, table.version, block)
        return block
