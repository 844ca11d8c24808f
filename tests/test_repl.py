"""The command line as people meet it: `mbd-rs chat` at a terminal (readline history, Ctrl-C, Ctrl-D, the /commands),
the load's stage lines where stderr is not a terminal, and the prefill note."""
import builtins
import io
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

import mbd_rs
from mbd_rs import cli

STEP_SECONDS = 60  # each step of a pty session may take this long (a slow, shared machine)


class Pty:
    """`python -m mbd_rs ARGS` with a pseudo-terminal as its controlling terminal, stdin, stdout and stderr."""

    def __init__(self, args, env):
        import pty
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            try:
                signal.signal(signal.SIGINT, signal.SIG_DFL)  # a test runner's worker may ignore it; Ctrl-C is tested
                os.execve(sys.executable, [sys.executable, "-m", "mbd_rs", *args], env)
            finally:
                os._exit(127)
        self.out = b""
        self.mark = 0

    def send(self, data):
        os.write(self.fd, data)

    def _read(self, timeout):
        r, _, _ = select.select([self.fd], [], [], timeout)
        if not r:
            return False
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # the child closed the terminal (exited)
            chunk = b""
        if not chunk:
            raise EOFError
        self.out += chunk
        return True

    def expect(self, what, timeout=STEP_SECONDS):
        """Wait until `what` (bytes) appears after the mark; return what came before it, and move the mark past it."""
        deadline = time.monotonic() + timeout
        while True:
            at = self.out.find(what, self.mark)
            if at >= 0:
                before, self.mark = self.out[self.mark:at], at + len(what)
                return before
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {what!r} within {timeout} s; the terminal showed:\n{self.out[-3000:]!r}")
            try:
                self._read(min(left, 1.0))
            except EOFError:
                raise AssertionError(f"the program exited before {what!r}:\n{self.out[-3000:]!r}") from None

    def alive(self):
        return os.waitpid(self.pid, os.WNOHANG) == (0, 0)

    def wait(self, timeout=STEP_SECONDS):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self._read(0.2)
            except EOFError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        raise AssertionError(f"still running after {timeout} s:\n{self.out[-3000:]!r}")

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


def _env(tmp_path):
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"), TERM="xterm", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(mbd_rs.__file__)),
                                                    env.get("PYTHONPATH")] if p)
    return env


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32", reason="needs a pseudo-terminal (pty)")
def test_chat_at_a_terminal(tmp_path):
    """At a terminal: an answer; the up arrow recalls the line and Enter sends it again (a second answer); Ctrl-C at
    the prompt gives a fresh prompt; /system is acknowledged; an empty line does nothing; Ctrl-D exits 0 and the
    history is kept under XDG_STATE_HOME. No load lines: a terminal gets the bar (none for the small embedded
    model)."""
    want = mbd_rs.Engine.load().chat([{"role": "user", "content": "sort 3 1 2"}], max_tokens=16).text.encode()
    p = Pty(["chat", "--max-tokens", "16", "--stats"], _env(tmp_path))
    try:
        p.expect(b"Ctrl-D quits")
        p.expect(b"> ")
        p.send(b"sort 3 1 2\r")
        p.expect(want)
        p.expect(b"tokens/forward")
        p.expect(b"> ")
        p.send(b"\x1b[A")  # up arrow: readline shows the previous line
        p.expect(b"sort 3 1 2")
        p.send(b"\r")
        p.expect(want)  # answered again
        p.expect(b"tokens/forward")
        p.expect(b"> ")
        # Ctrl-C at the prompt. Not at once: CPython's readline loop reads a signal only when it interrupts its
        # select(), so a SIGINT that lands between the prompt's write and the select() waits for the next key
        # (a person cannot be that fast; a test on a loaded machine can)
        time.sleep(0.5)
        p.send(b"\x03")
        p.expect(b"> ")
        time.sleep(0.5)
        assert p.alive()
        p.send(b"/system be brief\r")
        p.expect(b"system prompt set: be brief")
        p.expect(b"> ")
        p.send(b"\r")  # an empty line
        assert p.expect(b"> ").strip() == b""
        p.send(b"\x04")  # Ctrl-D
        assert p.wait() == 0
    finally:
        p.kill()
    assert b"mbd-rs: loading" not in p.out
    assert p.out.count(b"tokens/forward") == 2
    with open(tmp_path / "state" / "mbd-rs" / "chat_history", encoding="utf-8") as f:
        assert "sort 3 1 2" in f.read()


def _chat_in_process(monkeypatch, capsys, lines, args=()):
    """cmd_chat with `lines` as what the user types (input() patched; no terminal, so no readline)."""
    it = iter(lines)

    def fake_input(prompt=""):
        print(prompt, end="")
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr(builtins, "input", fake_input)
    a = cli.build_parser().parse_args(["chat", "--max-tokens", "16", "--stats", *args])
    assert cli.cmd_chat(a) == 0
    return capsys.readouterr()


def test_chat_commands_and_multiline(monkeypatch, capsys, tmp_path):
    """/system, /save, /reset, unknown commands, //text, backslash continuation; an empty line does not quit."""
    eng = mbd_rs.Engine.load()
    want = eng.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort 3 1 2"}],
                    max_tokens=16).text
    f = tmp_path / "conv.json"
    r = _chat_in_process(monkeypatch, capsys, ["", "/bogus", "sort 3 \\", "1 2", f"/save {f}", "/reset",
                                               "//x", f"/save {f}2"], ("--system", "be brief"))
    assert "unknown command /bogus" in r.err and "/help" in r.err
    assert "(saved 3 messages" in r.err and "history cleared" in r.err
    assert ". " in r.out  # the continuation prompt
    saved = json.loads(f.read_text(encoding="utf-8"))
    assert saved[:2] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort 3 \n1 2"}]
    assert saved[2]["role"] == "assistant"
    assert json.loads((tmp_path / "conv.json2").read_text())[1] == {"role": "user", "content": "/x"}
    r = _chat_in_process(monkeypatch, capsys, ["/system be brief", "sort 3 1 2", "/system", "/save"])
    assert "system prompt set: be brief; new conversation" in r.err and "system prompt cleared" in r.err
    assert r.out.startswith("> > " + want + "\n"), r.out
    assert "/save needs a file name" in r.err


def test_ctrl_c_stops_an_answer_and_its_stats_still_come(monkeypatch, capsys):
    """Ctrl-C while an answer streams: the generation is cancelled, "(interrupted ...)" and the stats line are
    printed, and the next line is answered as usual."""
    from mbd_rs import engine
    want = mbd_rs.Engine.load().chat([{"role": "user", "content": "reverse a b c"}], max_tokens=16).text
    real, calls = engine.Stream.__next__, []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(engine.Stream, "__next__", interrupted)
    r = _chat_in_process(monkeypatch, capsys, ["sort 7 1 2 9 5 4 3 8", "reverse a b c"])
    assert "(interrupted" in r.err
    assert r.err.count("tokens/forward") == 2, r.err
    assert r.out.endswith(want + "\n> "), r.out


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_prefill_note_on_a_terminal_only():
    out = _Tty()
    seen = iter([(0, 1536), (384, 1536), (1024, 1536)])
    last = [(1024, 1536)]

    def progress():
        last[0] = next(seen, last[0])
        return last[0]
    note = cli.PrefillNote(out, after=0.05, every=0.05).follow(progress)
    time.sleep(0.6)
    last[0] = (1536, 1536)
    time.sleep(0.3)
    note.clear()
    note.clear()
    assert out.getvalue() == ("prefilling 0% of 1536 tokens…\r\x1b[Kprefilling 25% of 1536 tokens…\r\x1b[K"
                              "prefilling 66% of 1536 tokens…\r\x1b[Kprefilled 1536 tokens, decoding…\r\x1b[K")
    out = _Tty()
    note = cli.PrefillNote(out, after=0.5).follow(lambda: (0, 1536))
    note.clear()  # the first text came in time
    time.sleep(0.8)
    assert out.getvalue() == ""
    out = io.StringIO()  # not a terminal
    note = cli.PrefillNote(out, after=0.01).follow(lambda: (0, 1536))
    time.sleep(0.2)
    note.clear()
    assert out.getvalue() == ""
    out = _Tty()  # a progress that fails to read shows nothing
    note = cli.PrefillNote(out, after=0.01, every=0.01).follow(lambda: 1 // 0)
    time.sleep(0.2)
    note.clear()
    assert out.getvalue() == ""


STAGES = ["resolving the path", "reading weights", "quantizing to q8_0", "ready in"]


def _stage_lines(err):
    lines = [line for line in err.splitlines() if line.startswith("mbd-rs: loading ")]
    found = [next((i for i, line in enumerate(lines) if s in line), None) for s in STAGES]
    return lines, found


def test_load_stage_lines_when_stderr_is_not_a_terminal():
    r = subprocess.run([sys.executable, "-m", "mbd_rs", "generate", "sort 3 1 2", "--max-tokens", "8",
                        "--quantize", "q8_0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines, found = _stage_lines(r.stderr)
    assert None not in found and found == sorted(found), lines
    assert re.search(r"reading weights [\d.]+/[\d.]+ MB$", lines[found[1]]), lines
    assert re.search(r"ready in [\d.]+ s \(q8_0", lines[found[3]]), lines
    assert len(lines) <= 8, lines  # short: a line per stage, a few for the weights
    r = subprocess.run([sys.executable, "-m", "mbd_rs", "generate", "sort 3 1 2", "--max-tokens", "8"],
                       capture_output=True, text=True, timeout=120)
    lines, found = _stage_lines(r.stderr)
    assert found[2] is None and None not in (found[0], found[1], found[3]), lines  # no quantize: no such stage


def test_serve_writes_the_load_stage_lines(tmp_path):
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = tmp_path / "err"
    with open(err, "w") as e:
        p = subprocess.Popen([sys.executable, "-m", "mbd_rs", "serve", "--port", str(port)], stdout=subprocess.PIPE,
                             stderr=e, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("mbd-rs: serving") and "as 'mbd-tiny'" in line, (line, err.read_text())
    finally:
        p.terminate()
        p.communicate(timeout=60)
    lines, found = _stage_lines(err.read_text())
    assert None not in (found[0], found[1], found[3]), lines
