"""The CLI as a newcomer meets it: profile overrides as flags derived from the core's registry (an SDAR-style
GGUF or a plain directory can be configured from the command line), and Ctrl-C that stops the work at once: exit
130 with a message in `generate`, the answer (not the session) in `chat`."""
import json
import signal
import subprocess
import sys
import time

import mbd_rs


def cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "mbd_rs", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def test_every_profile_override_and_load_option_is_a_flag():
    from mbd_rs.cli import build_parser
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[attr-defined]
    dests = {a.dest for a in serve._actions}
    want = set(mbd_rs.PROFILE_OVERRIDES) | set(mbd_rs.LOAD_PARAMS) - {"max_batch", "max_batch_rows"}
    assert want <= dests, want - dests


def test_overrides_reach_the_model():
    r = cli("info", "--json", "--attention", "full", "--block-size", "8", "--no-logits-shift",
            "--eos-token-ids", "2", "0", "1")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["attention"], info["block_size"], info["logits_shift"], info["eos_token_ids"]) == \
        ("full", 8, False, [2, 0, 1])
    # in generate, --block-size is the request's (and the override flags keep their own names)
    r = cli("generate", "--chat", "sort 3 1 2", "--block-size", "2", "--json", "--alignment", "prompt")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"].strip() == "1 2 3"
    r = cli("info", "--attention", "sideways")
    assert r.returncode == 2 and "attention must be" in r.stderr


def test_info_names_the_decoding_defaults():
    r = cli("info")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("defaults"))
    assert "entropy acceptance, tau 0.5, alpha 0.1, beta 0.95, forced progress first" in row, row


def test_ctrl_c_in_generate_exits_130_at_once(long_context_model):
    # a prompt whose no-cache recompute takes tens of seconds
    p = subprocess.Popen([sys.executable, "-m", "mbd_rs", "generate", "-m", long_context_model, "-", "--no-cache",
                          "--max-tokens", "8"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    p.stdin.write("7 " * 6000)
    p.stdin.close()
    time.sleep(3.0)  # loaded and working
    assert p.poll() is None
    t0 = time.perf_counter()
    p.send_signal(signal.SIGINT)
    rc = p.wait(timeout=30)
    assert time.perf_counter() - t0 < 3.0
    assert rc == 130
    assert "interrupted" in p.stderr.read()


def test_ctrl_c_in_chat_ends_the_answer_not_the_session(long_context_model):
    p = subprocess.Popen([sys.executable, "-m", "mbd_rs", "chat", "-m", long_context_model, "--no-cache", "--max-tokens", "8"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdin.write("7 " * 6000 + "\n")
    p.stdin.flush()
    time.sleep(3.0)
    p.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert p.poll() is None, p.stderr.read()  # the session goes on
    out, err = p.communicate("sort 3 1 2\n\n", timeout=60)
    assert p.returncode == 0, err
    assert "(interrupted)" in err
    assert "1 2 3" in out


def test_serve_names_the_live_views_address():
    from conftest import free_port
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "mbd_rs", "serve", "--port", str(port)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
    finally:
        p.terminate()
        p.wait(timeout=30)
    assert f"http://127.0.0.1:{port}/v1" in line and f"live view of decoding: http://127.0.0.1:{port}/" in line, line
    assert "live view" in cli("serve", "--help").stdout
