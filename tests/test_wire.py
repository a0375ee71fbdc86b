"""The pool's framing: any message survives any split of its bytes, both ways, over a socket."""

from __future__ import annotations

import contextlib
import itertools
import pickle
import select
import socket
import threading
from collections.abc import Generator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_infer.model import Parameters
from trio_infer.workers import wire

# Sizes either side of the 16 KiB out-of-band threshold, and arrays that are not contiguous
# (those travel in the pickle).
_arrays = st.builds(
    lambda rows, columns, transposed, seed: _array(rows, columns, transposed, seed),
    st.sampled_from([0, 1, 3, 64, 1100]),
    st.sampled_from([1, 4, 16]),
    st.booleans(),
    st.integers(0, 2**16),
)
_messages = st.tuples(
    st.integers(0, 2**40),
    st.dictionaries(st.text(max_size=3), _arrays, max_size=4),
    st.lists(st.one_of(st.none(), st.text(max_size=5), st.binary(max_size=40)), max_size=3),
)


def _array(rows: int, columns: int, transposed: bool, seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
    return values[:, ::2] if transposed else values


def _read(frame: list[wire.Buffer], cuts: list[int]) -> object:
    """Feed a frame's bytes to the reader in pieces that end at ``cuts``."""
    data = b"".join(bytes(buffer) for buffer in frame)
    parse = wire.reader()
    view = next(parse)
    position = 0
    pieces = sorted({min(cut, len(data)) for cut in cuts} | {len(data)})
    for end in pieces:
        while position < end:
            taken = min(end - position, len(view))
            view[:taken] = data[position : position + taken]
            position += taken
            view = view[taken:]
            if not view:
                try:
                    view = parse.send(None)
                except StopIteration as done:
                    assert position == len(data)
                    return done.value
    raise AssertionError("the reader wanted more than the frame holds")


def _assert_same(got: object, sent: object) -> None:
    number, arrays, rest = sent  # type: ignore[misc]
    assert got[0] == number  # type: ignore[index]
    assert got[2] == rest  # type: ignore[index]
    assert got[1].keys() == arrays.keys()  # type: ignore[index]
    for name, array in arrays.items():
        np.testing.assert_array_equal(got[1][name], array)  # type: ignore[index]
        assert got[1][name].dtype == array.dtype  # type: ignore[index]


@settings(max_examples=200, deadline=None)
@given(message=_messages, cuts=st.lists(st.integers(0, 2**20), max_size=20))
def test_a_message_read_in_any_pieces_is_the_message_sent(
    message: tuple[object, ...], cuts: list[int]
) -> None:
    _assert_same(_read(wire.pack(message), cuts), message)


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


@pytest.mark.parametrize(
    "array",
    [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.arange(5, dtype=np.longlong),  # numpy's unpickling makes int64 of it: so does ours
        np.arange(5, dtype=np.ulonglong),
        np.array([True, False]),
        np.zeros((0, 256), np.float16),
        np.array(2.5),
        np.float32(3.0),  # a numpy scalar, not an array
        np.zeros(4, np.clongdouble),
        _readonly(np.ones((2, 2))),
        np.frombuffer(b"\0" * 16, np.dtype(np.float32).newbyteorder("<")).reshape(2, 2),
        np.ones(8192),  # out of band
        _readonly(np.ones(8192)),
        np.zeros((3, 4), ">f4"),  # not native: as numpy pickles it
        np.zeros((4, 3), np.float32).T,  # not C-order
        np.array([b"a", b"bc"], object),
        np.array(["ab", "c"]),
        np.zeros(3, "M8[s]"),
        np.zeros(3, [("a", "f4"), ("b", "i2")]),
        np.zeros(3, np.dtype(np.float32, metadata={"key": 1})),
        np.ma.masked_array([1, 2], mask=[False, True]),
    ],
    ids=repr,
)
def test_an_array_arrives_as_numpys_own_pickle_makes_it(array: np.ndarray) -> None:
    got = _read(wire.pack(array), [])
    expected = pickle.loads(pickle.dumps(array, protocol=5))
    assert type(got) is type(expected)
    assert isinstance(got, np.ndarray | np.generic)
    assert got.dtype == expected.dtype
    assert got.dtype.char == expected.dtype.char
    assert got.dtype.byteorder == expected.dtype.byteorder
    assert got.dtype.metadata == expected.dtype.metadata
    assert got.shape == expected.shape
    assert got.flags.writeable == expected.flags.writeable
    assert got.flags.c_contiguous == expected.flags.c_contiguous
    np.testing.assert_array_equal(got, expected)
    if isinstance(expected, np.ma.MaskedArray):
        np.testing.assert_array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(expected))


def test_large_contiguous_tensors_travel_out_of_band_and_small_ones_in_the_pickle() -> None:
    large = np.zeros(4096, np.float32)  # 16 KiB
    small = np.zeros(4095, np.float32)
    frame = wire.pack({"large": large, "small": small, "strided": np.zeros(8192)[::2]})
    assert len(frame) == 3  # header, pickle, and the one large buffer
    assert memoryview(frame[2]).nbytes == large.nbytes


@pytest.mark.parametrize(
    "parameters",
    [
        Parameters(),
        Parameters({"delay_ms": 5, "flag": True, "name": "x"}),
        Parameters({"a": 1.5}, {"INPUT0": {"binary_data_size": 16}}, {"X-User": "me"}),
    ],
    ids=repr,
)
def test_parameters_arrive_as_pickle_makes_them(parameters: Parameters) -> None:
    got = _read(wire.pack({"parameters": parameters}), [])["parameters"]  # type: ignore[index]
    expected = pickle.loads(pickle.dumps(parameters, protocol=5))
    assert type(got) is Parameters
    assert got == expected
    assert got.inputs == expected.inputs
    assert got.headers == expected.headers
    assert repr(got) == repr(expected)


class _Unpicklable:
    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("no pickle for this")


class _PacksWhilePacked:
    """Its own pickling packs another message: the kept pickler is busy then."""

    def __reduce__(self) -> tuple[object, ...]:
        inner = wire.pack({"inner": np.arange(3, dtype=np.float32)})
        return bytes, (b"".join(bytes(buffer) for buffer in inner),)


@settings(max_examples=50, deadline=None)
@given(message=_messages)
def test_the_kept_pickler_makes_the_frame_a_fresh_one_makes(message: tuple[object, ...]) -> None:
    # The kept pickler has pickled messages before, and one that failed halfway, holding this
    # one: nothing of them (memo, bytes, buffers) is in the next frame.
    wire.pack(message)
    with pytest.raises(TypeError, match="no pickle for this"):
        wire.pack(({"x": np.zeros(8192)}, message, _Unpicklable()))
    kept = wire.pack(message)
    fresh = wire._Packer().pack(message)
    assert [bytes(buffer) for buffer in kept] == [bytes(buffer) for buffer in fresh]
    _assert_same(_read(kept, []), message)


def test_a_message_packed_while_another_is_packed_is_whole() -> None:
    outer = _read(wire.pack(["outer", _PacksWhilePacked(), "outer"]), [])
    assert isinstance(outer, list)
    assert outer[0] == outer[2] == "outer"
    inner = _read([outer[1]], [])
    assert isinstance(inner, dict)
    np.testing.assert_array_equal(inner["inner"], np.arange(3, dtype=np.float32))


@pytest.mark.parametrize("buffers", [1, 600, 1100])
def test_send_some_goes_on_until_a_frame_with_many_buffers_is_sent(buffers: int) -> None:
    message = [np.full(4096, i, np.float32) for i in range(buffers)]
    frame = wire.pack(message)
    sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with sender, receiver:
        sender.setblocking(False)
        received = bytearray()
        left = frame
        while left:
            try:
                left = wire.send_some(sender, left)
            except BlockingIOError:
                received += receiver.recv(1 << 20)
        total = sum(memoryview(buffer).nbytes for buffer in frame)
        while len(received) < total:
            received += receiver.recv(1 << 20)
    got = _read([bytes(received)], [])
    assert isinstance(got, list)
    assert len(got) == buffers
    np.testing.assert_array_equal(got[-1], message[-1])


@settings(max_examples=30, deadline=None)
@given(st.lists(_messages, min_size=1, max_size=6))
def test_messages_sent_back_to_back_are_received_in_order_through_the_staging(
    messages: list[object],
) -> None:
    # Read ahead, the start of one message is staged with the end of the one before it; the
    # receiver must see each whole, and say one waits while any of it is staged.
    sender, receiving = socket.socketpair()
    with sender, receiving:
        receiving.settimeout(5)
        receiver = wire.Receiver(receiving)
        assert not receiver.waiting()
        frames = [wire.pack(message) for message in messages]
        # Sent from a thread: together they may be more than the socket holds.
        sending = threading.Thread(target=lambda: [wire.send(sender, f) for f in frames])
        sending.start()
        for message in messages:
            _assert_same(receiver.receive(), message)
        sending.join()
        assert not receiver.waiting()
        sender.close()
        assert receiver.waiting()  # the end of the connection: a read would not block
        with pytest.raises(EOFError):
            receiver.receive()


def test_a_message_read_ahead_with_the_one_before_it_is_waiting() -> None:
    # Both fit one read: once the first is taken, the socket is empty and the second is staged.
    sender, receiving = socket.socketpair()
    with sender, receiving:
        wire.send(sender, wire.pack("first") + wire.pack("second"))
        receiver = wire.Receiver(receiving)
        assert receiver.receive() == "first"
        assert not select.select([receiving], [], [], 0)[0]
        assert receiver.waiting()
        assert receiver.receive() == "second"
        assert not receiver.waiting()


def _no_reader() -> object:
    raise AssertionError("a message staged whole is not stepped through reader()")


def test_a_message_staged_whole_is_what_the_reader_makes_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    message = (7, {"x": np.arange(4, dtype=np.float32)}, ["a", None])
    frame = wire.pack(message)
    data = b"".join(bytes(buffer) for buffer in frame)
    sender, receiving = socket.socketpair()
    with sender, receiving:
        receiver = wire.Receiver(receiving)
        wire.send(sender, frame)
        with monkeypatch.context() as patch:
            patch.setattr(wire, "reader", _no_reader)
            _assert_same(receiver.receive(), message)
        # In two reads, it is the reader's from its first part on.
        wire.send(sender, [data[:20]])
        rest = threading.Timer(0.05, lambda: wire.send(sender, [data[20:]]))
        rest.start()
        _assert_same(receiver.receive(), message)
        rest.join()
        assert not receiver.waiting()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 2 * wire._STAGING_BYTES), min_size=1, max_size=5))
def test_after_a_fill_that_leaves_room_a_read_finds_nothing(pieces: list[int]) -> None:
    # The pool's receiver waits for the socket instead of reading after such a fill: the read
    # it skips would have failed. A fill that fills the buffer says nothing of what is left.
    sender, receiving = socket.socketpair()
    with sender, receiving:
        receiving.setblocking(False)
        for size in pieces:
            wire.send(sender, [bytes(size)])
            staging = wire.Staging()
            assert staging.fill(receiving)
            assert staging.drained == (size < wire._STAGING_BYTES)
            if staging.drained:
                with pytest.raises(BlockingIOError):
                    receiving.recv(1, socket.MSG_PEEK)
            else:
                left = size - wire._STAGING_BYTES
                while left:
                    left -= len(receiving.recv(left))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(_messages, min_size=1, max_size=4),
    st.lists(st.integers(1, 70_000), min_size=1, max_size=30),
)
def test_a_non_blocking_reader_loses_no_byte_whatever_arrives_when(
    messages: list[object], pieces: list[int]
) -> None:
    # As the pool reads: read until the socket would block, then more arrives. A message's
    # start is one read into the staging buffer, then it is taken whole, or read on from what
    # that read holds of it (its buffers, or all of it). Bytes staged with the end of one part
    # must land in the next part, never be read over.
    sender, receiving = socket.socketpair()
    with sender, receiving:
        receiving.setblocking(False)
        data = b"".join(bytes(b) for message in messages for b in wire.pack(message))
        sizes = itertools.cycle(pieces)
        staging = wire.Staging()
        got: list[object] = []
        position = 0

        def send_more() -> None:
            nonlocal position
            assert position < len(data), "the reader wants more bytes than were sent"
            size = next(sizes)
            wire.send(sender, [data[position : position + size]])
            position += size

        parse: Generator[memoryview, None, object] | None = None
        view: memoryview | None = None
        while len(got) < len(messages):
            if parse is None:
                if not staging.held:
                    try:
                        assert staging.fill(receiving), "the sender is still open"
                    except BlockingIOError:
                        send_more()
                        continue
                whole, message = staging.take_message()
                if whole:
                    got.append(message)
                    continue
                parse = staging.take_start()
                view = next(parse)
            if view:
                try:
                    view = staging.read(receiving, view)
                except BlockingIOError:
                    send_more()
                    continue
                assert view is not None, "the sender is still open"
                if view:
                    continue
            try:
                view = parse.send(None)
            except StopIteration as done:
                got.append(done.value)
                parse = None
        assert position >= len(data)
        for received, sent in zip(got, messages, strict=True):
            _assert_same(received, sent)


def test_a_message_names_no_module_to_import(monkeypatch: pytest.MonkeyPatch) -> None:
    # The rebuild functions are in the pickler's memo from the start: pickling a function by
    # name would import its module at every message.
    message = (3, "predict", (b"settings", {"x": np.ones((1, 4), np.float32)}, Parameters()))
    imported: list[str] = []
    real_import = __import__

    def counting_import(name: str, *args: object, **kwargs: object) -> object:
        imported.append(name)
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("builtins.__import__", counting_import)
    frame = wire.pack(message)
    monkeypatch.undo()
    assert imported == []
    got = _read(frame, [])
    assert isinstance(got, tuple)
    assert got[2][0] == b"settings"
    np.testing.assert_array_equal(got[2][1]["x"], message[2][1]["x"])
    assert type(got[2][2]) is Parameters


def test_an_object_held_twice_arrives_twice_and_one_that_holds_itself_does_not_pickle() -> None:
    array = np.arange(4, dtype=np.float32)
    got = _read(wire.pack({"a": array, "b": array}), [])
    assert isinstance(got, dict)
    for value in got.values():
        np.testing.assert_array_equal(value, array)
    looped: list[object] = []
    looped.append(looped)
    with pytest.raises(ValueError, match="cyclic"):
        wire.pack(["x", looped])
    assert _read(wire.pack(("after", array)), [])[0] == "after"  # type: ignore[index]


def test_a_connection_closed_with_bytes_unread_is_waiting_and_ends_the_receiver() -> None:
    # The peer closed with bytes of ours unread: the receiver's read fails at once (as the
    # worker's serve expects), so waiting says a receive would not block.
    sender, receiving = socket.socketpair()
    with receiving:
        receiver = wire.Receiver(receiving)
        receiving.sendall(b"never read")
        assert not receiver.waiting()
        sender.close()
        assert receiver.waiting()
        with pytest.raises((EOFError, ConnectionResetError)):
            receiver.receive()


@pytest.mark.parametrize("char", "?bBhHiIlLqQefdgFDG")
@pytest.mark.parametrize("elements", [0, 3, 20_000])  # in the pickle, and out of band
@pytest.mark.parametrize("writeable", [True, False])
def test_every_plain_dtype_arrives_as_numpys_own_pickle_makes_it(
    char: str, elements: int, writeable: bool
) -> None:
    array = np.arange(elements).astype(char).reshape(-1, 1)
    array.flags.writeable = writeable
    got = _read(wire.pack([array]), [])[0]  # type: ignore[index]
    expected = pickle.loads(pickle.dumps(array, protocol=5))
    assert type(got) is np.ndarray
    assert got.dtype == expected.dtype
    assert got.dtype.char == expected.dtype.char
    assert got.shape == expected.shape
    assert got.flags.writeable == expected.flags.writeable
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, expected)


def test_a_pickle_of_many_frames_is_whole_and_the_next_message_starts_clean() -> None:
    # Past 64 KiB the pickler writes its output in several pieces, all of them in the frame.
    elements = np.array([bytes([i % 251]) * 1000 for i in range(700)], dtype=object)
    strided = np.arange(40_000, dtype=np.float64)[::2]  # in the pickle: not contiguous
    message = {"bytes": elements, "strided": strided, "small": np.ones(3, np.int8)}
    got = _read(wire.pack(message), [])
    assert isinstance(got, dict)
    assert got["bytes"].dtype == object
    assert list(got["bytes"]) == list(elements)
    np.testing.assert_array_equal(got["strided"], strided)
    np.testing.assert_array_equal(got["small"], message["small"])
    after = ("after", np.arange(3, dtype=np.float32))
    kept = wire.pack(after)
    assert [bytes(b) for b in kept] == [bytes(b) for b in wire._Packer().pack(after)]


def test_messages_packed_by_threads_at_once_are_each_whole() -> None:
    def packs(seed: int, out: list[object]) -> None:
        for i in range(200):
            array = np.full((i % 7, 3), seed, np.float32)
            out.append((_read(wire.pack((seed, i, array)), []), array))

    results: list[list[object]] = [[] for _ in range(4)]
    threads = [threading.Thread(target=packs, args=(seed, results[seed])) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for seed, out in enumerate(results):
        assert len(out) == 200
        for i, (got, array) in enumerate(out):  # type: ignore[misc]
            assert got[:2] == (seed, i)
            np.testing.assert_array_equal(got[2], array)


@pytest.mark.parametrize(
    "message",
    [
        "small",
        {"x": np.ones((300, 40), np.float64), "y": np.ones((2, 2), np.int16)},
        [np.zeros((64, 256), np.complex64), np.zeros((3, 8192), ">f4")],
        np.array([b"a" * 70_000, b"b"], object),
    ],
    ids=["small", "out-of-band", "numpy's-reduce", "in-band-large"],
)
def test_each_part_of_a_frame_has_its_size_as_its_len(message: object) -> None:
    # send_some counts a frame sent whole by the len of its parts.
    frame = wire.pack(message)
    for part in frame:
        assert len(part) == memoryview(part).nbytes  # type: ignore[arg-type]
    sender, receiver = socket.socketpair()
    with sender, receiver:
        sender.setblocking(False)
        received = bytearray()
        left: list[wire.Buffer] = frame
        while left:
            with contextlib.suppress(BlockingIOError):
                left = wire.send_some(sender, left)
            for part in left:
                assert len(part) == memoryview(part).nbytes  # type: ignore[arg-type]
            received += receiver.recv(1 << 16)
        total = sum(memoryview(part).nbytes for part in frame)
        while len(received) < total:
            received += receiver.recv(1 << 16)
    assert bytes(received) == b"".join(bytes(part) for part in frame)
