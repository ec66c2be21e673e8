#!/usr/bin/env python3
"""Drive a running vLLM server (serve.sh) with real requests and save what it exposes, as fixtures.

  capture.py idle URL OUT_PREFIX   completions and chat completions, streamed and not, long prompts
                                   sharing a prefix of > 256 tokens (prefix-cache counters move);
                                   then saves OUT_PREFIX.txt (/metrics) and the /v1/models answer
                                   beside it (OUT_PREFIX with "metrics" replaced by "models", .json)
  capture.py busy URL OUT.txt      6 streams of 512 tokens at once (against --max-num-seqs 1, so
                                   some wait); saves /metrics while they are in flight
  capture.py speed URL             one stream of 512 tokens; prints decode tokens/s

Standard library only (runs with any python3). Prints a short summary on stderr; exits non-zero
when a request fails, a stream lacks `data: [DONE]`, or a page lacks the series the tests read.
"""
import json
import os
import sys
import threading
import time
import urllib.request

MODEL = None


def get(url, path, timeout=30):
    with urllib.request.urlopen(url + path, timeout=timeout) as r:
        return r.read().decode()


def post(url, path, body, timeout=300):
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    return urllib.request.urlopen(req, timeout=timeout)


def complete(url, path, body):
    with post(url, path, body) as r:
        d = json.loads(r.read())
    return d["usage"]["completion_tokens"], d["choices"][0]["finish_reason"]


def stream(url, path, body, first=None):
    """Returns (content chunks, finish_reason, saw [DONE], seconds from first chunk to the end)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    chunks, finish, done, t_first, usage = 0, None, False, None, None
    with post(url, path, body) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            d = json.loads(data)
            if d.get("usage"):
                usage = d["usage"]
            for c in d.get("choices", []):
                if t_first is None:
                    t_first = time.monotonic()
                    if first:
                        first.set()
                chunks += 1
                finish = c.get("finish_reason") or finish
    tokens = usage["completion_tokens"] if usage else chunks
    return tokens, finish, done, time.monotonic() - (t_first or time.monotonic())


def words(n, seed):
    # Plain words the tokenizer knows well: about one token each.
    base = "the model server sends every request to the queue and the cache keeps each prompt".split()
    return " ".join(base[(i * 7 + seed) % len(base)] + str((i * 31 + seed) % 97) for i in range(n))


def check(cond, msg):
    if not cond:
        sys.exit("capture.py: " + msg)


def model_name(url):
    global MODEL
    if MODEL is None:
        MODEL = json.loads(get(url, "/v1/models"))["data"][0]["id"]
    return MODEL


def idle(url, out):
    m = model_name(url)
    n, fin = complete(url, "/v1/completions", {"model": m, "prompt": "Hello there", "max_tokens": 64})
    check(n == 64 and fin == "length", f"completion: {n} tokens, finish {fin}")
    n, fin, done, _ = stream(url, "/v1/completions", {"model": m, "prompt": "Once upon a time", "max_tokens": 128})
    check(done and n == 128, f"streamed completion: {n} tokens, [DONE] {done}")
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    n, fin = complete(url, "/v1/chat/completions", {"model": m, "messages": chat, "max_tokens": 256})
    check(n == 256 and fin == "length", f"chat: {n} tokens, finish {fin}")
    n, fin, done, _ = stream(url, "/v1/chat/completions", {"model": m, "messages": chat, "max_tokens": 200})
    check(done and n == 200, f"streamed chat: {n} tokens, [DONE] {done}")
    # Long prompts with a shared prefix of ~1500 tokens (many 128-token blocks), different tails.
    prefix = words(1500, 1)
    for i in range(4):
        prompt = prefix + " " + words(200, 10 + i)
        if i % 2:
            n, fin, done, _ = stream(url, "/v1/completions", {"model": m, "prompt": prompt, "max_tokens": 64})
            check(done and n == 64, f"long streamed completion {i}: {n} tokens")
        else:
            n, fin = complete(url, "/v1/completions", {"model": m, "prompt": prompt, "max_tokens": 64})
            check(n == 64, f"long completion {i}: {n} tokens")
    msgs = [{"role": "system", "content": prefix}, {"role": "user", "content": words(100, 3)}]
    n, fin = complete(url, "/v1/chat/completions", {"model": m, "messages": msgs, "max_tokens": 64})
    check(n == 64, f"long chat: {n} tokens")
    page = get(url, "/metrics")
    check("vllm:num_requests_waiting{" in page and "vllm:kv_cache_usage_perc{" in page, "page lacks series")
    hits = [l for l in page.splitlines() if l.startswith("vllm:prefix_cache_hits_total{")]
    check(hits and float(hits[0].rsplit(" ", 1)[1]) > 256, f"prefix cache hits did not move: {hits}")
    with open(out, "w") as f:
        f.write(page)
    models = os.path.join(os.path.dirname(out), os.path.basename(out).replace("metrics", "models"))
    models = os.path.splitext(models)[0] + ".json"
    with open(models, "w") as f:
        f.write(json.dumps(json.loads(get(url, "/v1/models")), indent=2) + "\n")
    print(f"wrote {out} and {models} ({hits[0]})", file=sys.stderr)


def busy(url, out, n=6, tokens=512):
    m = model_name(url)
    results, firsts = [None] * n, [threading.Event() for _ in range(n)]

    def run(i):
        try:
            results[i] = stream(url, "/v1/completions",
                                {"model": m, "prompt": words(40, i), "max_tokens": tokens}, firsts[i])
        except Exception as e:  # noqa: BLE001
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    firsts[0].wait(60)
    deadline = time.monotonic() + 30
    page = ""
    while time.monotonic() < deadline:
        page = get(url, "/metrics")
        waiting = [l for l in page.splitlines() if l.startswith("vllm:num_requests_waiting{")]
        if waiting and float(waiting[0].rsplit(" ", 1)[1]) > 0:
            break
        time.sleep(0.05)
    with open(out, "w") as f:
        f.write(page)
    for t in threads:
        t.join()
    bad = [r for r in results if isinstance(r, Exception) or not r[2] or r[0] != tokens]
    check(not bad, f"busy streams failed: {bad}")
    print(f"wrote {out} ({waiting[0] if waiting else 'no waiting series'})", file=sys.stderr)


def speed(url, tokens=512):
    m = model_name(url)
    n, _, done, secs = stream(url, "/v1/completions", {"model": m, "prompt": "Hello", "max_tokens": tokens})
    check(done and n == tokens, f"speed stream: {n} tokens")
    print(f"decode: {n} tokens in {secs:.2f} s after the first: {(n - 1) / secs:.0f} tokens/s")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("idle", "busy", "speed"):
        sys.exit(__doc__)
    mode, url = sys.argv[1], sys.argv[2].rstrip("/")
    if mode == "speed":
        speed(url)
    else:
        check(len(sys.argv) == 4, "OUT path missing")
        {"idle": idle, "busy": busy}[mode](url, sys.argv[3])
