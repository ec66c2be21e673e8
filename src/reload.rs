//! Live config reload for `run --config FILE`: an input of the one control loop
//! ([`crate::control_loop::run`]). [`watch_file`] notices changes and validates them off the control
//! task; [`Reloader`] swaps the controller between two cycles.
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
use crate::controller::Controller;
use crate::overrides::Overrides;
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
    if bytes.len() > MAX_CONFIG_BYTES {
        return Err(one_error(
            path,
            format!("{} bytes is more than a config file may have ({MAX_CONFIG_BYTES})", bytes.len()),
        ));
    }
    if let Some(depth) = nesting_beyond(bytes, MAX_CONFIG_DEPTH) {
        return Err(one_error(
            path,
            format!("nested deeper than {MAX_CONFIG_DEPTH} levels (at least {depth})"),
        ));
    }
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

/// Whether brackets/braces (YAML flow style) or indentation nest deeper than `limit`; returns the
/// depth found. A cheap scan before parsing, so a hostile document cannot make the parser recurse.
fn nesting_beyond(bytes: &[u8], limit: usize) -> Option<usize> {
    let mut depth = 0usize;
    for &b in bytes {
        match b {
            b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return Some(depth);
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    // Block style: each level indents by at least one space.
    let deepest = bytes
        .split(|&b| b == b'\n')
        .map(|line| line.iter().take_while(|&&b| b == b' ' || b == b'-').count())
        .max()
        .unwrap_or(0);
    (deepest > limit * 4).then_some(deepest / 2)
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

/// Largest config file accepted; a bigger one is rejected before parsing.
pub const MAX_CONFIG_BYTES: usize = 1 << 20;
/// Deepest nesting accepted (YAML flow collections count too); a config is a few levels deep, and a
/// pathological document must not stall the parser.
pub const MAX_CONFIG_DEPTH: usize = 64;

/// Watches one file's content.
struct FileWatch {
    path: PathBuf,
    /// The bytes of the config last handed to the loop.
    active: Vec<u8>,
    /// What the last look found (content or read error), so one change is handled once.
    last_seen: Result<Vec<u8>, String>,
    /// Command-line settings that win over the file's, after every reload too.
    overrides: Overrides,
}

impl FileWatch {
    /// A valid new config, if the file changed to one. Rejections are reported here. Reading and
    /// parsing run on a blocking thread: a huge or deeply nested file never stalls the control loop.
    async fn check(&mut self, telemetry: &Telemetry) -> Option<Config> {
        let path = self.path.clone();
        let now = tokio::task::spawn_blocking(move || std::fs::read(&path).map_err(|e| e.to_string()))
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
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
            Ok(bytes) => {
                let path = self.path.clone();
                let overrides = self.overrides;
                let parsed = {
                    let bytes = bytes.clone();
                    tokio::task::spawn_blocking(move || overrides.apply(&path, parse(&path, &bytes)?))
                        .await
                        .unwrap_or_else(|e| Err(one_error(&self.path, format!("parser failed: {e}"))))
                };
                match parsed {
                    Ok(cfg) => {
                        self.active = bytes;
                        Some(cfg)
                    }
                    Err(errs) => {
                        reject(telemetry, &self.path, &errs.to_string());
                        None
                    }
                }
            }
        }
    }
}

/// Watch `path` for changes (polled twice per interval, and at once on SIGHUP) and send each valid
/// new config. Runs as its own task, so reading and parsing never hold up a cycle.
pub fn watch_file(
    path: &Path,
    text: Vec<u8>,
    interval: Duration,
    overrides: Overrides,
    telemetry: Arc<Telemetry>,
) -> tokio::sync::mpsc::Receiver<Config> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let mut watch =
        FileWatch { path: path.to_path_buf(), active: text.clone(), last_seen: Ok(text), overrides };
    tokio::spawn(async move {
        let mut poll = tokio::time::interval(poll_period(interval));
        let mut hup = crate::signal::hangups();
        loop {
            tokio::select! {
                _ = poll.tick() => {}
                _ = hup.recv() => {
                    tracing::info!(file = %watch.path.display(), "SIGHUP received, reading the config file");
                    // Re-read even when the content looks unchanged to this watcher.
                    watch.last_seen = Err(String::new());
                }
                _ = tx.closed() => break,
            }
            if let Some(cfg) = watch.check(&telemetry).await {
                let new_interval = cfg.interval;
                if tx.send(cfg).await.is_err() {
                    break;
                }
                poll = tokio::time::interval(poll_period(new_interval));
            }
        }
    });
    rx
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
    let pickers = |c: &Config| -> Vec<(String, Option<crate::picker::PickerConfig>)> {
        c.pools.iter().map(|p| (p.name.clone(), p.picker.clone())).filter(|(_, p)| p.is_some()).collect()
    };
    if pickers(old) != pickers(new) {
        tracing::warn!("a pool's `picker` changed; the endpoint pickers keep their doors and settings until the next restart");
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
            m.forget_pool(&p.pool);
        }
    }
}

/// Config reload as an input of the control loop ([`crate::control_loop::run`]): new configs arrive
/// from [`watch`], and [`Reloader::apply`] swaps the controller between two cycles.
pub struct Reloader {
    pub configs: tokio::sync::mpsc::Receiver<Config>,
    pub builder: Builder,
    /// The config in force.
    pub cfg: Config,
    pub path: PathBuf,
    /// The last report before a reload, to drop gauges of pools and members that are gone.
    before_reload: Option<CycleReport>,
}

impl Reloader {
    pub fn new(
        configs: tokio::sync::mpsc::Receiver<Config>,
        builder: Builder,
        cfg: Config,
        path: &Path,
    ) -> Self {
        Reloader { configs, builder, cfg, path: path.to_path_buf(), before_reload: None }
    }

    /// Replace `controller` with one built from `new_cfg`, starting from the ratios the old one
    /// computed. If the new one cannot be built, the change is rejected and the old config is
    /// rebuilt. Returns whether the interval changed.
    pub async fn apply(&mut self, new_cfg: Config, controller: &mut Option<Controller>) -> bool {
        let telemetry = self.builder.telemetry.clone();
        let old = controller.take();
        let seeds = old.as_ref().map(Controller::carried).unwrap_or_default();
        if let Some(mut old) = old {
            old.shutdown().await;
        }
        warn_restart_only(&self.cfg, &new_cfg);
        match self.builder.build(&new_cfg) {
            Ok(mut c) => {
                c.seed(&seeds);
                *controller = Some(c);
                self.before_reload = telemetry.last_report();
                let interval_changed = new_cfg.interval != self.cfg.interval;
                self.cfg = new_cfg;
                telemetry.set_schedule(self.cfg.interval, self.cfg.unready_after_cycles);
                telemetry.metrics.config_reloads.get_or_create(&labels(&[("result", "applied")])).inc();
                clear_rejection(&telemetry);
                tracing::info!(file = %self.path.display(), pools = self.cfg.pools.len(), interval = ?self.cfg.interval, "config reloaded");
                interval_changed
            }
            Err(e) => {
                reject(&telemetry, &self.path, &format!("{}: {e}", self.path.display()));
                *controller = self.rebuild(&seeds);
                false
            }
        }
    }

    /// Build the controller of the config in force (after a failed swap, or retried every cycle).
    pub fn rebuild(&self, seeds: &BTreeMap<String, crate::controller::Carried>) -> Option<Controller> {
        match self.builder.build(&self.cfg) {
            Ok(mut c) => {
                c.seed(seeds);
                Some(c)
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot rebuild the controller from the config in force; retrying every cycle");
                None
            }
        }
    }

    /// After the first cycle of a new controller: drop gauges of what the new config no longer has.
    pub fn after_cycle(&mut self, report: &CycleReport) {
        if let Some(before) = self.before_reload.take() {
            forget_gone(&self.builder.telemetry, &before, report);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_the_new_config_drops_loses_all_its_series() {
        use crate::report::PoolReport;
        use crate::telemetry::PoolCounter;
        let t = Telemetry::new(Duration::from_secs(1), 3);
        let m = &t.metrics;
        for pool in ["kept", "gone"] {
            m.pool_up.get_or_create(&labels(&[("pool", pool)])).set(1.0);
            m.pool_members.get_or_create(&labels(&[("pool", pool)])).set(2.0);
            m.member_errors.get_or_create(&labels(&[("pool", pool), ("reason", "invalid_name")])).inc();
            // The series whose other labels only the cycles that set them know.
            m.pool_counter(PoolCounter::Pushes, pool, &[("sink", "haproxy"), ("outcome", "pushed")]).inc();
            m.pool_counter(PoolCounter::Pushes, pool, &[("sink", "haproxy"), ("outcome", "error")]).inc();
            m.pool_counter(PoolCounter::SinkWrites, pool, &[("sink", "haproxy")]).inc_by(3);
            m.pool_counter(PoolCounter::SamplesRejected, pool, &[("signal", "kv_usage"), ("reason", "nan")])
                .inc();
            m.sink_instance_ok(pool, "haproxy", "127.0.0.1:9999").set(1.0);
            m.sink_instance_ok(pool, "haproxy", "127.0.0.2:9999").set(0.0);
        }
        let report = |pools: &[&str]| CycleReport {
            ts: String::new(),
            pools: pools.iter().map(|p| PoolReport { pool: p.to_string(), ..Default::default() }).collect(),
        };
        forget_gone(&t, &report(&["kept", "gone"]), &report(&["kept"]));
        let page = m.encode();
        let lines = |pool: &str| page.lines().filter(|l| l.contains(&format!("pool=\"{pool}\""))).count();
        assert_eq!(lines("gone"), 0, "{page}");
        // pool_up, pool_members, member_errors, 2 pushes, sink_writes, samples_rejected, 2 instances.
        assert_eq!(lines("kept"), 9, "{page}");
        // The kept pool's handles still count into the page after the other pool went.
        m.pool_counter(PoolCounter::SinkWrites, "kept", &[("sink", "haproxy")]).inc();
        assert!(
            m.encode().contains("llmlc_sink_writes_total{pool=\"kept\",sink=\"haproxy\"} 4"),
            "{}",
            m.encode()
        );
    }

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
