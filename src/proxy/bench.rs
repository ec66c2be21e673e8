//! `proxy bench`: the proxy's overhead, measured side by side with real HAProxy in the same run.
//!
//! Starts a fast in-process backend answering small non-streaming chat completions, then the proxy
//! (this binary, `proxy --config ...`, as its own process) and HAProxy (`$HAPROXY_BIN`,
//! `/usr/sbin/haproxy` or `haproxy` on PATH) both forwarding to it, on free loopback ports with
//! generated configs in a temp dir. One load generator sends the same requests, at the same
//! concurrency, straight to the backend and through each proxy; added latency is the difference of
//! the percentiles. Both proxies get two threads (tokio's default on this 2-core class of machine,
//! HAProxy `nbthread 2`). Children are killed when the run ends.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use axum::routing::post;
use axum::Router;
use clap::Args;
use futures::StreamExt;

/// Arguments of `proxy bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Measured requests per target (after a warm-up of a tenth of that).
    #[arg(long, default_value_t = 20000)]
    pub requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Also write the results as Markdown to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

const BODY: &str = r#"{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;
const ANSWER: &str = r#"{"id":"cmpl-bench","object":"chat.completion","created":0,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;

/// Latency percentiles and throughput of one target.
#[derive(Debug, Clone)]
pub struct Measured {
    pub name: &'static str,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub rps: f64,
    pub errors: usize,
}

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A scratch directory removed on drop (tempfile is a dev-only dependency here).
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> anyhow::Result<TempDir> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("llmlc-proxy-bench-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).with_context(|| format!("cannot create {}", p.display()))?;
        Ok(TempDir(p))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot bind a free port")?;
    Ok(l.local_addr()?.port())
}

async fn wait_port(port: u16, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("{what} did not listen on 127.0.0.1:{port} within 15 s")
}

fn haproxy_bin() -> PathBuf {
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

async fn measure(
    client: &reqwest::Client,
    name: &'static str,
    url: &str,
    n: usize,
    concurrency: usize,
) -> Measured {
    let started = Instant::now();
    let results: Vec<Option<f64>> = futures::stream::iter(0..n)
        .map(|_| async {
            let t = Instant::now();
            let r = client.post(url).header("content-type", "application/json").body(BODY).send().await;
            match r {
                Ok(resp) if resp.status().is_success() => {
                    resp.bytes().await.ok().map(|_| t.elapsed().as_secs_f64())
                }
                _ => None,
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    let wall = started.elapsed().as_secs_f64();
    let mut ok: Vec<f64> = results.iter().flatten().copied().collect();
    ok.sort_by(|a, b| a.total_cmp(b));
    let pct = |q: f64| -> f64 {
        if ok.is_empty() {
            return f64::NAN;
        }
        let i = ((ok.len() as f64 - 1.0) * q).round() as usize;
        ok[i.min(ok.len() - 1)] * 1000.0
    };
    Measured { name, p50_ms: pct(0.5), p99_ms: pct(0.99), rps: ok.len() as f64 / wall, errors: n - ok.len() }
}

/// Run the benchmark and print (and optionally write) the table.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let dir = TempDir::new()?;

    // Backend: answers every chat completion with the same small body.
    let backend = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let backend_addr: SocketAddr = backend.local_addr()?;
    let app = Router::new().route(
        "/v1/chat/completions",
        post(|| async { ([(axum::http::header::CONTENT_TYPE, "application/json")], ANSWER) }),
    );
    let backend_task = tokio::spawn(async move {
        let _ = axum::serve(backend, app).await;
    });

    // The proxy, as its own process like HAProxy.
    let (pport, aport, hport) = (free_port()?, free_port()?, free_port()?);
    let pcfg = dir.path().join("proxy.yaml");
    std::fs::write(
        &pcfg,
        format!(
            "# proxy config\nlisten: 127.0.0.1:{pport}\nadmin: {{ listen: 127.0.0.1:{aport} }}\npools:\n  - name: bench\n    members: ['{backend_addr}']\nroutes:\n  steps:\n    - id: model\n      field: model\n      op: exists\n      match: {{ pool: bench }}\n      miss: {{ reject: 400 }}\n"
        ),
    )?;
    let exe = std::env::current_exe().context("cannot find this program's path")?;
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

    let client =
        reqwest::Client::builder().no_proxy().tcp_nodelay(true).pool_max_idle_per_host(1024).build()?;
    let targets: [(&'static str, String); 3] = [
        ("direct", format!("http://{backend_addr}/v1/chat/completions")),
        ("haproxy", format!("http://127.0.0.1:{hport}/v1/chat/completions")),
        ("llmlc-proxy", format!("http://127.0.0.1:{pport}/v1/chat/completions")),
    ];
    let warm = (args.requests / 10).max(100);
    for (name, url) in &targets {
        let w = measure(&client, name, url, warm, args.concurrency).await;
        if w.errors == warm {
            anyhow::bail!("every warm-up request to {name} ({url}) failed");
        }
    }
    let mut results = Vec::new();
    for (name, url) in &targets {
        results.push(measure(&client, name, url, args.requests, args.concurrency).await);
    }
    drop(proxy);
    drop(haproxy);
    backend_task.abort();

    let text = report(&results, &args);
    print!("{text}");
    if let Some(out) = &args.out {
        std::fs::write(out, &text).with_context(|| format!("cannot write {}", out.display()))?;
    }
    Ok(())
}

/// The results as a Markdown table, with added latency against the direct path.
pub fn report(results: &[Measured], args: &BenchArgs) -> String {
    let direct = results.iter().find(|m| m.name == "direct");
    let mut s = format!(
        "Small non-streaming chat completions, {} requests per target, concurrency {}.\n\n| target | p50 ms | p99 ms | added p50 ms | added p99 ms | req/s | errors |\n|---|---|---|---|---|---|---|\n",
        args.requests, args.concurrency
    );
    for m in results {
        let (a50, a99) = match direct {
            Some(d) if m.name != "direct" => {
                (format!("{:.3}", m.p50_ms - d.p50_ms), format!("{:.3}", m.p99_ms - d.p99_ms))
            }
            _ => ("-".into(), "-".into()),
        };
        s.push_str(&format!(
            "| {} | {:.3} | {:.3} | {a50} | {a99} | {:.0} | {} |\n",
            m.name, m.p50_ms, m.p99_ms, m.rps, m.errors
        ));
    }
    s
}
