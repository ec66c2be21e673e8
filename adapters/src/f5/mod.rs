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
//! - HA: `GET /mgmt/tm/cm/failover-status` tells a unit whether it is ACTIVE or STANDBY; configuration
//!   is written on the active unit and reaches the peer by config-sync (automatic or manual);
//! - transactions: `POST /mgmt/tm/transaction {}` answers `{"transId":N,"state":"STARTED",...}`; requests
//!   sent with `X-F5-REST-Coordination-Id: N` are queued, not run; `PATCH /mgmt/tm/transaction/N
//!   {"state":"VALIDATING"}` (without that header) runs them all or none and answers `"COMPLETED"` or
//!   an error. A transaction with nothing queued cannot be committed;
//! - priority groups: a member's `priorityGroup` is 0..=65535 (default 0, higher is preferred); with
//!   the pool's `minActiveMembers` >= 1 (priority group activation), BIG-IP uses only the highest
//!   group that has at least that many available members. `priority_groups: true` expresses
//!   inactive priority tiers that way (see [`plan`]).

mod config;
mod login_gate;
mod names;
mod plan;
mod session;
mod wire;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::stream::{self, StreamExt, TryStreamExt};
use reqwest::Method;
use serde_json::{json, Value};

pub use config::{AuthMode, F5Config, F5Mode, Username, MAX_LOGIN_BACKOFF};
pub use plan::{DEFAULT_MAX_RATIO, WIRE_MAX, WIRE_MIN};

use crate::{Applied, MemberId, RatioSink, Ratios, SinkError};
use names::{member_segment, PoolPath};
use plan::Change;
use session::{CallError, Request, RetryPolicy, Session};

/// The id the sink gives a member BIG-IP lists as `name` at `address` (what `members: { from_lb }`
/// reads back): `address:port` when the address is an IP, else the name as listed. Public for
/// the tests that feed it hostile names; the controller admits it through `name::check`.
pub fn member_id_of(name: &str, address: &str) -> MemberId {
    plan::member_id(&wire::Member {
        name: name.to_string(),
        partition: "Common".to_string(),
        address: address.to_string(),
        ratio: 1,
        priority_group: 0,
    })
}

/// Load-balancing modes in which pool member ratios take effect.
pub const RATIO_MODES: [&str; 2] = ["ratio-member", "ratio-least-connections-member"];

/// Pushes ratios into one BIG-IP pool (or, in sideband mode, only reads its members).
pub struct F5Sink {
    /// One session per unit: a single BIG-IP, or every unit of an HA pair.
    units: Vec<Arc<Session>>,
    /// The unit last found ACTIVE (index into `units`); asked first on the next push.
    active: AtomicUsize,
    /// Whether the last push was applied (for [`RatioSink::instances`]).
    last_push_ok: AtomicBool,
    pool: PoolPath,
    /// The controller's name for this pool, for logs.
    label: String,
    policy: RetryPolicy,
    transactions: bool,
    concurrency: usize,
    max_ratio: u32,
    mode: F5Mode,
    /// Inactive tiers (ratio 0) become the standby priority group.
    groups: bool,
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
        let units = cfg
            .unit_urls()
            .iter()
            .map(|url| Session::shared(cfg, url, username.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(F5Sink {
            units,
            active: AtomicUsize::new(0),
            last_push_ok: AtomicBool::new(false),
            pool: bigip_pool,
            label: pool.to_string(),
            policy: RetryPolicy { retries: cfg.retries, backoff: cfg.retry_backoff },
            transactions: cfg.transactions,
            concurrency: cfg.concurrency,
            max_ratio: cfg.max_ratio,
            mode: cfg.mode,
            groups: cfg.priority_groups,
            warned_mode: Mutex::new(None),
            released: AtomicBool::new(false),
        })
    }

    /// `f5 https://bigip pool /Common/llm_pool`: the start of every error message.
    fn target(&self, s: &Session) -> String {
        format!("f5 {} pool {}", s.base_url(), self.pool)
    }

    fn member_target(&self, s: &Session, c: &Change) -> String {
        format!("{} member {}", self.target(s), c.full_path())
    }

    fn pool_path(&self) -> String {
        format!("/mgmt/tm/ltm/pool/{}", self.pool.segment())
    }

    fn member_path(&self, c: &Change) -> String {
        format!("{}/members/{}", self.pool_path(), member_segment(&c.partition, &c.name))
    }

    /// The unit to talk to: the only one, or the one of the HA pair whose failover status is ACTIVE
    /// (the last one found active is asked first, so a steady pair costs one extra GET per push).
    /// Writing to a standby would be overwritten by the next config-sync, or would sync back over the
    /// active unit's configuration.
    async fn unit(&self) -> Result<Arc<Session>, SinkError> {
        let n = self.units.len();
        if n == 1 {
            return Ok(self.units[0].clone());
        }
        let last = self.active.load(Ordering::Relaxed);
        let mut seen = Vec::new();
        // A unit that reported a status (standby, offline) makes this a passing state; a refusal
        // that only configuration can fix (credentials, role) is returned when no unit got that far.
        let mut answered = false;
        let mut hard_error = None;
        for k in 0..n {
            let i = (last + k) % n;
            let unit = &self.units[i];
            let quick = RetryPolicy { retries: 1, backoff: self.policy.backoff };
            match unit.failover_status(quick).await {
                Ok(status) if status == "ACTIVE" => {
                    if i != last {
                        tracing::warn!(
                            pool = %self.label, active = %unit.base_url(), was = %self.units[last].base_url(),
                            "BIG-IP failover: writing to the unit that is ACTIVE now"
                        );
                        self.active.store(i, Ordering::Relaxed);
                    }
                    return Ok(unit.clone());
                }
                Ok(status) => {
                    answered = true;
                    seen.push(format!("{} is {status}", unit.base_url()));
                }
                Err(e) => {
                    seen.push(format!("{}: {}", unit.base_url(), e.summary()));
                    if !e.retryable() && hard_error.is_none() {
                        hard_error = Some(e.into_sink_error(self.target(unit)));
                    }
                }
            }
        }
        if let Some(e) = hard_error.filter(|_| !answered) {
            return Err(e);
        }
        Err(SinkError::Temporary {
            target: format!("f5 pool {} (HA units)", self.pool),
            detail: format!("no unit is ACTIVE: {}", seen.join("; ")),
        })
    }

    /// Turn a failed call about the pool into an error that says what to check.
    fn pool_error(&self, s: &Session, e: CallError) -> SinkError {
        let hint = match e.status() {
            Some(404) => format!(
                "; check `pool` ({}, with its partition) and that user {:?} may see that partition",
                self.pool,
                s.username()
            ),
            _ => String::new(),
        };
        match e.into_sink_error(self.target(s)) {
            SinkError::Rejected { target, detail } => SinkError::Rejected { target, detail: detail + &hint },
            other => other,
        }
    }

    async fn read_members(&self, s: &Session) -> Result<Vec<wire::Member>, SinkError> {
        let path = format!("{}/members", self.pool_path());
        let coll: wire::MemberCollection =
            s.call(&Request::get(&path), self.policy).await.map_err(|e| self.pool_error(s, e))?;
        Ok(coll.items)
    }

    /// Read the pool: a warning the first time its balancing mode is one where ratios do nothing,
    /// and, with priority groups, an error while its priority group activation is off.
    async fn check_mode(&self, s: &Session) -> Result<Option<String>, SinkError> {
        let pool: wire::Pool =
            s.call(&Request::get(&self.pool_path()), self.policy).await.map_err(|e| self.pool_error(s, e))?;
        if self.groups && pool.min_active_members.unwrap_or(0) == 0 {
            // Without activation every member takes traffic whatever its group: the inactive tier
            // would get its ratio's share. Refused rather than pushed.
            return Err(SinkError::Rejected {
                target: self.target(s),
                detail: format!(
                    "priority group activation is off (minActiveMembers 0), so members of inactive tiers \
                     would still get traffic; turn it on: tmsh modify ltm pool {} min-active-members 1",
                    self.pool
                ),
            });
        }
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

    /// PATCH one member's ratio (and group), directly or (with `coordination`) queued into a
    /// transaction.
    async fn patch(&self, s: &Session, c: &Change, coordination: Option<u64>) -> Result<(), SinkError> {
        let path = self.member_path(c);
        let body = wire::MemberPatch { ratio: (c.from != c.to).then_some(c.to), priority_group: c.group };
        let mut req = Request::with_body(Method::PATCH, &path, json!(body));
        req.coordination = coordination;
        // Sending the same PATCH twice after a retry is harmless: both set the same value.
        s.call::<Value>(&req, self.policy)
            .await
            .map(|_| ())
            .map_err(|e| e.into_sink_error(self.member_target(s, c)))
    }

    /// Every change PATCHed directly, `concurrency` at a time; stops at the first failure.
    async fn patch_each(&self, s: &Session, changes: &[Change]) -> Result<(), SinkError> {
        // Futures built up front: a closure inside the stream trips rustc's Send inference (#64552).
        let patches: Vec<_> = changes.iter().map(|c| self.patch(s, c, None)).collect();
        stream::iter(patches).buffer_unordered(self.concurrency).try_collect::<Vec<()>>().await.map(|_| ())
    }

    /// Queue every change in one transaction and commit it: all apply, or none. The PATCHes are
    /// queued `concurrency` at a time (BIG-IP only records them; the commit runs them in order), so a
    /// slow management plane costs a few round trips, not one per member.
    async fn patch_in_transaction(&self, s: &Arc<Session>, changes: &[Change]) -> Result<(), SinkError> {
        let tx: wire::Transaction = s
            .call(&Request::with_body(Method::POST, "/mgmt/tm/transaction", json!({})), self.policy)
            .await
            .map_err(|e| e.into_sink_error(format!("{} (starting a transaction)", self.target(s))))?;
        let mut open = OpenTransaction { session: s.clone(), id: tx.trans_id, armed: true };
        let patches: Vec<_> = changes.iter().map(|c| self.patch(s, c, Some(open.id))).collect();
        let queued = stream::iter(patches).buffer_unordered(self.concurrency).try_collect::<Vec<()>>().await;
        if let Err(e) = queued {
            open.abandon().await;
            return Err(e);
        }
        // From here the transaction is BIG-IP's to run; deleting it could race the commit.
        open.armed = false;
        self.commit(s, open.id).await
    }

    /// Commit transaction `id`. The commit itself is never blindly re-sent: after a failure that may
    /// or may not have reached BIG-IP, the transaction's state says whether it ran.
    async fn commit(&self, s: &Session, id: u64) -> Result<(), SinkError> {
        let path = format!("/mgmt/tm/transaction/{id}");
        let target = format!("{} (transaction {id})", self.target(s));
        let mut attempt = 0;
        loop {
            let req = Request::with_body(Method::PATCH, &path, json!(wire::Commit { state: "VALIDATING" }));
            let err = match s.call::<wire::Transaction>(&req, RetryPolicy::none()).await {
                Ok(t) => return self.await_outcome(s, id, t, &target).await,
                Err(e) if e.retryable() => e,
                // A re-sent commit may be refused because the earlier one landed in the meantime.
                Err(e) if attempt > 0 => {
                    return match s.call::<wire::Transaction>(&Request::get(&path), self.policy).await {
                        Ok(t) if t.state == "COMPLETED" => Ok(()),
                        _ => Err(e.into_sink_error(target)),
                    }
                }
                // BIG-IP's message names the command (pool and member) that failed; nothing applied.
                Err(e) => return Err(e.into_sink_error(target)),
            };
            tracing::debug!(pool = %self.label, transaction = id, error = ?err, "commit did not answer cleanly; checking its state");
            match s.call::<wire::Transaction>(&Request::get(&path), self.policy).await {
                Ok(t) if t.state == "STARTED" && attempt < self.policy.retries => {
                    // The same growing, jittered wait as every other retry (`retry_backoff`).
                    tokio::time::sleep(self.policy.delay(attempt)).await;
                    attempt += 1;
                }
                Ok(t) if t.state != "STARTED" => return self.await_outcome(s, id, t, &target).await,
                _ => return Err(err.into_sink_error(target)),
            }
        }
    }

    /// Follow a submitted transaction to COMPLETED or FAILED (BIG-IP may report VALIDATING while it
    /// works).
    async fn await_outcome(
        &self,
        s: &Session,
        id: u64,
        mut t: wire::Transaction,
        target: &str,
    ) -> Result<(), SinkError> {
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
                    t = s
                        .call(&Request::get(&path), self.policy)
                        .await
                        .map_err(|e| e.into_sink_error(target.to_string()))?;
                }
            }
        }
    }

    /// One push: see [`RatioSink::apply`].
    async fn push(&self, desired: &Ratios) -> Result<Applied, SinkError> {
        if self.mode == F5Mode::Sideband {
            // Nothing is written: the BIG-IP fetches the ratios from the controller's /v1/ratios.
            return Ok(Applied { changed: 0, unchanged: desired.len(), warnings: Vec::new() });
        }
        let s = self.unit().await?;
        let mut warnings = Vec::new();
        if let Some(w) = self.check_mode(&s).await? {
            warnings.push(w);
        }
        let members = self.read_members(&s).await?;
        let plan = plan::plan(self.pool.as_str(), &members, desired, self.max_ratio, self.groups);
        // Membership mismatches are in every push's warnings; the controller logs them when they appear.
        warnings.extend(plan.warnings());
        match plan.changes.len() {
            0 => {}
            1 => self.patch(&s, &plan.changes[0], None).await?,
            _ if self.transactions => self.patch_in_transaction(&s, &plan.changes).await?,
            _ => self.patch_each(&s, &plan.changes).await?,
        }
        for c in &plan.changes {
            tracing::debug!(pool = %self.label, member = %c.id, from = c.from, to = c.to, group = ?c.group, "ratio set");
        }
        Ok(Applied { changed: plan.changes.len(), unchanged: plan.unchanged, warnings })
    }
}

/// A transaction started and not yet committed. If the push is abandoned (an error, or the
/// controller's `push_timeout` dropping the push), the transaction is deleted rather than left for
/// BIG-IP to expire: open transactions hold memory on the management plane and show up to admins.
struct OpenTransaction {
    session: Arc<Session>,
    id: u64,
    armed: bool,
}

impl OpenTransaction {
    async fn abandon(mut self) {
        self.armed = false;
        delete_transaction(&self.session, self.id).await;
    }
}

impl Drop for OpenTransaction {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Dropped mid-push (cancelled): delete from a task of its own, the push's future is gone.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (session, id) = (self.session.clone(), self.id);
            rt.spawn(async move { delete_transaction(&session, id).await });
        }
    }
}

/// Best effort: a transaction that cannot be deleted expires on BIG-IP by itself.
async fn delete_transaction(s: &Session, id: u64) {
    let path = format!("/mgmt/tm/transaction/{id}");
    let req = Request { method: Method::DELETE, path: &path, body: None, coordination: None };
    match s.call::<Value>(&req, RetryPolicy { retries: 1, backoff: Duration::from_millis(200) }).await {
        Ok(_) => tracing::debug!(bigip = %s.base_url(), transaction = id, "deleted abandoned transaction"),
        Err(e) => {
            tracing::warn!(bigip = %s.base_url(), transaction = id, error = ?e, "could not delete abandoned transaction; BIG-IP expires it")
        }
    }
}

#[async_trait]
impl RatioSink for F5Sink {
    fn kind(&self) -> &'static str {
        match self.mode {
            F5Mode::Push => "f5",
            F5Mode::Sideband => "f5-sideband",
        }
    }

    fn reconciles(&self) -> bool {
        true
    }

    async fn members(&self) -> Result<Option<Vec<MemberId>>, SinkError> {
        let s = self.unit().await?;
        let mut ids: Vec<MemberId> = self.read_members(&s).await?.iter().map(plan::member_id).collect();
        ids.sort();
        ids.dedup();
        Ok(Some(ids))
    }

    async fn current(&self) -> Result<Option<Ratios>, SinkError> {
        let s = self.unit().await?;
        // With priority groups, a member of the standby group is an inactive tier: ratio 0, as pushed.
        let ratio = |m: &wire::Member| {
            if self.groups && m.priority_group == plan::STANDBY_GROUP {
                0
            } else {
                m.ratio
            }
        };
        Ok(Some(self.read_members(&s).await?.iter().map(|m| (plan::member_id(m), ratio(m))).collect()))
    }

    fn instances(&self) -> Vec<crate::InstanceStatus> {
        if self.units.len() < 2 {
            return Vec::new();
        }
        let (active, ok) = (self.active.load(Ordering::Relaxed), self.last_push_ok.load(Ordering::Relaxed));
        let units = self.units.iter().enumerate();
        units
            .map(|(i, u)| crate::InstanceStatus { address: u.base_url().to_string(), ok: ok && i == active })
            .collect()
    }

    async fn apply(&self, desired: &Ratios) -> Result<Applied, SinkError> {
        let result = self.push(desired).await;
        self.last_push_ok.store(result.is_ok(), Ordering::Relaxed);
        result
    }

    async fn shutdown(&self) {
        if !self.released.swap(true, Ordering::SeqCst) {
            for s in &self.units {
                s.clone().release().await;
            }
        }
    }
}

impl Drop for F5Sink {
    /// A sink dropped without `shutdown` still gives up its share of the session, so the last sink's
    /// shutdown deletes the token. The deletion itself needs the runtime; without one the token just
    /// expires on the BIG-IP.
    fn drop(&mut self) {
        if !self.released.swap(true, Ordering::SeqCst) {
            for session in &self.units {
                match tokio::runtime::Handle::try_current() {
                    Ok(rt) => {
                        rt.spawn(session.clone().release());
                    }
                    Err(_) => session.forget_holder(),
                }
            }
        }
    }
}
