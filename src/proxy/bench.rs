//! `proxy bench`: the proxy's overhead, measured side by side with real HAProxy in the same run.
//!
//! Starts a fast backend answering streamed chat completions (`--tokens` SSE events of vLLM's
//! shape, one write each with no delay between them; this binary, `proxy bench --backend-listen`),
//! then the proxy (this binary, `proxy --config ...`) and HAProxy (`$HAPROXY_BIN`,
//! `/usr/sbin/haproxy` or `haproxy` on PATH) both forwarding to it, each its own process, on free
//! loopback ports with generated configs in a temp dir. The load generator is the only thing left
//! in the bench's own process: when the backend shared its runtime, the client's reads and the
//! backend's writes took turns in one run queue, and the measured tail of a target depended on how
//! its write pattern fell into those turns (src/proxy/RESULTS.md, "The backend in its own process").
//!
//! Targets are interleaved, not run one after another: for each concurrency level the load
//! generator sends small batches (`--batch` requests, at least four per concurrent slot) to
//! direct, HAProxy and the proxy in turn, in an order where each follows each other equally often
//! ([`batch_cycle`]: a target's tail depends on who ran just before it), until each target has
//! `--requests`. Machine noise (other processes, CPU frequency) then hits all three alike.
//! Latency is the whole streamed response (send to last byte); the request rate of a target is its
//! requests over the time its own batches took. Added latency is the difference of the
//! percentiles with the direct path. Both proxies get two threads (tokio's default on this 2-core
//! class of machine, HAProxy `nbthread 2`). Children are killed when the run ends.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use axum::body::{Body, Bytes};
use axum::routing::post;
use axum::Router;
use clap::Args;
use futures::StreamExt;

/// Arguments of `proxy bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Measured requests per target and concurrency level (after one warm-up round).
    #[arg(long, default_value_t = 6000)]
    pub requests: usize,
    /// Concurrency levels (requests in flight at once), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 16, 64])]
    pub concurrency: Vec<usize>,
    /// Streamed tokens (SSE events) per response.
    #[arg(long, default_value_t = 200)]
    pub tokens: usize,
    /// Requests per target per batch (raised to four per concurrent slot).
    #[arg(long, default_value_t = 100)]
    pub batch: usize,
    /// Also write the results as Markdown to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Serve only the backend on this address (what the bench starts as its own process).
    #[arg(long, hide = true)]
    pub backend_listen: Option<SocketAddr>,
    /// Measure the controller's endpoint picker behind real Envoy (ext_proc) and HAProxy (SPOE)
    /// against each alone, instead of the proxy against HAProxy (see `bench_doors`).
    #[arg(long)]
    pub doors: bool,
}

const BODY: &str =
    r#"{"model":"bench","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":200}"#;

/// One SSE event in vLLM's chat-completion chunk shape.
pub(crate) fn event(i: usize) -> String {
    format!(
        "data: {{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"bench\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
    )
}

/// Latency percentiles and throughput of one target at one concurrency.
#[derive(Debug, Clone)]
pub struct Measured {
    pub name: &'static str,
    pub concurrency: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub rps: f64,
    pub errors: usize,
    /// CPU time the target's own processes spent per request, in microseconds (`None` for the
    /// direct path, which has none).
    pub cpu_us: Option<f64>,
}

/// One way to the backend: its name, its URL, and the processes that serve it (whose CPU time
/// is its cost).
pub(crate) struct Target {
    pub name: &'static str,
    pub url: String,
    pub pids: Vec<u32>,
}

impl Target {
    pub(crate) fn new(name: &'static str, url: String, pids: &[u32]) -> Target {
        Target { name, url, pids: pids.to_vec() }
    }
}

/// CPU time (user + system) of process `pid` so far, in seconds, from `/proc/PID/stat` (fields 14
/// and 15, in clock ticks of 1/100 s, Linux's USER_HZ); 0 where there is no such file.
pub(crate) fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // The command name (field 2) is in parentheses and may hold spaces: count from after it.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { return 0.0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3, so fields 14 and 15 are its 12th and 13th.
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// The order batches visit `n` targets in, repeated until each has its requests: every target
/// follows every other exactly once per cycle (an Eulerian circuit of the complete directed graph,
/// the wrap-around from the last batch to the first included), and never itself.
///
/// Who ran just before matters: measured at concurrency 64, HAProxy's p99 over its batches that
/// came right after the proxy's was 80-86 ms and over those after direct's 86-99 ms, in each of
/// three runs. A plain rotation (`0 1 2, 1 2 0, 2 0 1`) puts the proxy after HAProxy in two
/// batches of three and HAProxy after the proxy in one, so that effect leaned on the comparison.
pub fn batch_cycle(n: usize) -> Vec<usize> {
    if n < 2 {
        return vec![0; n];
    }
    // Hierholzer's walk; each target's unused successors, smallest first.
    let mut unused: Vec<Vec<usize>> = (0..n).map(|a| (0..n).rev().filter(|&b| b != a).collect()).collect();
    let mut path = vec![0];
    let mut circuit = Vec::with_capacity(n * (n - 1) + 1);
    while let Some(&at) = path.last() {
        match unused[at].pop() {
            Some(next) => path.push(next),
            None => circuit.extend(path.pop()),
        }
    }
    circuit.reverse();
    // The circuit ends on the target it began with: the next cycle's first batch closes it.
    circuit.pop();
    circuit
}

pub(crate) struct Kill(pub(crate) Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A scratch directory removed on drop (tempfile is a dev-only dependency here).
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new() -> anyhow::Result<TempDir> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("llmlc-proxy-bench-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).with_context(|| format!("cannot create {}", p.display()))?;
        Ok(TempDir(p))
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot bind a free port")?;
    Ok(l.local_addr()?.port())
}

pub(crate) async fn wait_port(port: u16, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("{what} did not listen on 127.0.0.1:{port} within 15 s")
}

pub(crate) fn haproxy_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("HAPROXY_BIN") {
        return PathBuf::from(p);
    }
    let debian = Path::new("/usr/sbin/haproxy");
    if debian.exists() {
        debian.to_path_buf()
    } else {
        PathBuf::from("haproxy")
    }
}

/// Send `n` requests to `url` at `concurrency`; each request's latency (None when it failed) and
/// the wall time of the batch.
pub(crate) async fn batch(
    client: &reqwest::Client,
    url: &str,
    n: usize,
    concurrency: usize,
) -> (Vec<Option<f64>>, f64) {
    const DONE: &[u8] = b"data: [DONE]\n\n";
    let started = Instant::now();
    let results: Vec<Result<f64, String>> = futures::stream::iter(0..n)
        .map(|_| async {
            let t = Instant::now();
            let r = client.post(url).header("content-type", "application/json").body(BODY).send().await;
            let resp = match r {
                Ok(resp) if resp.status().is_success() => resp,
                Ok(resp) => return Err(format!("status {}", resp.status())),
                Err(e) => return Err(super::errors::error_chain(&e)),
            };
            let mut body = resp.bytes_stream();
            // The last bytes seen, across chunk boundaries.
            let mut tail: Vec<u8> = Vec::with_capacity(64);
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| super::errors::error_chain(&e))?;
                tail.extend_from_slice(&chunk);
                if tail.len() > 32 {
                    tail.drain(..tail.len() - 32);
                }
            }
            // A stream cut short is an error, not a fast answer.
            if tail.ends_with(DONE) {
                Ok(t.elapsed().as_secs_f64())
            } else {
                Err("the stream ended without [DONE]".into())
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
        eprintln!("{url}: {} of {n} failed, e.g.: {e}", results.iter().filter(|r| r.is_err()).count());
    }
    (results.into_iter().map(Result::ok).collect(), started.elapsed().as_secs_f64())
}

pub(crate) fn summarize(
    name: &'static str,
    concurrency: usize,
    results: &[Option<f64>],
    busy_s: f64,
) -> Measured {
    let mut ok: Vec<f64> = results.iter().flatten().copied().collect();
    ok.sort_by(|a, b| a.total_cmp(b));
    let pct = |q: f64| -> f64 {
        if ok.is_empty() {
            return f64::NAN;
        }
        let i = ((ok.len() as f64 - 1.0) * q).round() as usize;
        ok[i.min(ok.len() - 1)] * 1000.0
    };
    Measured {
        name,
        concurrency,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        rps: ok.len() as f64 / busy_s.max(1e-9),
        errors: results.len() - ok.len(),
        cpu_us: None,
    }
}

/// The backend alone, on `addr`, until the process is stopped: every chat completion is `tokens`
/// SSE events and [DONE], sent as fast as possible.
async fn serve_backend(addr: SocketAddr, tokens: usize) -> anyhow::Result<()> {
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
    let events: Vec<Bytes> = (0..tokens)
        .map(|i| Bytes::from(event(i)))
        .chain(std::iter::once(Bytes::from_static(b"data: [DONE]\n\n")))
        .collect();
    // In flight now, for a metrics page in vLLM's names (the controller's picker reads it in
    // `proxy bench --doors`).
    let running = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
    let page_running = running.clone();
    let app = Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let n = page_running.load(std::sync::atomic::Ordering::Relaxed).max(0);
            async move {
                format!("vllm:num_requests_waiting 0\nvllm:num_requests_running {n}\nvllm:kv_cache_usage_perc 0.1\n")
            }
        }),
    );
    let app = app.route(
        "/v1/chat/completions",
        post(move || {
            let events = events.clone();
            let running = running.clone();
            async move {
                running.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let done = Done(running);
                // One write per event, as a model server streams tokens (yielding between events
                // makes hyper flush each one instead of batching the whole answer).
                let s = futures::stream::iter(events).then(move |e| {
                    let _held = &done;
                    async move {
                        tokio::task::yield_now().await;
                        Ok::<_, std::io::Error>(e)
                    }
                });
                ([(axum::http::header::CONTENT_TYPE, "text/event-stream")], Body::from_stream(s))
            }
        }),
    );
    // TCP_NODELAY like vLLM's uvicorn: without it Nagle and delayed ACKs add ~40 ms per stream.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).await?;
    Ok(())
}

/// Counts a response out of the in-flight gauge when its stream is dropped (ended or cut).
struct Done(std::sync::Arc<std::sync::atomic::AtomicI64>);

impl Drop for Done {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Run the benchmark and print (and optionally write) the table.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    if let Some(addr) = args.backend_listen {
        return serve_backend(addr, args.tokens).await;
    }
    let dir = TempDir::new()?;
    anyhow::ensure!(
        !args.concurrency.is_empty() && args.concurrency.iter().all(|&c| c > 0),
        "--concurrency needs levels > 0"
    );

    // The backend, as its own process: a model server is not the client's neighbour in its runtime.
    let bport = free_port()?;
    let backend_addr: SocketAddr = ([127, 0, 0, 1], bport).into();
    let exe = std::env::current_exe().context("cannot find this program's path")?;
    let backend = Kill(
        Command::new(&exe)
            .args(["proxy", "bench", "--backend-listen"])
            .arg(backend_addr.to_string())
            .arg("--tokens")
            .arg(args.tokens.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start {} proxy bench --backend-listen", exe.display()))?,
    );
    wait_port(bport, "the backend").await?;
    if args.doors {
        let (results, picks) = super::bench_doors::run(&args, &exe, dir.path(), backend_addr).await?;
        drop(backend);
        let text = super::bench_doors::report(&results, &args, &picks);
        print!("{text}");
        if let Some(out) = &args.out {
            std::fs::write(out, &text).with_context(|| format!("cannot write {}", out.display()))?;
        }
        return Ok(());
    }

    // The proxy, as its own process like HAProxy.
    let (pport, aport, hport) = (free_port()?, free_port()?, free_port()?);
    let pcfg = dir.path().join("proxy.yaml");
    std::fs::write(
        &pcfg,
        format!(
            "# proxy config\nlisten: 127.0.0.1:{pport}\nadmin: {{ listen: 127.0.0.1:{aport} }}\npools:\n  - name: bench\n    members: ['{backend_addr}']\nroutes:\n  steps:\n    - id: model\n      field: model\n      op: exists\n      match: {{ pool: bench }}\n      miss: {{ reject: 400 }}\n"
        ),
    )?;
    let proxy = Kill(
        Command::new(&exe)
            .args(["proxy", "--config"])
            .arg(&pcfg)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start {} proxy", exe.display()))?,
    );
    wait_port(pport, "the proxy").await?;

    // HAProxy, same backend, same thread count.
    let hcfg = dir.path().join("haproxy.cfg");
    std::fs::write(
        &hcfg,
        format!(
            "global\n    nbthread 2\n    maxconn 4096\n\ndefaults\n    mode http\n    timeout connect 2s\n    timeout client 30s\n    timeout server 30s\n    http-reuse always\n\nfrontend fe\n    bind 127.0.0.1:{hport}\n    default_backend be\n\nbackend be\n    balance leastconn\n    server s1 {backend_addr}\n"
        ),
    )?;
    let hbin = haproxy_bin();
    let haproxy = Kill(
        Command::new(&hbin)
            .arg("-db")
            .arg("-f")
            .arg(&hcfg)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| {
                format!("cannot start HAProxy ({}); install it or set HAPROXY_BIN", hbin.display())
            })?,
    );
    wait_port(hport, "HAProxy").await?;

    let client = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(1024)
        .timeout(Duration::from_secs(60))
        .build()?;
    let targets = [
        Target::new("direct", format!("http://{backend_addr}/v1/chat/completions"), &[]),
        Target::new("haproxy", format!("http://127.0.0.1:{hport}/v1/chat/completions"), &[haproxy.0.id()]),
        Target::new("llmlc-proxy", format!("http://127.0.0.1:{pport}/v1/chat/completions"), &[proxy.0.id()]),
    ];
    let results = interleaved(&client, &targets, &args).await?;
    drop(proxy);
    drop(haproxy);
    drop(backend);

    let text = report(&results, &args);
    print!("{text}");
    if let Some(out) = &args.out {
        std::fs::write(out, &text).with_context(|| format!("cannot write {}", out.display()))?;
    }
    Ok(())
}

/// Each target measured at each concurrency level of `args`: one warm-up batch each (connections,
/// caches; an error when every request of one fails), then batches in [`batch_cycle`]'s order
/// until every target has `args.requests`.
pub(crate) async fn interleaved(
    client: &reqwest::Client,
    targets: &[Target],
    args: &BenchArgs,
) -> anyhow::Result<Vec<Measured>> {
    let mut results = Vec::new();
    let cpu = |t: &Target| t.pids.iter().map(|&p| cpu_seconds(p)).sum::<f64>();
    for &c in &args.concurrency {
        let size = args.batch.max(4 * c);
        for t in targets {
            let (w, _) = batch(client, &t.url, size, c).await;
            if w.iter().all(Option::is_none) {
                anyhow::bail!("every warm-up request to {} ({}) failed", t.name, t.url);
            }
        }
        let mut lat: Vec<Vec<Option<f64>>> = vec![Vec::new(); targets.len()];
        let mut busy = vec![0.0f64; targets.len()];
        // CPU seconds each target's processes spent during its own batches: one target runs at a
        // time, so what its processes spend meanwhile is its cost.
        let mut spent = vec![0.0f64; targets.len()];
        for &t in batch_cycle(targets.len()).iter().cycle() {
            if lat.iter().all(|l| l.len() >= args.requests) {
                break;
            }
            let n = size.min(args.requests - lat[t].len().min(args.requests));
            if n == 0 {
                continue;
            }
            let before = cpu(&targets[t]);
            let (r, wall) = batch(client, &targets[t].url, n, c).await;
            spent[t] += cpu(&targets[t]) - before;
            lat[t].extend(r);
            busy[t] += wall;
        }
        for (i, t) in targets.iter().enumerate() {
            let mut m = summarize(t.name, c, &lat[i], busy[i]);
            let ok = lat[i].iter().flatten().count();
            m.cpu_us = (!t.pids.is_empty() && ok > 0).then(|| spent[i] * 1e6 / ok as f64);
            results.push(m);
        }
    }
    Ok(results)
}

/// The proxy's goal against the incumbent, per level: its added p99 at most HAProxy's + this.
pub const GOAL_P99_SLACK_MS: f64 = 0.5;
/// ... and its request rate at least this share of HAProxy's.
pub const GOAL_RATE_SHARE: f64 = 1.0;

/// The goal's two numbers at one level and whether both hold: (proxy p99 − HAProxy p99 in ms,
/// which is the difference of their added p99s since both add to the same direct path; proxy
/// rate / HAProxy rate; pass).
pub fn goal(proxy: &Measured, haproxy: &Measured) -> (f64, f64, bool) {
    let extra = proxy.p99_ms - haproxy.p99_ms;
    let share = if haproxy.rps > 0.0 { proxy.rps / haproxy.rps } else { 0.0 };
    let pass = extra <= GOAL_P99_SLACK_MS && share >= GOAL_RATE_SHARE && proxy.errors == 0;
    (extra, share, pass)
}

/// A CPU cost for a table cell.
pub(crate) fn cpu_cell(us: Option<f64>) -> String {
    us.map(|v| format!("{v:.0}")).unwrap_or_else(|| "-".into())
}

/// The results as a Markdown table per concurrency level, with added latency against the direct
/// path, the proxy's share of HAProxy's request rate, and the goal's verdict per level.
pub fn report(results: &[Measured], args: &BenchArgs) -> String {
    let mut s = format!(
        "Streamed chat completions of {} SSE events, {} requests per target and level, interleaved in batches of max({}, 4 x concurrency).\n",
        args.tokens, args.requests, args.batch
    );
    for &c in &args.concurrency {
        let level: Vec<&Measured> = results.iter().filter(|m| m.concurrency == c).collect();
        let direct = level.iter().find(|m| m.name == "direct");
        let haproxy_rps = level.iter().find(|m| m.name == "haproxy").map(|m| m.rps);
        s.push_str(&format!(
            "\nConcurrency {c}:\n\n| target | p50 ms | p99 ms | added p50 ms | added p99 ms | req/s | vs HAProxy req/s | CPU us/req | errors |\n|---|---|---|---|---|---|---|---|---|\n"
        ));
        for m in &level {
            let (a50, a99) = match direct {
                Some(d) if m.name != "direct" => {
                    (format!("{:.3}", m.p50_ms - d.p50_ms), format!("{:.3}", m.p99_ms - d.p99_ms))
                }
                _ => ("-".into(), "-".into()),
            };
            let share = match haproxy_rps {
                Some(h) if m.name != "direct" && h > 0.0 => format!("{:.0}%", 100.0 * m.rps / h),
                _ => "-".into(),
            };
            s.push_str(&format!(
                "| {} | {:.3} | {:.3} | {a50} | {a99} | {:.0} | {share} | {} | {} |\n",
                m.name,
                m.p50_ms,
                m.p99_ms,
                m.rps,
                cpu_cell(m.cpu_us),
                m.errors
            ));
        }
        let find = |name: &str| level.iter().find(|m| m.name == name).copied();
        if let (Some(p), Some(h)) = (find("llmlc-proxy"), find("haproxy")) {
            let (extra, share, pass) = goal(p, h);
            s.push_str(&format!(
                "\nGoal at concurrency {c}: added p99 {extra:+.3} ms against HAProxy's (at most +{GOAL_P99_SLACK_MS}), \
                 request rate {:.0}% of HAProxy's (at least {:.0}%): {}\n",
                100.0 * share,
                100.0 * GOAL_RATE_SHARE,
                if pass { "PASS" } else { "FAIL" }
            ));
            if let (Some(pc), Some(hc)) = (p.cpu_us, h.cpu_us) {
                s.push_str(&format!(
                    "CPU per request at concurrency {c}: the proxy {pc:.0} us, HAProxy {hc:.0} us ({:.2}x; goal at most 1x): {}\n",
                    pc / hc,
                    if pc <= hc { "PASS" } else { "FAIL" }
                ));
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_target_follows_every_other_once_per_cycle() {
        assert_eq!(batch_cycle(0), Vec::<usize>::new());
        assert_eq!(batch_cycle(1), vec![0]);
        assert_eq!(batch_cycle(3), vec![0, 1, 0, 2, 1, 2]);
        for n in 2..=6 {
            let cycle = batch_cycle(n);
            assert_eq!(cycle.len(), n * (n - 1), "n={n}: {cycle:?}");
            let mut pairs = std::collections::BTreeMap::new();
            for (i, &a) in cycle.iter().enumerate() {
                let b = cycle[(i + 1) % cycle.len()];
                *pairs.entry((a, b)).or_insert(0) += 1;
            }
            assert_eq!(pairs.len(), n * (n - 1), "n={n}: every ordered pair, {pairs:?}");
            assert!(pairs.iter().all(|(&(a, b), &k)| a != b && k == 1), "n={n}: {pairs:?}");
        }
    }

    #[test]
    fn report_has_one_table_per_level_with_added_latency_and_rate_share() {
        let m = |name, c, p99, rps| Measured {
            name,
            concurrency: c,
            p50_ms: 1.0,
            p99_ms: p99,
            rps,
            errors: 0,
            cpu_us: None,
        };
        let args = BenchArgs {
            requests: 10,
            concurrency: vec![1, 16],
            tokens: 200,
            batch: 100,
            out: None,
            backend_listen: None,
            doors: false,
        };
        let r = report(
            &[
                m("direct", 1, 2.0, 100.0),
                m("haproxy", 1, 2.5, 80.0),
                m("llmlc-proxy", 1, 2.75, 60.0),
                m("direct", 16, 3.0, 1.0),
            ],
            &args,
        );
        assert!(r.contains("Concurrency 1:") && r.contains("Concurrency 16:"), "{r}");
        assert!(r.contains("| llmlc-proxy | 1.000 | 2.750 | 0.000 | 0.750 | 60 | 75% | - | 0 |"), "{r}");
        assert!(r.contains("Goal at concurrency 1: added p99 +0.250 ms against HAProxy's"), "{r}");
        assert!(r.contains("request rate 75% of HAProxy's (at least 100%): FAIL"), "{r}");
        assert!(!r.contains("Goal at concurrency 16"), "no verdict without both proxies: {r}");
    }

    #[test]
    fn the_goal_needs_both_the_tail_and_the_rate() {
        let m = |p99_ms, rps| Measured {
            name: "x",
            concurrency: 16,
            p50_ms: 1.0,
            p99_ms,
            rps,
            errors: 0,
            cpu_us: None,
        };
        let h = m(10.0, 1000.0);
        assert!(goal(&m(10.5, 1000.0), &h).2, "+0.5 ms and 100% pass");
        assert!(!goal(&m(10.6, 1200.0), &h).2, "+0.6 ms fails whatever the rate");
        assert!(!goal(&m(9.0, 990.0), &h).2, "99% of the rate fails whatever the tail");
        let (extra, share, _) = goal(&m(9.0, 1500.0), &h);
        assert!((extra + 1.0).abs() < 1e-9 && (share - 1.5).abs() < 1e-9);
    }
}
