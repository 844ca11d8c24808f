"""Long requests and idle connections against a real `mbd-rs serve` (the hostile-input checks), with a bounded run time.

    . .venv/bin/activate && python benches/serving/hostile_serve.py         # ~1-2 min on 2 shared cores
    python benches/serving/hostile_serve.py --long 8000 --idle 1100 --out /tmp/hostile_serve.json
    python benches/serving/hostile_serve.py --cases slow_bodies,text_fields --slow-bodies 50   # the body checks alone

The server: `python -m mbd_rs serve` in its own process on 127.0.0.1, the embedded model copied with
`max_position_embeddings: 131072` (every real checkpoint has a 32k-128k context), default limits unless a case says.
Cases, each timed on the client:
  1. refused: a 100,000-token prompt (`use_cache: false`, 600 KB of JSON): status, error code, seconds to the answer.
  2. beside: a small chat request ("sort 5 3 9 1", 16 tokens) alone, then repeatedly while a long allowed prompt
     (`--long` tokens, max_tokens 4) prefills beside it: each small request's latency, and the long one's time.
  3. deadline: a no-cache request over 6000 positions (tens of seconds of work) against `--request-timeout 2`:
     the seconds to its 504, and the slots free after it.
  4. client gone: a non-streaming n=4 no-cache request whose client gives up after 0.5 s: the seconds from the
     client leaving to /health's `active` back at 0.
  5. idle connections: `--idle` sockets that each send one byte and stall (more than the common 1024-file limit),
     then small requests while they are open: latency, how many were answered, the server's open fds, and how long
     until the stalled sockets are closed (`--header-timeout`).
  6. SIGTERM with two long requests in flight (one streaming): the seconds until the process has exited.
  7. slow bodies: `--slow-bodies` N connections that send a request's headers and the start of its body, then stall,
     against `--limit-concurrency N --body-timeout T` (`--body-timeout`; 0: the server's default, for a build
     without the flag): the seconds for each of 5 new small requests to be answered (before the fix: refused, every
     connection place held until --request-timeout), how many stalled ones were replaced at the cap or got 408 (and
     when), and the server's log (tracebacks, lines).
  8. text fields: four /v1/chat/completions requests at once, each with `"tccf": true` and a 3 MB `tccf_check`
     (`tccf_trigger: " "`, one token of the embedded model's vocabulary, so that the check text is used): statuses,
     seconds, and the server's RSS before, sampled peak during (and VmHWM) and after.
`--cases` runs a subset (comma-separated names: refused, beside, client_gone, deadline, idle, sigterm, slow_bodies,
text_fields). Every request has a timeout and the whole run `--time-budget`; the server is killed at the end whatever happens.
Writes a JSON report (default benches/results/reliability/hostile_serve.json); exit status 1 if a check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import httpx

import mbd_rs
from serving import HOST, ServerProc

# this harness's results: benches/results/reliability/
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "reliability")
SMALL = {"messages": [{"role": "user", "content": "sort 5 3 9 1"}], "max_tokens": 16}
CASES = ("refused", "beside", "client_gone", "deadline", "idle", "sigterm", "slow_bodies", "text_fields")
LONG_NO_CACHE = {"prompt": [87] * 6000, "max_tokens": 8, "use_cache": False}


def long_context_model(root: str) -> str:
    d = os.path.join(root, "mbd-tiny-131k")
    shutil.copytree(mbd_rs.DEFAULT_MODEL, d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 131072
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def server(model: str, *flags: str) -> ServerProc:
    """The long-context model served with 8 slots (and `flags`); stopped with SIGTERM, as a service manager does."""
    return ServerProc("--model", model, "--max-concurrency", "8", *flags, stop_signal=signal.SIGTERM,
                      log_prefix="mbd-hostile-")


def timed_post(base: str, route: str, body: dict[str, Any], timeout: float) -> tuple[Any, float]:
    t0 = time.perf_counter()
    try:
        r = httpx.post(base + route, json=body, timeout=timeout)
        out: Any = r
    except httpx.HTTPError as e:
        out = type(e).__name__
    return out, time.perf_counter() - t0


def small_latency(base: str, timeout: float = 30) -> float:
    r, dt = timed_post(base, "/v1/chat/completions", SMALL, timeout)
    assert not isinstance(r, str) and r.status_code == 200, r
    return dt


def wait_active(s: ServerProc, want: int, timeout: float) -> float:
    active, waited = s.wait_active(want, timeout)
    if active != want:
        raise AssertionError(f"active did not reach {want} in {timeout} s")
    return waited


def case_refused(s: ServerProc) -> dict[str, Any]:
    body = {"prompt": [5] * 100_000, "max_tokens": 4, "use_cache": False}
    times, last = [], None
    for _ in range(3):
        r, dt = timed_post(s.base, "/v1/completions", body, 30)
        times.append(dt)
        last = r
    assert not isinstance(last, str)
    return {"status": last.status_code, "code": last.json()["error"]["code"], "seconds": [round(t, 3) for t in times],
            "ok": last.status_code == 400 and max(times) < 2.0}


def case_beside(s: ServerProc, n_long: int) -> dict[str, Any]:
    alone = [small_latency(s.base) for _ in range(5)]
    box: list[Any] = []

    def long() -> None:
        box.append(timed_post(s.base, "/v1/completions", {"prompt": [87] * n_long, "max_tokens": 4}, 300))

    t = threading.Thread(target=long)
    t.start()
    wait_active(s, 1, 10)
    beside = []
    while t.is_alive():
        beside.append(small_latency(s.base))
    t.join()
    r, long_s = box[0]
    return {"long_prompt_tokens": n_long, "long_status": getattr(r, "status_code", r), "long_seconds": round(long_s, 2),
            "small_alone_s": {"median": round(statistics.median(alone), 3), "max": round(max(alone), 3)},
            "small_beside_s": {"n": len(beside), "median": round(statistics.median(beside), 3) if beside else None,
                               "max": round(max(beside), 3) if beside else None},
            "ok": bool(beside) and max(beside) < 0.5}


def case_deadline(model: str) -> dict[str, Any]:
    s = server(model, "--request-timeout", "2")
    try:
        r, dt = timed_post(s.base, "/v1/completions", LONG_NO_CACHE, 60)
        free = wait_active(s, 0, 5)
        status = getattr(r, "status_code", r)
        return {"status": status, "seconds": round(dt, 2), "slots_free_after_s": round(free, 3),
                "ok": status == 504 and dt < 4}
    finally:
        s.stop()


def case_client_gone(s: ServerProc) -> dict[str, Any]:
    r, _ = timed_post(s.base, "/v1/completions", dict(LONG_NO_CACHE, n=4), 0.5)
    t0 = time.perf_counter()
    free = wait_active(s, 0, 30)
    return {"client": r if isinstance(r, str) else r.status_code, "slots_free_after_s": round(free, 3),
            "ok": time.perf_counter() - t0 < 1.5}


def case_idle(model: str, n: int, header_timeout: float) -> dict[str, Any]:
    s = server(model, "--header-timeout", str(header_timeout))
    socks: list[socket.socket] = []
    try:
        fds_before = s.fds()
        for _ in range(n):
            try:
                c = socket.create_connection((HOST, s.port), timeout=5)
                c.sendall(b"G")
                socks.append(c)
            except OSError:
                break
        answered, lat = 0, []
        t0 = time.perf_counter()
        for _ in range(5):
            r, dt = timed_post(s.base, "/v1/chat/completions", SMALL, 30)
            if not isinstance(r, str) and r.status_code == 200:
                answered += 1
                lat.append(dt)
        fds_during = s.fds()
        closed, t1 = 0, time.perf_counter()
        for c in socks:
            c.settimeout(max(0.1, header_timeout + 5 - (time.perf_counter() - t0)))
            try:
                closed += c.recv(1) == b""
            except (ConnectionResetError, socket.timeout):
                closed += 1
        log = s.log_text()
        return {"stalled_sockets": len(socks), "small_answered": answered,
                "small_latency_s": [round(x, 3) for x in lat],
                "server_fds_before": fds_before, "server_fds_during": fds_during, "stalled_closed": closed,
                "all_closed_within_s": round(time.perf_counter() - t1, 2), "tracebacks_in_log": log.count("Traceback"),
                "ok": answered == 5 and closed == len(socks) and "Traceback" not in log}
    finally:
        for c in socks:
            c.close()
        s.stop()


HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{\"messages\": ")


def case_slow_bodies(model: str, n: int, body_timeout: float) -> dict[str, Any]:
    flags = ["--limit-concurrency", str(n)] + (["--body-timeout", str(body_timeout)] if body_timeout else [])
    s = server(model, *flags)
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            c = socket.create_connection((HOST, s.port), timeout=5)
            c.sendall(HEAD)
            socks.append(c)
        time.sleep(0.5)  # every one's headers are in: they wait for their bodies
        t0 = time.perf_counter()
        answered, lat, failures = 0, [], []
        for _ in range(5):
            r, dt = timed_post(s.base, "/v1/chat/completions", SMALL, 30)
            if not isinstance(r, str) and r.status_code == 200:
                answered += 1
                lat.append(dt)
            else:
                failures.append(getattr(r, "status_code", r))
        # what became of the stalled connections: replaced (closed without a response) or 408, and when
        replaced, got_408, other, last = 0, 0, 0, 0.0
        wait = (body_timeout or 30.0) + 5
        for c in socks:
            c.settimeout(max(0.1, wait - (time.perf_counter() - t0)))
            try:
                got = c.recv(64)
            except ConnectionResetError:
                got = b""
            except socket.timeout:
                other += 1
                continue
            last = time.perf_counter() - t0
            if got.startswith(b"HTTP/1.1 408"):
                got_408 += 1
            elif not got:
                replaced += 1
            else:
                other += 1
        for c in socks:
            c.close()
        time.sleep(0.5)
        log = s.log_text()
        bound = body_timeout or 30.0
        return {"slow_bodies": n, "limit_concurrency": n, "body_timeout": body_timeout or "default",
                "small_answered": answered, "small_latency_s": [round(x, 3) for x in lat], "small_failures": failures,
                "stalled_replaced": replaced, "stalled_408": got_408, "stalled_open_or_other": other,
                "last_stalled_ended_after_s": round(last, 2), "tracebacks_in_log": log.count("Traceback"),
                "log_lines": len(log.splitlines()), "log_bytes": len(log),
                "ok": answered == 5 and max(lat) < bound and "Traceback" not in log}
    finally:
        for c in socks:
            c.close()
        s.stop()


def _rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process, in MB."""
    with open(f"/proc/{pid}/status") as f:
        d = dict(line.split(":", 1) for line in f if ":" in line)
    return int(d["VmRSS"].split()[0]) / 1024, int(d["VmHWM"].split()[0]) / 1024


def case_text_fields(model: str, mb: float = 3.0) -> dict[str, Any]:
    s = server(model)
    try:
        small_latency(s.base)  # warm: the first request's allocations are not the fields'
        time.sleep(0.5)
        before, _ = _rss_mb(s.proc.pid)
        body = dict(SMALL, tccf=True, tccf_trigger=" ", tccf_check="x" * int(mb * (1 << 20)))
        results: list[Any] = [None] * 4

        def post(i: int) -> None:
            results[i] = timed_post(s.base, "/v1/chat/completions", body, 120)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(4)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        peak = before
        while any(t.is_alive() for t in threads):
            peak = max(peak, _rss_mb(s.proc.pid)[0])
            time.sleep(0.05)
        took = time.perf_counter() - t0
        time.sleep(1.0)
        after, hwm = _rss_mb(s.proc.pid)
        statuses = [getattr(r, "status_code", r) for r, _ in results]
        first = next((r for r, _ in results if not isinstance(r, str)), None)
        said = None
        if first is not None and first.status_code != 200:
            said = first.json().get("error", {}).get("message", "")[:160]
        return {"field_mb": mb, "requests": 4, "statuses": statuses, "error": said,
                "seconds": [round(dt, 2) for _, dt in results], "all_done_s": round(took, 2),
                "rss_before_mb": round(before), "rss_peak_sampled_mb": round(peak), "rss_hwm_mb": round(hwm),
                "rss_after_mb": round(after), "small_after_s": round(small_latency(s.base), 3),
                "ok": all(isinstance(x, int) for x in statuses) and after - before < 64 and peak - before < 256}
    finally:
        s.stop()


def case_sigterm(model: str) -> dict[str, Any]:
    s = server(model)
    results: list[Any] = []
    threads = [threading.Thread(target=lambda b=b: results.append(timed_post(s.base, "/v1/completions", b, 60)[0]))
               for b in (LONG_NO_CACHE, dict(LONG_NO_CACHE, stream=True))]
    for t in threads:
        t.start()
    wait_active(s, 2, 10)
    time.sleep(0.5)
    t0 = time.perf_counter()
    s.proc.send_signal(signal.SIGTERM)
    try:
        s.proc.wait(timeout=30)
    finally:
        s.stop()
    took = time.perf_counter() - t0
    for t in threads:
        t.join(timeout=10)
    return {"exit_seconds": round(took, 2), "returncode": s.proc.returncode,
            "requests": [getattr(r, "status_code", r) for r in results], "ok": took < 5}


def _simd() -> str:
    """The widest x86 vector extension /proc/cpuinfo names (AVX-512, AVX2), or what the platform is."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=8000, help="tokens of the long prompt beside small requests")
    ap.add_argument("--idle", type=int, default=1100, help="stalled connections")
    ap.add_argument("--header-timeout", type=float, default=2.0)
    ap.add_argument("--slow-bodies", type=int, default=50, help="stalled bodies, and the connection cap")
    ap.add_argument("--body-timeout", type=float, default=5.0,
                    help="the server's --body-timeout in the slow-bodies case (0: not passed, the server's default)")
    ap.add_argument("--text-field-mb", type=float, default=3.0, help="size of each tccf_check in the text-fields case")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated cases to run (default: all)")
    ap.add_argument("--time-budget", type=float, default=600.0, help="whole run; later cases are skipped past it")
    ap.add_argument("--out", default=os.path.join(RESULTS, "hostile_serve.json"))
    a = ap.parse_args()
    wanted = [c.strip() for c in a.cases.split(",") if c.strip()]
    if unknown := sorted(set(wanted) - set(CASES)):
        ap.error(f"unknown case(s) {unknown}; the cases are {', '.join(CASES)}")
    t_start = time.time()
    root = tempfile.mkdtemp(prefix="mbd-hostile-")
    model = long_context_model(root)
    report: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d"),
                              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "simd": _simd(),
                                          "load_avg": os.getloadavg()}, "cases": {}}
    try:
        shared = [c for c in ("refused", "beside", "client_gone") if c in wanted]
        if shared:
            s = server(model)
            try:
                for name in shared:
                    report["cases"][name] = {"refused": lambda: case_refused(s),
                                             "beside": lambda: case_beside(s, a.long),
                                             "client_gone": lambda: case_client_gone(s)}[name]()
            finally:
                s.stop()
        for name, run in [("deadline", lambda: case_deadline(model)),
                          ("idle", lambda: case_idle(model, a.idle, a.header_timeout)),
                          ("sigterm", lambda: case_sigterm(model)),
                          ("slow_bodies", lambda: case_slow_bodies(model, a.slow_bodies, a.body_timeout)),
                          ("text_fields", lambda: case_text_fields(model, a.text_field_mb))]:
            if name not in wanted:
                continue
            if time.time() - t_start > a.time_budget:
                report["cases"][name] = {"skipped": "time budget"}
                continue
            report["cases"][name] = run()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["seconds"] = round(time.time() - t_start, 1)
    report["ok"] = all(c.get("ok", True) for c in report["cases"].values())
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
