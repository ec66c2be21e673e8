//! Live config reload: the control loop for `run --config FILE`, which picks up changes of the file
//! while it runs.
//!
//! How a change is seen: the file's content is polled (twice per cycle interval, between 0.2 s and
//! 2 s) and compared with what was last read. Polling the content rather than watching inotify events
//! is deliberate: a Kubernetes ConfigMap volume changes by swapping a `..data` symlink, editors
//! write a temp file and rename it, and network filesystems send no events; reading the path
//! follows every one of those.
//!
//! What happens then, between two cycles:
//! - The new text is parsed and validated exactly like `check` does. Invalid: it is *rejected*: an
//!   error log with every problem, `llmlc_config_reloads_total{result="rejected"}`,
//!   `llmlc_config_last_reload_successful 0`, and a note in `/readyz`. The old config keeps running
//!   and `/readyz` keeps its status (200 while cycles succeed): the replica is still doing its job,
//!   and failing readiness would take working replicas out of service for a typo.
//! - Valid: the old controller releases its sinks, a new one is built and starts from the ratios the
//!   old one computed (no jump back to the middle of the range). If the new one cannot be built (a
//!   port in use, a missing directory), the change is rejected and the old config is rebuilt.
//! - `listen`, `log_format` and `leader_election` cannot change while running; a change to them is
//!   logged and applies at the next restart. Everything else applies at once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use llm_lc_adapters::SinkContext;
use tokio::sync::watch;

use crate::config::{self, Config, ConfigError, ConfigErrors};
use crate::controller::{Controller, Output};
use crate::report::CycleReport;
use crate::telemetry::{labels, Telemetry};

const NOTE: &str = "config";

/// Read and validate the config file, keeping its bytes to compare later changes with.
pub fn read(path: &Path) -> Result<(Config, Vec<u8>), ConfigErrors> {
    let bytes = std::fs::read(path).map_err(|e| one_error(path, format!("cannot read: {e}")))?;
    let cfg = parse(path, &bytes)?;
    Ok((cfg, bytes))
}

fn parse(path: &Path, bytes: &[u8]) -> Result<Config, ConfigErrors> {
    let text = std::str::from_utf8(bytes).map_err(|e| one_error(path, format!("not UTF-8 text: {e}")))?;
    config::parse(path, text)
}

fn one_error(path: &Path, message: String) -> ConfigErrors {
    ConfigErrors(vec![ConfigError {
        file: path.to_path_buf(),
        location: None,
        field: String::new(),
        message,
    }])
}

/// How often the file is read: twice per cycle, within 0.2 s..2 s.
pub fn poll_period(interval: Duration) -> Duration {
    (interval / 2).clamp(Duration::from_millis(200), Duration::from_secs(2))
}

/// What the controller is built with, besides the config.
pub struct Builder {
    pub telemetry: Arc<Telemetry>,
    pub dry_run: bool,
    pub ctx: SinkContext,
    pub leader: watch::Receiver<bool>,
}

impl Builder {
    pub fn build(&self, cfg: &Config) -> Result<Controller, String> {
        let mut c = Controller::new(cfg, self.telemetry.clone(), self.dry_run, &self.ctx)
            .map_err(|e| e.to_string())?;
        c.set_leadership(self.leader.clone());
        Ok(c)
    }
}

/// Watches one file's content.
struct FileWatch {
    path: PathBuf,
    /// The bytes of the config in force.
    active: Vec<u8>,
    /// What the last look found (content or read error), so one change is handled once.
    last_seen: Result<Vec<u8>, String>,
}

impl FileWatch {
    /// A valid new config, if the file changed to one. Rejections are reported here.
    fn check(&mut self, telemetry: &Telemetry) -> Option<(Config, Vec<u8>)> {
        let now = std::fs::read(&self.path).map_err(|e| e.to_string());
        if now == self.last_seen {
            return None;
        }
        self.last_seen = now.clone();
        match now {
            Err(e) => {
                reject(
                    telemetry,
                    &self.path,
                    &one_error(&self.path, format!("cannot read: {e}")).to_string(),
                );
                None
            }
            Ok(bytes) if bytes == self.active => {
                // Back to the config in force (a bad edit reverted): nothing to rebuild.
                clear_rejection(telemetry);
                tracing::info!(file = %self.path.display(), "config file is back to the config in force");
                None
            }
            Ok(bytes) => match parse(&self.path, &bytes) {
                Ok(cfg) => Some((cfg, bytes)),
                Err(errs) => {
                    reject(telemetry, &self.path, &errs.to_string());
                    None
                }
            },
        }
    }
}

fn reject(telemetry: &Telemetry, path: &Path, why: &str) {
    tracing::error!(
        file = %path.display(),
        "config change rejected; the previous config keeps running. Fix the file (`llm-load-controller check --config FILE` shows the same errors):\n{why}"
    );
    let m = &telemetry.metrics;
    m.config_reloads.get_or_create(&labels(&[("result", "rejected")])).inc();
    m.config_last_reload_successful.set(0);
    let one_line = why.lines().collect::<Vec<_>>().join(" | ");
    telemetry.set_note(NOTE, Some(format!("change rejected, previous config keeps running: {one_line}")));
}

fn clear_rejection(telemetry: &Telemetry) {
    telemetry.metrics.config_last_reload_successful.set(1);
    telemetry.set_note(NOTE, None);
}

/// Settings that only take effect at start.
fn warn_restart_only(old: &Config, new: &Config) {
    if old.listen != new.listen {
        tracing::warn!(old = %old.listen, new = %new.listen, "`listen` changed; the listener stays where it is until the next restart");
    }
    if old.log_format != new.log_format {
        tracing::warn!("`log_format` changed; it applies at the next restart");
    }
    if old.leader_election != new.leader_election {
        tracing::warn!("`leader_election` changed; it applies at the next restart");
    }
}

/// Remove gauges of pools and members the new config no longer has, once the new controller's first
/// cycle shows what it has (members may come from discovery).
fn forget_gone(telemetry: &Telemetry, before: &CycleReport, after: &CycleReport) {
    let m = &telemetry.metrics;
    let now: BTreeMap<&str, Vec<&str>> = after
        .pools
        .iter()
        .map(|p| (p.pool.as_str(), p.members.iter().map(|x| x.member.as_str()).collect()))
        .collect();
    for p in &before.pools {
        let kept = now.get(p.pool.as_str());
        for mem in &p.members {
            if !kept.is_some_and(|k| k.contains(&mem.member.as_str())) {
                m.forget_member(&p.pool, &mem.member);
            }
        }
        if kept.is_none() {
            let l = labels(&[("pool", &p.pool)]);
            for f in [&m.pool_saturation, &m.pool_fresh_members, &m.pool_up] {
                f.remove(&l);
            }
        }
    }
}

/// Run cycles on the interval until `shutdown`, reloading `path` when it changes. Returns whether
/// the last cycle computed ratios for every pool (as [`crate::controller::run`]).
pub async fn run(
    controller: Controller,
    cfg: Config,
    path: &Path,
    text: Vec<u8>,
    builder: Builder,
    output: Output,
    shutdown: impl std::future::Future<Output = ()>,
) -> bool {
    let mut watch = FileWatch { path: path.to_path_buf(), active: text.clone(), last_seen: Ok(text) };
    let mut cfg = cfg;
    // `None` only if neither the new nor the old config could be built; retried every tick.
    let mut controller = Some(controller);
    let mut ticker = new_ticker(cfg.interval);
    let mut poll = tokio::time::interval(poll_period(cfg.interval));
    let mut before_reload: Option<CycleReport> = None;
    tokio::pin!(shutdown);
    let mut last_ok = true;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = ticker.tick() => {}
            _ = poll.tick() => {
                if let Some((new_cfg, bytes)) = watch.check(&builder.telemetry) {
                    let old = controller.take();
                    let seeds = old.as_ref().map(Controller::computed_ratios).unwrap_or_default();
                    if let Some(old) = old {
                        old.shutdown().await;
                    }
                    warn_restart_only(&cfg, &new_cfg);
                    match builder.build(&new_cfg) {
                        Ok(mut c) => {
                            c.seed_ratios(&seeds);
                            controller = Some(c);
                            before_reload = builder.telemetry.last_report();
                            watch.active = bytes;
                            let interval_changed = new_cfg.interval != cfg.interval;
                            cfg = new_cfg;
                            builder.telemetry.set_schedule(cfg.interval, cfg.unready_after_cycles);
                            let m = &builder.telemetry.metrics;
                            m.config_reloads.get_or_create(&labels(&[("result", "applied")])).inc();
                            clear_rejection(&builder.telemetry);
                            tracing::info!(file = %path.display(), pools = cfg.pools.len(), interval = ?cfg.interval, "config reloaded");
                            if interval_changed {
                                ticker = new_ticker(cfg.interval);
                                poll = tokio::time::interval(poll_period(cfg.interval));
                            }
                        }
                        Err(e) => {
                            reject(&builder.telemetry, path, &format!("{}: {e}", path.display()));
                            controller = rebuild(&builder, &cfg, &seeds);
                        }
                    }
                }
                continue;
            }
        }
        if controller.is_none() {
            controller = rebuild(&builder, &cfg, &BTreeMap::new());
        }
        let Some(c) = controller.as_mut() else { continue };
        let (report, ok) = tokio::select! {
            _ = &mut shutdown => break,
            r = c.cycle() => r,
        };
        last_ok = ok;
        if let Some(before) = before_reload.take() {
            forget_gone(&builder.telemetry, &before, &report);
        }
        match output {
            Output::Text => println!("{}", report.to_table()),
            Output::Json => println!("{}", report.to_json_line()),
            Output::Quiet => {}
        }
    }
    if let Some(c) = controller {
        c.shutdown().await;
    }
    last_ok
}

fn rebuild(
    builder: &Builder,
    cfg: &Config,
    seeds: &BTreeMap<String, llm_lc_adapters::Ratios>,
) -> Option<Controller> {
    match builder.build(cfg) {
        Ok(mut c) => {
            c.seed_ratios(seeds);
            Some(c)
        }
        Err(e) => {
            tracing::error!(error = %e, "cannot rebuild the controller from the config in force; retrying every cycle");
            None
        }
    }
}

fn new_ticker(interval: Duration) -> tokio::time::Interval {
    let mut t = tokio::time::interval(interval);
    // A slow cycle delays the next one instead of firing a burst to catch up.
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_period_is_bounded() {
        assert_eq!(poll_period(Duration::from_secs(5)), Duration::from_secs(2));
        assert_eq!(poll_period(Duration::from_secs(1)), Duration::from_millis(500));
        assert_eq!(poll_period(Duration::from_millis(100)), Duration::from_millis(200));
    }

    #[test]
    fn read_rejects_non_utf8_naming_the_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("c.yaml");
        std::fs::write(&p, [0xff, 0xfe]).expect("write");
        let e = read(&p).expect_err("not UTF-8");
        assert!(e.to_string().contains("c.yaml") && e.to_string().contains("UTF-8"), "{e}");
    }
}
