//! The endpoint picker served by the controller, per pool, behind the per-request hooks of the
//! load balancers users already run: Envoy's `ext_proc` as the Gateway API Inference Extension's
//! endpoint-picker protocol ([`ext_proc`]), HAProxy's SPOE ([`spoe`]), and an HTTP sideband for
//! a BIG-IP iRule ([`http`]).
//!
//! It runs on every replica, leader or not: the picker's design makes replicas agree without
//! talking (a prefix's home is the same rendezvous hash everywhere, and every replica reads the
//! same engines), so an Envoy fleet can spread its streams over all of them. What it knows:
//! - members and capacity: each cycle's ratios ([`crate::telemetry::Telemetry::reports`]);
//! - the engines' gauges: its own reads, every `refresh` ([`refresh`]);
//! - its own dispatches: from the doors.
//!
//! When the picker cannot answer (no members yet, or down), the load balancer's own balancing,
//! weighted by the pushed ratios, is the fallback: the shipped configs fail open to it.

pub mod config;
pub mod ext_proc;
pub mod http;
pub mod pool;
pub mod refresh;
pub mod rules;
pub mod spoe;
pub mod tls;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;

pub use config::PickerConfig;
pub use pool::PoolPicker;

use crate::config::{Config, SourceConfig};
use crate::report::CycleReport;
use crate::telemetry::{labels, Labels, Telemetry};
use llm_lc_adapters::SinkConfig;

/// `llmlc_picker_picks{pool, door, outcome}`: every answer a door gave; and
/// `llmlc_picker_served{pool, as_picked}`: every report of the endpoint used.
#[derive(Clone, Default)]
pub struct PickCounter {
    picks: Family<Labels, Counter>,
    served: Family<Labels, Counter>,
}

impl PickCounter {
    pub fn new(telemetry: &Telemetry) -> PickCounter {
        PickCounter {
            picks: telemetry.metrics.picker_picks.clone(),
            served: telemetry.metrics.picker_served.clone(),
        }
    }

    pub fn count(&self, pool: &str, door: &str, outcome: &str) {
        self.picks.get_or_create(&labels(&[("pool", pool), ("door", door), ("outcome", outcome)])).inc();
    }

    pub fn served(&self, pool: &str, as_picked: bool) {
        let v = if as_picked { "true" } else { "false" };
        self.served.get_or_create(&labels(&[("pool", pool), ("as_picked", v)])).inc();
    }
}

/// The gRPC health service names a pool's ext_proc door answers for (the protocol's).
const HEALTH_SERVICES: &[&str] = &["", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"];

/// The served pickers: their tasks run until `stop`.
pub struct Served {
    pub pools: BTreeMap<String, Arc<PoolPicker>>,
    /// The address each door is bound to (port 0 in the config resolved), by pool and door.
    pub bound: BTreeMap<(String, &'static str), SocketAddr>,
    tasks: Vec<JoinHandle<()>>,
}

impl Served {
    /// Wait for the tasks after `stop` was cancelled.
    pub async fn join(self) {
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Problems with the pickers of `cfg` as a whole (one ext_proc door per pool, doors not on the
/// controller's own listener), as (field, message).
pub fn validate(cfg: &Config) -> Vec<(String, String)> {
    let mut errs = Vec::new();
    let mut ext_procs: BTreeMap<SocketAddr, &str> = BTreeMap::new();
    for (i, p) in cfg.pools.iter().enumerate() {
        let Some(pc) = &p.picker else { continue };
        for (field, msg) in pc.validate() {
            let at = if field.is_empty() {
                format!("pools[{i}].picker")
            } else {
                format!("pools[{i}].picker.{field}")
            };
            errs.push((at, msg));
        }
        let mine = [pc.ext_proc, pc.health, pc.http, pc.spoe];
        if mine.iter().flatten().any(|a| *a == cfg.listen && a.port() != 0) {
            errs.push((
                format!("pools[{i}].picker"),
                format!("a door on {} is the controller's own `listen`", cfg.listen),
            ));
        }
        if let Some(a) = pc.ext_proc.filter(|a| a.port() != 0) {
            if let Some(other) = ext_procs.insert(a, &p.name) {
                errs.push((
                    format!("pools[{i}].picker.ext_proc"),
                    format!("{a} already serves pool {other:?}: the protocol does not name the pool, so one address per pool"),
                ));
            }
        }
    }
    errs
}

/// Bind every door of `cfg`'s pools and start their tasks. Errors name the pool and address.
pub async fn serve(
    cfg: &Config,
    telemetry: Arc<Telemetry>,
    stop: CancellationToken,
) -> Result<Served, String> {
    let counter = PickCounter::new(&telemetry);
    let mut served = Served { pools: BTreeMap::new(), bound: BTreeMap::new(), tasks: Vec::new() };
    let mut http_doors: BTreeMap<SocketAddr, BTreeMap<String, Arc<PoolPicker>>> = BTreeMap::new();
    let mut spoe_doors: BTreeMap<SocketAddr, BTreeMap<String, Arc<spoe::SpoePool>>> = BTreeMap::new();
    for p in &cfg.pools {
        let Some(pc) = &p.picker else { continue };
        let settings = pc.settings().map_err(|e| format!("pool {:?} picker: {e}", p.name))?;
        let pool = Arc::new(PoolPicker::new(&p.name, settings, pc.fallbacks, pc.max_open));
        served.pools.insert(p.name.clone(), pool.clone());
        let access = page_access(cfg, &p.source)?;
        let in_flight = telemetry.metrics.picker_in_flight.clone();
        served.tasks.push(tokio::spawn(refresh::run(
            pool.clone(),
            access,
            pc.refresh,
            in_flight,
            stop.clone(),
        )));
        if let Some(addr) = pc.ext_proc {
            let listener = bind(addr, &p.name, "ext_proc").await?;
            served.bound.insert((p.name.clone(), "ext_proc"), local(&listener, addr));
            let (reporter, health) = tonic_health::server::health_reporter();
            for s in HEALTH_SERVICES.iter().chain(["liveness"].iter()) {
                reporter.set_service_status(*s, ServingStatus::NotServing).await;
            }
            reporter.set_service_status("liveness", ServingStatus::Serving).await;
            let door = ext_proc::Door::new(pool.clone(), counter.clone());
            let routes = tonic::service::Routes::new(door.server()).add_service(health.clone());
            let acceptor = match &pc.tls {
                Some(t) => Some(
                    tls::acceptor(&t.cert_file, &t.key_file)
                        .map_err(|e| format!("pool {:?} picker.tls: {e}", p.name))?,
                ),
                None => None,
            };
            let grpc = |listener, app: axum::Router| match &acceptor {
                Some(a) => tokio::spawn(tls::serve(listener, a.clone(), app, stop.clone())),
                None => spawn_server(listener, app, stop.clone()),
            };
            served.tasks.push(grpc(listener, routes.into_axum_router()));
            if let Some(haddr) = pc.health {
                let listener = bind(haddr, &p.name, "health").await?;
                served.bound.insert((p.name.clone(), "health"), local(&listener, haddr));
                let routes = tonic::service::Routes::new(health);
                served.tasks.push(grpc(listener, routes.into_axum_router()));
            }
            served.tasks.push(tokio::spawn(readiness(pool.clone(), reporter, stop.clone())));
        }
        if let Some(addr) = pc.http {
            http_doors.entry(addr).or_default().insert(p.name.clone(), pool.clone());
        }
        if let Some(addr) = pc.spoe {
            let sp = Arc::new(spoe::SpoePool::new(pool.clone()));
            if let SinkConfig::Haproxy(h) = &p.sink {
                let addrs: Vec<String> = h.runtime_addresses().cloned().collect();
                if !addrs.is_empty() {
                    served.tasks.push(tokio::spawn(spoe::follow_names(
                        sp.clone(),
                        addrs,
                        h.backend.clone(),
                        stop.clone(),
                    )));
                }
            }
            spoe_doors.entry(addr).or_default().insert(p.name.clone(), sp);
        }
    }
    for (addr, pools) in spoe_doors {
        let names: Vec<String> = pools.keys().cloned().collect();
        let listener = bind(addr, &names.join(","), "spoe").await?;
        let at = local(&listener, addr);
        for n in names {
            served.bound.insert((n, "spoe"), at);
        }
        served.tasks.push(tokio::spawn(spoe::serve(
            listener,
            Arc::new(pools),
            counter.clone(),
            stop.clone(),
        )));
    }
    for (addr, pools) in http_doors {
        let names: Vec<String> = pools.keys().cloned().collect();
        let listener = bind(addr, &names.join(","), "http").await?;
        let at = local(&listener, addr);
        for n in names {
            served.bound.insert((n, "http"), at);
        }
        served.tasks.push(spawn_server(listener, http::router(pools, counter.clone()), stop.clone()));
    }
    if !served.pools.is_empty() {
        served.tasks.push(tokio::spawn(follow_cycles(served.pools.clone(), telemetry, stop)));
    }
    Ok(served)
}

async fn bind(addr: SocketAddr, pool: &str, door: &str) -> Result<tokio::net::TcpListener, String> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("pool {pool:?} picker: cannot listen on {addr} ({door}): {e}"))
}

fn local(listener: &tokio::net::TcpListener, configured: SocketAddr) -> SocketAddr {
    listener.local_addr().unwrap_or(configured)
}

fn spawn_server(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    stop: CancellationToken,
) -> JoinHandle<()> {
    // No Nagle: an answer of a few hundred bytes otherwise waits for the peer's delayed ACK
    // (measured: +43 ms per request through Envoy at one request at a time).
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned()).await {
            tracing::error!(error = %e, "picker door stopped");
        }
    })
}

/// How the picker reaches a pool's pages: its scrape source's way, or plain HTTP.
fn page_access(cfg: &Config, source: &str) -> Result<refresh::PageAccess, String> {
    let timeout = std::time::Duration::from_secs(2);
    match cfg.sources.get(source) {
        Some(SourceConfig::Scrape(s)) => Ok(refresh::PageAccess {
            client: crate::source::http_client(
                timeout,
                s.ca_file.as_deref(),
                s.insecure_skip_verify,
                &Default::default(),
            )
            .map_err(|e| e.to_string())?,
            scheme: s.scheme.clone(),
            path: s.path.clone(),
            token: s.bearer_token.clone(),
        }),
        _ => Ok(refresh::PageAccess {
            client: crate::source::http_client(timeout, None, false, &Default::default())
                .map_err(|e| e.to_string())?,
            scheme: "http".into(),
            path: "/metrics".into(),
            token: None,
        }),
    }
}

/// Each cycle's members and ratios become the pickers' members and capacity.
async fn follow_cycles(
    pools: BTreeMap<String, Arc<PoolPicker>>,
    telemetry: Arc<Telemetry>,
    stop: CancellationToken,
) {
    let mut reports = telemetry.reports();
    loop {
        if let Some(report) = reports.borrow_and_update().clone() {
            apply(&pools, &report);
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            changed = reports.changed() => if changed.is_err() { return },
        }
    }
}

/// One cycle's report applied to the pickers.
pub fn apply(pools: &BTreeMap<String, Arc<PoolPicker>>, report: &CycleReport) {
    for p in &report.pools {
        if let Some(picker) = pools.get(&p.pool) {
            let members: Vec<(String, f64)> =
                p.members.iter().map(|m| (m.member.clone(), f64::from(m.ratio))).collect();
            picker.set_members(&members);
        }
    }
}

/// The ext_proc door is ready (gRPC health `readiness`, `""` and the service's name) while its
/// pool has members to pick from.
async fn readiness(
    pool: Arc<PoolPicker>,
    reporter: tonic_health::server::HealthReporter,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(200));
    let mut was: Option<bool> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let ready = !pool.members().is_empty();
        if was != Some(ready) {
            was = Some(ready);
            let status = if ready { ServingStatus::Serving } else { ServingStatus::NotServing };
            for s in HEALTH_SERVICES {
                reporter.set_service_status(*s, status).await;
            }
        }
    }
}
