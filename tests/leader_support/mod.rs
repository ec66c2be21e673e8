//! The controller binary as a child process, for the leader-election and reload tests: its stderr
//! in a file, HTTP helpers for its endpoints, SIGTERM to stop, killed on drop.

#![allow(dead_code)] // each test binary uses a different part

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use llm_lc_testkit::wait;

pub const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");

pub struct Proc {
    child: Child,
    pub listen: u16,
    log: std::path::PathBuf,
}

impl Proc {
    /// `run --config CONFIG` with extra environment variables; stderr goes to `log`.
    pub fn start(config: &Path, listen: u16, env: &[(&str, &str)], log: &Path) -> Proc {
        let mut cmd = Command::new(BIN);
        cmd.args(["run", "--config"]).arg(config).stdout(Stdio::null());
        cmd.stderr(std::fs::File::create(log).expect("create the log file"));
        // The test machine may run in a pod; the controller must only see the fake API server.
        cmd.env_remove("KUBERNETES_SERVICE_HOST").env_remove("KUBERNETES_SERVICE_PORT");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("start the controller");
        Proc { child, listen, log: log.to_path_buf() }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Status and body of `GET path`, or `None` when the listener does not answer.
    pub async fn get(&self, path: &str) -> Option<(u16, String)> {
        let r = reqwest::Client::new()
            .get(format!("http://127.0.0.1:{}{path}", self.listen))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .ok()?;
        let code = r.status().as_u16();
        Some((code, r.text().await.ok()?))
    }

    /// The last cycle's report from `GET /v1/ratios`.
    pub async fn report(&self) -> Option<serde_json::Value> {
        let (code, body) = self.get("/v1/ratios").await?;
        (code == 200).then(|| serde_json::from_str(&body).ok()).flatten()
    }

    /// The value of one exposition line, e.g. `llmlc_leader` or `llmlc_config_reloads_total{result="applied"}`.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics").await?;
        body.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
    }

    /// Wait until the process has exited by itself; its status.
    pub async fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let child = &mut self.child;
        wait::until(timeout, "the controller to exit", || {
            let s = child.try_wait().ok().flatten();
            async move { s }
        })
        .await
    }

    /// SIGTERM, then the exit status (within 5 s).
    pub async fn stop(&mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        self.wait_exit(Duration::from_secs(5)).await
    }

    /// SIGKILL: no chance to release anything (a crashed or partitioned pod).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Lay out `dir` like a Kubernetes ConfigMap volume: `dir/NAME -> ..data/NAME`,
/// `..data -> ..VERSION/`; each call writes a new version and swaps `..data` atomically (rename of
/// a new symlink over the old one), exactly as the kubelet's atomic writer does.
pub fn configmap_write(dir: &Path, name: &str, content: &str, version: u32) {
    let versioned = dir.join(format!("..v{version}"));
    std::fs::create_dir_all(&versioned).expect("create the version dir");
    std::fs::write(versioned.join(name), content).expect("write the config");
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(format!("..v{version}"), &tmp).expect("symlink ..data_tmp");
    std::fs::rename(&tmp, dir.join("..data")).expect("swap ..data");
    let link = dir.join(name);
    if std::fs::symlink_metadata(&link).is_err() {
        std::os::unix::fs::symlink(format!("..data/{name}"), &link).expect("symlink the file");
    }
}
