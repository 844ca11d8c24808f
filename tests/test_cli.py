"""The `mbd-rs` command line, run as a subprocess on the embedded model."""
import json
import subprocess
import sys

import mbd_rs
from conftest import parity_dir, serve_subprocess


def cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "mbd_rs", *args], input=stdin, capture_output=True, text=True, timeout=120)


def test_generate_json_matches_api():
    want = mbd_rs.Engine.load().chat([{"role": "user", "content": "sort 3 1 2"}], max_tokens=16)
    r = cli("generate", "--chat", "sort 3 1 2", "--max-tokens", "16", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"] == want.text and out["token_ids"] == want.token_ids and out["finish_reason"] == want.finish_reason


def test_generate_streams_text_and_stats():
    want = mbd_rs.Engine.load().generate("hello", max_tokens=12)
    r = cli("generate", "hello", "--max-tokens", "12", "--stats")
    assert r.returncode == 0 and r.stdout == want.text + "\n"
    assert "tokens/forward" in r.stderr


def test_prompt_from_stdin_and_file(tmp_path):
    want = mbd_rs.Engine.load().generate("add 1+2", max_tokens=8).text
    assert cli("generate", "--max-tokens", "8", stdin="add 1+2").stdout == want + "\n"
    f = tmp_path / "p.txt"
    f.write_text("add 1+2")
    assert cli("generate", "--file", str(f), "--max-tokens", "8").stdout == want + "\n"


def test_visual_trace_shows_blocks():
    r = cli("generate", "--chat", "hello Ada", "--visual", "--max-tokens", "16")
    assert r.returncode == 0
    steps = [line for line in r.stdout.splitlines() if line.startswith("step")]
    assert steps and all("|" in line for line in steps)
    assert "tokens/forward" in r.stderr


def test_usage_errors_exit_2(tmp_path):
    r = cli("generate", "hi", "--threshold", "-1")
    errors = [line for line in r.stderr.splitlines() if not line.startswith("mbd-rs: loading ")]  # the load's lines
    assert r.returncode == 2 and errors[0].startswith("mbd-rs: error:") and "threshold" in r.stderr
    assert "Traceback" not in r.stderr
    assert cli("generate", "hi", "--block-size", "nope").returncode == 2  # argparse
    assert cli("info", str(tmp_path / "missing")).returncode == 2


def test_info(tmp_path):
    r = cli("info", parity_dir("qwen3moe_top1"), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["arch"] == "qwen3_moe"
    cfg = json.loads(open(parity_dir("qwen2_gqa_tied") + "/config.json").read())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    r = cli("info", str(d))
    assert r.returncode == 2 and "not supported" in r.stderr


def test_bench_runs():
    r = cli("bench", "--max-tokens", "16", "--repeats", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens_per_forward"] > 0


def test_info_is_readable_and_missing_is_not_unsupported(tmp_path):
    r = cli("info", parity_dir("qwen3moe_top1"))
    assert r.returncode == 0
    lines = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert lines["family"].startswith("qwen3_moe") and "experts" in lines["family"] and lines["supported"] == "yes"
    r = cli("info", str(tmp_path / "missing"))
    assert r.returncode == 2 and "cannot load" in r.stderr and "not supported" not in r.stderr


def test_version():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"mbd-rs {mbd_rs.__version__}"


def test_stdin_final_newline_is_not_part_of_the_prompt():
    want = mbd_rs.Engine.load().chat([{"role": "user", "content": "sort 3 2 1"}], max_tokens=8).text
    r = cli("generate", "--chat", "--max-tokens", "8", stdin="sort 3 2 1\n")
    assert r.returncode == 0 and r.stdout == want + "\n"


def test_visual_legend_in_help():
    r = cli("generate", "--help")
    assert r.returncode == 0 and "'=' completed" in r.stdout and "'·' still masked" in r.stdout


def test_chat_is_single_turn_on_the_embedded_model_and_has_reset():
    eng = mbd_rs.Engine.load()
    want = [eng.chat([{"role": "user", "content": q}], max_tokens=16).text for q in ("sort 3 1 2", "reverse a b c")]
    r = cli("chat", "--max-tokens", "16", stdin="sort 3 1 2\n/help\nreverse a b c\n/reset\n\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.replace("> ", "").split("\n")[:2] == want
    assert "/reset forgets" in r.stderr and "history cleared" in r.stderr


def test_serve_ray_flags():
    """The Ray Serve flags need --ray; --ray without Ray installed says how to get it; bad values are usage
    errors (the deployment itself is tests/test_ray.py)."""
    r = cli("serve", "--replicas", "2")
    assert r.returncode == 2 and "--replicas need --ray" in r.stderr
    r = cli("serve", "--autoscale", "3:1", "--ray")
    assert r.returncode == 2 and "MIN:MAX" in r.stderr
    try:
        import ray  # noqa: F401
    except ImportError:
        r = cli("serve", "--ray", "--replicas", "2")
        assert r.returncode == 2 and "pip install 'mbd-rs[ray]'" in r.stderr


def test_generate_json_with_logprobs():
    want = mbd_rs.Engine.load().chat([{"role": "user", "content": "sort 3 1 2"}], max_tokens=8, logprobs=2)
    r = cli("generate", "--chat", "sort 3 1 2", "--max-tokens", "8", "--logprobs", "2", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["logprobs"]
    assert [t[0] for t in got] == [t.token_id for t in want.logprobs]
    assert [t[1] for t in got] == [t.logprob for t in want.logprobs]
    assert all(len(t[2]) == 2 for t in got)
    assert "logprobs" not in json.loads(cli("generate", "hi", "--max-tokens", "2", "--json").stdout)


def test_isd_from_the_command_line():
    """An I-DLM-style load (causal, shifted) and ISD decoding through the CLI's derived flags give the API's answer."""
    d = parity_dir("qwen2_gqa_tied")
    load = dict(device="cpu", mask_token_id=3, attention="causal", logits_shift=True)
    want = mbd_rs.Engine.load(d, **load).generate("abc", max_tokens=12, speculative="isd", isd_stride=3)
    r = cli("generate", "abc", "--model", d, "--device", "cpu", "--mask-token-id", "3", "--attention", "causal", "--logits-shift",
            "--max-tokens", "12", "--speculative", "isd", "--isd-stride", "3", "--json", "--stats")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == want.token_ids and out["usage"]["drafts_proposed"] == want.usage.drafts_proposed


def test_generate_chats_by_default_and_raw_opts_out():
    eng = mbd_rs.Engine.load()
    r = cli("generate", "sort 3 1 2", "--max-tokens", "12")
    assert r.returncode == 0 and r.stdout == eng.chat([{"role": "user", "content": "sort 3 1 2"}], max_tokens=12).text + "\n"
    r = cli("generate", "sort 3 1 2", "--max-tokens", "12", "--raw")
    assert r.returncode == 0 and r.stdout == eng.generate("sort 3 1 2", max_tokens=12, raw=True).text + "\n"
    assert cli("generate", "x", "--raw", "--chat").returncode == 2  # one or the other


def _bool_flags(cmd):
    """The boolean parameters that are flags of `cmd`: every boolean generation parameter (but those that are not
    flags) and the boolean load options and profile overrides, from the registry."""
    from mbd_rs.cli import _NOT_FLAGS, build_parser
    a = build_parser().parse_args([cmd])
    gen = [n for n in mbd_rs.GENERATION_PARAMS if mbd_rs.PARAMS[n]["kind"] == "bool" and n not in _NOT_FLAGS]
    return gen + [n for n in a.load_flags if mbd_rs.PARAMS[n]["kind"] == "bool" and n not in gen]


def test_every_boolean_parameter_has_a_flag_and_its_negation():
    """Before: generation booleans had only --no-x, so TCCF (off by default) could not be turned on: `--tccf` was
    "ambiguous" (--tccf-trigger, --tccf-check, ...). Now every boolean of the registry is --x / --no-x (unset: the
    core's default), and the older spellings still work."""
    from mbd_rs.cli import build_parser
    ap = build_parser()
    for cmd in ("generate", "chat", "bench"):
        names = _bool_flags(cmd)
        assert {"tccf", "use_cache", "early_stop"} <= set(names), names
        for name in names:
            flag = "--" + name.replace("_", "-")
            assert getattr(ap.parse_args([cmd, flag]), name) is True, (cmd, flag)
            assert getattr(ap.parse_args([cmd, "--no-" + flag[2:]]), name) is False, (cmd, flag)
            assert getattr(ap.parse_args([cmd]), name) is None, (cmd, flag)
        assert ap.parse_args([cmd, "--no-cache"]).use_cache is False
        assert ap.parse_args([cmd, "--no-early-stop"]).early_stop is False


def test_tccf_from_the_command_line():
    """`--tccf` runs TCCF on the embedded model (a one-token trigger: its vocabulary has no "</think>"), as the API
    does: the check text follows the trigger."""
    args = ("sort 3 1 2", "--max-tokens", "16", "--tccf-trigger", " ")
    want = mbd_rs.Engine.load().chat([{"role": "user", "content": "sort 3 1 2"}], max_tokens=16, tccf=True,
                                     tccf_trigger=" ")
    r = cli("generate", "--chat", "--tccf", *args, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == want.token_ids and "Let's check" in out["text"], out["text"]


def test_input_that_is_not_utf8_is_named_so():
    """Before: bytes that are not UTF-8 on stdin (or in the prompt argument) were reported as "lone surrogates"
    (Python's escapes of them, refused by the core). Now: not UTF-8, and at which byte; a prompt file alike."""
    for args, stdin in [(("generate", "--max-tokens", "4"), b"sort \xff 1 2"),
                        (("generate", "-", "--max-tokens", "4"), b"ab\xe2\x82 1")]:
        r = subprocess.run([sys.executable, "-m", "mbd_rs", *args], input=stdin, capture_output=True, timeout=120)
        err = r.stderr.decode()
        assert r.returncode == 2 and "not UTF-8" in err and "surrogate" not in err, err
        assert ("byte 5 (0xff)" if b"\xff" in stdin else "byte 2 (0xe2)") in err, err
    r = subprocess.run([sys.executable, "-m", "mbd_rs", "generate", b"sort \xff 1", "--max-tokens", "4"],
                       capture_output=True, timeout=120)
    assert r.returncode == 2 and b"the prompt is not UTF-8 text: byte 5 (0xff)" in r.stderr, r.stderr


def test_a_prompt_file_that_is_not_utf8_is_named_so(tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes(b"sort 3\r\n\xc3(")
    r = cli("generate", "--file", str(f), "--max-tokens", "4")
    assert r.returncode == 2 and f"the prompt file {f} is not UTF-8 text: byte 8 (0xc3)" in r.stderr, r.stderr


def test_structured_outputs_from_the_command_line(tmp_path):
    """`--json-schema FILE` and `--regex` constrain the output as the API's response_format and regex do."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    f = tmp_path / "answer.json"
    f.write_text(json.dumps(schema))
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    want = mbd_rs.Engine.load().chat([{"role": "user", "content": "add 1+2"}], max_tokens=32, response_format=fmt)
    r = cli("generate", "add 1+2", "--max-tokens", "32", "--json-schema", str(f), "--stats")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want.text + "\n" and 0 <= json.loads(want.text)["n"] <= 9
    assert "forced by the grammar" in r.stderr
    r = cli("generate", "add 1+2", "--max-tokens", "16", "--regex", "[0-9]{2}")
    assert r.returncode == 0 and len(r.stdout.strip()) == 2 and r.stdout.strip().isdigit(), r.stdout
    f.write_text("{not json")
    r = cli("generate", "hi", "--json-schema", str(f))
    assert r.returncode == 2 and f"--json-schema {f}" in r.stderr and "Traceback" not in r.stderr


def test_serve_starts_from_a_saved_prefix_cache(tmp_path):
    """`serve --load-prefix-cache FILE`: a request that begins as the saved prompt reads it from the cache; a file
    of another engine is refused before the server starts; not with --ray."""
    import httpx
    eng = mbd_rs.Engine.load()
    msgs = [{"role": "system", "content": "You sort numbers. " * 6}, {"role": "user", "content": "sort 3 1 2"}]
    eng.chat(msgs, max_tokens=4)
    f = tmp_path / "system.safetensors"
    assert eng.save_prefix_cache(f) > 0
    q8 = tmp_path / "q8.safetensors"
    mbd_rs.Engine.load(quantize="q8_0").save_prefix_cache(q8)
    r = cli("serve", "--load-prefix-cache", str(q8))
    assert r.returncode == 2 and "another model, engine build or load options" in r.stderr
    r = cli("serve", "--ray", "--load-prefix-cache", str(f))
    assert r.returncode == 2 and "--load-prefix-cache" in r.stderr
    procs = []
    for base, name, proc in serve_subprocess(["--load-prefix-cache", str(f)]):
        procs.append(proc)
        body = {"model": name, "messages": msgs[:1] + [{"role": "user", "content": "sort 9 8"}], "max_tokens": 4}
        u = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()["usage"]
        assert u["prompt_tokens_details"]["cached_tokens"] >= 32
    assert "prefix cache pages from" in procs[0].stderr.read()
