"""Admission: a server's generation slots (`Slots`: its batch plus its queue) and one request's lease on k of them
(`Lease`), freed exactly once on every path (finish, error, cancel, client gone). `Slots.cancel_all` cancels the
work of every lease (shutdown)."""
from __future__ import annotations

import asyncio
import threading

from ..engine import CancelToken, Stream
from ..errors import RequestCancelledError
from ..types import StreamChunk


class Slots:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.active = 0
        self._lock = threading.Lock()
        self._leases: set[Lease] = set()
        self.closed = False

    def try_acquire(self, k: int = 1) -> "Lease | None":
        """k slots at once, or none (always none once `cancel_all` has closed the slots)."""
        with self._lock:
            if self.closed or self.active + k > self.capacity:
                return None
            self.active += k
            lease = Lease(self, k)
            self._leases.add(lease)
            return lease

    def _release(self, k: int) -> None:
        with self._lock:
            self.active -= k

    def _forget(self, lease: "Lease") -> None:
        with self._lock:
            self._leases.discard(lease)

    def cancel_all(self) -> None:
        """Close the slots (no more leases) and cancel the work of every lease (its streams end "cancelled", its
        scoring stops); the requests then end."""
        with self._lock:
            self.closed = True
            leases = list(self._leases)
        for lease in leases:
            lease.cancel()


Item = tuple[int, "StreamChunk | BaseException | None"]


class Lease:
    """One request's k slots, one per generation. Every slot is freed exactly once: a stream handed to a reader
    task (`pump`) is stepped and closed by that task alone, which frees its slot when the stream ends;
    `release` (idempotent) cancels every stream, closes the ones no thread owns and frees their slots (and those
    of streams never started). `cancel` stops the work without freeing anything: the streams end "cancelled" and
    `token` (which the request's prompt scoring polls) is cancelled."""

    def __init__(self, slots: Slots, k: int):
        self._slots = slots
        self._lock = threading.Lock()
        self._unowned = k  # slots not handed to a reader task
        self._readers: list[asyncio.Task[None]] = []
        self._released = False
        self.streams: list[Stream] = []
        self.token = CancelToken()

    def cancel(self) -> None:
        """Cancel the streams and the token (thread-safe, idempotent); the slots stay held until `release` or the
        streams' readers end."""
        self.token.cancel()
        for s in list(self.streams):
            try:
                s.cancel()
            except Exception:
                pass

    def add(self, s: Stream) -> None:
        """A started stream of this request (cancelled at once if the request already is)."""
        self.streams.append(s)
        if self.token.cancelled:
            s.cancel()

    def check(self) -> None:
        """Raise RequestCancelledError once cancelled (between a request's steps of work)."""
        if self.token.cancelled:
            raise RequestCancelledError("the request was cancelled")

    def pump(self, q: "asyncio.Queue[Item]") -> None:
        """Start one reader task per stream on the running event loop (`async for`: no thread), putting (stream
        index, chunk) on q, then (index, None) at the end or (index, exception)."""
        with self._lock:
            if self._released:  # already cancelled and closed: the streams just end
                for i in range(len(self.streams)):
                    q.put_nowait((i, None))
                return
            self._unowned -= len(self.streams)
        self._readers = [asyncio.create_task(self._read(i, s, q), name=f"mbd-stream-{i}")
                         for i, s in enumerate(self.streams)]

    async def _read(self, i: int, s: Stream, q: "asyncio.Queue[Item]") -> None:
        end: BaseException | None = None
        try:
            async for ch in s:
                q.put_nowait((i, ch))
        except asyncio.CancelledError:  # the event loop is closing: the stream is closed below
            end = RequestCancelledError("the request was cancelled")
        except Exception as e:  # handed to the request's task, which raises it
            end = e
        finally:
            # the stream's KV cache and slot are freed before its end is signalled: a client that has its
            # response can send the next request into that slot at once
            try:
                s.close()
            finally:
                self._slots._release(1)
                q.put_nowait((i, end))

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            unowned, self._unowned = self._unowned, 0
        self._slots._forget(self)
        try:
            self.cancel()  # thread-safe; a reader task then sees its stream end and frees its slot
            if unowned:  # no reader tasks were started: this closes the streams
                for s in self.streams:
                    try:
                        s.close()
                    except Exception:
                        pass
        finally:
            self._slots._release(unowned)
