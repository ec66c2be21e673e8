//! A real Prometheus (Debian's `/usr/bin/prometheus`) on a free loopback port, scraping the targets a
//! test gives it every second, in a temp dir, killed on drop.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{ports, wait};

/// Target labels, and the targets (`host:port`) that carry them.
pub type TargetGroup<'a> = (&'a [(&'a str, &'a str)], &'a [String]);

pub struct Prometheus {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

/// The binary: `$PROMETHEUS_BIN` when set, else Debian's path, else whatever is on PATH.
fn binary() -> PathBuf {
    if let Ok(p) = std::env::var("PROMETHEUS_BIN") {
        return p.into();
    }
    let debian = PathBuf::from("/usr/bin/prometheus");
    if debian.exists() {
        debian
    } else {
        "prometheus".into()
    }
}

impl Prometheus {
    /// Start Prometheus scraping `targets` (`host:port`) as job `job` every second, and wait until it is ready.
    pub async fn start(job: &str, targets: &[String]) -> Prometheus {
        Self::start_labelled(job, &[(&[], targets)]).await
    }

    /// Like [`Prometheus::start`], with target labels per group of targets (what a Thanos external
    /// label or a relabelling rule adds in a real setup), e.g. `[(&[("region", "east")], targets)]`.
    pub async fn start_labelled(job: &str, groups: &[TargetGroup<'_>]) -> Prometheus {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut static_configs = String::new();
        for (labels, targets) in groups {
            let list = targets.iter().map(|t| format!("'{t}'")).collect::<Vec<_>>().join(", ");
            static_configs.push_str(&format!("      - targets: [{list}]\n"));
            if !labels.is_empty() {
                // JSON strings are YAML double-quoted scalars: any value (quotes, backslashes, line
                // breaks) arrives in Prometheus as written.
                let l = labels
                    .iter()
                    .map(|(k, v)| format!("{k}: {}", serde_json::Value::from(*v)))
                    .collect::<Vec<_>>()
                    .join(", ");
                static_configs.push_str(&format!("        labels: {{ {l} }}\n"));
            }
        }
        let cfg = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: '{job}'\n    scrape_interval: 1s\n    scrape_timeout: 900ms\n    static_configs:\n{static_configs}"
        );
        let cfg_path = dir.path().join("prometheus.yml");
        std::fs::write(&cfg_path, cfg).expect("write prometheus.yml");
        let port = ports::free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log file");
        let child = Command::new(binary())
            .arg(format!("--config.file={}", cfg_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--web.enable-lifecycle")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus (install Debian's `prometheus` package, or set PROMETHEUS_BIN)");
        let prom = Prometheus { child, port, _dir: dir };
        wait::http_ok(&format!("{}/-/ready", prom.url()), Duration::from_secs(30)).await;
        prom
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Run an instant query and return the `data.result` array.
    pub async fn query(&self, promql: &str) -> Vec<serde_json::Value> {
        let resp: serde_json::Value = reqwest::Client::new()
            .get(format!("{}/api/v1/query", self.url()))
            .query(&[("query", promql)])
            .send()
            .await
            .expect("query prometheus")
            .json()
            .await
            .expect("prometheus answers JSON");
        resp["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// Wait until `promql` returns at least `n` series (targets scraped at least once).
    pub async fn wait_for_series(&self, promql: &str, n: usize, timeout: Duration) {
        wait::until(timeout, &format!("{n} series for {promql}"), || async move {
            (self.query(promql).await.len() >= n).then_some(())
        })
        .await
    }

    /// Stop Prometheus now (to test behaviour while it is down).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.kill();
    }
}
