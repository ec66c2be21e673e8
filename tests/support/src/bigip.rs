//! A strict, stateful F5 BIG-IP iControl REST double on a loopback port.
//!
//! BIG-IP cannot run here, so this double stands in for it and enforces the rules a real one does:
//! - authentication: basic (local users only) and token (`/mgmt/shared/authn/login`,
//!   `X-F5-Auth-Token`, lifetime counted from the token's start, extension by PATCHing `timeout` up to
//!   an absolute cap, deletion, at most N live tokens per user except `admin`), user roles (an
//!   Operator may only enable/disable members, a Guest only reads);
//! - LTM pools with partitions, members named `addr:port`, `addr%RD:port`, IPv6 `addr.port` or
//!   `node:port`, addressed with `~Partition~name` and `%` sent as `%25`; malformed escapes are 400;
//! - PATCH changes only the named properties; PUT resets every property it does not carry; ratio is an
//!   integer 1..=65535, anything else is 400 in BIG-IP's error format; unknown pools and members are
//!   404 with BIG-IP's `01020036:3` messages;
//! - transactions: created with POST, filled by requests carrying `X-F5-REST-Coordination-Id` (which
//!   are queued, not run), committed by PATCHing `{"state":"VALIDATING"}` without that header; all or
//!   nothing; an empty transaction cannot be committed (404); idle transactions expire;
//! - JSON shaped like real answers (`kind`, `selfLink` with `?ver=`, `fullPath`, `generation`).
//!
//! Tests seed it (users, pools, members), inject faults (500 "mcpd lost", 503 restarting, hangs),
//! move its clock or expire tokens, and read back its state and the requests it saw.
//!
//! ```no_run
//! # async fn demo() {
//! use llm_lc_testkit::bigip::{BigIpDouble, MemberSpec, PoolSpec, Role, UserSpec};
//! let bigip = BigIpDouble::start().await;
//! bigip.add_user(UserSpec::new("svc", "pw", Role::ApplicationEditor));
//! bigip.add_pool(
//!     PoolSpec::new("/Common/llm_pool")
//!         .mode("ratio-least-connections-member")
//!         .member(MemberSpec::ip("10.1.1.1", 8000))
//!         .member(MemberSpec::ip("2001:db8::1", 8000)),
//! );
//! // ... point a client at bigip.url() ...
//! assert_eq!(bigip.ratio("/Common/llm_pool", "10.1.1.1:8000"), Some(1));
//! # }
//! ```

mod http;
mod state;
mod tls;

pub use tls::TlsFiles;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

use self::http::{lock, Shared};
use self::state::State;

/// Knobs of the double. Defaults are BIG-IP's own.
#[derive(Debug, Clone)]
pub struct DoubleConfig {
    /// Shown in `selfLink`s as `?ver=`.
    pub version: String,
    /// Lifetime of a new token, seconds (BIG-IP: 1200).
    pub token_lifetime_s: u64,
    /// Longest `timeout` a token may be given, counted from its start (BIG-IP: 36000).
    pub max_token_timeout_s: u64,
    /// Live tokens one user may hold; `admin` is exempt (BIG-IP: 100).
    pub max_tokens_per_user: usize,
    /// Idle seconds after which an uncommitted transaction disappears (BIG-IP: 120).
    pub transaction_timeout_s: u64,
    /// Seed for generated token values.
    pub seed: u64,
    /// Time every request takes before it is processed: a management plane under load answers in
    /// 100-300 ms per call, which is what a push's time budget must cope with.
    pub latency: Duration,
    /// Largest pool member ratio accepted. TMOS stores up to 65535; F5's AS3 schema and Ansible
    /// modules give 1..100, and a front end enforcing that fails a transaction whole.
    pub max_ratio: u64,
}

impl Default for DoubleConfig {
    fn default() -> Self {
        DoubleConfig {
            version: "15.1.8".into(),
            token_lifetime_s: 1200,
            max_token_timeout_s: 36_000,
            max_tokens_per_user: 100,
            transaction_timeout_s: 120,
            seed: 1,
            latency: Duration::ZERO,
            max_ratio: 65_535,
        }
    }
}

/// Built-in BIG-IP user roles that matter for pool members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Admin,
    Manager,
    Editor,
    /// The narrowest built-in role that may modify existing pools and pool members.
    ApplicationEditor,
    /// May only enable/disable nodes and pool members.
    Operator,
    /// Read-only.
    Guest,
}

#[derive(Debug, Clone)]
pub struct UserSpec {
    pub name: String,
    pub password: String,
    pub role: Role,
    /// A remote (LDAP/RADIUS/TACACS+) user: token auth only, basic auth refused.
    pub remote: bool,
    /// A login provider other than `tmos` that this user may name.
    pub login_provider: Option<String>,
}

impl UserSpec {
    pub fn new(name: &str, password: &str, role: Role) -> Self {
        UserSpec { name: name.into(), password: password.into(), role, remote: false, login_provider: None }
    }

    /// Make this a remote user (basic auth refused).
    pub fn remote(mut self) -> Self {
        self.remote = true;
        self
    }
}

/// A pool to seed.
#[derive(Debug, Clone)]
pub struct PoolSpec {
    pub full_path: String,
    pub lb_mode: String,
    pub members: Vec<MemberSpec>,
    /// Priority group activation: 0 (BIG-IP's default) is off.
    pub min_active_members: u64,
}

impl PoolSpec {
    /// A pool in BIG-IP's default mode, `round-robin`.
    pub fn new(full_path: &str) -> Self {
        PoolSpec {
            full_path: full_path.into(),
            lb_mode: "round-robin".into(),
            members: Vec::new(),
            min_active_members: 0,
        }
    }

    /// Turn on priority group activation (`min-active-members`).
    pub fn min_active_members(mut self, n: u64) -> Self {
        self.min_active_members = n;
        self
    }

    pub fn mode(mut self, mode: &str) -> Self {
        self.lb_mode = mode.into();
        self
    }

    pub fn member(mut self, m: MemberSpec) -> Self {
        self.members.push(m);
        self
    }
}

/// A pool member to seed, named as BIG-IP would name it.
#[derive(Debug, Clone)]
pub struct MemberSpec {
    pub partition: String,
    pub name: String,
    pub address: String,
    pub ratio: u64,
}

impl MemberSpec {
    /// A member named after its address: `10.1.1.1:80`, `10.1.1.1%2:80`, `2001:db8::1.80`.
    pub fn ip(address: &str, port: u16) -> Self {
        let sep = if address.contains(':') { '.' } else { ':' };
        MemberSpec {
            partition: "Common".into(),
            name: format!("{address}{sep}{port}"),
            address: address.into(),
            ratio: 1,
        }
    }

    /// A member of a named node: name `node:port`, address separate.
    pub fn named(node: &str, address: &str, port: u16) -> Self {
        MemberSpec {
            partition: "Common".into(),
            name: format!("{node}:{port}"),
            address: address.into(),
            ratio: 1,
        }
    }

    pub fn ratio(mut self, r: u64) -> Self {
        self.ratio = r;
        self
    }

    pub fn partition(mut self, p: &str) -> Self {
        self.partition = p.into();
        self
    }
}

/// What an injected fault does to a matching request.
#[derive(Debug, Clone)]
pub enum FaultKind {
    /// 500 `{"code":500,"message":"The connection to mcpd has been lost, try again.",...}`.
    McpdLost,
    /// 503 with an HTML "Configuration Utility restarting..." page.
    Restarting,
    /// Hold the request this long, then answer 503 without doing anything (a client with a shorter
    /// timeout sees a timeout).
    Hang(Duration),
    /// Hold the request this long, then process it normally, even if the client gave up meanwhile
    /// (the work lands after the client stopped waiting: a lost answer, not a lost request).
    Delay(Duration),
    /// Any status with any JSON body.
    Status(u16, Value),
}

/// A fault for the next `times` requests matching `method` and `path_contains` (both optional).
/// Faults strike before authentication, like a management plane that is down.
#[derive(Debug, Clone)]
pub struct Fault {
    pub method: Option<String>,
    pub path_contains: Option<String>,
    pub kind: FaultKind,
    pub times: u32,
}

impl Fault {
    /// Strike the next request, whatever it is.
    pub fn new(kind: FaultKind) -> Self {
        Fault { method: None, path_contains: None, kind, times: 1 }
    }

    /// Only requests with this method whose raw path contains this text.
    pub fn on(mut self, method: &str, path_contains: &str) -> Self {
        self.method = Some(method.into());
        self.path_contains = Some(path_contains.into());
        self
    }

    pub fn times(mut self, n: u32) -> Self {
        self.times = n.max(1);
        self
    }

    fn matches(&self, method: &str, path: &str) -> bool {
        self.method.as_deref().is_none_or(|m| m.eq_ignore_ascii_case(method))
            && self.path_contains.as_deref().is_none_or(|p| path.contains(p))
    }
}

/// How a request authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordedAuth {
    None,
    Basic(String),
    Token,
}

/// One request the double answered.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    /// The raw path as sent (still percent-encoded).
    pub path: String,
    pub query: Option<String>,
    /// `X-F5-REST-Coordination-Id`, when sent.
    pub coordination: Option<String>,
    pub auth: RecordedAuth,
    pub status: u16,
    /// Answered by an injected fault.
    pub fault: bool,
}

impl Recorded {
    /// A PATCH/PUT to one pool member.
    pub fn is_member_write(&self) -> bool {
        matches!(self.method.as_str(), "PATCH" | "PUT") && self.path.contains("/members/")
    }
}

/// A running double. Stops when dropped.
///
/// One double is one BIG-IP unit. An HA pair is two doubles whose failover status the test sets
/// ([`BigIpDouble::set_failover_status`]); config-sync between them is not modelled (the controller
/// must write only to the active unit, which is what tests check).
pub struct BigIpDouble {
    addr: SocketAddr,
    https: bool,
    state: Shared,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for BigIpDouble {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl BigIpDouble {
    /// Start with BIG-IP's defaults on a free loopback port.
    pub async fn start() -> Self {
        Self::start_with(DoubleConfig::default()).await
    }

    pub async fn start_with(cfg: DoubleConfig) -> Self {
        let (listener, addr, state, app) = Self::prepare(cfg).await;
        let server = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("BIG-IP double stopped: {e}");
            }
        });
        BigIpDouble { addr, https: false, state, server }
    }

    /// Serve HTTPS with the certificate in `files` (see [`TlsFiles::generate`]), like a BIG-IP
    /// management port with a certificate from a private CA.
    pub async fn start_tls(cfg: DoubleConfig, files: &TlsFiles) -> Self {
        let (listener, addr, state, app) = Self::prepare(cfg).await;
        let files = files.clone();
        let server = tokio::spawn(async move { tls::serve(listener, app, &files).await });
        BigIpDouble { addr, https: true, state, server }
    }

    async fn prepare(cfg: DoubleConfig) -> (tokio::net::TcpListener, SocketAddr, Shared, axum::Router) {
        let state: Shared = Arc::new(Mutex::new(State::new(cfg)));
        // Binding port 0 lets the OS pick a free port with no race against other tests.
        let listener =
            tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("cannot bind a loopback port");
        let addr = listener.local_addr().expect("bound listener has an address");
        let app = http::router(state.clone());
        (listener, addr, state, app)
    }

    /// `http://127.0.0.1:PORT` (or `https://` after [`BigIpDouble::start_tls`]), the base URL clients
    /// use.
    pub fn url(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn add_user(&self, u: UserSpec) {
        lock(&self.state).users.insert(u.name.clone(), u);
    }

    pub fn add_pool(&self, p: PoolSpec) {
        lock(&self.state).add_pool(p);
    }

    pub fn add_member(&self, pool: &str, m: MemberSpec) {
        lock(&self.state).add_member(pool, m);
    }

    /// Remove a member by name (as if an operator deleted it).
    pub fn remove_member(&self, pool: &str, name: &str) {
        lock(&self.state).pool_mut(pool).members.retain(|m| m.name != name);
    }

    /// Change a ratio behind the client's back (a hand edit, drift).
    pub fn set_ratio(&self, pool: &str, name: &str, ratio: u64) {
        let mut s = lock(&self.state);
        let m = s.pool_mut(pool).members.iter_mut().find(|m| m.name == name);
        m.unwrap_or_else(|| panic!("no member {name} in {pool}")).props.ratio = ratio;
    }

    pub fn set_min_active_members(&self, pool: &str, n: u64) {
        lock(&self.state).pool_mut(pool).min_active_members = n;
    }

    pub fn set_lb_mode(&self, pool: &str, mode: &str) {
        lock(&self.state).pool_mut(pool).lb_mode = mode.into();
    }

    /// Member name -> ratio, for one pool.
    pub fn ratios(&self, pool: &str) -> BTreeMap<String, u64> {
        let s = lock(&self.state);
        let p = s.pools.get(pool).unwrap_or_else(|| panic!("no pool {pool} in the double"));
        p.members.iter().map(|m| (m.name.clone(), m.props.ratio)).collect()
    }

    pub fn ratio(&self, pool: &str, name: &str) -> Option<u64> {
        self.ratios(pool).get(name).copied()
    }

    /// Member name -> priority group, for one pool.
    pub fn priority_groups(&self, pool: &str) -> BTreeMap<String, u64> {
        let s = lock(&self.state);
        let p = s.pools.get(pool).unwrap_or_else(|| panic!("no pool {pool} in the double"));
        p.members.iter().map(|m| (m.name.clone(), m.props.priority_group)).collect()
    }

    /// The members BIG-IP would send new connections to, by priority group activation: with
    /// `min-active-members` 0 every enabled member; otherwise the highest groups, from the top down,
    /// until they hold at least that many enabled members.
    pub fn serving(&self, pool: &str) -> Vec<String> {
        let s = lock(&self.state);
        let p = s.pools.get(pool).unwrap_or_else(|| panic!("no pool {pool} in the double"));
        let enabled: Vec<_> = p
            .members
            .iter()
            .filter(|m| {
                m.props.session != "user-disabled" && !matches!(m.props.state.as_str(), "down" | "user-down")
            })
            .collect();
        if p.min_active_members == 0 {
            return enabled.iter().map(|m| m.name.clone()).collect();
        }
        let mut groups: Vec<u64> = enabled.iter().map(|m| m.props.priority_group).collect();
        groups.sort_unstable_by(|a, b| b.cmp(a));
        groups.dedup();
        let mut out = Vec::new();
        for g in groups {
            out.extend(enabled.iter().filter(|m| m.props.priority_group == g).map(|m| m.name.clone()));
            if out.len() as u64 >= p.min_active_members {
                break;
            }
        }
        out
    }

    /// A member as `GET` would show it.
    pub fn member_json(&self, pool: &str, name: &str) -> Option<Value> {
        let s = lock(&self.state);
        let p = s.pools.get(pool)?;
        let m = p.members.iter().find(|m| m.name == name)?;
        Some(s.member_json(p, m))
    }

    /// Tokens of `user` that are alive now.
    pub fn live_tokens(&self, user: &str) -> usize {
        let mut s = lock(&self.state);
        s.expire();
        s.tokens.values().filter(|t| t.user == user).count()
    }

    /// Timeout (seconds from start) of each live token of `user`.
    pub fn token_timeouts(&self, user: &str) -> Vec<u64> {
        let mut s = lock(&self.state);
        s.expire();
        s.tokens.values().filter(|t| t.user == user).map(|t| t.timeout_s).collect()
    }

    /// Make every token expire now (as after a BIG-IP restart or a long pause).
    pub fn expire_tokens(&self) {
        lock(&self.state).tokens.clear();
    }

    /// Move the double's clock forward: tokens and transactions age by `d`.
    pub fn advance_clock(&self, d: Duration) {
        let mut s = lock(&self.state);
        s.offset += d;
        s.expire();
    }

    /// Transactions that exist now (started and not expired, or finished).
    pub fn transactions(&self) -> Vec<(u64, String, usize)> {
        let mut s = lock(&self.state);
        s.expire();
        s.txns.values().map(|t| (t.id, format!("{:?}", t.state).to_uppercase(), t.commands.len())).collect()
    }

    /// Make this unit `ACTIVE`, `STANDBY`, `OFFLINE`, ... (a failover of an HA pair).
    pub fn set_failover_status(&self, status: &str) {
        lock(&self.state).failover = status.into();
    }

    /// Change the per-request latency while running (a management plane getting slower).
    pub fn set_latency(&self, d: Duration) {
        lock(&self.state).cfg.latency = d;
    }

    /// The most requests that were being processed at the same time.
    pub fn max_in_flight(&self) -> usize {
        lock(&self.state).max_in_flight
    }

    pub fn inject(&self, f: Fault) {
        lock(&self.state).faults.push(f);
    }

    /// Faults not yet consumed.
    pub fn pending_faults(&self) -> usize {
        lock(&self.state).faults.len()
    }

    /// Every request answered so far, in order.
    pub fn requests(&self) -> Vec<Recorded> {
        lock(&self.state).log.clone()
    }

    pub fn clear_requests(&self) {
        lock(&self.state).log.clear();
    }
}
