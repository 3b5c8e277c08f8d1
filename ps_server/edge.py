"""The shard's gRPC edge on asyncio: handlers on an event loop, their blocking parts on a thread pool, their
waits on the loop.

Each RPC is an asyncio handler (`handler`). Its body, the servicer's method,
is ordinary blocking code run on the shard's thread pool (ps-server
--threads), with a CallContext in place of grpc's context. A body that
waits for a sync release, the ssp bound or a step (Push, PushPull, Pull)
is a generator that yields waits.Wait objects there, holding no lock: the
handler then lets go of its thread and awaits the bookkeeping condition's
callback (WatchedCondition.watch) or the wait's deadline on the loop, and
resumes the body on the pool. A waiting call so costs a coroutine and a
watcher, not a thread. A client that goes away ends its CallContext (its
callbacks run, `is_active()` turns false) and its body is run to its end on
the pool, where every wait it meets is over at once (its `cancelled()`).
A request stream is read on the loop by a task of its own, one message ahead
of the body, which takes each message on its thread without a trip to the
loop (_RequestStream).

LoopServer runs a grpc.aio server on its own loop thread behind the blocking
start/stop of a grpc.Server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
import time
from typing import Callable

import grpc

from .waits import Wait, run_blocking

__all__ = ["CallContext", "CallEnded", "LoopServer", "handler"]

_DONE = object()


class CallEnded(Exception):
    """The call ended (the client went away, or the shard ended a stalled stream) while its body ran."""


class CallContext:
    """What a handler's body, on a pool thread, sees of its call: the grpc.ServicerContext methods the
    servicer uses. Thread-safe. The call's peer, metadata, auth context and deadline are read once, on the
    loop, when the call starts: grpc.aio's context is the loop's alone (read from another thread once its
    call was over, by a stalled stream's watchdog naming its peer, it crashed the shard in cygrpc)."""

    def __init__(self, context: grpc.aio.ServicerContext, loop: asyncio.AbstractEventLoop,
                 pool: concurrent.futures.Executor):
        self._loop, self._pool = loop, pool
        self._peer, self._metadata = context.peer(), context.invocation_metadata()
        self._auth = context.auth_context()
        remaining = context.time_remaining()
        self._deadline = None if remaining is None else time.monotonic() + remaining
        self._lock = threading.Lock()
        self._ended = False
        self._callbacks: list[Callable[[], None]] = []
        self._stream: _RequestStream | None = None
        self.stalled: str | None = None  # why the shard ended the call's stream (end_stalled), if it did
        self.trailing: tuple = ()

    def is_active(self) -> bool:
        return not self._ended

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self):
        return self._metadata

    def auth_context(self):
        return self._auth

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Runs callback() on the pool once the call ends (answered, cancelled or failed)."""
        with self._lock:
            if not self._ended:
                self._callbacks.append(callback)
                return True
        self._pool.submit(callback)
        return True

    def end(self) -> None:
        """The call is over: its callbacks run, a read in progress is cut (CallEnded). Idempotent."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            callbacks, self._callbacks = self._callbacks, []
            stream, self._stream = self._stream, None  # gRPC's context, a cycle, keeps this object: not the stream
        if stream is not None:
            stream.close()
        for callback in callbacks:
            self._pool.submit(callback)

    def end_stalled(self, details: str) -> None:
        """Ends the call from outside its body: it is answered DEADLINE_EXCEEDED with `details`."""
        self.stalled = details
        self.end()

    def requests(self, iterator) -> "_RequestStream":
        """A blocking iterator, for the body's thread, over the call's async request stream, read from the
        body's first request on, one message ahead of the body."""
        stream = _RequestStream(iterator, self._loop)
        with self._lock:
            self._stream = stream
            ended = self._ended
        if ended:
            stream.close()
        return stream


class _RequestStream:
    """A call's request stream, read on the loop by a task of its own one message ahead of the body, which
    takes each from its pool thread without a trip to the loop: per message, the loop only reads it (the
    body's wait for the next one costs the loop nothing). At most one message waits unread by the body.
    Reading starts at the body's first request, not before: gRPC refuses an oversized message when it is
    read, and a call refused before its body ran would never run it (the body is always entered, as
    GetStatus's calls_started counts). Iterating blocks; StopIteration at the stream's end, CallEnded once
    the call ended (close()), and what reading raised otherwise."""

    def __init__(self, iterator, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._iterator = iterator
        self._task: asyncio.Task | None = None  # the loop's alone: set by _start, cancelled by _cancel
        self._asked = False  # the body asked for its first message
        self._cond = threading.Condition(threading.Lock())
        self._message = _DONE  # the message read and not yet taken; _DONE: none
        # How the stream ended: StopIteration, CallEnded (each raised afresh: one kept here and raised would hold
        # its traceback, which holds this object, a cycle per call) or what reading raised.
        self._end: type[BaseException] | BaseException | None = None
        self._space: asyncio.Future | None = None  # (the loop's) set once the body took the waiting message

    def _start(self) -> None:
        """(On the loop.) Starts reading, unless the call ended first."""
        with self._cond:
            if self._end is not None:
                return
        self._task = self._loop.create_task(self._read(self._iterator))

    def _cancel(self) -> None:
        """(On the loop.) Stops reading."""
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _read(self, iterator) -> None:
        try:
            async for message in iterator:
                while True:
                    with self._cond:
                        if self._end is not None:
                            return
                        if self._message is _DONE:
                            self._message = message
                            self._cond.notify()
                            break
                        space = self._space = self._loop.create_future()
                    await space
            end: type[BaseException] | BaseException = StopIteration
        except asyncio.CancelledError:
            end = CallEnded
        except Exception as exc:  # noqa: BLE001 - the body raises it where it reads
            end = exc
        with self._cond:
            if self._end is None:
                self._end = end
            self._cond.notify()

    def __iter__(self):
        return self

    def __next__(self):
        with self._cond:
            if not self._asked:
                self._asked = True
                self._loop.call_soon_threadsafe(self._start)
            while self._message is _DONE and self._end is None:
                self._cond.wait()
            if self._end is CallEnded:
                raise CallEnded("the call ended before its stream was read")
            if self._message is _DONE:
                raise self._end() if self._end is StopIteration else self._end
            message, self._message = self._message, _DONE
            space, self._space = self._space, None
        if space is not None:
            self._loop.call_soon_threadsafe(_set_done, space)
        return message

    def close(self) -> None:
        """The call ended: the body's next read raises CallEnded, and reading stops. Any thread; idempotent."""
        with self._cond:
            self._end = CallEnded
            self._cond.notify()
            space, self._space = self._space, None
        if space is not None:
            self._loop.call_soon_threadsafe(_set_done, space)
        if self._asked:  # else nothing reads the stream
            self._loop.call_soon_threadsafe(self._cancel)


def _set_done(future: asyncio.Future) -> None:
    """(On the loop.) Sets `future`'s result to None unless it is done."""
    if not future.done():
        future.set_result(None)


def handler(body: Callable, *, name: str, inline: bool, pool: concurrent.futures.Executor,
            fail: Callable[[str, Exception, CallContext], tuple[grpc.StatusCode, str, tuple]],
            streaming: bool):
    """An asyncio handler for `body(request, context)`. `streaming`: the body is a generator of serialized
    replies, among which it may yield Waits; else it returns the reply, or (a generator function) yields
    Waits and returns the reply. `inline`: a short body that never waits runs on the loop itself (GetStatus:
    never queued behind the pool). `fail(name, exc, context)` maps an exception to (code, details, trailing
    metadata)."""
    waits = inspect.isgeneratorfunction(body)

    def prepare(request, context) -> CallContext:
        loop = asyncio.get_running_loop()
        call = CallContext(context, loop, pool)
        context.add_done_callback(lambda _: call.end())
        return call

    def request_of(request, call: CallContext):
        return call.requests(request) if hasattr(request, "__aiter__") else request

    async def failed(context, call: CallContext, exc: Exception):
        code, details, trailing = fail(name, exc, call)
        await context.abort(code, details, trailing)

    if streaming:
        async def stream(request, context):
            loop = asyncio.get_running_loop()
            call = prepare(request, context)
            replies = body(request_of(request, call), call)

            def abandon() -> None:
                call.end()
                replies.close()

            try:
                watch = None
                while True:
                    reply = await _segment(pool, abandon, functools.partial(_part, loop, watch, next, replies, _DONE))
                    if reply is _DONE:
                        return
                    watch = reply if isinstance(reply, _Watch) else None
                    if watch is not None:
                        await _await(watch, pool, abandon)
                    else:
                        yield reply
            except asyncio.CancelledError:  # at an await: _segment or _await abandons the body
                call.end()
                raise
            except GeneratorExit:  # at `yield reply`: the client is gone, the body waits for its next turn
                pool.submit(abandon)
                raise
            except Exception as exc:  # noqa: BLE001 - the edge maps everything
                await failed(context, call, exc)
        return stream

    async def unary(request, context):
        loop = asyncio.get_running_loop()
        call = prepare(request, context)
        try:
            if inline:
                return body(request_of(request, call), call)
            if not waits:
                return await asyncio.wrap_future(pool.submit(body, request_of(request, call), call))
            run = body(request_of(request, call), call)

            def abandon() -> None:
                call.end()
                _finish(run)

            watch = None
            while True:
                step = await _segment(pool, abandon, functools.partial(_part, loop, watch, _step, run))
                if not isinstance(step, _Watch):
                    return step[0]
                watch = step
                await _await(watch, pool, abandon)
        except asyncio.CancelledError:
            call.end()
            raise
        except Exception as exc:  # noqa: BLE001
            await failed(context, call, exc)
    return unary


def _step(run) -> Wait | tuple:
    """The next Wait of a generator body, or (its return value,)."""
    try:
        return next(run)
    except StopIteration as stop:
        return (stop.value,)


async def _segment(pool: concurrent.futures.Executor, abandon: Callable[[], None], function):
    """function() (a part of body `run`) on the pool; if the caller is cancelled meanwhile, abandon() runs on
    the pool once that part is over (or never started)."""
    part = pool.submit(function)
    try:
        return await asyncio.wrap_future(part)
    except asyncio.CancelledError:
        part.add_done_callback(lambda _: pool.submit(abandon))
        raise


class _Watch:
    """A Wait, watched from a pool thread (WatchedCondition.watch takes the bookkeeping lock there, never on the
    loop): `woken`, a future of the loop, is done once the wait is ready or its deadline passed."""

    def __init__(self, wait: Wait, loop: asyncio.AbstractEventLoop):
        self.wait, self.loop = wait, loop
        self.woken = loop.create_future()
        self.left = wait.left()
        self.key = wait.cond.watch(wait.ready, lambda: loop.call_soon_threadsafe(self.end), wait.level)

    def end(self) -> None:
        """(On the loop.) The wait is over."""
        if not self.woken.done():
            self.woken.set_result(None)

    def forget(self) -> None:
        """(On the pool.) Its watcher goes, if it was not called back (a deadline passed, a cancelled call)."""
        self.wait.cond.unwatch(self.key)


def _part(loop: asyncio.AbstractEventLoop, watch: _Watch | None, function, *args):
    """(On the pool.) The previous wait's watcher forgotten, function(*args): a Wait it returns is watched."""
    if watch is not None:
        watch.forget()
    result = function(*args)
    return _Watch(result, loop) if isinstance(result, Wait) else result


async def _await(watch: _Watch, pool: concurrent.futures.Executor, abandon: Callable[[], None]) -> None:
    """Waits on the loop, taking no lock, until `watch` is ready or its deadline passed (the body then decides
    what that means). If the caller is cancelled meanwhile, the watcher is forgotten and abandon() runs on the
    pool (the call ended, its body run to its end), and CancelledError goes on."""
    timer = watch.loop.call_later(watch.left, watch.end) if watch.left is not None else None
    try:
        await watch.woken
    except asyncio.CancelledError:
        pool.submit(watch.forget)
        pool.submit(abandon)
        raise
    finally:
        if timer is not None:
            timer.cancel()


def _finish(run) -> None:
    """Runs a cancelled body (a generator) to its end, every wait over at once (its cancelled() is true); what
    it raises or returns is nobody's any more. One never started is only closed."""
    if inspect.getgeneratorstate(run) == inspect.GEN_CREATED:
        run.close()
        return
    try:
        run_blocking(run)
    except Exception:  # noqa: BLE001 - the client is gone: there is no one to answer
        pass


class LoopServer:
    """A grpc.aio server on its own event loop thread, with the blocking start/stop a grpc.Server has.
    `make()` builds the server (on the loop's thread)."""

    def __init__(self, make: Callable[[], grpc.aio.Server], name: str):
        self.loop = asyncio.new_event_loop()
        self.closers: list[Callable[[], None]] = []
        self.replication = None  # the shard's backups' side (replication.Replication), set by server.create_server
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.server = self.call(make)

    def call(self, function, *args):
        """function(*args) run on the loop's thread; its value, or what it raised."""
        async def run():
            return function(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result()

    def add_insecure_port(self, address: str) -> int:
        return self.call(self.server.add_insecure_port, address)

    def add_secure_port(self, address: str, credentials) -> int:
        return self.call(self.server.add_secure_port, address, credentials)

    def start(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result()

    def stop(self, grace: float | None) -> threading.Event:
        """Stops serving; calls still running after `grace` s are cancelled. The event is set once stopped.
        What was added to `closers` (the bulk lanes) is closed first."""
        for close in self.closers:
            close()
        stopped = threading.Event()
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop).add_done_callback(
            lambda _: stopped.set())
        return stopped
