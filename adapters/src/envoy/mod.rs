//! Envoy sink: endpoint weights over EDS.
//!
//! Envoy has no pool to ask and no runtime API for weights, so the controller is Envoy's source of
//! endpoints for the clusters it manages: each member becomes an endpoint with
//! `load_balancing_weight` = its ratio. Two ways to hand them over:
//! - `mode: xds` (default): the controller's listener serves the assignments from an [`EdsRegistry`]:
//!   REST-JSON EDS at `POST /v3/discovery:endpoints`, which Envoy polls every `refresh_delay`, and,
//!   with this crate's `ads` feature, gRPC ADS and EDS streams, which are pushed to on every change.
//! - `mode: file`: the assignment is written to `directory/file_name`, which Envoy watches
//!   (`path_config_source` + `watched_directory`), for setups that mount config rather than call out.
//!
//! Membership comes from the pool's configured members or Prometheus targets: whatever the controller
//! passes to `apply` is the whole cluster. With `admin` set, the sink can also read the cluster's
//! endpoints from Envoy's admin interface (`members: { from_lb: true }`, dry runs); in file mode it
//! reads the file Envoy watches. See [`assignment`] for how ratios become weights (0 means
//! "left out", never sent) and [`registry`] for how polls are answered.

pub mod admin;
#[cfg(feature = "ads")]
pub mod ads;
pub mod assignment;
pub mod file;
pub mod registry;
pub mod resolve;
pub mod wire;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde::Deserialize;

pub use assignment::{Assignment, Held};
pub use registry::{Discovery, EdsRegistry, Poller, EDS_PATH};

use crate::{Applied, MemberId, RatioSink, Ratios, SinkError};
use assignment::{build, served_from, standby_from, NothingToServe};
use file::EdsFile;

impl EdsRegistry {
    /// Routes to merge into the controller's listener: `POST /v3/discovery:endpoints` (REST EDS) and,
    /// with the `ads` feature, the gRPC ADS and EDS services. Here rather than in `registry`, which
    /// `ads` builds on: the registry does not know its transports.
    pub fn router(self: Arc<Self>) -> axum::Router {
        let rest = self.clone().rest_router();
        #[cfg(feature = "ads")]
        let rest = rest.merge(ads::router(self));
        #[cfg(not(feature = "ads"))]
        drop(self);
        rest
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyConfig {
    /// The EDS resource Envoy asks for: the cluster's `eds_cluster_config.service_name` when it sets
    /// one, else the cluster's name.
    pub cluster: String,
    /// How Envoy gets the assignment: `xds` (served on the controller's listener) or `file`.
    #[serde(default)]
    pub mode: EnvoyMode,
    /// `mode: file`: the directory Envoy watches (`watched_directory.path`). Must exist.
    #[serde(default)]
    pub directory: Option<PathBuf>,
    /// `mode: file`: the file in `directory` Envoy reads (`path_config_source.path`). Default
    /// `CLUSTER.json`; must end in `.json` (Envoy picks the parser by extension).
    #[serde(default)]
    pub file_name: Option<String>,
    /// How long resolving one member's DNS name may take (Envoy's EDS takes IP addresses only).
    #[serde(default = "default_resolve_timeout", with = "humantime_serde")]
    pub resolve_timeout: Duration,
    /// Envoy's admin address (`http://127.0.0.1:9901`), read-only: lists the cluster's endpoints for
    /// membership discovery and dry runs.
    #[serde(default)]
    pub admin: Option<String>,
    /// Members at ratio 0 (inactive priority tiers) stay in the assignment at priority 1 with weight
    /// 1 instead of being left out: no traffic while priority 0 is healthy, and Envoy's own failover
    /// to them if it is not.
    #[serde(default)]
    pub priority_levels: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvoyMode {
    /// Served by the controller's listener: REST EDS polls (`api_type: REST`) and, with the `ads`
    /// feature, gRPC streams (`ads: {}` or `api_type: GRPC`).
    #[default]
    #[serde(alias = "rest")]
    Xds,
    /// Written to a file Envoy watches.
    File,
}

fn default_resolve_timeout() -> Duration {
    Duration::from_secs(2)
}

impl EnvoyConfig {
    /// Problems visible without Envoy, as `(field, message)` pairs.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errs = Vec::new();
        if self.cluster.trim().is_empty() || self.cluster.chars().any(char::is_whitespace) {
            errs.push((
                "cluster".into(),
                "must be the Envoy cluster's EDS name, non-empty and without spaces".into(),
            ));
        }
        if self.resolve_timeout.is_zero() {
            errs.push(("resolve_timeout".into(), "must be > 0".into()));
        }
        if let Some(a) = &self.admin {
            if !(a.starts_with("http://") || a.starts_with("https://")) {
                errs.push((
                    "admin".into(),
                    format!("{a:?} must be an http(s) URL of Envoy's admin interface"),
                ));
            }
        }
        match self.mode {
            EnvoyMode::Xds => {
                for (field, set) in
                    [("directory", self.directory.is_some()), ("file_name", self.file_name.is_some())]
                {
                    if set {
                        errs.push((
                            field.into(),
                            "only used with `mode: file`; remove it or set `mode: file`".into(),
                        ));
                    }
                }
            }
            EnvoyMode::File => {
                if self.directory.is_none() {
                    errs.push((
                        "directory".into(),
                        "required with `mode: file`: the directory Envoy watches (watched_directory.path)"
                            .into(),
                    ));
                }
                let name = self.file_name();
                if name.contains('/') || name.starts_with('.') || !name.ends_with(".json") {
                    errs.push((
                        "file_name".into(),
                        format!("{name:?} must be a plain file name ending in .json (not hidden, no `/`)"),
                    ));
                }
            }
        }
        errs
    }

    /// Whether the sink can tell which members Envoy has (for `members: { from_lb: true }`).
    pub fn can_read_members(&self) -> bool {
        self.admin.is_some() || self.mode == EnvoyMode::File
    }

    fn file_name(&self) -> String {
        self.file_name.clone().unwrap_or_else(|| format!("{}.json", self.cluster))
    }
}

enum Output {
    Xds,
    File(EdsFile),
}

/// Pushes one pool's ratios to one Envoy cluster.
pub struct EnvoySink {
    pool: String,
    cluster: String,
    output: Output,
    eds: Arc<EdsRegistry>,
    /// The registry claim that keeps two pools from feeding one cluster (or file).
    claim: String,
    resolve_timeout: Duration,
    priority_levels: bool,
    /// File mode: members left out at ratio 0 (the file cannot say so; the registry holds this itself).
    drained: Mutex<BTreeSet<MemberId>>,
    /// Envoy's admin interface, read for membership.
    admin: Option<(String, reqwest::Client)>,
}

impl EnvoySink {
    pub fn new(cfg: &EnvoyConfig, pool: &str, eds: Arc<EdsRegistry>) -> Result<Self, SinkError> {
        let errs = cfg.validate();
        if !errs.is_empty() {
            let msg: Vec<String> = errs.into_iter().map(|(f, m)| format!("{f}: {m}")).collect();
            return Err(SinkError::Config(format!("envoy sink of pool {pool}: {}", msg.join("; "))));
        }
        let (output, claim) = match cfg.mode {
            EnvoyMode::Xds => (Output::Xds, registry::cluster_target(&cfg.cluster)),
            EnvoyMode::File => {
                let dir = cfg.directory.clone().unwrap_or_default();
                if !dir.is_dir() {
                    return Err(SinkError::Config(format!(
                        "envoy sink of pool {pool}: directory {} does not exist or is not a directory; \
                         create it (and mount it into Envoy as its watched_directory)",
                        dir.display()
                    )));
                }
                let f = EdsFile::new(&dir, &cfg.file_name());
                let claim = format!("file {}", f.path.display());
                (Output::File(f), claim)
            }
        };
        eds.claim(&claim, pool).map_err(|owner| {
            SinkError::Config(format!(
                "envoy {claim} is already fed by pool {owner}; one pool per Envoy cluster (pool {pool} must use another)"
            ))
        })?;
        Ok(EnvoySink {
            pool: pool.to_string(),
            cluster: cfg.cluster.clone(),
            output,
            eds,
            claim,
            resolve_timeout: cfg.resolve_timeout,
            priority_levels: cfg.priority_levels,
            drained: Mutex::new(BTreeSet::new()),
            admin: match &cfg.admin {
                Some(url) => {
                    let client = crate::tls::client_builder(Duration::from_secs(5), None, false)
                        .and_then(|b| b.build().map_err(|e| e.to_string()))
                        .map_err(|e| {
                            SinkError::Config(format!("envoy sink of pool {pool}: admin client: {e}"))
                        })?;
                    Some((url.trim_end_matches('/').to_string(), client))
                }
                None => None,
            },
        })
    }

    fn target(&self) -> String {
        format!("envoy {} (pool {})", self.claim, self.pool)
    }

    /// What Envoy is given now, as held by this sink's output.
    fn held(&self) -> Result<Option<Held>, SinkError> {
        match &self.output {
            Output::Xds => Ok(self.eds.held(&self.cluster)),
            Output::File(f) => {
                let cla = f
                    .read(&self.cluster)
                    .map_err(|detail| SinkError::Rejected { target: self.target(), detail })?;
                Ok(cla.map(|cla| {
                    let served = served_from(&cla);
                    let drained = self.drained.lock().unwrap_or_else(|p| p.into_inner());
                    let standby = standby_from(&cla);
                    Held {
                        drained: drained
                            .iter()
                            .chain(&standby)
                            .filter(|m| !served.contains_key(*m))
                            .cloned()
                            .collect(),
                        served,
                    }
                }))
            }
        }
    }
}

impl Drop for EnvoySink {
    fn drop(&mut self) {
        self.eds.release(&self.claim, &self.pool);
    }
}

#[async_trait]
impl RatioSink for EnvoySink {
    fn kind(&self) -> &'static str {
        "envoy"
    }

    fn reconciles(&self) -> bool {
        true
    }

    async fn current(&self) -> Result<Option<Ratios>, SinkError> {
        Ok(self.held()?.map(|h| h.to_ratios()))
    }

    /// Envoy's own view through its admin interface when `admin` is set; in file mode without it, the
    /// members of the file Envoy watches; otherwise Envoy has nothing to ask (`None`).
    async fn members(&self) -> Result<Option<Vec<MemberId>>, SinkError> {
        if let Some((url, client)) = &self.admin {
            let target = format!("envoy admin {url} (pool {})", self.pool);
            let resp = client.get(format!("{url}/clusters?format=json")).send().await.map_err(|e| {
                SinkError::Unreachable { target: target.clone(), detail: e.without_url().to_string() }
            })?;
            if !resp.status().is_success() {
                return Err(SinkError::Rejected { target, detail: format!("HTTP {}", resp.status()) });
            }
            let body = resp.bytes().await.map_err(|e| SinkError::Unreachable {
                target: target.clone(),
                detail: e.without_url().to_string(),
            })?;
            return match admin::members_of(&body, &self.cluster)
                .map_err(|detail| SinkError::Rejected { target: target.clone(), detail })?
            {
                Some(m) => Ok(Some(m)),
                None => Err(SinkError::Rejected {
                    target,
                    detail: format!("Envoy has no cluster named {:?}", self.cluster),
                }),
            };
        }
        match &self.output {
            Output::File(_) => {
                Ok(self.held()?.map(|h| h.to_ratios().iter().map(|(m, _)| m.clone()).collect()))
            }
            Output::Xds => Ok(None),
        }
    }

    async fn apply(&self, desired: &Ratios) -> Result<Applied, SinkError> {
        let members: Vec<MemberId> = desired.iter().map(|(m, _)| m.clone()).collect();
        let (resolved, failed) = resolve::resolve_all(&members, self.resolve_timeout).await;
        let mut warnings: Vec<String> = failed
            .iter()
            .map(|(m, why)| format!("{m} left out of Envoy cluster {}: {why}", self.cluster))
            .collect();
        let pairs: Vec<_> = resolved
            .into_iter()
            .map(|r| {
                let w = desired.get(&r.member).unwrap_or(0);
                (r, w)
            })
            .collect();
        let (next, build_warnings) =
            build(&self.cluster, &pairs, self.priority_levels).map_err(|why| match why {
                NothingToServe::NoMembers if !failed.is_empty() => SinkError::Unreachable {
                    target: self.target(),
                    detail: format!(
                        "no member could be resolved ({}); the previous assignment is kept",
                        warnings.join("; ")
                    ),
                },
                other => SinkError::Rejected { target: self.target(), detail: other.to_string() },
            })?;
        warnings.extend(build_warnings);

        let prev = match &self.output {
            Output::Xds => {
                let prev_version = self.eds.assignment(&self.cluster).map(|a| a.version);
                let prev = self.eds.store(&self.cluster, next.clone());
                if prev_version.as_deref() == Some(next.version.as_str()) {
                    // Nothing new reached Envoy: these were reported when they first happened.
                    warnings.clear();
                }
                prev
            }
            Output::File(f) => {
                let prev = self.held()?;
                let wrote = f.write(&next).map_err(|e| SinkError::Rejected {
                    target: self.target(),
                    detail: format!(
                        "cannot write {}: {e}; check that the directory is writable",
                        f.path.display()
                    ),
                })?;
                *self.drained.lock().unwrap_or_else(|p| p.into_inner()) = next.held.drained.clone();
                if !wrote {
                    warnings.clear();
                }
                prev
            }
        };

        let before = prev.map(|h| h.to_ratios()).unwrap_or_default();
        let after = next.held.to_ratios();
        let touched: BTreeSet<&MemberId> = before.members().chain(after.members()).collect();
        let changed = touched.iter().filter(|m| before.get(m) != after.get(m)).count();
        let unchanged = after.iter().filter(|(m, r)| before.get(m) == Some(*r)).count();
        Ok(Applied { changed, unchanged, warnings })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(yaml: serde_json::Value) -> EnvoyConfig {
        serde_json::from_value(yaml).unwrap()
    }

    fn ratios(r: &[(&str, u32)]) -> Ratios {
        r.iter().map(|(m, w)| (MemberId::from(*m), *w)).collect()
    }

    #[test]
    fn config_rules() {
        assert!(cfg(serde_json::json!({"cluster": "vllm"})).validate().is_empty());
        let c = cfg(serde_json::json!({"cluster": "vllm", "mode": "rest"}));
        assert_eq!(c.mode, EnvoyMode::Xds);
        let errs = cfg(serde_json::json!({"cluster": "vllm", "directory": "/tmp"})).validate();
        assert_eq!(errs[0].0, "directory");
        let errs = cfg(serde_json::json!({"cluster": "vllm", "mode": "file"})).validate();
        assert_eq!(errs[0].0, "directory");
        let errs = cfg(serde_json::json!({"cluster": "vllm", "mode": "file", "directory": "/tmp", "file_name": "a/b.yaml"})).validate();
        assert_eq!(errs[0].0, "file_name");
        assert!(
            serde_json::from_value::<EnvoyConfig>(serde_json::json!({"cluster": "v", "typo": 1})).is_err()
        );
    }

    #[test]
    fn one_pool_per_cluster() {
        let eds = Arc::new(EdsRegistry::new());
        let c = cfg(serde_json::json!({"cluster": "vllm"}));
        let a = EnvoySink::new(&c, "p1", eds.clone()).unwrap();
        let err = EnvoySink::new(&c, "p2", eds.clone()).err().unwrap();
        assert!(err.to_string().contains("already fed by pool p1"), "{err}");
        // A config reload rebuilds the same pool's sink: allowed.
        let again = EnvoySink::new(&c, "p1", eds.clone()).unwrap();
        drop(again);
        drop(a);
        assert!(EnvoySink::new(&c, "p2", eds).is_ok(), "dropping the sinks releases the cluster");
    }

    #[tokio::test]
    async fn apply_counts_changes_and_never_serves_zero() {
        let eds = Arc::new(EdsRegistry::new());
        let sink = EnvoySink::new(&cfg(serde_json::json!({"cluster": "vllm"})), "p", eds.clone()).unwrap();
        assert_eq!(sink.current().await.unwrap(), None);

        let r1 = ratios(&[("10.0.0.1:80", 3), ("10.0.0.2:80", 1)]);
        let a = sink.apply(&r1).await.unwrap();
        assert_eq!((a.changed, a.unchanged), (2, 0));
        let v1 = eds.assignment("vllm").unwrap().version;
        let a = sink.apply(&r1).await.unwrap();
        assert_eq!((a.changed, a.unchanged), (0, 2));
        assert_eq!(eds.assignment("vllm").unwrap().version, v1, "same ratios, same version");

        let r2 = ratios(&[("10.0.0.1:80", 3), ("10.0.0.2:80", 0)]);
        let a = sink.apply(&r2).await.unwrap();
        assert_eq!((a.changed, a.unchanged), (1, 1));
        assert_eq!(sink.current().await.unwrap(), Some(r2));
        let cla = eds.assignment("vllm").unwrap().cla;
        assert_eq!(cla.endpoints[0].lb_endpoints.len(), 1);

        let err = sink.apply(&ratios(&[("10.0.0.1:80", 0)])).await.unwrap_err();
        assert!(matches!(err, SinkError::Rejected { .. }), "{err}");
        let err = sink.apply(&Ratios::default()).await.unwrap_err();
        assert!(matches!(err, SinkError::Rejected { .. }), "{err}");
        assert_eq!(eds.assignment("vllm").unwrap().cla, cla, "refused pushes keep the previous assignment");

        let err = sink.apply(&ratios(&[("nope.invalid:80", 2)])).await.unwrap_err();
        assert!(err.retryable(), "DNS failure is worth retrying: {err}");
    }

    #[tokio::test]
    async fn file_mode_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(serde_json::json!({"cluster": "vllm", "mode": "file", "directory": dir.path()}));
        let eds = Arc::new(EdsRegistry::new());
        let sink = EnvoySink::new(&c, "p", eds.clone()).unwrap();
        assert_eq!(sink.current().await.unwrap(), None);
        let r = ratios(&[("10.0.0.1:80", 3), ("10.0.0.2:80", 0), ("10.0.0.3:80", 1)]);
        let a = sink.apply(&r).await.unwrap();
        assert_eq!(a.changed, 3);
        assert_eq!(sink.current().await.unwrap(), Some(r.clone()));
        assert!(dir.path().join("vllm.json").is_file());
        assert!(eds.assignment("vllm").is_none(), "file mode does not serve over xDS");
        let a = sink.apply(&r).await.unwrap();
        assert_eq!((a.changed, a.unchanged), (0, 3));

        let missing =
            cfg(serde_json::json!({"cluster": "x", "mode": "file", "directory": dir.path().join("nope")}));
        let err = EnvoySink::new(&missing, "q", eds).err().unwrap();
        assert!(err.to_string().contains("does not exist"), "{err}");
    }
}
