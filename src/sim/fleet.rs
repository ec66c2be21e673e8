//! A fleet of simulated replicas in one process: start, control, stop.
//!
//! [`start_fleet`] binds every replica's port first (so a taken port fails the start cleanly),
//! then starts one engine task and one HTTP server per replica. [`Fleet`] is the handle: bound
//! addresses, runtime faults, shutdown. Dropping it stops everything.
//!
//! Runtime control over HTTP, served on every replica's port and addressing any replica of the
//! fleet (so a replica that is down can be brought back through another one):
//! - `GET  /admin/replicas`: state of every replica (JSON list).
//! - `POST /admin/replicas/{i}/speed` `{"speed": 0.5}`: speed factor, in (0, 100].
//! - `POST /admin/replicas/{i}/fail` `{"rate": 0.3}`: answer that fraction of generation requests
//!   with 500 (seeded, so runs repeat).
//! - `POST /admin/replicas/{i}/hang` `{"hang": true}`: the engine stops stepping; requests queue and
//!   never answer, `/health` and `/metrics` still answer (a stuck GPU under a live API process).
//! - `POST /admin/replicas/{i}/down` `{"for_s": 5}` (body optional): crash: close the port, drop
//!   in-flight requests (their connections break), and restart empty when `up` is called or after
//!   `for_s` real seconds. Answers 202 at once; poll the port to see it close.
//! - `POST /admin/replicas/{i}/up`: listen again on the same address, with a fresh engine.
//!
//! Errors are JSON `{"error": "..."}` with 400 (bad value), 404 (no such replica), 409 (already
//! up/down).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::driver::{self, Cmd, Observed};
use super::engine::{Engine, EngineStats};
use super::metrics::MetricsStyle;
use super::profile::{ModelProfile, ProfileError};
pub use super::server::OutputLen;
use super::server::{self, AppState, Replica};

/// One replica's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaConfig {
    /// Speed factor against the profile's GPU (0.5 = a GPU half as fast).
    pub speed: f64,
    /// Served model names; empty = the profile's model. The first one labels the metrics.
    pub models: Vec<String>,
    /// LoRA adapters this replica serves (requests name them as the model).
    pub lora_adapters: Vec<String>,
    /// Batch limit of this replica instead of the profile's, with the cache scaled to match, as
    /// llama-server's `--parallel` ([`ModelProfile::with_slots`]).
    pub slots: Option<u32>,
}

impl ReplicaConfig {
    pub fn with_speed(speed: f64) -> Self {
        ReplicaConfig { speed, models: Vec::new(), lora_adapters: Vec::new(), slots: None }
    }

    /// The profile this replica runs: the fleet's, with its own slot count.
    pub fn profile(&self, fleet: &ModelProfile) -> ModelProfile {
        match self.slots {
            Some(n) => fleet.clone().with_slots(n),
            None => fleet.clone(),
        }
    }
}

/// A whole fleet's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetConfig {
    pub host: IpAddr,
    /// Port of replica 0; replica i listens on `base_port + i`. 0 = free ports chosen by the OS.
    pub base_port: u16,
    pub profile: ModelProfile,
    pub replicas: Vec<ReplicaConfig>,
    /// Run this many times faster than real time (latency metrics still show model time).
    pub time_scale: f64,
    pub metrics_style: MetricsStyle,
    pub output_len: OutputLen,
    /// Seeds fault injection and output lengths (replica i uses `seed + i`).
    pub seed: u64,
}

impl FleetConfig {
    /// Replicas at `speeds` on free loopback ports, real time, vLLM v1 metrics.
    pub fn new(profile: ModelProfile, speeds: &[f64]) -> Self {
        FleetConfig {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            base_port: 0,
            profile,
            replicas: speeds.iter().map(|&s| ReplicaConfig::with_speed(s)).collect(),
            time_scale: 1.0,
            metrics_style: MetricsStyle::Vllm,
            output_len: OutputLen::default(),
            seed: 0,
        }
    }

    pub fn validate(&self) -> Result<(), SimError> {
        self.profile.validate()?;
        if self.replicas.is_empty() {
            return Err(SimError::Invalid("a fleet needs at least one replica".into()));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0 && self.time_scale <= 1000.0) {
            return Err(SimError::Invalid(format!("time scale {} must be in (0, 1000]", self.time_scale)));
        }
        if self.base_port != 0
            && usize::from(self.base_port) + self.replicas.len() - 1 > usize::from(u16::MAX)
        {
            return Err(SimError::Invalid(format!(
                "{} replicas from port {} run past 65535; lower --base-port",
                self.replicas.len(),
                self.base_port
            )));
        }
        for (i, r) in self.replicas.iter().enumerate() {
            check_speed(r.speed).map_err(|e| SimError::Invalid(format!("replica {i}: {e}")))?;
            if r.slots.is_some() {
                let p = r.profile(&self.profile);
                if p.max_num_seqs == 0 || p.max_num_seqs > 4096 {
                    return Err(SimError::Invalid(format!(
                        "replica {i}: {} slots; give 1 to 4096",
                        p.max_num_seqs
                    )));
                }
                p.validate()?;
            }
            if r.models.iter().chain(&r.lora_adapters).any(|m| m.trim().is_empty()) {
                return Err(SimError::Invalid(format!(
                    "replica {i}: model and adapter names must not be empty"
                )));
            }
        }
        if !(self.output_len.median >= 1.0
            && self.output_len.sigma >= 0.0
            && self.output_len.sigma.is_finite())
        {
            return Err(SimError::Invalid("output length median must be >= 1 and sigma >= 0".into()));
        }
        Ok(())
    }
}

fn check_speed(speed: f64) -> Result<(), String> {
    if speed.is_finite() && speed > 0.0 && speed <= 100.0 {
        Ok(())
    } else {
        Err(format!("speed {speed} must be in (0, 100]"))
    }
}

fn check_rate(rate: f64) -> Result<(), String> {
    if (0.0..=1.0).contains(&rate) {
        Ok(())
    } else {
        Err(format!("fail rate {rate} must be in [0, 1]"))
    }
}

/// What can go wrong starting or controlling a fleet.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error("cannot listen on {addr}: {source}; choose another --base-port, or 0 for free ports")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("no replica {index}: the fleet has {len} (0..={last})", last = len.saturating_sub(1))]
    NoReplica { index: usize, len: usize },
    #[error("{0}")]
    Invalid(String),
    #[error("replica {0} is already up")]
    AlreadyUp(usize),
    #[error("replica {0} is already down")]
    AlreadyDown(usize),
}

impl SimError {
    fn status(&self) -> StatusCode {
        match self {
            SimError::NoReplica { .. } => StatusCode::NOT_FOUND,
            SimError::AlreadyUp(_) | SimError::AlreadyDown(_) => StatusCode::CONFLICT,
            SimError::Invalid(_) => StatusCode::BAD_REQUEST,
            SimError::Profile(_) | SimError::Bind { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for SimError {
    fn into_response(self) -> Response {
        (self.status(), Json(json!({"error": self.to_string()}))).into_response()
    }
}

/// State of one replica, as `GET /admin/replicas` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaStatus {
    pub index: usize,
    pub addr: String,
    pub up: bool,
    pub speed: f64,
    pub fail_rate: f64,
    pub hang: bool,
    pub waiting: u32,
    pub running: u32,
    pub kv_usage: f64,
    pub num_preemptions: u64,
    pub models: Vec<String>,
    pub lora_adapters: Vec<String>,
}

struct Serving {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

struct Slot {
    replica: Arc<Replica>,
    addr: SocketAddr,
    up: AtomicBool,
    serving: tokio::sync::Mutex<Option<Serving>>,
    driver: Mutex<Option<JoinHandle<()>>>,
}

pub(crate) struct FleetInner {
    slots: Vec<Slot>,
}

/// A running fleet. Dropping it stops every server and engine task.
pub struct Fleet {
    inner: Arc<FleetInner>,
}

/// Start a fleet; returns once every replica listens.
pub async fn start_fleet(cfg: FleetConfig) -> Result<Fleet, SimError> {
    cfg.validate()?;
    let mut listeners = Vec::with_capacity(cfg.replicas.len());
    for i in 0..cfg.replicas.len() {
        let port = if cfg.base_port == 0 { 0 } else { cfg.base_port + i as u16 };
        let addr = SocketAddr::new(cfg.host, port);
        let l = TcpListener::bind(addr).await.map_err(|source| SimError::Bind { addr, source })?;
        listeners.push(l);
    }
    let mut slots = Vec::with_capacity(cfg.replicas.len());
    for (i, (rc, l)) in cfg.replicas.iter().zip(&listeners).enumerate() {
        let addr =
            l.local_addr().map_err(|source| SimError::Bind { addr: SocketAddr::new(cfg.host, 0), source })?;
        let profile = rc.profile(&cfg.profile);
        let engine = Engine::new(&profile, rc.speed)?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let lora_slots = (!rc.lora_adapters.is_empty()).then_some(rc.lora_adapters.len() as u32);
        let observed = Arc::new(Mutex::new(Observed::new(rc.speed, profile.num_gpu_blocks, lora_slots)));
        let driver =
            tokio::spawn(driver::drive(profile.clone(), engine, cfg.time_scale, rx, observed.clone()));
        let models = if rc.models.is_empty() { vec![profile.model.clone()] } else { rc.models.clone() };
        let replica = Arc::new(Replica {
            index: i,
            front_end: Duration::from_secs_f64(profile.request_overhead_s / cfg.time_scale),
            profile,
            models,
            adapters: rc.lora_adapters.clone(),
            style: cfg.metrics_style,
            output_len: cfg.output_len,
            cmd: tx,
            observed,
            fail_rate: AtomicU64::new(0f64.to_bits()),
            hang: AtomicBool::new(false),
            rng: Mutex::new(ChaCha8Rng::seed_from_u64(cfg.seed.wrapping_add(i as u64))),
            next_id: AtomicU64::new(0),
        });
        slots.push(Slot {
            replica,
            addr,
            up: AtomicBool::new(false),
            serving: tokio::sync::Mutex::new(None),
            driver: Mutex::new(Some(driver)),
        });
    }
    let inner = Arc::new(FleetInner { slots });
    for (i, l) in listeners.into_iter().enumerate() {
        let serving = inner.spawn_server(i, l);
        *inner.slots[i].serving.lock().await = Some(serving);
        inner.slots[i].up.store(true, Ordering::SeqCst);
    }
    Ok(Fleet { inner })
}

impl FleetInner {
    fn slot(&self, i: usize) -> Result<&Slot, SimError> {
        self.slots.get(i).ok_or(SimError::NoReplica { index: i, len: self.slots.len() })
    }

    fn spawn_server(self: &Arc<Self>, i: usize, listener: TcpListener) -> Serving {
        let state = AppState { replica: self.slots[i].replica.clone() };
        let app = server::router(state, admin_routes().with_state(Arc::downgrade(self)));
        let (stop, stop_rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let shutdown = async move {
                let _ = stop_rx.await;
            };
            if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
                tracing::warn!(replica = i, error = %e, "simulated replica server stopped with an error");
            }
        });
        Serving { stop, task }
    }

    fn set_speed(&self, i: usize, speed: f64) -> Result<(), SimError> {
        let slot = self.slot(i)?;
        check_speed(speed).map_err(SimError::Invalid)?;
        let _ = slot.replica.cmd.send(Cmd::SetSpeed(speed));
        slot.replica.observed().speed = speed;
        Ok(())
    }

    fn set_fail_rate(&self, i: usize, rate: f64) -> Result<(), SimError> {
        let slot = self.slot(i)?;
        check_rate(rate).map_err(SimError::Invalid)?;
        slot.replica.fail_rate.store(rate.to_bits(), Ordering::Relaxed);
        Ok(())
    }

    fn set_hang(&self, i: usize, hang: bool) -> Result<(), SimError> {
        let slot = self.slot(i)?;
        slot.replica.hang.store(hang, Ordering::Relaxed);
        let _ = slot.replica.cmd.send(Cmd::SetHang(hang));
        Ok(())
    }

    async fn down(&self, i: usize) -> Result<(), SimError> {
        let slot = self.slot(i)?;
        let serving = slot.serving.lock().await.take().ok_or(SimError::AlreadyDown(i))?;
        slot.up.store(false, Ordering::SeqCst);
        slot.replica.hang.store(false, Ordering::Relaxed);
        // Drop in-flight requests first so their bodies end and graceful shutdown can finish.
        let _ = slot.replica.cmd.send(Cmd::Reset);
        let _ = serving.stop.send(());
        let mut task = serving.task;
        if tokio::time::timeout(Duration::from_secs(5), &mut task).await.is_err() {
            task.abort();
        }
        Ok(())
    }

    async fn up(self: &Arc<Self>, i: usize) -> Result<(), SimError> {
        let slot = self.slot(i)?;
        let mut serving = slot.serving.lock().await;
        if serving.is_some() {
            return Err(SimError::AlreadyUp(i));
        }
        let listener = TcpListener::bind(slot.addr)
            .await
            .map_err(|source| SimError::Bind { addr: slot.addr, source })?;
        *serving = Some(self.spawn_server(i, listener));
        slot.up.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn status(&self) -> Vec<ReplicaStatus> {
        self.slots
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let r = &s.replica;
                let (speed, st) = {
                    let o = r.observed();
                    (o.speed, o.stats)
                };
                ReplicaStatus {
                    index: i,
                    addr: s.addr.to_string(),
                    up: s.up.load(Ordering::SeqCst),
                    speed,
                    fail_rate: r.fail_rate(),
                    hang: r.hang.load(Ordering::Relaxed),
                    waiting: st.waiting,
                    running: st.running,
                    kv_usage: st.kv_usage,
                    num_preemptions: st.num_preemptions,
                    models: r.models.clone(),
                    lora_adapters: r.adapters.clone(),
                }
            })
            .collect()
    }
}

impl Drop for FleetInner {
    fn drop(&mut self) {
        for s in &mut self.slots {
            if let Some(serving) = s.serving.get_mut().take() {
                serving.task.abort();
            }
            let driver = match s.driver.get_mut() {
                Ok(d) => d.take(),
                Err(p) => p.into_inner().take(),
            };
            if let Some(d) = driver {
                d.abort();
            }
        }
    }
}

impl Fleet {
    /// Bound address of each replica, in order.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.inner.slots.iter().map(|s| s.addr).collect()
    }

    /// `http://ADDR` of each replica.
    pub fn urls(&self) -> Vec<String> {
        self.addrs().iter().map(|a| format!("http://{a}")).collect()
    }

    pub fn len(&self) -> usize {
        self.inner.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inner.slots.is_empty()
    }

    pub fn set_speed(&self, i: usize, speed: f64) -> Result<(), SimError> {
        self.inner.set_speed(i, speed)
    }

    pub fn set_fail_rate(&self, i: usize, rate: f64) -> Result<(), SimError> {
        self.inner.set_fail_rate(i, rate)
    }

    pub fn set_hang(&self, i: usize, hang: bool) -> Result<(), SimError> {
        self.inner.set_hang(i, hang)
    }

    /// Crash replica `i`: its port is closed when this returns.
    pub async fn down(&self, i: usize) -> Result<(), SimError> {
        self.inner.down(i).await
    }

    /// Restart replica `i` on its address, empty.
    pub async fn up(&self, i: usize) -> Result<(), SimError> {
        self.inner.up(i).await
    }

    /// Engine gauges and counters of replica `i` as last published.
    pub fn stats(&self, i: usize) -> Result<EngineStats, SimError> {
        Ok(self.inner.slot(i)?.replica.observed().stats)
    }

    pub fn status(&self) -> Vec<ReplicaStatus> {
        self.inner.status()
    }

    /// Stop every server (gracefully, up to 5 s each) and engine task.
    pub async fn shutdown(self) {
        for i in 0..self.inner.slots.len() {
            let _ = self.inner.down(i).await;
        }
        // Drop aborts the engine tasks.
    }
}

// ---- /admin routes ----

/// The `/admin` routes; their state is the fleet (weak: the servers must not keep it alive).
fn admin_routes() -> Router<Weak<FleetInner>> {
    Router::new()
        .route("/admin/replicas", get(admin_list))
        .route("/admin/replicas/{i}/speed", post(admin_speed))
        .route("/admin/replicas/{i}/fail", post(admin_fail))
        .route("/admin/replicas/{i}/hang", post(admin_hang))
        .route("/admin/replicas/{i}/down", post(admin_down))
        .route("/admin/replicas/{i}/up", post(admin_up))
}

fn fleet_of(fleet: &Weak<FleetInner>) -> Result<Arc<FleetInner>, SimError> {
    fleet.upgrade().ok_or_else(|| SimError::Invalid("the fleet is shutting down".into()))
}

fn index(raw: &str) -> Result<usize, SimError> {
    raw.parse().map_err(|_| SimError::Invalid(format!("replica index {raw:?} is not a number")))
}

fn body<T: for<'de> Deserialize<'de>>(bytes: &[u8], example: &str) -> Result<T, SimError> {
    serde_json::from_slice(bytes)
        .map_err(|e| SimError::Invalid(format!("bad body ({e}); send e.g. {example}")))
}

fn ok() -> Response {
    Json(json!({"ok": true})).into_response()
}

async fn admin_list(State(app): State<Weak<FleetInner>>) -> Result<Response, SimError> {
    Ok(Json(fleet_of(&app)?.status()).into_response())
}

#[derive(Deserialize)]
struct SpeedBody {
    speed: f64,
}

async fn admin_speed(
    State(app): State<Weak<FleetInner>>,
    Path(i): Path<String>,
    b: Bytes,
) -> Result<Response, SimError> {
    let b: SpeedBody = body(&b, r#"{"speed": 0.5}"#)?;
    fleet_of(&app)?.set_speed(index(&i)?, b.speed)?;
    Ok(ok())
}

#[derive(Deserialize)]
struct FailBody {
    rate: f64,
}

async fn admin_fail(
    State(app): State<Weak<FleetInner>>,
    Path(i): Path<String>,
    b: Bytes,
) -> Result<Response, SimError> {
    let b: FailBody = body(&b, r#"{"rate": 0.3}"#)?;
    fleet_of(&app)?.set_fail_rate(index(&i)?, b.rate)?;
    Ok(ok())
}

#[derive(Deserialize)]
struct HangBody {
    hang: bool,
}

async fn admin_hang(
    State(app): State<Weak<FleetInner>>,
    Path(i): Path<String>,
    b: Bytes,
) -> Result<Response, SimError> {
    let b: HangBody = body(&b, r#"{"hang": true}"#)?;
    fleet_of(&app)?.set_hang(index(&i)?, b.hang)?;
    Ok(ok())
}

#[derive(Deserialize, Default)]
struct DownBody {
    #[serde(default)]
    for_s: Option<f64>,
}

async fn admin_down(
    State(app): State<Weak<FleetInner>>,
    Path(i): Path<String>,
    b: Bytes,
) -> Result<Response, SimError> {
    let b: DownBody = if b.is_empty() { DownBody::default() } else { body(&b, r#"{"for_s": 5}"#)? };
    let fleet = fleet_of(&app)?;
    let i = index(&i)?;
    let slot = fleet.slot(i)?;
    if !slot.up.load(Ordering::SeqCst) {
        return Err(SimError::AlreadyDown(i));
    }
    if let Some(s) = b.for_s {
        if !(s.is_finite() && s > 0.0 && s <= 86_400.0) {
            return Err(SimError::Invalid(format!("for_s {s} must be in (0, 86400]")));
        }
    }
    // In the background: this very request may be served by the replica going down, and graceful
    // shutdown waits for it to finish.
    let weak = Arc::downgrade(&fleet);
    tokio::spawn(async move {
        let Some(f) = weak.upgrade() else { return };
        if let Err(e) = f.down(i).await {
            tracing::warn!(replica = i, error = %e, "admin down failed");
            return;
        }
        drop(f);
        if let Some(s) = b.for_s {
            tokio::time::sleep(Duration::from_secs_f64(s)).await;
            if let Some(f) = weak.upgrade() {
                if let Err(e) = f.up(i).await {
                    tracing::warn!(replica = i, error = %e, "automatic restart failed");
                }
            }
        }
    });
    Ok((StatusCode::ACCEPTED, Json(json!({"ok": true, "going_down": i, "back_after_s": b.for_s})))
        .into_response())
}

async fn admin_up(State(app): State<Weak<FleetInner>>, Path(i): Path<String>) -> Result<Response, SimError> {
    fleet_of(&app)?.up(index(&i)?).await?;
    Ok(ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_len_is_seeded_and_bounded() {
        let d = OutputLen::default();
        let mut a = ChaCha8Rng::seed_from_u64(1);
        let mut b = ChaCha8Rng::seed_from_u64(1);
        let xs: Vec<u32> = (0..1000).map(|_| d.sample(&mut a)).collect();
        let ys: Vec<u32> = (0..1000).map(|_| d.sample(&mut b)).collect();
        assert_eq!(xs, ys);
        assert!(xs.iter().all(|&x| x >= 1));
        let mut sorted = xs.clone();
        sorted.sort_unstable();
        let median = sorted[500];
        assert!((150..=260).contains(&median), "median {median}");
        assert_eq!(OutputLen { median: 7.0, sigma: 0.0 }.sample(&mut a), 7);
    }

    #[test]
    fn config_validation_names_the_problem() {
        let mut c = FleetConfig::new(ModelProfile::tiny(), &[1.0, 0.0]);
        assert!(c.validate().unwrap_err().to_string().contains("replica 1: speed 0"));
        c.replicas[1].speed = 0.5;
        c.validate().unwrap();
        c.time_scale = 0.0;
        assert!(c.validate().is_err());
        let mut c = FleetConfig::new(ModelProfile::tiny(), &[1.0, 1.0]);
        c.base_port = 65535;
        assert!(c.validate().unwrap_err().to_string().contains("past 65535"));
        assert!(FleetConfig::new(ModelProfile::tiny(), &[]).validate().is_err());
    }
}
