//! A real vLLM server (0.32, the CPU build `tests/vllm/install.sh` puts under target/) serving the
//! seeded tiny model on a free loopback port, through `tests/vllm/serve.sh`; ready once
//! `GET /v1/models` answers; stopped on drop with SIGTERM to its process group (the API server,
//! its engine core and its workers), then SIGKILL for whatever is left.
//!
//! A server takes ~2 GB and ~30 s to start: tests start the few they need together
//! ([`VllmServer::start_all`]) and run alone (`.config/nextest.toml`).

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::ports::free_port;

/// How long a server gets to load and answer: ~30 s on a quiet 2-core machine, more beside builds.
const READY_TIMEOUT: Duration = Duration::from_secs(240);

/// The served model name (`serve.sh`'s default).
pub const MODEL: &str = "tiny-llama";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `$VLLM_PYTHON`, else the venv `tests/vllm/install.sh` makes.
pub fn python() -> PathBuf {
    std::env::var_os("VLLM_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/vllm-venv/bin/python"))
}

/// How to start one server.
#[derive(Debug, Clone)]
pub struct Options {
    /// `--max-num-seqs`: requests decoded at once.
    pub max_num_seqs: u32,
    /// `--kv-cache-memory-bytes` (the tiny model takes 2 KiB per token).
    pub kv_bytes: u64,
    /// The CPU core its worker is bound to.
    pub core: u32,
}

impl Options {
    pub fn new(max_num_seqs: u32, kv_mib: u64, core: u32) -> Options {
        Options { max_num_seqs, kv_bytes: kv_mib << 20, core }
    }
}

pub struct VllmServer {
    child: Child,
    port: u16,
    pub options: Options,
    log_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl VllmServer {
    /// Start the servers together (their start-ups overlap) and wait until all answer.
    pub async fn start_all(options: &[Options]) -> Vec<VllmServer> {
        let mut servers: Vec<VllmServer> = options.iter().cloned().map(VllmServer::spawn).collect();
        for s in &mut servers {
            s.wait_ready().await;
        }
        servers
    }

    fn spawn(o: Options) -> VllmServer {
        let python = python();
        assert!(
            python.exists(),
            "no vLLM at {} (run tests/vllm/install.sh, or tests/run.sh, which calls it)",
            python.display()
        );
        let dir = tempfile::Builder::new().prefix("vllm-").tempdir().expect("temp dir");
        let log_path = dir.path().join("vllm.log");
        let log = std::fs::File::create(&log_path).expect("log file");
        let port = free_port();
        let child = Command::new(root().join("tests/vllm/serve.sh"))
            .args([port.to_string(), o.kv_bytes.to_string(), o.max_num_seqs.to_string(), o.core.to_string()])
            .env("VLLM_PYTHON", &python)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            // Its own process group: on drop the whole server (API, engine, workers) is stopped,
            // and nothing else.
            .process_group(0)
            .spawn()
            .expect("start tests/vllm/serve.sh");
        VllmServer { child, port, options: o, log_path, _dir: dir }
    }

    async fn wait_ready(&mut self) {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("vLLM exited during start-up ({status}):\n{}", self.log_tail());
            }
            let models =
                client.get(format!("{}/v1/models", self.url())).timeout(Duration::from_secs(2)).send();
            if let Ok(r) = models.await {
                if r.status().is_success() {
                    return;
                }
            }
            if Instant::now() >= deadline {
                panic!("vLLM did not answer within {READY_TIMEOUT:?}:\n{}", self.log_tail());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `127.0.0.1:PORT`: the member id the controller uses.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The last 60 lines of its log.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    /// One gauge of its `/metrics` page, summed over its series (`engine`, `model_name`).
    pub async fn gauge(&self, name: &str) -> Option<f64> {
        let page = reqwest::get(format!("{}/metrics", self.url())).await.ok()?.text().await.ok()?;
        crate::load::sum_of_series(&page, name)
    }

    fn signal(&self, sig: &str) {
        // The negative PID names the group this server leads (spawned with `process_group(0)`).
        let _ = Command::new("kill").args([sig, "--", &format!("-{}", self.child.id())]).status();
    }
}

impl Drop for VllmServer {
    fn drop(&mut self) {
        self.signal("-TERM");
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // Engine and worker processes outlive a killed API server: the group goes, whatever is left.
        self.signal("-KILL");
        let _ = self.child.wait();
    }
}
