//! The controller binary as a child process with its own config in a temp dir: checked with
//! `check` first, read back over its HTTP API, stopped on drop. Integration tests pass the binary's
//! path (`env!("CARGO_BIN_EXE_llm-load-controller")`), which only they know.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::ports;

pub struct Running {
    child: Child,
    listen: u16,
    dir: tempfile::TempDir,
}

impl Running {
    /// `bin run --config` with `interval`, a free `listen` port and `body` (sources, pools).
    pub fn start(bin: &Path, interval: &str, body: &str) -> Running {
        Running::start_capped(bin, interval, body, None)
    }

    /// As [`Running::start`], with the process's address space capped at `address_space` bytes
    /// (`prlimit --as`): an allocation past it aborts the controller, as a container's memory
    /// limit would kill it.
    pub fn start_capped(bin: &Path, interval: &str, body: &str, address_space: Option<u64>) -> Running {
        let dir = tempfile::tempdir().expect("tmp");
        let listen = ports::free_port();
        let cfg = dir.path().join("controller.yaml");
        std::fs::write(&cfg, format!("interval: {interval}\nlisten: 127.0.0.1:{listen}\n{body}"))
            .expect("config");
        let out = Command::new(bin).args(["check", "--config"]).arg(&cfg).output().expect("check");
        assert!(out.status.success(), "config rejected: {}", String::from_utf8_lossy(&out.stderr));
        let mut cmd = match address_space {
            Some(bytes) => {
                let mut c = Command::new("prlimit");
                c.arg(format!("--as={bytes}")).arg("--").arg(bin);
                c
            }
            None => Command::new(bin),
        };
        let child = cmd
            .args(["run", "--config"])
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("stderr.log")).expect("log"))
            .spawn()
            .expect("start controller");
        Running { child, listen, dir }
    }

    /// The port of its HTTP API (`/metrics`, `/v1/ratios`, Envoy's EDS).
    pub fn listen(&self) -> u16 {
        self.listen
    }

    /// The config file it runs from (rewrite it to make the controller reload).
    pub fn config_path(&self) -> std::path::PathBuf {
        self.dir.path().join("controller.yaml")
    }

    /// Whether the process is still running (not exited, not killed by an abort).
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Its peak resident memory so far (`VmHWM`), in bytes.
    pub fn peak_rss(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default()
    }

    /// The last cycle's report of `pool` from `GET /v1/ratios`.
    pub async fn pool(&self, pool: &str) -> Option<serde_json::Value> {
        let v: serde_json::Value = reqwest::get(format!("http://127.0.0.1:{}/v1/ratios", self.listen))
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        v["pools"].as_array()?.iter().find(|p| p["pool"] == pool).cloned()
    }

    /// The ratios of the last cycle of `pool`, by member.
    pub async fn ratios(&self, pool: &str) -> Option<BTreeMap<String, u64>> {
        let p = self.pool(pool).await?;
        Some(
            p["members"]
                .as_array()?
                .iter()
                .filter_map(|m| Some((m["member"].as_str()?.to_string(), m["ratio"].as_u64()?)))
                .collect(),
        )
    }

    pub async fn metrics(&self) -> String {
        match reqwest::get(format!("http://127.0.0.1:{}/metrics", self.listen)).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
