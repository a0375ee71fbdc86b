"""Code that runs inside a worker process: the per-process model cache, load and predict.

trio-parallel starts each worker process with ``configure`` and runs ``serve`` in it, as one job
for the process's whole life; ``serve`` then runs the calls the pool
(``trio_infer.workers.pool``) sends over a socket: ``load_all``, ``predict``, ``generate`` (a
decoupled model's call, whose items are sent as they come) and ``unload``, by name
(:data:`JOBS`). This
module must stay importable without Trio or the server: it is what every worker imports.

Error contract (every exception leaving this module must unpickle in the parent):

- an ``InferError`` raised by a model reaches the parent with its class, message and status;
- any other exception from importing, creating, loading or calling a model becomes
  ``ModelFailed("<Type>: <message>")`` here, in the child, because a model's own exception
  classes may not be picklable or importable in the parent; with ``debug`` the traceback text is
  appended to the message;
- outputs that are not ``dict[str, numpy.ndarray]`` (or a ``Response`` of one, with metadata
  that keeps its rules) are a ``ModelFailed`` naming the problem; outputs of subclasses of
  these (the model's own, which the server could not unpickle, or numpy's matrix and masked
  array) are sent as the plain types.

Decoupled models (``"decoupled": true``): ``predict`` is a generator, sync or async (driven
here by an asyncio loop of its own). ``serve`` steps it one item at a time and sends each item
as soon as it is yielded (:mod:`trio_infer.workers.wire`); between two steps it reads what the
pool sent: a cancel of the call closes the generator there (its ``finally`` blocks run), and
with no credit left it waits for one before stepping again. A step that never ends is the
pool's to stop: it kills the worker.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import inspect
import os
import pickle
import re
import signal
import socket
import sys
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from trio_infer import errors
from trio_infer.errors import InferError, ModelFailed
from trio_infer.model import MAX_RESPONSE_METADATA, Model, ModelOutputs, Parameters, Response
from trio_infer.repository.settings import ModelSettings
from trio_infer.workers import wire

__all__ = [
    "JOBS",
    "THREAD_VARIABLES",
    "configure",
    "generate",
    "load_all",
    "pickled_settings",
    "predict",
    "serve",
    "unload",
]

#: Environment variables that size the thread pools of BLAS / OpenMP libraries when they load.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_METADATA_NAME = re.compile(r"[0-9a-z_.-]+")
_METADATA_VALUE = re.compile(r"[\x20-\x7e]*")
#: Names HTTP/2, HTTP/1.1, gRPC or the V2 protocols define (``grpc-*`` too): a model's value
#: would contradict the server's, or break the response.
_RESERVED_METADATA = frozenset(
    {
        "connection",
        "content-length",
        "content-type",
        "date",
        "host",
        "inference-header-content-length",
        "keep-alive",
        "proxy-connection",
        "server",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "user-agent",
        "x-request-id",
    }
)

# Each loaded model by its pickled settings (what predict receives). Invariant: a cached
# model's load() has returned without raising. Settings that differ (a reload: another revision
# of the folder, or a load's config) are another entry: calls of the old settings still in
# flight keep using theirs until the server unloads it.
_models: dict[bytes, Model] = {}
# The settings and model of the last call that found its model, while that model is in
# _models: a call's settings are a new bytes object, whose hash (a look-up in _models) costs
# more than comparing it with the last call's, which are most calls' settings.
_last: tuple[bytes, Model] | None = None
# The revision of the folder each model folder's modules were imported from.
_imported: dict[Path, str] = {}
# Settings unloaded since, most recent last: a late call of one fails rather than loading the
# model again behind the server's back. Only the last few are kept: a call that late has
# outlived the grace period it was given many times over.
_retired: dict[bytes, str] = {}
_MAX_RETIRED = 64
_threads = 1
_debug = False


def configure(threads_per_worker: int, debug: bool) -> None:
    """Set up this worker process; trio-parallel calls it once, before the first job.

    Workers on a machine share its cores: several workers each running a BLAS pool sized to
    every core oversubscribe the CPU and turn sub-millisecond calls into tens of milliseconds.

    Args:
        threads_per_worker: Threads each BLAS / OpenMP library of this process may use.
        debug: Append tracebacks to the messages of ``ModelFailed``.
    """
    global _threads, _debug
    _threads, _debug = threads_per_worker, debug
    # Spawned workers (where there is no fork server) do what trio_infer.workers.forkserver does:
    # the server, not a stop signal sent to its process group, decides when workers stop.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A process group of its own, named by its pid: the processes its model starts (a
    # subprocess, a fork) are in it, and the pool stops them with it, after it died too. A
    # group's stop signal (a terminal's Ctrl+C) no longer reaches it, which ignores it anyway.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    # Model work is throughput work, the server's thread latency work: a worker woken by a call
    # the server writes to it (a Unix socket's write wakes its reader on the writer's core)
    # must not preempt the server there while another core may be idle. SCHED_BATCH drops only
    # that wake-up preemption; the share of the CPU (the nice value) stays the server's. A
    # kernel or sandbox that refuses it leaves the worker as it was, which is only slower. It
    # is the calling thread's, and a thread inherits it from the thread that makes it: set
    # before any other thread is made (threadpool_limits starts BLAS's pool).
    if hasattr(os, "SCHED_BATCH"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    # Libraries a model loads later (torch, onnxruntime's OpenMP) read these when they load;
    # those already loaded (numpy's BLAS) are limited by threadpoolctl.
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads_per_worker)
    threadpool_limits(limits=threads_per_worker)
    # What the fork server imported lives as long as this process: a full garbage collection
    # walking it would stall a model call (as it stalled the server, see trio_infer.cli).
    gc.freeze()


#: A call as the pool sends it: its id, the name of the job (a function of :data:`JOBS`) and
#: the job's arguments.
_Call = tuple[int, str, tuple[object, ...]]


def serve(address: str) -> None:
    """Run the calls the pool sends on the socket at ``address``, until it closes the connection.

    Calls run one at a time, in the order they came. The pool sends a call before the one
    running ends, so that the next starts at once instead of after a round trip to the server,
    most of which is waking a process that waits on a read. A call the pool cancels is skipped
    if it has not started: cancels that came during a call are read before the next one starts,
    and the report of that call names them.

    Args:
        address: The path of the pool's Unix socket for this worker.
    """
    inbox: deque[_Call] = deque()
    skipped: list[int] = []
    finished: tuple[int, bool, object, float] | None = None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(address)
        receiver = wire.Receiver(sock)
        try:
            while True:
                if finished is None and not skipped and not inbox:
                    # Nothing to run or report: wait for a message, and take what came with it.
                    # What comes later is read when the call it brought has ended.
                    message = receiver.receive()
                    while True:
                        if type(message) is tuple:  # a call, as _take takes it
                            inbox.append(message)
                        else:
                            _take(message, inbox, skipped)
                        if not receiver.held:
                            break
                        message = receiver.receive()
                else:
                    # A call ended: what came meanwhile is read before its report goes and the
                    # next call starts, even with no call in the inbox. A call sent behind the
                    # one that ran, and its cancel, may wait unread in the socket: the report
                    # must name that call skipped, for the pool takes a call it has given up on
                    # at the head of the worker's calls, with no report left to read, as the
                    # one the worker runs, and kills the worker.
                    while receiver.waiting():
                        _take(receiver.receive(), inbox, skipped)
                if finished is not None or skipped:
                    _report(sock, finished, skipped)
                    finished, skipped = None, []
                if inbox:
                    call_id, name, args = inbox.popleft()
                    function = JOBS[name]
                    if function is generate:
                        finished = _generate(sock, receiver, call_id, args, inbox, skipped)
                    else:
                        finished = _run(call_id, function, args)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return  # the pool closed the connection: this worker is done


def _take(message: object, inbox: deque[_Call], skipped: list[int]) -> None:
    if isinstance(message, tuple):
        inbox.append(message)
        return
    if isinstance(message, dict):
        return  # credits for a generating call that has ended
    assert isinstance(message, list)
    cancelled = set(message)
    for call in [call for call in inbox if call[0] in cancelled]:
        inbox.remove(call)
        skipped.append(call[0])
    # The others ran already: their reports are on their way.


def _run(
    call_id: int, function: Callable[..., object], args: tuple[object, ...]
) -> tuple[int, bool, object, float]:
    started = time.perf_counter()
    try:
        value, ok = function(*args), True
    except InferError as exc:
        value, ok = _portable(exc), False
    except BaseException as exc:
        value, ok = _failed(exc), False
    return call_id, ok, value, time.perf_counter() - started


def _report(
    sock: socket.socket, finished: tuple[int, bool, object, float] | None, skipped: list[int]
) -> None:
    try:
        frame = wire.pack((finished, skipped, None))
    except Exception as exc:
        # The result does not pickle (a model's own class in it, say): the call fails instead.
        assert finished is not None
        call_id, _, _, seconds = finished
        failed = ModelFailed(f"the result could not be sent to the server: {_failed(exc).message}")
        frame = wire.pack(((call_id, False, failed, seconds), skipped, None))
    wire.send(sock, frame)


def _generate(
    sock: socket.socket,
    receiver: wire.Receiver,
    call_id: int,
    args: tuple[object, ...],
    inbox: deque[_Call],
    skipped: list[int],
) -> tuple[int, bool, object, float] | None:
    """Run a generating call: send each item as it is yielded; the call's report, or None
    when the pool stopped it (its id is then in ``skipped``)."""
    started = time.perf_counter()
    credits = wire.ITEMS_AHEAD
    steps: _Steps | None = None
    try:
        steps = generate(*args)  # type: ignore[arg-type]
        while True:
            # Between two steps: cancels, credits and calls that came; no credit, wait for one.
            while credits <= 0 or receiver.waiting():
                message = receiver.receive()
                if isinstance(message, dict):
                    credits += message.get(call_id, 0)
                    continue
                if isinstance(message, list) and call_id in message:
                    skipped.append(call_id)
                    _take(message, inbox, skipped)
                    return None
                _take(message, inbox, skipped)
            item = steps.next()
            if item is None:
                break
            try:
                frame = wire.pack((None, [], (call_id, item)))
            except Exception as exc:
                raise ModelFailed(
                    f"an output could not be sent to the server: {_failed(exc).message}"
                ) from None
            wire.send(sock, frame)
            credits -= 1
    except InferError as exc:
        return call_id, False, _portable(exc), time.perf_counter() - started
    finally:
        if steps is not None:
            steps.close()
    return call_id, True, None, time.perf_counter() - started


class _Steps:
    """A decoupled model's generator (sync or async), stepped one checked item at a time."""

    def __init__(self, settings: ModelSettings, produced: object) -> None:
        self._settings = settings
        self._sync: Iterator[object] | None = None
        self._async: AsyncIterator[object] | None = None
        if isinstance(produced, AsyncIterator):
            import asyncio  # only workers that serve an async generator pay for it

            self._loop = asyncio.new_event_loop()
            self._async = produced
        elif isinstance(produced, Iterator):
            self._sync = produced
        else:
            raise ModelFailed(
                f"model {settings.name!r} is decoupled: predict() must be a generator (sync or "
                f"async) yielding dict[str, numpy.ndarray], it returned {type(produced).__name__}"
            )

    def next(self) -> ModelOutputs | None:
        """The next item, checked; None at the end.

        Raises:
            InferError: The model raised one (portable), or failed otherwise (``ModelFailed``).
        """
        error: InferError
        try:
            if self._sync is not None:
                item = next(self._sync, _END)
            else:
                assert self._async is not None
                item = self._loop.run_until_complete(anext(self._async, _END))
        except InferError as exc:
            error = _portable(exc)
        except BaseException as exc:
            error = _failed(exc)
        else:
            return None if item is _END else _checked(self._settings, item)
        raise error

    def close(self) -> None:
        """Close the generator (its ``finally`` blocks run); what it raises then is dropped:
        only a stopped call is closed before its end, and nobody waits for it."""
        try:
            if self._sync is not None:
                close = getattr(self._sync, "close", None)
                if close is not None:
                    close()
            else:
                aclose = getattr(self._async, "aclose", None)
                try:
                    if aclose is not None:
                        self._loop.run_until_complete(aclose())
                finally:
                    self._loop.close()
        except BaseException:  # see the docstring
            pass


_END = object()


def load_all(models: Sequence[bytes]) -> int:
    """Load several models into this process's cache (the pool's warm-up job).

    Args:
        models: The models to load, in order: their settings pickled by the server
            (:func:`pickled_settings`), the same bytes its calls of them send, which key the
            cache.

    Returns:
        This process's id, so the caller can tell which worker did the job.

    Raises:
        InferError: The first model that fails: its ``__init__`` or ``load()`` raised one, or
            importing, creating or loading it failed otherwise (``ModelFailed``); the message
            starts with ``loading model '<name>' failed:``.
    """
    for pickled in models:
        _retired.pop(pickled, None)  # loaded again on purpose
        settings: ModelSettings = pickle.loads(pickled)
        try:
            _cached_model(settings, pickled)
        except InferError as exc:
            # One job loads many models: say which one failed. exc is already portable.
            failed = type(exc)(f"loading model {settings.name!r} failed: {exc.message}", exc.code)
            break
    else:
        return os.getpid()
    raise failed


def predict(settings: bytes, inputs: dict[str, np.ndarray], parameters: Parameters) -> ModelOutputs:
    """Run one model call, loading the model first if this process has not yet.

    Args:
        settings: The model to call: its ``ModelSettings``, pickled (:func:`pickled_settings`).
        inputs: The input tensors by name.
        parameters: The request's parameters.

    Returns:
        The model's outputs, checked to be ``dict[str, numpy.ndarray]``, or a ``Response``
        with them and its metadata, checked.

    Raises:
        InferError: The model raised one (its class and status are kept).
        ModelFailed: Loading or calling the model failed otherwise, or its outputs have the
            wrong type.
    """
    model, outputs = _called(settings, inputs, parameters)
    return _checked(model.settings, outputs)


def generate(settings: bytes, inputs: dict[str, np.ndarray], parameters: Parameters) -> _Steps:
    """Start a decoupled model's call: its generator, for ``serve`` to step (see the module's
    docstring); loads the model first if this process has not yet.

    Raises:
        InferError: The model raised one (its class and status are kept).
        ModelFailed: Loading or calling the model failed otherwise, or its ``predict`` is not a
            generator.
    """
    model, produced = _called(settings, inputs, parameters)
    return _Steps(model.settings, produced)


def _called(
    settings: bytes, inputs: dict[str, np.ndarray], parameters: Parameters
) -> tuple[Model, Any]:
    """The model of ``settings`` (loaded first if this process has not yet), and what its
    ``predict`` returned.

    Raises:
        InferError: The model raised one (its class and status are kept).
        ModelFailed: Loading or calling the model failed otherwise.
    """
    global _last
    if _last is not None and _last[0] == settings:
        model = _last[1]
    else:
        cached = _models.get(settings)
        if cached is None:
            if settings in _retired:
                raise errors.Unavailable(f"model {_retired[settings]!r} was unloaded")
            cached = _cached_model(pickle.loads(settings), settings)
        model = cached
        _last = settings, model
    error: InferError
    try:
        return model, model.predict(inputs, parameters)
    except InferError as exc:
        error = _portable(exc)
    except BaseException as exc:
        # BaseException too: a model calling sys.exit() must fail its request, not have
        # SystemExit re-raised in the server process.
        error = _failed(exc)
    # Raised outside the handler so the model's exception is not attached as __context__:
    # trio-parallel pickles the whole chain, and the model's exception may not pickle.
    raise error


def pickled_settings(settings: ModelSettings) -> bytes:
    """The form of a model's settings that :func:`predict` takes.

    Settings cross to the worker on every call; pickled once by the caller and compared as
    bytes here, they cost neither side an unpickling nor a field-by-field comparison per call.
    """
    return pickle.dumps(settings, protocol=pickle.HIGHEST_PROTOCOL)


def unload(settings: bytes) -> bool:
    """Drop a model from this process's cache (its memory is freed once the calls that hold it
    end); whether it was loaded.

    Args:
        settings: The model's settings, pickled (:func:`pickled_settings`).
    """
    global _last
    model = _models.pop(settings, None)
    if model is None:
        return False
    if _last is not None and _last[1] is model:
        _last = None
    _retired[settings] = model.settings.name
    if len(_retired) > _MAX_RETIRED:
        del _retired[next(iter(_retired))]
    del model
    gc.collect()
    return True


#: The jobs ``serve`` runs, by the name the pool sends: a name costs a message less to pickle
#: and to unpickle than a reference to a function, which is looked up and imported each time.
JOBS: dict[str, Callable[..., object]] = {
    job.__name__: job for job in (load_all, predict, generate, unload)
}


def _cached_model(settings: ModelSettings, key: bytes) -> Model:
    model = _models.get(key)
    if model is not None:
        return model
    error: InferError
    try:
        cls = _import_class(settings)
        _check_kind(settings, cls)
        model = cls(settings)
        model.load()
    except InferError as exc:
        error = _portable(exc)
    except BaseException as exc:
        error = _failed(exc)
    else:
        # A model may load a library with its own thread pool (torch, onnxruntime).
        threadpool_limits(limits=_threads)
        _models[key] = model
        return model
    raise error


def _import_class(settings: ModelSettings) -> type[Model]:
    module_name, _, class_name = settings.implementation.rpartition(".")
    if settings.path is not None:
        _prefer_folder(settings.path, module_name, settings.revision)
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Model)):
        found = "nothing" if cls is None else repr(cls)
        raise TypeError(
            f"implementation {settings.implementation!r} of model {settings.name!r} must name "
            f"a subclass of trio_infer.model.Model, found {found}"
        )
    return cls


def _check_kind(settings: ModelSettings, cls: type[Model]) -> None:
    # A generator served as a plain model would fail every call with a confusing type error.
    if not settings.decoupled and (
        inspect.isgeneratorfunction(cls.predict) or inspect.isasyncgenfunction(cls.predict)
    ):
        raise TypeError(
            f'the predict() of model {settings.name!r} is a generator: set "decoupled": true '
            "in its model-settings.json to serve it (on ModelStreamInfer)"
        )


def _prefer_folder(folder: Path, module_name: str, revision: str) -> None:
    # MLServer-style: the model's folder goes first on sys.path, so "model.MyModel" is the
    # folder's own model.py. Kept there afterwards: the model may import siblings lazily.
    if _imported.setdefault(folder, revision) != revision:
        # Another revision of the folder (a reload): its code is imported anew. Instances made
        # from the old modules keep their classes.
        _imported[folder] = revision
        for name, module in list(sys.modules.items()):
            if _defined_in(module, folder):
                del sys.modules[name]
    entry = str(folder)
    if entry in sys.path:
        sys.path.remove(entry)
    sys.path.insert(0, entry)
    importlib.invalidate_caches()
    top = module_name.partition(".")[0]
    if not ((folder / top).is_dir() or (folder / f"{top}.py").is_file()):
        return  # an installed module (e.g. trio_infer.examples): import it as usual
    loaded = sys.modules.get(top)
    if loaded is not None and not _defined_in(loaded, folder):
        # Every model folder may have its own model.py; the one another folder imported earlier
        # must not stand in for this folder's. Forgetting it leaves that model's class intact.
        for name in [n for n in sys.modules if n == top or n.startswith(f"{top}.")]:
            del sys.modules[name]


def _defined_in(module: ModuleType, folder: Path) -> bool:
    file = getattr(module, "__file__", None)
    if file is None:
        return False
    return Path(file).resolve().is_relative_to(folder.resolve())


def _portable(exc: InferError) -> InferError:
    # A subclass defined in model code would not unpickle in the parent (its module is on the
    # worker's sys.path only), and a custom __init__ would not unpickle at all: keep the class
    # only when it is one of ours, and always keep the message and status.
    cls = type(exc) if type(exc).__module__ == errors.__name__ else InferError
    try:
        message, code = exc.message, exc.code
    except Exception as failure:
        # A subclass whose __init__ did not run InferError's (or whose properties raise): the
        # model's failure, as any other exception of its code is.
        return _failed(failure)
    return cls(message, code)


def _failed(exc: BaseException) -> ModelFailed:
    message = f"{type(exc).__name__}: {exc}"
    if _debug:
        message += "\n" + "".join(traceback.format_exception(exc)).rstrip()
    return ModelFailed(message)


def _checked(settings: ModelSettings, outputs: object) -> ModelOutputs:
    if isinstance(outputs, Response):
        where = _where(settings)
        return Response(
            _checked_outputs(settings, outputs.outputs),
            _checked_metadata(where, "header", outputs.headers),
            _checked_metadata(where, "trailer", outputs.trailers),
        )
    return _checked_outputs(settings, outputs)


def _where(settings: ModelSettings) -> str:
    """The start of a message on a model's outputs: made only for a failure, it is no work of
    a call that succeeds."""
    return f"model {settings.name!r}"


#: The class of numpy's object dtype (numpy 1.25 gave each dtype its class): asking a dtype's
#: class is cheaper than comparing the dtype to ``object``, at every output of every call.
_OBJECT_DTYPE = type(np.dtype(object))


def _checked_outputs(settings: ModelSettings, outputs: object) -> dict[str, np.ndarray]:
    if not isinstance(outputs, dict):
        raise ModelFailed(
            f"{_where(settings)}: predict() returned {type(outputs).__name__}, "
            "expected dict[str, numpy.ndarray] or trio_infer.Response"
        )
    # Whether the outputs are of the exact types, which the server process has: a subclass (of
    # dict, str, ndarray, bytes) may be the model's own, which would not unpickle there.
    exact = type(outputs) is dict
    for name, value in outputs.items():
        if type(name) is not str:
            if not isinstance(name, str):
                raise ModelFailed(f"{_where(settings)}: output {name!r} is not a string")
            exact = False
        if type(value) is not np.ndarray:
            if not isinstance(value, np.ndarray):
                raise ModelFailed(
                    f"{_where(settings)}: output {name!r} is {type(value).__name__}, expected "
                    "numpy.ndarray"
                )
            exact = False
        if type(value.dtype) is _OBJECT_DTYPE:
            # BYTES outputs hold bytes (or str, encoded as UTF-8).
            for element in value.flat:
                if type(element) not in _TEXT_TYPES:
                    if not isinstance(element, bytes | str):
                        raise ModelFailed(
                            f"{_where(settings)}: output {name!r} holds a "
                            f"{type(element).__name__}; object arrays (BYTES) must hold bytes "
                            "or str"
                        )
                    exact = False
    if exact:
        return outputs
    return {str.__str__(name): _plain(value) for name, value in outputs.items()}


_TEXT_TYPES = (bytes, str)


def _plain(array: np.ndarray) -> np.ndarray:
    """``array`` as an ndarray whose BYTES elements are bytes or str, not a subclass of
    either; what a subclass of ndarray adds (a matrix's rules, a masked array's mask) is
    dropped, as it is on the wire."""
    array = array.view(np.ndarray)
    if type(array.dtype) is not _OBJECT_DTYPE:
        return array
    plain = np.empty(array.size, object)
    plain[:] = [
        bytes.__bytes__(element) if isinstance(element, bytes) else str.__str__(element)
        for element in array.flat
    ]
    return plain.reshape(array.shape)


def _checked_metadata(where: str, kind: str, metadata: object) -> dict[str, str]:
    """A model's response metadata as plain lower-case names and text values, checked against
    gRPC's rules for text metadata and the names the protocols keep for themselves.

    Raises:
        ModelFailed: Naming the first entry that breaks a rule, or the size past the bound.
    """
    if not isinstance(metadata, Mapping):
        raise ModelFailed(f"{where}: response {kind}s are {type(metadata).__name__}, not a mapping")
    checked: dict[str, str] = {}
    size = 0
    for name, value in metadata.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ModelFailed(f"{where}: response {kind} {name!r}: names and values must be str")
        lowered = name.lower()
        if not lowered or not _METADATA_NAME.fullmatch(lowered):
            raise ModelFailed(
                f"{where}: response {kind} name {name!r} may hold only letters, digits, "
                "'-', '_' and '.'"
            )
        if lowered.endswith("-bin"):
            raise ModelFailed(f"{where}: response {kind} {name!r}: binary metadata is not served")
        if lowered in _RESERVED_METADATA or lowered.startswith("grpc-"):
            raise ModelFailed(f"{where}: response {kind} {name!r} is the protocol's own")
        if not _METADATA_VALUE.fullmatch(value):
            raise ModelFailed(
                f"{where}: response {kind} {name!r} has a value that is not printable ASCII"
            )
        size += len(lowered) + len(value)
        checked[lowered] = value
    if size > MAX_RESPONSE_METADATA:
        raise ModelFailed(
            f"{where}: response {kind}s take {size} bytes, more than the "
            f"{MAX_RESPONSE_METADATA} allowed"
        )
    return checked
