//! F5 BIG-IP sink: pool member ratios over iControl REST.
//!
//! One [`F5Sink`] keeps one BIG-IP pool's member ratios equal to the controller's. Each push reads the
//! pool (its `loadBalancingMode`) and its members, matches them to the controller's members by address
//! and port, and PATCHes only the members whose ratio differs: directly when one changes, inside one
//! iControl transaction when several do, so the pool never runs on a half-applied set.
//!
//! Wire facts used here (F5's iControl REST API reference and user guide, DevCentral articles, the F5
//! SDKs' behaviour; restated in our words):
//! - members: `GET /mgmt/tm/ltm/pool/~Common~POOL/members` lists `name`, `partition`, `address`,
//!   `ratio`; a member is changed with `PATCH .../members/~Common~NAME {"ratio":N}` (PUT would reset
//!   every property it does not carry);
//! - ratio is an integer 1..=65535, default 1;
//! - ratios only steer traffic in the `ratio-member` and `ratio-least-connections-member` modes (the
//!   `*-node` modes read the node's ratio instead);
//! - transactions: `POST /mgmt/tm/transaction {}` answers `{"transId":N,"state":"STARTED",...}`; requests
//!   sent with `X-F5-REST-Coordination-Id: N` are queued, not run; `PATCH /mgmt/tm/transaction/N
//!   {"state":"VALIDATING"}` (without that header) runs them all or none and answers `"COMPLETED"` or
//!   an error. A transaction with nothing queued cannot be committed.

mod config;
mod names;
mod plan;
mod session;
mod wire;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use reqwest::Method;
use serde_json::{json, Value};

pub use config::{AuthMode, F5Config, Username};
pub use plan::{WIRE_MAX, WIRE_MIN};

use crate::{Applied, MemberId, RatioSink, Ratios, SinkError};
use names::{member_segment, PoolPath};
use plan::Change;
use session::{CallError, Request, RetryPolicy, Session};

/// Load-balancing modes in which pool member ratios take effect.
pub const RATIO_MODES: [&str; 2] = ["ratio-member", "ratio-least-connections-member"];

/// Pushes ratios into one BIG-IP pool.
pub struct F5Sink {
    session: Arc<Session>,
    pool: PoolPath,
    /// The controller's name for this pool, for logs.
    label: String,
    policy: RetryPolicy,
    transactions: bool,
    /// The last balancing mode we warned about, so the warning is given once, not every cycle.
    warned_mode: Mutex<Option<String>>,
    released: AtomicBool,
}

impl F5Sink {
    /// Build the sink for one pool. `pool` is the controller's pool name (for logs); the BIG-IP pool is
    /// `cfg.pool`. Sinks for the same BIG-IP and user share one login session.
    pub fn new(cfg: &F5Config, pool: &str) -> Result<Self, SinkError> {
        if let Some((field, msg)) = cfg.validate().into_iter().next() {
            return Err(SinkError::Config(format!("f5 {field}: {msg}")));
        }
        let bigip_pool =
            PoolPath::parse(&cfg.pool).map_err(|e| SinkError::Config(format!("f5 pool: {e}")))?;
        let username = cfg.username.resolve().map_err(|e| SinkError::Config(format!("f5 username: {e}")))?;
        let session = Session::shared(cfg, username)?;
        Ok(F5Sink {
            session,
            pool: bigip_pool,
            label: pool.to_string(),
            policy: RetryPolicy { retries: cfg.retries, backoff: cfg.retry_backoff },
            transactions: cfg.transactions,
            warned_mode: Mutex::new(None),
            released: AtomicBool::new(false),
        })
    }

    /// `f5 https://bigip pool /Common/llm_pool`: the start of every error message.
    fn target(&self) -> String {
        format!("f5 {} pool {}", self.session.base_url(), self.pool)
    }

    fn member_target(&self, c: &Change) -> String {
        format!("{} member {}", self.target(), c.full_path())
    }

    fn pool_path(&self) -> String {
        format!("/mgmt/tm/ltm/pool/{}", self.pool.segment())
    }

    fn member_path(&self, c: &Change) -> String {
        format!("{}/members/{}", self.pool_path(), member_segment(&c.partition, &c.name))
    }

    /// Turn a failed call about the pool into an error that says what to check.
    fn pool_error(&self, e: CallError) -> SinkError {
        let hint = match e.status() {
            Some(404) => format!(
                "; check `pool` ({}, with its partition) and that user {:?} may see that partition",
                self.pool,
                self.session.username()
            ),
            _ => String::new(),
        };
        match e.into_sink_error(self.target()) {
            SinkError::Rejected { target, detail } => SinkError::Rejected { target, detail: detail + &hint },
            other => other,
        }
    }

    async fn read_members(&self) -> Result<Vec<wire::Member>, SinkError> {
        let path = format!("{}/members", self.pool_path());
        let coll: wire::MemberCollection =
            self.session.call(&Request::get(&path), self.policy).await.map_err(|e| self.pool_error(e))?;
        Ok(coll.items)
    }

    /// Read the pool's balancing mode; a warning the first time it is one where ratios do nothing.
    async fn check_mode(&self) -> Result<Option<String>, SinkError> {
        let pool: wire::Pool = self
            .session
            .call(&Request::get(&self.pool_path()), self.policy)
            .await
            .map_err(|e| self.pool_error(e))?;
        let mode = pool.load_balancing_mode.unwrap_or_else(|| "round-robin".to_string());
        let mut warned = self.warned_mode.lock().unwrap_or_else(|p| p.into_inner());
        if RATIO_MODES.contains(&mode.as_str()) {
            *warned = None;
            return Ok(None);
        }
        if warned.as_deref() == Some(mode.as_str()) {
            return Ok(None);
        }
        let msg = format!(
            "BIG-IP pool {} uses load-balancing mode {mode}, in which member ratios have no effect; set it to \
             ratio-least-connections-member (recommended) or ratio-member",
            self.pool
        );
        // Returned, not logged: the controller logs each new warning of a push once (logging here too
        // printed it twice).
        *warned = Some(mode);
        Ok(Some(msg))
    }

    async fn patch_direct(&self, c: &Change) -> Result<(), SinkError> {
        let path = self.member_path(c);
        let req = Request::with_body(Method::PATCH, &path, json!(wire::RatioPatch { ratio: c.to }));
        self.session
            .call::<Value>(&req, self.policy)
            .await
            .map(|_| ())
            .map_err(|e| e.into_sink_error(self.member_target(c)))
    }

    /// Queue every change in one transaction and commit it: all apply, or none.
    async fn patch_in_transaction(&self, changes: &[Change]) -> Result<(), SinkError> {
        let tx: wire::Transaction = self
            .session
            .call(&Request::with_body(Method::POST, "/mgmt/tm/transaction", json!({})), self.policy)
            .await
            .map_err(|e| e.into_sink_error(format!("{} (starting a transaction)", self.target())))?;
        let id = tx.trans_id;
        for c in changes {
            let path = self.member_path(c);
            let mut req = Request::with_body(Method::PATCH, &path, json!(wire::RatioPatch { ratio: c.to }));
            req.coordination = Some(id);
            // Queuing the same PATCH twice after a retry is harmless: both set the same value.
            if let Err(e) = self.session.call::<Value>(&req, self.policy).await {
                self.abandon(id).await;
                return Err(e.into_sink_error(self.member_target(c)));
            }
        }
        self.commit(id).await
    }

    /// Commit transaction `id`. The commit itself is never blindly re-sent: after a failure that may
    /// or may not have reached BIG-IP, the transaction's state says whether it ran.
    async fn commit(&self, id: u64) -> Result<(), SinkError> {
        let path = format!("/mgmt/tm/transaction/{id}");
        let target = format!("{} (transaction {id})", self.target());
        let mut attempt = 0;
        loop {
            let req = Request::with_body(Method::PATCH, &path, json!(wire::Commit { state: "VALIDATING" }));
            let err = match self.session.call::<wire::Transaction>(&req, RetryPolicy::none()).await {
                Ok(t) => return self.await_outcome(id, t, &target).await,
                Err(e) if e.retryable() => e,
                // A re-sent commit may be refused because the earlier one landed in the meantime.
                Err(e) if attempt > 0 => {
                    return match self
                        .session
                        .call::<wire::Transaction>(&Request::get(&path), self.policy)
                        .await
                    {
                        Ok(t) if t.state == "COMPLETED" => Ok(()),
                        _ => Err(e.into_sink_error(target)),
                    }
                }
                // BIG-IP's message names the command (pool and member) that failed; nothing applied.
                Err(e) => return Err(e.into_sink_error(target)),
            };
            tracing::debug!(pool = %self.label, transaction = id, error = ?err, "commit did not answer cleanly; checking its state");
            match self.session.call::<wire::Transaction>(&Request::get(&path), self.policy).await {
                Ok(t) if t.state == "STARTED" && attempt < self.policy.retries => {
                    attempt += 1;
                    tokio::time::sleep(self.policy.backoff).await;
                }
                Ok(t) if t.state != "STARTED" => return self.await_outcome(id, t, &target).await,
                _ => return Err(err.into_sink_error(target)),
            }
        }
    }

    /// Follow a submitted transaction to COMPLETED or FAILED (BIG-IP may report VALIDATING while it
    /// works).
    async fn await_outcome(&self, id: u64, mut t: wire::Transaction, target: &str) -> Result<(), SinkError> {
        let path = format!("/mgmt/tm/transaction/{id}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match t.state.as_str() {
                "COMPLETED" => return Ok(()),
                "FAILED" => {
                    return Err(SinkError::Rejected {
                        target: target.to_string(),
                        detail: format!(
                            "transaction failed, nothing applied: {}",
                            t.failure_reason.unwrap_or_else(|| "no reason given".into())
                        ),
                    })
                }
                _ if Instant::now() >= deadline => {
                    return Err(SinkError::Temporary {
                        target: target.to_string(),
                        detail: format!(
                            "transaction still {} after 30s; the next push re-reads the pool",
                            t.state
                        ),
                    })
                }
                _ => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    t = self
                        .session
                        .call(&Request::get(&path), self.policy)
                        .await
                        .map_err(|e| e.into_sink_error(target.to_string()))?;
                }
            }
        }
    }

    /// Best effort: drop a transaction we will not commit (BIG-IP would expire it anyway).
    async fn abandon(&self, id: u64) {
        let path = format!("/mgmt/tm/transaction/{id}");
        let req = Request { method: Method::DELETE, path: &path, body: None, coordination: None };
        if let Err(e) = self.session.call::<Value>(&req, RetryPolicy::none()).await {
            tracing::debug!(pool = %self.label, transaction = id, error = ?e, "could not delete abandoned transaction");
        }
    }
}

#[async_trait]
impl RatioSink for F5Sink {
    fn kind(&self) -> &'static str {
        "f5"
    }

    fn reconciles(&self) -> bool {
        true
    }

    async fn members(&self) -> Result<Option<Vec<MemberId>>, SinkError> {
        let mut ids: Vec<MemberId> = self.read_members().await?.iter().map(plan::member_id).collect();
        ids.sort();
        ids.dedup();
        Ok(Some(ids))
    }

    async fn current(&self) -> Result<Option<Ratios>, SinkError> {
        Ok(Some(self.read_members().await?.iter().map(|m| (plan::member_id(m), m.ratio)).collect()))
    }

    async fn apply(&self, desired: &Ratios) -> Result<Applied, SinkError> {
        let mut warnings = Vec::new();
        if let Some(w) = self.check_mode().await? {
            warnings.push(w);
        }
        let members = self.read_members().await?;
        let plan = plan::plan(self.pool.as_str(), &members, desired);
        // Membership mismatches are in every push's warnings; the controller logs them when they appear.
        warnings.extend(plan.warnings());
        match plan.changes.len() {
            0 => {}
            1 => self.patch_direct(&plan.changes[0]).await?,
            _ if self.transactions => self.patch_in_transaction(&plan.changes).await?,
            _ => {
                for c in &plan.changes {
                    self.patch_direct(c).await?;
                }
            }
        }
        for c in &plan.changes {
            tracing::debug!(pool = %self.label, member = %c.id, from = c.from, to = c.to, "ratio set");
        }
        Ok(Applied { changed: plan.changes.len(), unchanged: plan.unchanged, warnings })
    }

    async fn shutdown(&self) {
        if !self.released.swap(true, Ordering::SeqCst) {
            self.session.clone().release().await;
        }
    }
}

impl Drop for F5Sink {
    /// A sink dropped without `shutdown` still gives up its share of the session, so the last sink's
    /// shutdown deletes the token. The deletion itself needs the runtime; without one the token just
    /// expires on the BIG-IP.
    fn drop(&mut self) {
        if !self.released.swap(true, Ordering::SeqCst) {
            let session = self.session.clone();
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(session.release());
                }
                Err(_) => session.forget_holder(),
            }
        }
    }
}
