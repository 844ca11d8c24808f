"""Soak proof of the server and the streaming API: a real `mbd-rs serve` process under concurrent streaming clients with disconnects,
then streams opened and cancelled through the Python API.

    . .venv/bin/activate && python benches/serving/soak.py    # ~2-5 min on 2 shared cores
    python benches/serving/soak.py --rounds 5 --per-round 10 --clients 32 --out /tmp/soak.json

Part 1 (server, separate process, 127.0.0.1 only, embedded model, --max-concurrency 8):
  * reference: each prompt's single-client greedy output (non-streaming request, temperature 0);
  * rounds: `clients` threads, each with its own official `openai` client, send `per_round` streaming chat requests
    each per round; a fixed 20% of requests close the response after the first content chunk (a disconnect
    mid-stream); 503 (server at its concurrency limit) is retried with a short jittered backoff, as documented.
    Checked: every other request finishes (finish_reason stop/length) with text equal to its reference, a
    disconnected request's partial text is a prefix of its reference, /health `active` is back to 0 after each
    round; the server's VmRSS (and threads, open fds) is read from /proc after each round.
Part 2 (in-process Python API): `api_streams` streams opened and cancelled in rotating ways (cancel, close, cancel
  then close, context manager, drop without closing, with one chunk taken or none), interleaved with full
  generations checked against the reference; this process's RSS before/after.

Bounded everywhere: per-request timeouts, a retry cap, per-round and whole-run deadlines; the server is stopped at
the end whatever happens. Writes a JSON report (default benches/results/reliability/soak.json); exit status 1 if any check failed.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import threading
import time
from typing import Any

import openai

import mbd_rs
from serving import ServerProc

# this harness's results: benches/results/reliability/
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "reliability")

KEY = "sk-soak-" + os.urandom(6).hex()
MODEL = "mbd-tiny"
GREEDY_EXTRA: dict[str, Any] = {}
# One token per forward with no early stop: a long generation, so disconnects really land mid-stream.
SLOW_EXTRA = {"block_size": 1, "threshold": 0.0, "block_add_threshold": 1.0, "early_stop": False}
CASES = [  # (name, user message, extra body fields)
    ("sort", "sort 5 3 9 1", GREEDY_EXTRA),
    ("reverse", "reverse a b c d", GREEDY_EXTRA),
    ("repeat", "repeat ab 3", GREEDY_EXTRA),
    ("hello", "hello Ada", GREEDY_EXTRA),
    ("add", "add 12+30", GREEDY_EXTRA),
    ("hello-slow", "hello Ada", SLOW_EXTRA),
]


def proc_status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "Threads"):
                out[k] = int(v.split()[0])
    try:
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        out["fds"] = -1
    return out


def client(base: str, timeout: float) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=timeout)


def reference(base: str, timeout: float) -> dict[str, dict[str, Any]]:
    c = client(base, timeout)
    ref = {}
    for name, msg, extra in CASES:
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": msg}], max_tokens=40,
                                      temperature=0, extra_body=extra or None)
        ref[name] = {"text": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason,
                     "completion_tokens": r.usage.completion_tokens if r.usage else None}
    return ref


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.completed = 0
        self.disconnected = 0
        self.disconnect_after_finish = 0  # planned disconnect, but the first content chunk already carried the finish
        self.retries_503 = 0
        self.max_retries_one_request = 0
        self.failed: list[str] = []
        self.mismatches: list[dict[str, Any]] = []
        self.finish: dict[str, int] = {}
        self.latencies: list[float] = []


def one_request(c: openai.OpenAI, case: tuple[str, str, dict[str, Any]], disconnect: bool, ref: dict[str, Any],
                tally: Tally, rng: random.Random, max_retries: int, deadline: float) -> None:
    name, msg, extra = case
    retries = 0
    t0 = time.time()
    while True:
        try:
            stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": msg}], max_tokens=40,
                                               temperature=0, stream=True, extra_body=extra or None)
            break
        except openai.APIStatusError as e:
            if e.status_code == 503 and retries < max_retries and time.time() < deadline:
                retries += 1
                time.sleep(rng.uniform(0.005, 0.03) * min(retries, 4))  # short jittered backoff
                continue
            with tally.lock:
                tally.retries_503 += retries
                tally.failed.append(f"{name}: HTTP {e.status_code} after {retries} retries: {str(e)[:200]}")
            return
        except Exception as e:  # noqa: BLE001 -- every other failure is a failed completion
            with tally.lock:
                tally.retries_503 += retries
                tally.failed.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            return
    text, finish, closed_early = "", None, False
    try:
        for chunk in stream:
            if not chunk.choices:
                continue
            ch = chunk.choices[0]
            if ch.delta.content:
                text += ch.delta.content
            if ch.finish_reason:
                finish = ch.finish_reason
            if disconnect and ch.delta.content:
                stream.close()  # drop the connection mid-stream
                closed_early = True
                break
    except Exception as e:  # noqa: BLE001
        with tally.lock:
            tally.retries_503 += retries
            tally.failed.append(f"{name}: during stream: {type(e).__name__}: {str(e)[:200]}")
        return
    finally:
        if not closed_early:
            stream.close()
    with tally.lock:
        tally.retries_503 += retries
        tally.max_retries_one_request = max(tally.max_retries_one_request, retries)
        if closed_early and finish is None:
            tally.disconnected += 1
            if not ref["text"].startswith(text):
                tally.mismatches.append({"case": name, "kind": "partial-not-prefix", "got": text, "want": ref["text"]})
            return
        if closed_early:
            tally.disconnect_after_finish += 1
        if finish not in ("stop", "length"):
            tally.failed.append(f"{name}: stream ended without finish_reason (text {text!r})")
            return
        tally.completed += 1
        tally.latencies.append(time.time() - t0)
        tally.finish[finish] = tally.finish.get(finish, 0) + 1
        if text != ref["text"] or finish != ref["finish_reason"]:
            tally.mismatches.append({"case": name, "got": text, "got_finish": finish, "want": ref["text"],
                                     "want_finish": ref["finish_reason"]})


def run_round(base: str, rnd: int, clients: int, per_round: int, disconnect_every: int, ref: dict[str, Any],
              timeout: float, max_retries: int, round_timeout: float) -> Tally:
    tally = Tally()
    deadline = time.time() + round_timeout

    def worker(ci: int) -> None:
        rng = random.Random(rnd * 1000 + ci)
        c = client(base, timeout)
        try:
            for j in range(per_round):
                if time.time() > deadline:
                    with tally.lock:
                        tally.failed.append(f"client {ci}: round deadline passed before request {j}")
                    return
                k = ci * per_round + j  # request number inside the round
                case = CASES[(k + rnd) % len(CASES)]
                disconnect = k % disconnect_every == disconnect_every - 1  # exactly 1 in disconnect_every
                one_request(c, case, disconnect, ref[case[0]], tally, rng, max_retries, deadline)
        finally:
            c.close()

    ts = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=max(0.1, deadline + timeout - time.time()))
    alive = sum(t.is_alive() for t in ts)
    if alive:
        tally.failed.append(f"{alive} client threads still running after the round deadline")
    return tally


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def api_soak(n: int, check_every: int, ref: dict[str, Any]) -> dict[str, Any]:
    eng = mbd_rs.Engine.load()
    prompts = {name: eng.apply_chat_template([{"role": "user", "content": msg}]) for name, msg, _ in CASES}
    # the in-process reference must equal the server's
    local_ref = {name: eng.generate(prompts[name], max_tokens=40, **extra).text for name, _, extra in CASES}
    ref_diff = {k: {"api": local_ref[k], "server": ref[k]["text"]} for k in local_ref if local_ref[k] != ref[k]["text"]}
    for _ in range(50):  # warm-up, so allocator pools are filled before the baseline
        s = eng.stream(prompts["hello-slow"], max_tokens=40, **SLOW_EXTRA)
        next(s, None)
        s.cancel()
        s.close()
    gc.collect()
    before = proc_status(os.getpid())
    modes = ["none+cancel", "one+cancel", "one+close", "one+cancel+close", "none+close", "one+with", "one+drop",
             "none+drop"]
    counts = {m: 0 for m in modes}
    checks = mismatches = errors = 0
    mismatch_detail: list[dict[str, Any]] = []
    mid: dict[str, int] = {}
    t0 = time.time()
    for i in range(n):
        name, _, extra = CASES[i % len(CASES)]
        mode = modes[i % len(modes)]
        try:
            if mode == "one+with":
                with eng.stream(prompts[name], max_tokens=40, **extra) as s:
                    next(s, None)
            else:
                s = eng.stream(prompts[name], max_tokens=40, **extra)
                if mode.startswith("one"):
                    next(s, None)
                if "cancel" in mode:
                    s.cancel()
                if "close" in mode:
                    s.close()
                del s  # "drop" modes rely on this alone
            counts[mode] += 1
        except Exception as e:  # noqa: BLE001
            errors += 1
            mismatch_detail.append({"i": i, "mode": mode, "error": f"{type(e).__name__}: {e}"[:200]})
        if i % check_every == check_every - 1:
            cname = CASES[(i // check_every) % len(CASES)][0]
            cextra = CASES[(i // check_every) % len(CASES)][2]
            got = eng.generate(prompts[cname], max_tokens=40, **cextra).text
            checks += 1
            if got != ref[cname]["text"]:
                mismatches += 1
                mismatch_detail.append({"i": i, "case": cname, "got": got, "want": ref[cname]["text"]})
        if i == n // 2 - 1:
            gc.collect()
            mid = proc_status(os.getpid())
    gc.collect()
    after = proc_status(os.getpid())
    return {"streams": n, "by_mode": counts, "errors": errors, "full_generations_checked": checks,
            "mismatches": mismatches, "detail": mismatch_detail[:20], "reference_api_vs_server_diff": ref_diff,
            "seconds": round(time.time() - t0, 2), "rss_kb_before": before["VmRSS"], "rss_kb_mid": mid.get("VmRSS"),
            "rss_kb_after": after["VmRSS"], "rss_growth_pct": round(100 * (after["VmRSS"] - before["VmRSS"]) /
                                                                    before["VmRSS"], 2),
            "threads_before": before["Threads"], "threads_after": after["Threads"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=10, help="requests per client per round")
    ap.add_argument("--disconnect-every", type=int, default=5, help="1 request in N disconnects (5 = 20%%)")
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--api-streams", type=int, default=1000)
    ap.add_argument("--api-check-every", type=int, default=50)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--max-503-retries", type=int, default=2000, help="per request, then it counts as failed")
    ap.add_argument("--round-timeout", type=float, default=240.0)
    ap.add_argument("--time-budget", type=float, default=840.0, help="whole run; later rounds are skipped past it")
    ap.add_argument("--out", default=os.path.join(RESULTS, "soak.json"))
    a = ap.parse_args()

    t_start = time.time()
    report: dict[str, Any] = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs "
        f"(shared), Python {platform.python_version()}, openai {openai.__version__}",
        "config": {k: v for k, v in vars(a).items() if k != "out"},
        "cases": [{"name": n, "message": m, "extra_body": e} for n, m, e in CASES]}
    srv = ServerProc("--max-concurrency", str(a.max_concurrency), api_key=KEY, log_prefix="mbd-soak-server-")
    rounds: list[dict[str, Any]] = []
    try:
        print(f"server pid {srv.proc.pid} on {srv.base}, start RSS {proc_status(srv.proc.pid)['VmRSS']} kB", flush=True)
        ref = reference(srv.base, a.request_timeout)
        report["reference"] = ref
        for k, v in ref.items():
            print(f"  reference {k:11s} {v['finish_reason']:6s} {v['text']!r}")
        report["server_rss_kb_start"] = proc_status(srv.proc.pid)["VmRSS"]
        for rnd in range(1, a.rounds + 1):
            if time.time() - t_start > a.time_budget * 0.7:
                print(f"round {rnd}: skipped, time budget nearly spent", flush=True)
                report.setdefault("skipped_rounds", []).append(rnd)
                continue
            t0 = time.time()
            tally = run_round(srv.base, rnd, a.clients, a.per_round, a.disconnect_every, ref, a.request_timeout,
                              a.max_503_retries, a.round_timeout)
            secs = time.time() - t0
            active, waited = srv.wait_active(0, 30.0)
            st = proc_status(srv.proc.pid)
            r = {"round": rnd, "requests": a.clients * a.per_round, "completed": tally.completed,
                 "disconnected": tally.disconnected, "disconnect_after_finish": tally.disconnect_after_finish,
                 "retries_503": tally.retries_503, "max_503_retries_one_request": tally.max_retries_one_request,
                 "failed": len(tally.failed), "failures": tally.failed[:20], "mismatches": len(tally.mismatches),
                 "mismatch_detail": tally.mismatches[:20], "finish_reasons": tally.finish,
                 "active_after": active, "idle_wait_s": round(waited, 3), "seconds": round(secs, 2),
                 "latency_p50_s": pct(tally.latencies, 0.5), "latency_p95_s": pct(tally.latencies, 0.95),
                 "rss_kb": st["VmRSS"], "hwm_kb": st["VmHWM"], "threads": st["Threads"], "fds": st["fds"]}
            for k in ("latency_p50_s", "latency_p95_s"):
                if r[k] is not None:
                    r[k] = round(r[k], 4)
            rounds.append(r)
            print(f"round {rnd}: {r['completed']} completed, {r['disconnected']} disconnected "
                  f"(+{r['disconnect_after_finish']} closed after finish), {r['retries_503']} 503 retries, "
                  f"{r['failed']} failed, {r['mismatches']} mismatches, active after {active}, RSS {st['VmRSS']} kB, "
                  f"threads {st['Threads']}, fds {st['fds']}, {secs:.1f} s", flush=True)
            for f in tally.failed[:5]:
                print("   failed:", f)
            for m in tally.mismatches[:5]:
                print("   mismatch:", m)
        report["server_health_end"] = srv.health()
    finally:
        rc = srv.stop()
        log = srv.log_text()
        report["server_exit_code"] = rc
        report["server_log_tail"] = log[-3000:]
        report["server_log_tracebacks"] = log.count("Traceback")
        os.unlink(srv.log.name)
    report["rounds"] = rounds
    rss = [r["rss_kb"] for r in rounds]
    growth = round(100 * (rss[-1] - rss[1]) / rss[1], 2) if len(rss) >= 3 else None
    report["server_rss_growth_round2_to_last_pct"] = growth
    tot = {k: sum(r[k] for r in rounds) for k in ("requests", "completed", "disconnected", "disconnect_after_finish",
                                                   "retries_503", "failed", "mismatches")}
    report["totals"] = tot

    print(f"API: {a.api_streams} streams opened and cancelled in-process ...", flush=True)
    api = api_soak(a.api_streams, a.api_check_every, report["reference"])
    report["api"] = api
    report["seconds_total"] = round(time.time() - t_start, 1)

    checks = {
        "all_rounds_ran": len(rounds) == a.rounds,
        "zero_failed_completions": tot["failed"] == 0,
        "zero_mismatches": tot["mismatches"] == 0,
        "every_request_accounted": tot["completed"] + tot["disconnected"] + tot["failed"] == tot["requests"],
        "slots_back_to_zero_each_round": all(r["active_after"] == 0 for r in rounds),
        "server_rss_growth_under_10pct": growth is not None and growth < 10,
        "server_clean_log": report["server_log_tracebacks"] == 0,
        "api_zero_errors": api["errors"] == 0,
        "api_zero_mismatches": api["mismatches"] == 0 and not api["reference_api_vs_server_diff"],
    }
    report["checks"] = checks
    report["pass"] = all(checks.values())
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")

    print("\n== soak summary ==")
    print(f"requests {tot['requests']}: completed {tot['completed']}, disconnected mid-stream {tot['disconnected']} "
          f"(+{tot['disconnect_after_finish']} planned disconnects whose first content chunk already finished), "
          f"503 retries {tot['retries_503']}, failed {tot['failed']}, mismatches {tot['mismatches']}")
    print("active after each round:", [r["active_after"] for r in rounds])
    print("server RSS kB per round:", rss, f"(start {report['server_rss_kb_start']}); growth round 2 -> last: {growth}%")
    print("server threads per round:", [r["threads"] for r in rounds], " fds:", [r["fds"] for r in rounds])
    print(f"API: {api['streams']} streams {api['by_mode']}, {api['errors']} errors, {api['full_generations_checked']} "
          f"full generations checked, {api['mismatches']} mismatches, RSS {api['rss_kb_before']} -> {api['rss_kb_mid']}"
          f" -> {api['rss_kb_after']} kB ({api['rss_growth_pct']}%), {api['seconds']} s")
    print(f"total {report['seconds_total']} s; checks: " + ", ".join(f"{k}={v}" for k, v in checks.items()))
    print("PASS" if report["pass"] else "FAIL", "->", a.out)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
