"""lm-evaluation-harness against `mbd-rs serve` on the embedded mbd-tiny model's held-out items.

1. writes the task data (make_data.py: the first --per-task items of each family of benches/decoding/eval_tiny.py's set);
2. starts `python -m mbd_rs serve` on 127.0.0.1 (a free port, CPU);
3. runs lm-eval twice, greedy (temperature 0), max_gen_toks 40 (eval_tiny.py's --max-tokens):
   - `local-chat-completions` on /v1/chat/completions, task mbd_tiny_heldout, --apply_chat_template (the server
     renders the model's chat template), tokenizer_backend=remote (/tokenizer_info, /tokenize);
   - `local-completions` on /v1/completions, task mbd_tiny_heldout_rendered (the prompt already rendered by the
     chat template), tokenizer_backend=remote: lm-eval tokenizes through POST /tokenize and sends token ids;
   and a third time on a loglikelihood task:
   - `local-completions` on /v1/completions, task mbd_tiny_choice (multiple choice: the answer among near misses
     after the rendered prompt): lm-eval sends prompt + choice as token ids with echo, logprobs 1, max_tokens 1 and
     sums the continuation's token_logprobs;
4. scores the same items in-process with mbd_rs.Engine the way eval_tiny.py does (`eng.chat(...).text == answer`),
   and the choices with `Engine.prompt_logprobs` (the same context/continuation split as lm-eval's);
5. prints the accuracies, writes benches/results/batching-serving/lm_eval.json and asserts that the accuracies are equal, every
   item's output is equal, and every choice's log-likelihood agrees to 1e-3.

No network: HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1; the data is a local JSONL, the tokenizer is the server's.

    PYTHONPATH=python VENV/bin/python benches/lm_eval/run.py [--per-task 20] [--keep-outputs DIR]
"""
import argparse
import glob
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
import make_data  # noqa: E402

MAX_TOKENS = 40  # benches/decoding/eval_tiny.py --max-tokens default; also max_gen_toks in _mbd_tiny_template_yaml
MODEL_NAME = "mbd-tiny"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not healthy after {timeout}s")


def portable(cmd, port, out_dir):
    """A command as one shell line without this machine's paths (python, PORT, OUT) for the result JSON."""
    line = " ".join(shlex.quote(c) for c in cmd).replace(str(port), "PORT").replace(out_dir, "OUT")
    return line.replace(sys.executable, "python").replace(HERE, "benches/lm_eval")


def run_lm_eval(name, model, model_args, task, extra, out_dir, env):
    """One lm-eval run; returns (accuracy, {prompt: generated text, or the choices' log-likelihoods}, seconds,
    command)."""
    out = os.path.join(out_dir, name)
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args, "--tasks", task,
           "--include_path", HERE, "--output_path", out, "--log_samples", *extra]
    print("$ (cd benches/lm_eval &&", " ".join(shlex.quote(c) for c in cmd) + ")", flush=True)
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True)
    secs = time.perf_counter() - t
    with open(os.path.join(out_dir, name + ".log"), "w") as f:
        f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-6000:])
        raise SystemExit(f"lm-eval run '{name}' failed with code {p.returncode}")
    res = json.load(open(glob.glob(os.path.join(out, "*", "results_*.json"))[0]))
    metrics = res["results"][task]
    choice = "acc,none" in metrics
    acc = metrics["acc,none" if choice else "exact_match,none"]
    outputs = {}
    for line in open(glob.glob(os.path.join(out, "*", f"samples_{task}_*.jsonl"))[0]):
        s = json.loads(line)
        # multiple choice: one (loglikelihood, is_greedy) per choice
        outputs[s["doc"]["prompt"]] = [float(r[0]) for r in s["filtered_resps"]] if choice else s["filtered_resps"][0]
    return acc, outputs, secs, cmd


def ours(rows):
    """eval_tiny.py's scoring: one chat turn per item, default decoding, max_tokens 40, exact match."""
    import mbd_rs
    eng = mbd_rs.Engine.load(None, device="cpu")
    t = time.perf_counter()
    outputs = {}
    for _, p, _ in rows:
        outputs[p] = eng.chat([{"role": "user", "content": p}], max_tokens=MAX_TOKENS).text
    secs = time.perf_counter() - t
    return sum(outputs[p] == a for _, p, a in rows) / len(rows), outputs, secs


def encode_pair(eng, context, continuation):
    """lm-eval's split (TemplateLM._encode_pair for causal models): trailing whitespace of the context moves to
    the continuation, the whole is tokenized once and the continuation is what follows the context's tokens."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = eng.tokenize(context + continuation)
    return whole, len(eng.tokenize(context))


def ours_choice(rows):
    """The multiple-choice items scored in-process: each choice's log-likelihood after the rendered prompt
    (Engine.prompt_logprobs, summed over the continuation), the most likely choice picked (ties: the first)."""
    import mbd_rs
    eng = mbd_rs.Engine.load(None, device="cpu")
    t = time.perf_counter()
    lls, right, per_task = {}, 0, {}
    for r in rows:
        scores = []
        for c in r["continuations"]:
            whole, ctx = encode_pair(eng, r["rendered"], c)
            scores.append(sum(x.logprob for x in eng.prompt_logprobs(whole)[ctx:]))
        lls[r["prompt"]] = scores
        ok = max(range(len(scores)), key=lambda i: (scores[i], -i)) == r["gold"]
        right += ok
        per_task.setdefault(r["task"], []).append(ok)
    secs = time.perf_counter() - t
    return right / len(rows), lls, secs, {k: sum(v) / len(v) for k, v in per_task.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-task", type=int, default=20, help="items per task family (make_data.py)")
    ap.add_argument("--keep-outputs", default=None, help="keep lm-eval's outputs and logs in this folder")
    args = ap.parse_args()
    import lm_eval

    rows = make_data.items(args.per_task)
    with open(make_data.DEFAULT_OUT, "w") as f:
        for task, p, a in rows:
            f.write(json.dumps(make_data.row(task, p, a)) + "\n")
    print(f"{len(rows)} held-out items -> {os.path.relpath(make_data.DEFAULT_OUT, ROOT)}", flush=True)

    work = args.keep_outputs or tempfile.mkdtemp(prefix="mbd_lm_eval_")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=os.path.join(work, "hf_datasets_cache"), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH")])))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    serve_cmd = [sys.executable, "-m", "mbd_rs", "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                 "--model-name", MODEL_NAME]
    print("$", " ".join(shlex.quote(c) for c in serve_cmd), flush=True)
    t = time.perf_counter()
    log = open(os.path.join(work, "server.log"), "w")
    server = subprocess.Popen(serve_cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    runs = {}
    try:
        wait_healthy(base, server)
        server_start = time.perf_counter() - t
        common = f"model={MODEL_NAME},tokenizer_backend=remote,max_gen_toks={MAX_TOKENS},max_length=256"
        specs = [
            ("lm_eval_chat", "local-chat-completions", f"{common},base_url={base}/v1/chat/completions",
             "mbd_tiny_heldout", ["--apply_chat_template"]),
            ("lm_eval_completions", "local-completions", f"{common},base_url={base}/v1/completions",
             "mbd_tiny_heldout_rendered", []),
            ("lm_eval_loglikelihood", "local-completions", f"{common},base_url={base}/v1/completions",
             "mbd_tiny_choice", []),
        ]
        for name, model, margs, task, extra in specs:
            acc, outs, secs, cmd = run_lm_eval(name, model, margs, task, extra, work, env)
            runs[name] = dict(model=model, task=task, accuracy=acc, seconds=round(secs, 2), outputs=outs,
                              command=portable(cmd, port, work))
            metric = "acc" if task == "mbd_tiny_choice" else "exact_match"
            print(f"{name:20s} {metric} {acc:.4f}  ({secs:.1f} s)", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()

    acc, outs, secs = ours(rows)
    print(f"{'ours (mbd_rs.Engine)':20s} exact_match {acc:.4f}  ({secs:.2f} s)", flush=True)
    choice_rows = [json.loads(line) for line in open(make_data.DEFAULT_OUT)]
    c_acc, c_lls, c_secs, c_per_task = ours_choice(choice_rows)
    print(f"{'ours (prompt_logprobs)':20s} acc {c_acc:.4f}  ({c_secs:.2f} s)", flush=True)

    per_task = {}
    for task, p, a in rows:
        per_task.setdefault(task, []).append(outs[p] == a)

    def same(name, p):
        got = runs[name]["outputs"].get(p)
        if runs[name]["task"] != "mbd_tiny_choice":
            return got == outs[p]
        return got is not None and len(got) == len(c_lls[p]) and all(abs(a - b) <= 1e-3 for a, b in zip(got, c_lls[p]))

    differ = {name: [p for _, p, _ in rows if not same(name, p)] for name in runs}
    equal = all(r["accuracy"] == (c_acc if r["task"] == "mbd_tiny_choice" else acc) for r in runs.values())
    ll_gap = max((abs(a - b) for p, v in c_lls.items() for a, b in
                  zip(runs.get("lm_eval_loglikelihood", {}).get("outputs", {}).get(p, []), v)), default=None)
    result = dict(
        issue=15, lm_eval_version=lm_eval.__version__ if hasattr(lm_eval, "__version__") else None,
        model=MODEL_NAME, items=len(rows), per_task_items={k: len(v) for k, v in per_task.items()},
        max_gen_toks=MAX_TOKENS, decoding="greedy (temperature 0), the model's default block-diffusion settings",
        metric="exact_match, no normalisation (eval_tiny.py: tasks.correct, text == answer for these families)",
        server_command=portable(serve_cmd, port, work),
        server_start_seconds=round(server_start, 2),
        lm_eval={k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in runs.items()},
        ours=dict(accuracy=acc, seconds=round(secs, 3), per_task={k: sum(v) / len(v) for k, v in per_task.items()}),
        ours_choice=dict(accuracy=c_acc, seconds=round(c_secs, 3), per_task=c_per_task,
                         scoring="Engine.prompt_logprobs (left to right, block size 1), summed over the continuation"),
        choice_loglikelihood_max_abs_diff=ll_gap,
        accuracies_equal=equal, outputs_differing={k: len(v) for k, v in differ.items()},
    )
    with open(os.path.join(ROOT, "benches", "results", "batching-serving", "lm_eval.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"accuracies equal: {equal}; items whose output differs from ours: "
          + ", ".join(f"{k} {len(v)}" for k, v in differ.items()) + f"; wrote {os.path.relpath(f.name, ROOT)}")
    for name, ps in differ.items():
        for p in ps[:5]:
            mine = c_lls[p] if runs[name]["task"] == "mbd_tiny_choice" else outs[p]
            print(f"  {name}: {p!r}: lm-eval {runs[name]['outputs'].get(p)!r} vs ours {mine!r}")
    assert equal, {k: v["accuracy"] for k, v in runs.items()} | {"ours": acc, "ours_choice": c_acc}
    assert not any(differ.values()), {k: len(v) for k, v in differ.items()}


if __name__ == "__main__":
    main()
