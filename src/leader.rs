//! Leader election over a Kubernetes Lease (`coordination.k8s.io/v1`), so that of several replicas
//! exactly one pushes ratios to the load balancers while the others compute and serve them.
//!
//! The rules are client-go's `leaderelection`:
//! - A candidate reads the Lease. Nobody holds it, or the holder has not renewed for
//!   `leaseDurationSeconds` (timed on *our* clock from when we last saw the record change, so clock
//!   skew between nodes does not matter): take it, with `acquireTime`/`renewTime` now and
//!   `leaseTransitions` + 1. Otherwise stay a follower and look again every `retry_period` (jittered).
//! - Every write carries the `resourceVersion` it was based on; the API server answers 409 when
//!   someone else wrote first, so two candidates can never both win the same round.
//! - The leader renews every `retry_period`. If it cannot renew for `renew_deadline` it steps down
//!   at once (stops pushing), before the lease can expire for the others at `lease_duration`.
//! - On shutdown the leader steps down, then releases: empty `holderIdentity` and a 1-second lease,
//!   so a successor takes over within one retry period instead of waiting for expiry.
//!
//! Outside Kubernetes (no `KUBERNETES_SERVICE_HOST`, no `api_url`) the process is the only leader.

pub mod lease;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use llm_lc_adapters::SecretRef;
use rand::Rng;
use serde::{Deserialize, Deserializer};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::kube::{ApiError, KubeApi, SERVICE_ACCOUNT_DIR};
pub use lease::{micro_time_now, Lease, LeaseSpec};

use crate::telemetry::Telemetry;

/// `leader_election:` in the config file. Every field is optional.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaderElectionConfig {
    /// `auto` (default): elect when running in a pod (or `api_url` is set), else run as the only
    /// leader. `true`: elect, and refuse to start without an API server. `false`: always leader.
    #[serde(default)]
    pub enabled: Enabled,
    /// Name of the Lease object.
    #[serde(default = "defaults::lease_name")]
    pub lease_name: String,
    /// Namespace of the Lease. Default: `POD_NAMESPACE`, else the service account's namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// This replica's name in the Lease. Default: `POD_NAME` (downward API), else hostname plus a
    /// random suffix. Two processes with the same identity would both believe they lead.
    #[serde(default)]
    pub identity: Option<String>,
    /// How long a lease is valid after its last renewal, for the others.
    #[serde(default = "defaults::lease_duration", with = "humantime_serde")]
    pub lease_duration: Duration,
    /// The leader steps down when it could not renew for this long.
    #[serde(default = "defaults::renew_deadline", with = "humantime_serde")]
    pub renew_deadline: Duration,
    /// How often to renew (leader) or to try to acquire (followers).
    #[serde(default = "defaults::retry_period", with = "humantime_serde")]
    pub retry_period: Duration,
    /// API server URL. Default: in-cluster (`KUBERNETES_SERVICE_HOST`/`PORT`). `http://127.0.0.1:8001`
    /// works with `kubectl proxy`.
    #[serde(default)]
    pub api_url: Option<String>,
    /// Bearer token. Default: the pod's service-account token file, re-read on every call.
    #[serde(default)]
    pub token: Option<SecretRef>,
    /// CA bundle of the API server. Default: the service account's `ca.crt`.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
}

impl Default for LeaderElectionConfig {
    fn default() -> Self {
        LeaderElectionConfig {
            enabled: Enabled::Auto,
            lease_name: defaults::lease_name(),
            namespace: None,
            identity: None,
            lease_duration: defaults::lease_duration(),
            renew_deadline: defaults::renew_deadline(),
            retry_period: defaults::retry_period(),
            api_url: None,
            token: None,
            ca_file: None,
        }
    }
}

mod defaults {
    use std::time::Duration;
    pub fn lease_name() -> String {
        "llm-load-controller".into()
    }
    pub fn lease_duration() -> Duration {
        Duration::from_secs(15)
    }
    pub fn renew_deadline() -> Duration {
        Duration::from_secs(10)
    }
    pub fn retry_period() -> Duration {
        Duration::from_secs(2)
    }
}

/// `enabled: auto | true | false`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Enabled {
    #[default]
    Auto,
    Always,
    Never,
}

impl<'de> Deserialize<'de> for Enabled {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Enabled;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("auto, true or false")
            }
            fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<Enabled, E> {
                Ok(if b { Enabled::Always } else { Enabled::Never })
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Enabled, E> {
                match s {
                    "auto" => Ok(Enabled::Auto),
                    "true" => Ok(Enabled::Always),
                    "false" => Ok(Enabled::Never),
                    other => Err(E::custom(format!("expected auto, true or false, not {other:?}"))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

impl LeaderElectionConfig {
    /// Problems as `(field, message)`, fields relative to `leader_election`.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errs = Vec::new();
        let mut err = |f: &str, m: String| errs.push((f.to_string(), m));
        if !is_dns_subdomain(&self.lease_name) {
            err(
                "lease_name",
                format!(
                    "{:?} is not a Kubernetes object name (lowercase letters, digits, '-' and '.', \
                     starting and ending with a letter or digit, at most 253 characters)",
                    self.lease_name
                ),
            );
        }
        if let Some(ns) = &self.namespace {
            if ns.len() > 63 || !is_dns_subdomain(ns) || ns.contains('.') {
                err("namespace", format!("{ns:?} is not a namespace name (a DNS label)"));
            }
        }
        if let Some(id) = &self.identity {
            if id.trim().is_empty() {
                err("identity", "must not be empty; leave it out to use POD_NAME".into());
            }
        }
        if self.lease_duration < Duration::from_secs(1) {
            err("lease_duration", "must be at least 1s (the Lease stores whole seconds)".into());
        }
        if self.renew_deadline >= self.lease_duration {
            err(
                "renew_deadline",
                "must be shorter than lease_duration, so a leader that cannot renew steps down before \
                 the others may take over"
                    .into(),
            );
        }
        if self.retry_period.is_zero() || self.retry_period.mul_f64(1.2) >= self.renew_deadline {
            err(
                "retry_period",
                "must be > 0 and, with 20% jitter, shorter than renew_deadline (so a renewal can be retried)"
                    .into(),
            );
        }
        if let Some(u) = &self.api_url {
            match url::Url::parse(u) {
                Ok(p) if matches!(p.scheme(), "http" | "https") => {}
                Ok(_) => err("api_url", "must be an http:// or https:// URL".into()),
                Err(e) => err("api_url", format!("not a URL: {e}")),
            }
        }
        errs
    }

    fn lease_seconds(&self) -> i32 {
        self.lease_duration.as_secs_f64().ceil().clamp(1.0, i32::MAX as f64) as i32
    }
}

fn is_dns_subdomain(s: &str) -> bool {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    !s.is_empty()
        && s.len() <= 253
        && s.chars().all(ok_char)
        && edge(s.chars().next())
        && edge(s.chars().last())
}

/// Everything one candidate needs, resolved from the config and the pod's environment.
#[derive(Debug, Clone)]
pub struct Settings {
    pub namespace: String,
    pub lease_name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
    lease_seconds: i32,
}

impl Settings {
    pub fn new(cfg: &LeaderElectionConfig, namespace: &str, identity: &str) -> Settings {
        Settings {
            namespace: namespace.into(),
            lease_name: cfg.lease_name.clone(),
            identity: identity.into(),
            lease_duration: cfg.lease_duration,
            renew_deadline: cfg.renew_deadline,
            retry_period: cfg.retry_period,
            lease_seconds: cfg.lease_seconds(),
        }
    }
}

/// Decide from the config and the environment whether to elect. `Ok(None)`: run as the only leader.
pub fn elector_from_config(cfg: &LeaderElectionConfig) -> Result<Option<Elector>, ApiError> {
    if cfg.enabled == Enabled::Never {
        return Ok(None);
    }
    let sa = Path::new(SERVICE_ACCOUNT_DIR);
    let url = match cfg.api_url.clone().or_else(KubeApi::in_cluster_url) {
        Some(u) => u,
        None if cfg.enabled == Enabled::Auto => return Ok(None),
        None => {
            return Err(ApiError::Config(
                "leader_election.enabled is true, but there is no API server to elect through: not in a \
                 pod (KUBERNETES_SERVICE_HOST is unset) and no leader_election.api_url; set one, or set \
                 enabled: auto"
                    .into(),
            ))
        }
    };
    let token = cfg.token.clone().or_else(|| {
        let f = sa.join("token");
        f.exists().then_some(SecretRef::File(f))
    });
    let ca_path = cfg.ca_file.clone().or_else(|| {
        let f = sa.join("ca.crt");
        (url.starts_with("https:") && f.exists()).then_some(f)
    });
    let ca = ca_path.as_deref().map(KubeApi::read_ca).transpose()?;
    let namespace = cfg
        .namespace
        .clone()
        .or_else(|| std::env::var("POD_NAMESPACE").ok().filter(|s| !s.is_empty()))
        .or_else(|| std::fs::read_to_string(sa.join("namespace")).ok().map(|s| s.trim().to_string()))
        .ok_or_else(|| {
            ApiError::Config(
                "cannot tell the Lease's namespace: set leader_election.namespace, or POD_NAMESPACE".into(),
            )
        })?;
    let identity = cfg
        .identity
        .clone()
        .or_else(|| std::env::var("POD_NAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(default_identity);
    let timeout = (cfg.renew_deadline / 2).max(Duration::from_millis(100));
    let api = KubeApi::new(&url, token, ca.as_deref(), timeout)?;
    Ok(Some(Elector::new(api, Settings::new(cfg, &namespace, &identity))))
}

/// Hostname plus a random suffix: unique even for two processes on one host.
fn default_identity() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|s| s.trim().to_string()))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "llm-load-controller".into());
    format!("{host}_{:08x}", rand::thread_rng().gen::<u32>())
}

/// What we last saw of the Lease, and when (on our own monotonic clock).
struct Observed {
    spec: LeaseSpec,
    resource_version: Option<String>,
    at: Instant,
}

/// One candidate: reads and writes the Lease. [`Leadership::spawn`] runs it in a loop.
pub struct Elector {
    api: KubeApi,
    settings: Settings,
    observed: Option<Observed>,
}

impl Elector {
    pub fn new(api: KubeApi, settings: Settings) -> Elector {
        Elector { api, settings, observed: None }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The holder in the last record seen, if any.
    pub fn observed_holder(&self) -> Option<String> {
        self.observed.as_ref().and_then(|o| o.spec.holder().map(str::to_string))
    }

    fn observe(&mut self, lease: &Lease) {
        let same = self
            .observed
            .as_ref()
            .is_some_and(|o| o.spec == lease.spec && o.resource_version == lease.metadata.resource_version);
        if !same {
            self.observed = Some(Observed {
                spec: lease.spec.clone(),
                resource_version: lease.metadata.resource_version.clone(),
                at: Instant::now(),
            });
        }
    }

    /// Whether the holder we saw has gone `leaseDurationSeconds` without the record changing.
    fn expired(&self) -> bool {
        match &self.observed {
            None => true,
            Some(o) => {
                let secs = o.spec.lease_duration_seconds.unwrap_or(self.settings.lease_seconds).max(0);
                o.at.elapsed() >= Duration::from_secs(secs as u64)
            }
        }
    }

    /// One round: create the Lease, renew it, or take it over when it expired. `Ok(true)` when we hold
    /// it now; `Ok(false)` when someone else validly does; `Err` when the round failed (including a
    /// 409 from a concurrent writer).
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool, ApiError> {
        let s = &self.settings;
        let now = micro_time_now();
        let Some(mut lease) = self.api.get(&s.namespace, &s.lease_name).await? else {
            let spec = LeaseSpec {
                holder_identity: Some(s.identity.clone()),
                lease_duration_seconds: Some(s.lease_seconds),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(0),
                ..Default::default()
            };
            let created = self.api.create(&Lease::new(&s.namespace, &s.lease_name, spec)).await?;
            self.observe(&created);
            return Ok(true);
        };
        self.observe(&lease);
        let mine = lease.spec.holder() == Some(self.settings.identity.as_str());
        if !mine && lease.spec.holder().is_some() && !self.expired() {
            return Ok(false);
        }
        let s = &self.settings;
        let spec = &mut lease.spec;
        if !mine {
            spec.holder_identity = Some(s.identity.clone());
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
        }
        spec.renew_time = Some(now);
        spec.lease_duration_seconds = Some(s.lease_seconds);
        let updated = self.api.update(&lease).await?;
        self.observe(&updated);
        Ok(true)
    }

    /// Give the Lease up if we hold it: empty holder, 1-second lease (what client-go writes), so the
    /// next candidate takes it at its next retry.
    pub async fn release(&mut self) -> Result<(), ApiError> {
        let s = &self.settings;
        for _ in 0..2 {
            let Some(mut lease) = self.api.get(&s.namespace, &s.lease_name).await? else { return Ok(()) };
            if lease.spec.holder() != Some(s.identity.as_str()) {
                return Ok(());
            }
            let now = micro_time_now();
            lease.spec.holder_identity = Some(String::new());
            lease.spec.lease_duration_seconds = Some(1);
            lease.spec.acquire_time = Some(now.clone());
            lease.spec.renew_time = Some(now);
            match self.api.update(&lease).await {
                Ok(l) => {
                    self.observe(&l);
                    return Ok(());
                }
                // Someone wrote in between (a renewal of ours cannot be in flight): read again.
                Err(ApiError::Conflict(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(ApiError::Conflict("the Lease kept changing while releasing it".into()))
    }
}

enum Mode {
    /// No election: always the leader.
    Single { _leader: watch::Sender<bool>, _holder: watch::Sender<Option<String>> },
    /// The election loop runs in a task.
    Task(tokio::task::JoinHandle<()>),
    /// One round was run (`--once`); release on stop if it won.
    Once(Box<Elector>, bool),
}

/// Who leads, as seen by this process, and the means to stop (and release) on shutdown.
pub struct Leadership {
    leader: watch::Receiver<bool>,
    holder: watch::Receiver<Option<String>>,
    stop: CancellationToken,
    mode: Mode,
}

impl Leadership {
    /// Always the leader (no Kubernetes, or election disabled).
    pub fn single() -> Leadership {
        let (ltx, leader) = watch::channel(true);
        let (htx, holder) = watch::channel(None);
        Leadership {
            leader,
            holder,
            stop: CancellationToken::new(),
            mode: Mode::Single { _leader: ltx, _holder: htx },
        }
    }

    /// Run the election loop in the background. Starts as a follower.
    pub fn spawn(elector: Elector) -> Leadership {
        let (ltx, leader) = watch::channel(false);
        let (htx, holder) = watch::channel(None);
        let stop = CancellationToken::new();
        let task = tokio::spawn(election_loop(elector, ltx, htx, stop.clone()));
        Leadership { leader, holder, stop, mode: Mode::Task(task) }
    }

    /// One round only, for `--once`: leader if the Lease is free or ours, follower otherwise.
    pub async fn single_round(mut elector: Elector) -> Leadership {
        let won = match elector.try_acquire_or_renew().await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "leader election round failed; running this cycle as a follower");
                false
            }
        };
        let (ltx, leader) = watch::channel(won);
        let (htx, holder) = watch::channel(elector.observed_holder());
        drop((ltx, htx));
        Leadership {
            leader,
            holder,
            stop: CancellationToken::new(),
            mode: Mode::Once(Box::new(elector), won),
        }
    }

    /// "Am I the leader", for the controller to gate pushes on.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.leader.clone()
    }

    /// The holder of the Lease as last seen (`None` before the first round or when nobody holds it).
    pub fn holder(&self) -> watch::Receiver<Option<String>> {
        self.holder.clone()
    }

    pub fn is_leader(&self) -> bool {
        *self.leader.borrow()
    }

    /// Whether an election runs at all (false: the only leader).
    pub fn elected(&self) -> bool {
        !matches!(self.mode, Mode::Single { .. })
    }

    /// Keep the `llmlc_leader` gauge and the `/readyz` note in step with the role.
    pub fn report_to(&self, telemetry: Arc<Telemetry>) {
        let mut leader = self.leader.clone();
        let mut holder = self.holder.clone();
        let elected = self.elected();
        let publish = move |leader: bool, holder: Option<String>| {
            telemetry.metrics.leader.set(if leader { 1 } else { 0 });
            let note = match (elected, leader, holder) {
                (false, _, _) => None,
                (true, true, _) => Some("leader".to_string()),
                (true, false, Some(h)) => Some(format!("follower (leader: {h})")),
                (true, false, None) => Some("follower (no leader yet)".to_string()),
            };
            telemetry.set_note("leader_election", note);
        };
        publish(*leader.borrow(), holder.borrow().clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    r = leader.changed() => if r.is_err() { break },
                    r = holder.changed() => if r.is_err() { break },
                }
                let (l, h) = (*leader.borrow_and_update(), holder.borrow_and_update().clone());
                publish(l, h);
            }
        });
    }

    /// Step down and release the Lease (if held), then return. Call after the control loop stopped.
    pub async fn stop(self) {
        self.stop.cancel();
        match self.mode {
            Mode::Single { .. } => {}
            Mode::Task(task) => {
                let _ = task.await;
            }
            Mode::Once(mut elector, won) => {
                if won {
                    release_logged(&mut elector).await;
                }
            }
        }
    }
}

async fn release_logged(elector: &mut Elector) {
    let deadline = elector.settings.renew_deadline.max(Duration::from_secs(1));
    match tokio::time::timeout(deadline, elector.release()).await {
        Ok(Ok(())) => tracing::info!(lease = %elector.settings.lease_name, "released the leader lease"),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "could not release the leader lease; the others take over when it expires")
        }
        Err(_) => {
            tracing::warn!("releasing the leader lease timed out; the others take over when it expires")
        }
    }
}

/// Logs an error when it first appears or changes, not on every retry.
#[derive(Default)]
struct ErrorLog(Option<String>);

impl ErrorLog {
    fn failed(&mut self, what: &str, e: &ApiError) {
        let msg = e.to_string();
        if self.0.as_deref() != Some(&msg) {
            tracing::warn!(error = %msg, "{what}");
            self.0 = Some(msg);
        }
    }
    fn ok(&mut self) {
        if self.0.take().is_some() {
            tracing::info!("leader election: the API server answers again");
        }
    }
}

fn jittered(d: Duration) -> Duration {
    d.mul_f64(1.0 + rand::thread_rng().gen_range(0.0..0.2))
}

async fn election_loop(
    mut e: Elector,
    leader: watch::Sender<bool>,
    holder: watch::Sender<Option<String>>,
    stop: CancellationToken,
) {
    let s = e.settings.clone();
    tracing::info!(
        lease = %format!("{}/{}", s.namespace, s.lease_name),
        identity = %s.identity,
        lease_duration = ?s.lease_duration,
        renew_deadline = ?s.renew_deadline,
        retry_period = ?s.retry_period,
        "leader election started; pushing nothing until elected"
    );
    let mut errors = ErrorLog::default();
    let publish_holder = |e: &Elector| {
        let h = e.observed_holder();
        holder.send_if_modified(|cur| {
            if *cur != h {
                if let Some(h) = &h {
                    if *h != s.identity {
                        tracing::info!(leader = %h, "another replica leads; this one computes and serves ratios but pushes nothing");
                    }
                }
                *cur = h;
                true
            } else {
                false
            }
        });
    };
    loop {
        // Follower: try until we win, every retry period with jitter.
        loop {
            match e.try_acquire_or_renew().await {
                Ok(true) => {
                    errors.ok();
                    break;
                }
                Ok(false) => errors.ok(),
                Err(ApiError::Conflict(_)) => {} // another candidate won this round
                Err(err) => errors.failed("leader election: cannot read or write the Lease", &err),
            }
            publish_holder(&e);
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(jittered(s.retry_period)) => {}
            }
        }
        publish_holder(&e);
        leader.send_replace(true);
        tracing::info!(identity = %s.identity, "became the leader; pushing ratios");

        // Leader: renew every retry period; step down when no renewal succeeded for renew_deadline.
        let mut renewed = Instant::now();
        let lost = loop {
            tokio::select! {
                _ = stop.cancelled() => {
                    leader.send_replace(false);
                    release_logged(&mut e).await;
                    publish_holder(&e);
                    return;
                }
                _ = tokio::time::sleep(s.retry_period) => {}
            }
            let left = s.renew_deadline.saturating_sub(renewed.elapsed());
            let outcome = tokio::time::timeout(left, e.try_acquire_or_renew()).await;
            match outcome {
                Ok(Ok(true)) => {
                    errors.ok();
                    renewed = Instant::now();
                }
                Ok(Ok(false)) => break "another replica holds the lease now",
                Ok(Err(ApiError::Conflict(_))) => {}
                Ok(Err(err)) => errors.failed("leader election: renewing the Lease failed", &err),
                Err(_) => {}
            }
            if renewed.elapsed() >= s.renew_deadline {
                break "could not renew the lease within renew_deadline";
            }
        };
        leader.send_replace(false);
        publish_holder(&e);
        tracing::warn!(reason = lost, "lost leadership; pushes stop, ratios are still computed and served");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<LeaderElectionConfig, serde_yaml_ng::Error> {
        serde_yaml_ng::from_str(yaml)
    }

    #[test]
    fn enabled_reads_bool_or_auto() {
        assert_eq!(parse("enabled: true").expect("ok").enabled, Enabled::Always);
        assert_eq!(parse("enabled: false").expect("ok").enabled, Enabled::Never);
        assert_eq!(parse("enabled: auto").expect("ok").enabled, Enabled::Auto);
        assert_eq!(parse("{}").expect("ok"), LeaderElectionConfig::default());
        let e = parse("enabled: maybe").expect_err("bad word");
        assert!(e.to_string().contains("auto, true or false"), "{e}");
    }

    #[test]
    fn durations_must_nest() {
        let c = parse("lease_duration: 10s\nrenew_deadline: 10s\nretry_period: 9s").expect("parse");
        let fields: Vec<String> = c.validate().into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, ["renew_deadline", "retry_period"]);
        assert!(LeaderElectionConfig::default().validate().is_empty());
    }

    #[test]
    fn names_are_checked() {
        let c = parse("lease_name: Bad_Name\nnamespace: a.b\napi_url: 'ftp://x'").expect("parse");
        let fields: Vec<String> = c.validate().into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, ["lease_name", "namespace", "api_url"]);
    }

    #[test]
    fn lease_seconds_round_up() {
        let c = LeaderElectionConfig { lease_duration: Duration::from_millis(1500), ..Default::default() };
        assert_eq!(c.lease_seconds(), 2);
    }

    #[test]
    fn disabled_or_outside_a_cluster_means_no_election() {
        let off = LeaderElectionConfig { enabled: Enabled::Never, ..Default::default() };
        assert!(elector_from_config(&off).expect("ok").is_none());
        if KubeApi::in_cluster_url().is_none() {
            assert!(elector_from_config(&LeaderElectionConfig::default()).expect("ok").is_none());
            let on = LeaderElectionConfig { enabled: Enabled::Always, ..Default::default() };
            let err = elector_from_config(&on).err().expect("no API server");
            assert!(err.to_string().contains("KUBERNETES_SERVICE_HOST"), "{err}");
        }
    }
}
