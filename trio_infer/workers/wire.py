"""How messages cross the socket between the pool and a worker process.

A message is a pickle (protocol 5) whose large buffers, such as numpy arrays' data, travel out of
band: the sender gives the kernel the arrays' own memory (one ``sendmsg`` of several buffers) and
the receiver reads each buffer into memory of its own, which the unpickled array then uses. A
tensor is copied by the kernel once each way and never by Python.

A frame is a header (``!IQ``: buffer count, pickle length), the buffers' lengths (``!Q`` each),
the pickle, then the buffers. This module is I/O-free apart from the blocking helpers the worker
uses; the pool drives :func:`reader` with Trio. It must stay importable without Trio.

Messages, pool to worker: a tuple ``(call_id, name, args)`` runs the worker's job of that name
(``trio_infer.workers.child.JOBS``) with ``args``; a
list of call ids cancels those calls that have not started, and stops a generating call between
two of its items; a dict ``{call_id: n}`` gives a generating call ``n`` more credits. Worker to
pool: ``(done, skipped, item)``. After each call (and when it skipped cancelled calls), ``done``
is ``None`` or ``(call_id, ok, value, seconds)`` (``value`` is the result, or the error when not
``ok``) and ``skipped`` lists the ids of cancelled calls that will not run (or, for a generating
call, that stopped when told); ``item`` is ``None``. A generating call (a decoupled model's)
sends each item as soon as its generator yields it, as ``(None, [], (call_id, outputs))``, then
its ``done`` with the value ``None``. It starts with ``ITEMS_AHEAD`` credits and spends one per
item; with none left its generator does not step again until the pool gives one (when the
request has taken an item), so a reader that falls behind stalls the generator, and no more
than ``ITEMS_AHEAD`` items of a call are ever on their way or waiting to be read.
"""

from __future__ import annotations

import copyreg
import os
import pickle
import select
import socket
import struct
import sys
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from trio_infer.buffers import MAX_BUFFERS, Buffer, unsent, write_some
from trio_infer.errors import TooLarge
from trio_infer.model import Parameters, ParameterValue

__all__ = ["ITEMS_AHEAD", "Buffer", "Receiver", "Staging", "pack", "reader", "send", "send_some"]

_HEADER = struct.Struct("!IQ")
#: Items a generating call may have sent that the request has not taken yet (its credits).
ITEMS_AHEAD = 4
#: Buffers smaller than this stay in the pickle: a buffer of its own costs the receiver a
#: read call, more than copying a few KiB. Parts at least this large are read straight into
#: their own memory, smaller ones through a Staging buffer of _STAGING_BYTES: room for a
#: message whose tensors all travel in its pickle, and little of a large buffer behind it
#: (what the staging read takes of that is copied once more).
_OUT_OF_BAND_BYTES = 16 * 1024
_STAGING_BYTES = _OUT_OF_BAND_BYTES + 4 * 1024


def _array(data: Buffer, char: str, shape: tuple[int, ...]) -> np.ndarray:
    """An array that :func:`_reduce_array` pickled: a view of ``data`` (a PickleBuffer's,
    writable when the sender's array was), as numpy's own unpickling makes it."""
    # One constructor of a dtype made once: a third of frombuffer(data, char).reshape(shape),
    # which parses the character and makes a second array.
    return np.ndarray(shape, _DTYPES[char], data)


def _reduce_array(array: np.ndarray) -> str | tuple[Any, ...]:
    """How a message pickles a numpy array: a C-order array of a plain numeric dtype as its
    data (a PickleBuffer, in or out of band as with numpy's own reduce), the dtype's character
    and the shape; any other array as numpy pickles it. numpy pickles the dtype as an object (a
    class, arguments and a state tuple, rebuilt on the other side): for a small call's arrays,
    that cost more than the data."""
    dtype = array.dtype
    # A plain numeric or bool dtype in native byte order without metadata: a character names
    # it, the one numpy's own unpickling gives it (which makes int64 of longlong, say).
    char = _PLAIN_DTYPES.get(type(dtype))
    if char is not None and dtype.isnative and dtype.metadata is None and array.flags.c_contiguous:
        # ndarray exports a buffer; numpy's stubs do not declare it.
        data = pickle.PickleBuffer(array)  # type: ignore[arg-type]
        return _array, (data, char, array.shape)
    return array.__reduce_ex__(5)


#: numpy's bool and numeric dtype classes (numpy 1.25 gave each dtype its class), each with
#: the character of the dtype numpy's unpickling makes of it (from its kind and size).
_PLAIN_DTYPES: dict[type[np.dtype[Any]], str] = {
    type(np.dtype(char)): np.dtype(np.dtype(char).str).char for char in "?bBhHiIlLqQefdgFDG"
}
#: The dtype of each character of :data:`_PLAIN_DTYPES`.
_DTYPES: dict[str, np.dtype[Any]] = {char: np.dtype(char) for char in _PLAIN_DTYPES.values()}


def _parameters(
    values: dict[str, ParameterValue],
    inputs: dict[str, dict[str, ParameterValue]],
    headers: dict[str, str],
) -> Parameters:
    """Parameters that :func:`_reduce_parameters` pickled, made of the unpickled mappings (this
    message's own copies) as pickle's default would make them: its fields set, no copies."""
    parameters: Parameters = object.__new__(Parameters)
    fields = parameters.__dict__
    fields["_values"], fields["inputs"], fields["headers"] = values, inputs, headers
    return parameters


def _reduce_parameters(parameters: Parameters) -> tuple[Any, ...]:
    """How a message pickles a request's parameters: their three mappings, which pickle as
    plain dicts. The default (the class, a new object, then its state set key by key) cost a
    call's message more than its tensor."""
    fields = parameters.__dict__
    return _parameters, (fields["_values"], fields["inputs"], fields["headers"])


#: The codes :func:`_array` and :func:`_parameters` travel as (extension codes of
#: :mod:`copyreg`, in the range it leaves to private use): unpickling a code takes one look-up
#: in a cache, where a name is imported again at every message. Only this module's messages
#: hold these functions, so no other pickle changes.
copyreg.add_extension(__name__, _array.__name__, 0xF1)
copyreg.add_extension(__name__, _parameters.__name__, 0xF2)

#: What every message's pickle starts with: the two functions by their codes, each memoized
#: (as 0 and 1) and taken off the stack again. The pickler's memo holds them at those indexes
#: from the start, so a message refers to them as ``BINGET 0`` and ``BINGET 1``: pickling a
#: function otherwise imports its module (to check that the name finds it) before it looks up
#: its code, at every message. A second ``PROTO`` follows, the pickler's own.
_PREFIX = b"\x80\x05\x82\xf1\x94\x82\xf2\x9400"
_MEMO = {id(_array): (0, _array), id(_parameters): (1, _parameters)}


class _Pickler(pickle.Pickler):
    # Exact types only: a subclass of ndarray pickles as numpy (or it) says.
    dispatch_table = copyreg.dispatch_table | {
        np.ndarray: _reduce_array,
        Parameters: _reduce_parameters,
    }


class _Chunks:
    """Where a pickler writes: the bytes objects it makes, kept as they are (one for a
    message smaller than a pickle frame, 64 KiB), not copied into a file and out again."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.write = self.chunks.append


class _Packer:
    """A pickler and its output kept from message to message: making a pickler, its memo and
    its output buffer cost more than pickling a small message."""

    def __init__(self) -> None:
        self._out = _Chunks()
        self._buffers: list[memoryview] = []
        self._pickler = _Pickler(self._out, protocol=5, buffer_callback=self._out_of_band)
        self._pickler.memo = _MEMO
        # No memo of the message's own objects (it is only ever _MEMO): no memo entry to make
        # and clear per object, nor a MEMOIZE for the receiver to do. An object that the
        # message holds twice is pickled twice; a message that holds itself fails to pickle
        # (ValueError), as it must not be sent.
        self._pickler.fast = True

    def _out_of_band(self, buffer: pickle.PickleBuffer) -> bool:
        view = buffer.raw()
        if view.nbytes < _OUT_OF_BAND_BYTES:
            return True  # serialise in band
        self._buffers.append(view)
        return False

    def pack(self, message: object) -> list[Buffer]:
        buffers = self._buffers = []
        chunks = self._out.chunks
        try:
            self._pickler.dump(message)
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        finally:
            # Nothing of this message is kept (the memo holds none of its objects): not its
            # bytes, whether it pickled or not.
            chunks.clear()
            self._buffers = []
        # The pickle is _PREFIX then data: the prefix goes with the header.
        size = len(_PREFIX) + len(data)
        if not buffers:
            return [_HEADER.pack(0, size) + _PREFIX, data]
        lengths = struct.pack(f"!{len(buffers)}Q", *(view.nbytes for view in buffers))
        return [_HEADER.pack(len(buffers), size) + lengths + _PREFIX, data, *buffers]


#: Packers free to use: one is kept, taken while it packs. A second thread, or a message
#: pickled while another is (an object's __reduce__ calling pack), finds none and packs with
#: a packer of its own, which is not kept. list.pop and list.append are atomic.
_packers = [_Packer()]


def pack(message: object) -> list[Buffer]:
    """The frame of a message, as buffers to send in order.

    Raises:
        Exception: Whatever pickling the message raises (an object that does not pickle).
    """
    try:
        packer = _packers.pop()
    except IndexError:
        return _Packer().pack(message)
    try:
        return packer.pack(message)
    finally:
        _packers.append(packer)


def send_some(sock: socket.socket, frame: Sequence[Buffer]) -> list[Buffer]:
    """Send what one vectored write takes of a frame; return the rest (empty when all is sent).

    Raises:
        BlockingIOError: The socket is non-blocking and its buffer is full.
        OSError: The connection is broken.
    """
    if len(frame) > MAX_BUFFERS:
        return write_some(sock.fileno(), frame)
    sent = os.writev(sock.fileno(), frame)
    # Every part of a frame (pack's, or what unsent leaves of one) is bytes or a 1-D view of
    # bytes, whose len is its size: a frame sent whole is known without a view of each part.
    if sent == sum(map(len, frame)):
        return []
    return unsent(frame, sent)


def reader(limit: int = sys.maxsize) -> Generator[memoryview, None, object]:
    """Read one message: yields buffers for the caller to fill completely, returns the message.

    Args:
        limit: The most bytes the message may take; its header is checked against it before
            anything the header sizes is allocated.

    Raises:
        TooLarge: The message takes more than ``limit`` bytes (its header says so).
        Exception: Whatever unpickling the message raises (a class this process cannot import).
    """
    header = bytearray(_HEADER.size)
    yield memoryview(header)
    count, size = _HEADER.unpack(header)
    # Each out-of-band buffer takes _OUT_OF_BAND_BYTES at least (_Packer._out_of_band).
    _check_size(size + count * (8 + _OUT_OF_BAND_BYTES), limit)
    lengths = bytearray(8 * count)
    if count:
        yield memoryview(lengths)
    data = bytearray(size)
    yield memoryview(data)
    return (yield from _buffers(data, struct.unpack(f"!{count}Q", lengths), limit))


def _check_size(size: int, limit: int) -> None:
    """Refuse a message of ``size`` bytes past ``limit``: bytes that are not a frame (a model
    that wrote to its worker's socket) must not size what the reader allocates."""
    if size > limit:
        raise TooLarge(f"{size} bytes, more than the {limit} allowed")


def _buffers(
    data: Buffer, lengths: tuple[int, ...], limit: int
) -> Generator[memoryview, None, object]:
    """The rest of a message whose pickle is ``data``: its out-of-band buffers, of
    ``lengths``, to fill in turn; returns the message.

    Raises:
        TooLarge: The pickle and the buffers take more than ``limit`` bytes together.
    """
    _check_size(len(data) + sum(lengths), limit)
    # Memory that is not zero-filled first (as bytearray(n) is): every byte of it is read
    # into before the message is unpickled. Each buffer is a view of an array of its own,
    # which the unpickled array then views (writable, or read-only as the sender's was), so
    # it is freed with that array.
    buffers = [np.empty(n, np.uint8).data for n in lengths]
    yield from buffers
    return pickle.loads(data, buffers=buffers)


def send(sock: socket.socket, frame: list[Buffer]) -> None:
    """Send a packed message on a blocking socket."""
    while frame:
        frame = send_some(sock, frame)


class Staging:
    """Bytes read ahead of what :func:`reader` asks for, so that a small message (a header and
    a pickle) takes one read, not one per part; a large buffer is read into its own memory.
    Each end of a connection has one, kept from message to message: what it holds past one
    message is the start of the next."""

    def __init__(self) -> None:
        self._buffer = bytearray(_STAGING_BYTES)
        # Never resized, so a view of it may live as long as it: a message is unpickled from
        # a slice of this view, not from a view made (and released) for each.
        self._view = memoryview(self._buffer)
        self._start = self._end = 0

    @property
    def held(self) -> bool:
        """Whether bytes are staged (a message has started, or more than one arrived)."""
        return self._start < self._end

    def fill(self, sock: socket.socket) -> bool:
        """Read from ``sock`` into the staging buffer, which holds nothing; whether any bytes
        came (none: the end of the connection).

        Raises:
            OSError: The connection is broken.
        """
        assert self._start >= self._end, "staged bytes would be read over"
        self._start, self._end = 0, sock.recv_into(self._buffer)
        return self.held

    @property
    def drained(self) -> bool:
        """Whether the last :meth:`fill` left room in the buffer: the socket held no more
        bytes then (a stream socket's read takes all it has, up to the room given)."""
        return self._end < _STAGING_BYTES

    def take_message(self) -> tuple[bool, object]:
        """The next message, when the staged bytes hold all of it and it has no out-of-band
        buffers: ``(True, message)``, unpickled as :func:`reader` would, without stepping
        through its parts; what is staged then starts after it. Otherwise ``(False, None)``,
        and nothing is taken.

        Raises:
            Exception: Whatever unpickling the message raises (it is taken all the same).
        """
        start = self._start
        if self._end - start < _HEADER.size:
            return False, None
        count, size = _HEADER.unpack_from(self._buffer, start)
        end = start + _HEADER.size + size
        if count or end > self._end:
            return False, None
        self._start = end
        return True, pickle.loads(self._view[start + _HEADER.size : end])

    def take_start(self, limit: int = sys.maxsize) -> Generator[memoryview, None, object]:
        """A reader of the next message (as :func:`reader`, with its ``limit``), which
        :meth:`take_message` did not take. When the staged bytes hold its header, buffer
        lengths and pickle, these are taken (the pickle copied: the staging buffer is read over
        before the message ends) and the reader starts at its first buffer; otherwise nothing
        is taken."""
        start = self._start
        if self._end - start >= _HEADER.size:
            count, size = _HEADER.unpack_from(self._buffer, start)
            lengths_end = start + _HEADER.size + 8 * count
            end = lengths_end + size
            if end <= self._end:
                self._start = end
                lengths = struct.unpack_from(f"!{count}Q", self._buffer, start + _HEADER.size)
                return _buffers(self._buffer[lengths_end:end], lengths, limit)
        return reader(limit)

    def _fill(self, view: memoryview) -> memoryview:
        """Copy what is staged into ``view``; return the part of it still to fill."""
        count = min(self._end - self._start, view.nbytes)
        if count:
            view[:count] = self._view[self._start : self._start + count]
            self._start += count
        return view[count:]

    def read(self, sock: socket.socket, view: memoryview) -> memoryview | None:
        """Put the next bytes into ``view`` (not empty): what is staged, else one read from
        ``sock`` (into ``view`` itself when it is large, else into the staging buffer, then
        copied). Returns the part of ``view`` still to fill (empty when full), or None at the
        end of the connection; some bytes went in either way.

        Raises:
            BlockingIOError: The socket is non-blocking and has nothing to read; ``view`` is
                unchanged then.
            OSError: The connection is broken.
        """
        if self.held:
            return self._fill(view)
        if view.nbytes >= _OUT_OF_BAND_BYTES:
            received = sock.recv_into(view)
            return view[received:] if received else None
        received = sock.recv_into(self._buffer)
        if not received:
            return None
        self._start, self._end = 0, received
        return self._fill(view)


class Receiver:
    """The receiving end of a blocking socket (the worker's): messages, and whether one waits."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._staging = Staging()
        # A poll object registered once: asking it costs a third of a select of a list.
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def receive(self) -> object:
        """Receive a message, waiting for it.

        Raises:
            EOFError: The peer closed the connection.
        """
        staging = self._staging
        # Staging.held, without a property's call: a worker asks two or three times a call.
        if staging._start >= staging._end and not staging.fill(self._sock):
            raise EOFError
        whole, message = staging.take_message()
        if whole:
            return message
        parse = staging.take_start()
        view: memoryview | None = next(parse)
        while True:
            while view:
                view = staging.read(self._sock, view)
                if view is None:
                    raise EOFError
            try:
                view = parse.send(None)
            except StopIteration as done:
                return done.value

    @property
    def held(self) -> bool:
        """Whether bytes of a message that :meth:`receive` has not returned were read already
        (a message came with the last one): known without a system call."""
        staging = self._staging
        return staging._start < staging._end

    def waiting(self) -> bool:
        """Whether :meth:`receive` would not block (a message, or the end of the connection)."""
        # The end of the connection or an error is an event too (POLLHUP, POLLERR), as it
        # makes the socket readable for select.
        staging = self._staging
        return staging._start < staging._end or bool(self._poll.poll(0))
