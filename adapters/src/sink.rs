//! The [`RatioSink`] trait every load-balancer adapter implements, and the config enum that picks one.

use async_trait::async_trait;
use serde::Deserialize;

use std::sync::Arc;

use crate::{dry_run, envoy, f5, haproxy, webhook, MemberId, Ratios, SinkError};

/// What one `apply` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// Members whose ratio was changed on the load balancer.
    pub changed: usize,
    /// Members that already had the desired ratio and were not touched.
    pub unchanged: usize,
    /// Things worth a log line that did not stop the push (a member the LB does not know, a balancing
    /// mode in which ratios have no effect, a value clamped into the LB's range).
    pub warnings: Vec<String>,
}

/// One load-balancer instance of a sink and whether the last push was applied there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceStatus {
    /// How the instance is addressed in the config (runtime API address, management URL).
    pub address: String,
    pub ok: bool,
}

/// Makes one load-balancer pool agree with a set of ratios.
///
/// One instance serves one pool of the controller. Implementations read what the LB has now where they
/// can and change only what differs, so calling `apply` every cycle with the same ratios is cheap and
/// repairs drift (a hand edit, a reload that dropped runtime weights).
#[async_trait]
pub trait RatioSink: Send + Sync {
    /// Short name for logs and metrics: `dry-run`, `webhook`, `haproxy`, `f5`, `envoy`.
    fn kind(&self) -> &'static str;

    /// Whether what `apply` changes reaches a load balancer (the dry-run sink only prints): its
    /// changes are counted as writes on the load balancer.
    fn reaches_lb(&self) -> bool {
        true
    }

    /// The members the load balancer itself has in this pool, if it can tell. Used for membership
    /// discovery (`members: {from: lb}`); sinks that have no pool to ask return `Ok(None)`.
    async fn members(&self) -> Result<Option<Vec<MemberId>>, SinkError> {
        Ok(None)
    }

    /// The ratios the load balancer has now, if it can tell. Optional: the controller does not need
    /// it (reconciling sinks read inside `apply`); it is there for tools and tests that verify a load
    /// balancer's state through the same adapter.
    async fn current(&self) -> Result<Option<Ratios>, SinkError> {
        Ok(None)
    }

    /// Whether `apply` itself reads the load balancer and changes only what differs. The controller
    /// then calls `apply` every cycle (one read, and writes only on drift) instead of reading back
    /// first; for sinks that cannot read back it pushes on change and re-sends now and then.
    fn reconciles(&self) -> bool {
        false
    }

    /// Make the load balancer hold `desired`. Members in `desired` that the LB does not have are
    /// reported in [`Applied::warnings`], not treated as fatal.
    async fn apply(&self, desired: &Ratios) -> Result<Applied, SinkError>;

    /// Release what the sink holds on the LB (login tokens). Called once on shutdown.
    async fn shutdown(&self) {}

    /// The load-balancer instances behind this sink, when there are several (HAProxy instances, the
    /// units of a BIG-IP HA pair), and whether the last push was applied on each. Empty otherwise.
    fn instances(&self) -> Vec<InstanceStatus> {
        Vec::new()
    }
}

/// Which sink a pool pushes to, chosen by `kind` in the config.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum SinkConfig {
    /// Print nothing, push nothing: the controller's own output shows the ratios.
    #[default]
    DryRun,
    /// POST the pool's ratios as JSON to a URL (the reference proxy's admin listener, or anything else).
    Webhook(webhook::WebhookConfig),
    /// HAProxy runtime API weights.
    Haproxy(haproxy::HaproxyConfig),
    /// F5 BIG-IP pool member ratios over iControl REST.
    F5(f5::F5Config),
    /// Envoy endpoint weights over EDS.
    Envoy(envoy::EnvoyConfig),
}

impl SinkConfig {
    pub fn kind(&self) -> &'static str {
        match self {
            SinkConfig::DryRun => "dry-run",
            SinkConfig::Webhook(_) => "webhook",
            SinkConfig::Haproxy(_) => "haproxy",
            SinkConfig::F5(_) => "f5",
            SinkConfig::Envoy(_) => "envoy",
        }
    }

    /// Whether pushing changes state outside the controller's process, so that only the leader
    /// may push: every sink but the dry run, Envoy's xDS modes (served from the process itself)
    /// and HAProxy's agent mode (HAProxy asks).
    pub fn needs_leader(&self) -> bool {
        match self {
            SinkConfig::DryRun => false,
            SinkConfig::Envoy(e) => e.mode != crate::envoy::EnvoyMode::Xds,
            SinkConfig::Haproxy(h) => h.mode != crate::haproxy::HaproxyMode::Agent,
            SinkConfig::F5(_) | SinkConfig::Webhook(_) => true,
        }
    }

    /// Problems visible without talking to the LB, as `(field, message)` pairs relative to the sink.
    pub fn validate(&self) -> Vec<(String, String)> {
        match self {
            SinkConfig::DryRun => Vec::new(),
            SinkConfig::Webhook(w) => w.validate(),
            SinkConfig::Haproxy(c) => c.validate(),
            SinkConfig::F5(c) => c.validate(),
            SinkConfig::Envoy(c) => c.validate(),
        }
    }
}

/// Process-wide things sinks share: the EDS registry the controller's listener serves to Envoy.
#[derive(Debug, Clone, Default)]
pub struct SinkContext {
    pub eds: Arc<envoy::EdsRegistry>,
}

/// Build the sink for one pool. `pool` is the controller's pool name, used in messages and payloads.
pub fn build_sink(cfg: &SinkConfig, pool: &str, ctx: &SinkContext) -> Result<Box<dyn RatioSink>, SinkError> {
    Ok(match cfg {
        SinkConfig::DryRun => Box::new(dry_run::DryRunSink::default()),
        SinkConfig::Webhook(w) => Box::new(webhook::WebhookSink::new(w, pool)?),
        SinkConfig::Haproxy(c) => Box::new(haproxy::HaproxySink::new(c, pool)?),
        SinkConfig::F5(c) => Box::new(f5::F5Sink::new(c, pool)?),
        SinkConfig::Envoy(c) => Box::new(envoy::EnvoySink::new(c, pool, ctx.eds.clone())?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sinks_that_change_state_outside_the_process_need_the_leader() {
        assert!(!SinkConfig::DryRun.needs_leader());
        let agent = crate::haproxy::HaproxyConfig::agent("0.0.0.0:9999", "llm");
        assert!(!SinkConfig::Haproxy(agent).needs_leader(), "HAProxy asks the agent");
        let runtime = crate::haproxy::HaproxyConfig::runtime("unix:/run/h.sock", "llm");
        assert!(SinkConfig::Haproxy(runtime).needs_leader());
        assert!(!crate::dry_run::DryRunSink::default().reaches_lb());
    }
}
