#!/usr/bin/env python3
"""Before/after numbers for issue 39 (what outside input can do), against two builds of the
controller binary: `measure.py OLD_BIN NEW_BIN`. Standard library only. Each case starts the
binary with a generated config on free loopback ports, does to it what tests/outside_input.rs does,
and prints what it cost: answer bytes, peak resident memory (VmHWM), log bytes, cycles with
samples, member series. Stops only the processes it started."""
import http.server, json, os, socket, subprocess, sys, tempfile, threading, time, urllib.request

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def serve(handler_fn):
    port = free_port()
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_GET(self):
            status, body, ctype = handler_fn(self.path)
            try:
                self.send_response(status); self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body))); self.end_headers(); self.wfile.write(body)
            except OSError:
                pass
    class S(http.server.ThreadingHTTPServer):
        daemon_threads = True
        def handle_error(self, *a): pass
    srv = S(("127.0.0.1", port), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return port, srv

VLLM_PAGE = ("vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0\n"
             "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2\n"
             "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.1\n").encode()

def start(binary, body, interval="300ms", extra=()):
    d = tempfile.mkdtemp(); listen = free_port(); cfg = os.path.join(d, "c.yaml")
    open(cfg, "w").write(f"interval: {interval}\nlisten: 127.0.0.1:{listen}\n{body}")
    log = open(os.path.join(d, "log"), "w")
    p = subprocess.Popen([*extra, binary, "run", "--config", cfg], stdout=subprocess.DEVNULL, stderr=log)
    return p, listen, os.path.join(d, "log")

def hwm(pid):
    try:
        for l in open(f"/proc/{pid}/status"):
            if l.startswith("VmHWM:"): return int(l.split()[1]) * 1024
    except OSError:
        return None

def post(url, obj, timeout=120):
    data = json.dumps(obj).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r: return r.status, len(r.read())
    except urllib.error.HTTPError as e: return e.code, len(e.read())
    except Exception as e: return str(e)[:60], 0

def get_json(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r: return json.loads(r.read())
    except Exception: return None

def wait_for(check, secs=30):
    end = time.time() + secs
    while time.time() < end:
        v = check()
        if v: return v
        time.sleep(0.1)
    return None

def envoy_case(binary, cap):
    tp, srv = serve(lambda path: (200, VLLM_PAGE, "text/plain"))
    body = (f"sources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n"
            f"    members: {{ static: ['127.0.0.1:{tp}'] }}\n    sink: {{ kind: envoy, cluster: vllm }}\n")
    extra = ("prlimit", f"--as={cap}") if cap else ()
    p, listen, log = start(binary, body, extra=extra)
    url = f"http://127.0.0.1:{listen}/v3/discovery:endpoints"
    ct = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
    wait_for(lambda: post(url, {"resource_names": ["vllm"], "type_url": ct})[0] == 200)
    out = {}
    for n in (10_000, 30_000):
        out[f"repeat{n}"] = post(url, {"resource_names": ["vllm"] * n, "type_url": ct})
        out[f"repeat{n}_alive"] = p.poll() is None
        if p.poll() is not None: break
    out["peak_rss_mb"] = (hwm(p.pid) or 0) >> 20
    p.kill(); p.wait(); srv.shutdown()
    return out

def pollers_case(binary):
    tp, srv = serve(lambda path: (200, VLLM_PAGE, "text/plain"))
    body = (f"sources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n"
            f"    members: {{ static: ['127.0.0.1:{tp}'] }}\n    sink: {{ kind: envoy, cluster: vllm }}\n")
    p, listen, log = start(binary, body)
    url = f"http://127.0.0.1:{listen}/v3/discovery:endpoints"
    ct = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
    wait_for(lambda: post(url, {"resource_names": ["vllm"], "type_url": ct})[0] == 200)
    huge = "n" * (1_900_000)
    for i in range(600):
        post(url, {"resource_names": ["vllm"], "type_url": ct, "version_info": "v", "node": {"id": f"{i}-{huge}"}})
    peak = (hwm(p.pid) or 0) >> 20
    time.sleep(5)
    try: rss = int([l for l in open(f"/proc/{p.pid}/status") if l.startswith("VmRSS:")][0].split()[1]) >> 10
    except Exception: rss = None
    p.kill(); p.wait(); srv.shutdown()
    return {"peak_rss_mb": peak, "rss_mb_5s_later": rss}

def slow_case(binary, interval, page_s, props_s, cycles):
    page = open(os.path.join(os.path.dirname(__file__), "../llamacpp/fixtures/metrics-busy.txt"), "rb").read()
    def fast(path):
        return (200, page, "text/plain") if path.startswith("/metrics") else (200, b'{"total_slots":4}', "application/json")
    def slow(path):
        time.sleep(page_s if path.startswith("/metrics") else props_s)
        return fast(path)
    ports = [serve(fast) for _ in range(4)] + [serve(slow)]
    members = ", ".join(f"'127.0.0.1:{pt}'" for pt, _ in ports)
    body = (f"sources:\n  direct: {{ kind: scrape, timeout: 2s }}\npools:\n  - name: llm\n    source: direct\n"
            f"    profile: llamacpp\n    members: {{ static: [{members}] }}\n    sink: {{ kind: dry-run }}\n")
    p, listen, log = start(binary, body, interval=interval)
    seen, last_ts = [], None
    end = time.time() + 120
    while len(seen) < cycles + 1 and time.time() < end:
        v = get_json(f"http://127.0.0.1:{listen}/v1/ratios")
        if v and v.get("ts") != last_ts:
            last_ts = v.get("ts")
            ms = v["pools"][0].get("members", [])
            seen.append(sum(1 for m in ms if m.get("waiting") is not None))
        time.sleep(0.1)
    p.kill(); p.wait()
    for _, s in ports: s.shutdown()
    with_samples = sum(1 for n in seen[1:] if n >= 4)
    return {"cycles": len(seen) - 1, "cycles_with_the_4_fast_members": with_samples}

def churn_case(binary, secs=40):
    t0 = time.time()
    def prom(path):
        q = urllib.parse.parse_qs(urllib.parse.urlparse(path).query).get("query", [""])[0]
        el = time.time() - t0; gen = int(el // 2)
        if not q.startswith("up") and int(el) % 3 == 0: time.sleep(1.5)
        v = str(time.time()) if "timestamp(" in q else "1"
        res = [{"metric": {"instance": f"10.{gen // 250}.{gen % 250}.{i}:8000"}, "value": [time.time(), v]} for i in range(10)]
        return 200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": res}}).encode(), "application/json"
    port, srv = serve(prom)
    body = (f"sources:\n  prom: {{ kind: prometheus, url: 'http://127.0.0.1:{port}' }}\npools:\n  - name: llm\n"
            f"    source: prom\n    members: {{ prometheus_up: '{{job=\"vllm\"}}' }}\n    sink: {{ kind: dry-run }}\n")
    p, listen, log = start(binary, body, interval="1s")
    time.sleep(secs)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{listen}/metrics", timeout=5) as r: text = r.read().decode()
    except Exception: text = ""
    members = {l.split('member="')[1].split('"')[0] for l in text.splitlines() if l.startswith("llmlc_member_weight{")}
    p.kill(); p.wait(); srv.shutdown()
    return {"member_weight_series_after_s": secs, "distinct_members": len(members), "live": 10}

def proxy_case(binary):
    d = tempfile.mkdtemp(); api, admin = free_port(), free_port(); cfg = os.path.join(d, "p.yaml")
    open(cfg, "w").write(
        f"listen: 127.0.0.1:{api}\nadmin: {{ listen: 127.0.0.1:{admin} }}\npools:\n  - name: llm\n"
        f"    members: ['127.0.0.1:9']\n    algorithm: prefix-affinity\nroutes:\n  steps:\n    - id: model\n"
        f"      field: model\n      op: exists\n      match: {{ pool: llm }}\n      miss: {{ reject: 400 }}\n")
    logp = os.path.join(d, "log"); log = open(logp, "w")
    # Under a 2 GiB address-space cap: the old ring for a 10^8 ratio asks for ~25 GB.
    p = subprocess.Popen(["prlimit", f"--as={2 << 30}", binary, "proxy", "--config", cfg], stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{admin}/admin/ratios"
    wait_for(lambda: get_json(f"http://127.0.0.1:{admin}/admin/state"))
    before = os.path.getsize(logp)
    huge = "x" * (1 << 20)
    answers = [post(url, {"pool": "llm", "ratios": {f"{huge}{i}:80": 5}})[1] for i in range(20)]
    written = os.path.getsize(logp) - before
    big = post(url, {"pool": "llm", "ratios": {"127.0.0.1:9": 100_000_000}}, timeout=60)
    alive = wait_for(lambda: p.poll() is None and get_json(f"http://127.0.0.1:{admin}/admin/state"), 5) is not None
    p.kill(); p.wait()
    return {"log_bytes_for_20_unknown_1MB_names": written, "largest_answer_bytes": max(answers),
            "ratio_1e8_answer": big, "alive_after_1e8": alive}

import urllib.parse
if __name__ == "__main__":
    for label, b in (("before", sys.argv[1]), ("after", sys.argv[2])):
        print(label, "EDS 10k/30k repeats, 256 MiB address-space cap:", envoy_case(b, 256 << 20), flush=True)
        print(label, "EDS 10k/30k repeats, no cap:", envoy_case(b, None), flush=True)
        print(label, "600 polls, 1.9 MB node ids:", pollers_case(b), flush=True)
        print(label, "1.8 s member beside four fast, 3 s interval:", slow_case(b, "3s", 1.8, 1.8, 10), flush=True)
        print(label, "/props 1.5 s, 1 s interval:", slow_case(b, "1s", 0.0, 1.5, 20), flush=True)
        print(label, "Prometheus churn, late metric queries:", churn_case(b), flush=True)
        print(label, "proxy admin API:", proxy_case(b), flush=True)
