"""The connection level of `mbd-rs serve` (docs/security.md): who may talk to the server and for how long.

- `raise_open_files_limit`: the open-files soft limit raised to the hard limit at start-up (1024 is common, and every
  connection is a file).
- `guarded_protocol`: uvicorn's HTTP protocol with a header timeout (a connection that has not finished its request
  line and headers within `header_timeout` seconds of connecting, or of its previous response, is closed: uvicorn
  times out only idle keep-alive connections, so a client that sends one byte and stalls held a file forever) and a
  connection cap (at most `limit` open: a new connection over it replaces the one that has waited longest for its
  headers, else the one that has waited longest for its request's body (the app's `body_timeout` ends those), and
  is refused only when every connection is serving a request: stalled connections can neither take every file nor
  shut real clients out).
- `AcceptFailures`: the event loop's handler for `accept()` failing (EMFILE and the like) logs it once a minute with a
  count, not asyncio's traceback per attempt (79 MB of log in 42 s).
- `make_server`: uvicorn's server with these guards, whose shutdown (SIGTERM, Ctrl-C) first cancels the app's work in
  flight, so it exits in seconds whatever runs.
- `HostGuard`: ASGI middleware that answers a request whose `Host` is not one this server answers to with 421
  (DNS rebinding: a web page of another origin reaching a key-less local server), and puts `X-Frame-Options: DENY`
  and `frame-ancestors 'none'` on every response (no page of another origin may frame the web view).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from .limits import CONNECTIONS, HEADER_TIMEOUT
from .openai import error

_log = logging.getLogger("mbd_rs.server")

#: Open files kept for the process itself (model files, pipes, the event loop) below the open-files limit when the
#: connection cap is derived from it.
RESERVED_FILES = 64
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("", "0.0.0.0", "::")


def raise_open_files_limit() -> int | None:
    """Raise the open-files soft limit to the hard limit; returns the soft limit now (None where there is none)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard or hard == resource.RLIM_INFINITY and soft < (1 << 20):
        want = hard if hard != resource.RLIM_INFINITY else 1 << 20
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):  # e.g. macOS caps it below an "unlimited" hard limit
            pass
    return None if soft == resource.RLIM_INFINITY else int(soft)


def connection_limit(requested: int | None, open_files: int | None) -> int:
    """The connection cap: `requested`, else CONNECTIONS or what the open-files limit leaves (RESERVED_FILES
    kept back). A requested cap over that limit is kept, with a warning: accept() will fail past it."""
    room = None if open_files is None else max(open_files - RESERVED_FILES, 1)
    if requested is None:
        return CONNECTIONS if room is None else min(CONNECTIONS, room)
    if room is not None and requested > room:
        _log.warning("--limit-concurrency %d is over what the open-files limit (%d) leaves for connections (%d): "
                     "connections past it will fail to be accepted", requested, open_files, room)
    return requested


def guarded_protocol(base: type[asyncio.Protocol], header_timeout: float, limit: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class `base` (h11 or httptools: both keep `cycle`, the request being served, with
    `more_body` and `response_started`, and call `on_response_complete`) with a header timeout and a connection cap
    (see the module's doc). At the cap, a new connection takes the place of the connection that has waited longest
    for its request's headers (a stalled one: real clients send their headers at once), else of the one that has
    waited longest for its request's body (stalled mid-body: the app would answer it 408 at its body timeout), and
    is refused only when every connection is serving a request."""
    class Guarded(base):  # type: ignore[valid-type,misc]
        # this server's connections waiting for their headers, and those whose request's body is still arriving
        # (headers in, no response started), oldest first
        waiting: "dict[Any, None]" = {}
        in_body: "dict[Any, None]" = {}
        _timer: asyncio.TimerHandle | None = None
        _waiting_on: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limit:
                victim = next(iter(self.waiting), None) or self._oldest_in_body()
                if victim is None:
                    transport.abort()  # every connection is serving a request: this one's file is freed at once
                    return
                victim._drop()
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._disarm_if_started()
            self._track_body()

        def on_response_complete(self) -> None:
            self.in_body.pop(self, None)
            self._arm()  # the next request's headers are timed from here (pipelined ones may be parsed below)
            super().on_response_complete()
            self._disarm_if_started()
            self._track_body()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self.in_body.pop(self, None)
            super().connection_lost(exc)

        def _receiving_body(self) -> bool:
            """This connection's request has its headers in, and its body is still arriving with no response
            started."""
            c = self.cycle
            return (c is not None and self._timer is None and bool(getattr(c, "more_body", False))
                    and not getattr(c, "response_started", True))

        def _track_body(self) -> None:
            if self._receiving_body():
                self.in_body.setdefault(self, None)
            else:
                self.in_body.pop(self, None)

        def _oldest_in_body(self) -> "Guarded | None":
            conn: Guarded
            for conn in list(self.in_body):
                if conn._receiving_body():  # a response may have started since its last bytes came
                    return conn
                self.in_body.pop(conn, None)
            return None

        def _arm(self) -> None:
            self._disarm()
            self._waiting_on = self.cycle
            self._timer = self.loop.call_later(header_timeout, self._drop)
            self.waiting[self] = None

        def _disarm(self) -> None:
            self.waiting.pop(self, None)
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _disarm_if_started(self) -> None:
            if self._timer is not None and self.cycle is not self._waiting_on:  # a new request's headers are in
                self._disarm()

        def _drop(self) -> None:
            self._disarm()
            self.in_body.pop(self, None)
            if not self.transport.is_closing():
                self.transport.abort()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


class AcceptFailures:
    """An event loop exception handler: `accept()` out of resources is logged once per `every` seconds with the count
    since the last line; everything else goes to the loop's default handler."""

    def __init__(self, every: float = 60.0):
        self.every, self.count, self.last = every, 0, -float("inf")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            loop.default_exception_handler(context)
            return
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every:
            _log.error("cannot accept connections: %s (%d failed accept() calls since the last line; raise the "
                       "open-files limit (ulimit -n) or lower --limit-concurrency; retried every second)",
                       context.get("exception"), self.count)
            self.last, self.count = now, 0


def make_server(app: Any, host: str, port: int, *, header_timeout: float = HEADER_TIMEOUT,
                limit_concurrency: int | None = None, on_shutdown: Callable[[], None] | None = None,
                log_level: str = "warning") -> Any:
    """A uvicorn server for `app` with this module's guards (the open-files limit raised first): accept failures
    logged once (`AcceptFailures`), the header timeout and the connection cap (`guarded_protocol`), and on shutdown
    (SIGTERM, Ctrl-C) `on_shutdown` (cancel the work in flight) before uvicorn stops accepting and waits (at most
    3 s) for the requests to end."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class Server(uvicorn.Server):
        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            asyncio.get_running_loop().set_exception_handler(AcceptFailures())
            await super().serve(sockets)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            if on_shutdown is not None:
                on_shutdown()
            await super().shutdown(sockets)

    limit = connection_limit(limit_concurrency, raise_open_files_limit())
    # uvicorn answers 503 from `limit_concurrency` connections or tasks on; the guard keeps at most `limit`
    # connections, each of which is served
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, limit_concurrency=limit + 1,
                            http=guarded_protocol(AutoHTTPProtocol, header_timeout, limit),
                            timeout_graceful_shutdown=3)
    return Server(config)


# ---- Host and framing -------------------------------------------------------------------------------------------

def allowed_hosts(bind: str, extra: Iterable[str] = ()) -> list[str] | None:
    """The Host names a server bound to `bind` answers to: the bound name or address, the loopback names, and
    `extra` (`--allowed-hosts`; "*" = any: None; ".example.com" = that domain and its subdomains). A server bound to
    every interface (0.0.0.0, ::) also answers to any IP address (a DNS-rebinding page must use a name) and to this
    machine's host names."""
    names = [h.strip().lower().rstrip(".") for h in extra if h.strip()]
    if "*" in names:
        return None
    names += [bind.strip("[]").lower().rstrip("."), *LOOPBACK_NAMES]
    if bind in WILDCARD_BINDS:
        names += ["<ip>", socket.gethostname().lower(), socket.getfqdn().lower()]
    return sorted(set(n for n in names if n))


def host_of(header: str) -> str:
    """The name or address of a Host header, without its port: "[::1]:8000" -> "::1", "Example.com.:80" ->
    "example.com"."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    if h.count(":") == 1:
        h = h.split(":")[0]
    return h.rstrip(".")


def _is_ip(h: str) -> bool:
    try:
        ipaddress.ip_address(h)
        return True
    except ValueError:
        return False


def host_allowed(host: str, allowed: list[str]) -> bool:
    return (host in allowed or "<ip>" in allowed and _is_ip(host)
            or any(a.startswith(".") and (host == a[1:] or host.endswith(a)) for a in allowed))


SECURITY_HEADERS = [(b"x-frame-options", b"DENY"), (b"content-security-policy", b"frame-ancestors 'none'"),
                    (b"x-content-type-options", b"nosniff")]


class HostGuard:
    """ASGI middleware: 421 for a Host this server does not answer to (`allowed`: None = any), and
    SECURITY_HEADERS on every response."""

    def __init__(self, app: Any, allowed: list[str] | None):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_secured(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), *SECURITY_HEADERS])
            await send(message)

        raw = dict(scope.get("headers") or []).get(b"host")
        host = host_of(raw.decode("latin-1")) if raw is not None else None
        if self.allowed is None or host is None or host_allowed(host, self.allowed):
            await self.app(scope, receive, send_secured)
            return
        shown = ", ".join("any IP address" if a == "<ip>" else a for a in self.allowed)
        refused = error(421, f"Host '{host[:100]}' is not a name this server answers to ({shown}); start it with "
                        "--allowed-hosts NAME to serve it under another name", code="invalid_host")
        await refused(scope, receive, send_secured)
