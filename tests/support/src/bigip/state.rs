//! The double's model of a BIG-IP: users, tokens, pools, members, transactions, and the rules that
//! decide every answer. No HTTP here: `http.rs` turns requests into calls on [`State`].
//!
//! Each rule below is a fact about real BIG-IP (source in the comment) or, where the public record
//! gives the behaviour but not the exact words, the behaviour with our own message text.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use super::{DoubleConfig, Fault, FaultKind, MemberSpec, PoolSpec, Recorded, Role, UserSpec};

/// An answer before it becomes HTTP.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub body: ReplyBody,
}

#[derive(Debug, Clone)]
pub enum ReplyBody {
    Json(Value),
    Html(String),
    Empty,
}

impl Reply {
    pub fn ok(v: Value) -> Reply {
        Reply { status: 200, body: ReplyBody::Json(v) }
    }

    /// Errors from the configuration layer (mcpd/icrd): `{"code","message","errorStack","apiError"}`,
    /// as in `{"code":404,"message":"01020036:3: The requested Pool (/Common/x) was not found.",
    /// "errorStack":[],"apiError":3}` quoted by several public BIG-IP clients' tests.
    pub fn tm_error(status: u16, message: impl Into<String>, api_error: u64) -> Reply {
        Reply {
            status,
            body: ReplyBody::Json(json!({
                "code": status, "message": message.into(), "errorStack": [], "apiError": api_error
            })),
        }
    }

    /// Errors from the REST framework (restjavad: auth, unknown URIs), shaped like
    /// `{"code":401,"message":"...","referer":"10.145.74.44","restOperationId":7945916,
    /// "kind":":resterrorresponse"}`.
    pub fn rest_error(status: u16, message: impl Into<String>, op: u64) -> Reply {
        Reply {
            status,
            body: ReplyBody::Json(json!({
                "code": status, "message": message.into(), "referer": "127.0.0.1",
                "restOperationId": op, "kind": ":resterrorresponse"
            })),
        }
    }

    pub fn html(status: u16, text: &str) -> Reply {
        Reply {
            status,
            body: ReplyBody::Html(format!(
                "<html><head><title>BIG-IP</title></head><body>{text}</body></html>"
            )),
        }
    }
}

/// A live login token.
#[derive(Debug, Clone)]
pub struct Token {
    pub value: String,
    pub user: String,
    pub provider: String,
    pub started: Instant,
    pub start_micros: u64,
    pub timeout_s: u64,
    pub generation: u64,
    pub last_update_micros: u64,
}

/// Pool member properties that PATCH/PUT may change, with BIG-IP's defaults (tmsh `ltm pool` manual
/// and the iControl REST API reference: ratio 1, priority group 0, connection limit 0, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct MemberProps {
    pub ratio: u64,
    pub priority_group: u64,
    pub connection_limit: u64,
    pub dynamic_ratio: u64,
    pub session: String,
    pub state: String,
    pub description: Option<String>,
    pub monitor: String,
    pub rate_limit: String,
    pub logging: String,
    pub inherit_profile: String,
}

impl Default for MemberProps {
    fn default() -> Self {
        MemberProps {
            ratio: 1,
            priority_group: 0,
            connection_limit: 0,
            dynamic_ratio: 1,
            session: "monitor-enabled".into(),
            state: "up".into(),
            description: None,
            monitor: "default".into(),
            rate_limit: "disabled".into(),
            logging: "disabled".into(),
            inherit_profile: "enabled".into(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Member {
    pub partition: String,
    pub name: String,
    pub address: String,
    pub props: MemberProps,
    pub generation: u64,
}

#[derive(Debug, Clone)]
pub struct Pool {
    pub partition: String,
    pub full_path: String,
    pub name: String,
    pub lb_mode: String,
    pub members: Vec<Member>,
    pub generation: u64,
    pub min_active_members: u64,
}

/// A PATCH or PUT of one pool member, as received.
pub struct MemberWrite<'a> {
    pub user: &'a str,
    pub method: &'a str,
    pub pool: &'a str,
    pub member: &'a (String, String),
    pub body: &'a Value,
    pub coordination: Option<u64>,
    pub uri: &'a str,
}

/// One queued request of a transaction.
#[derive(Debug, Clone)]
pub struct Command {
    pub id: u64,
    pub method: String,
    pub uri: String,
    pub pool: String,
    pub member: (String, String),
    pub body: Value,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnState {
    Started,
    Completed,
    Failed,
}

impl TxnState {
    fn as_str(self) -> &'static str {
        match self {
            TxnState::Started => "STARTED",
            TxnState::Completed => "COMPLETED",
            TxnState::Failed => "FAILED",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Txn {
    pub id: u64,
    pub user: String,
    pub state: TxnState,
    pub commands: Vec<Command>,
    pub touched: Instant,
    pub failure_reason: String,
    pub validate_only: bool,
}

/// Everything the double knows.
pub struct State {
    pub cfg: DoubleConfig,
    pub users: BTreeMap<String, UserSpec>,
    pub tokens: BTreeMap<String, Token>,
    pub pools: BTreeMap<String, Pool>,
    pub txns: BTreeMap<u64, Txn>,
    pub faults: Vec<Fault>,
    pub log: Vec<Recorded>,
    pub generation: u64,
    pub rest_op: u64,
    pub offset: Duration,
    /// This unit's failover status (`ACTIVE`, `STANDBY`, ...), as `/mgmt/tm/cm/failover-status` says.
    pub failover: String,
    /// Requests being processed now, and the most seen at once.
    pub in_flight: usize,
    pub max_in_flight: usize,
    last_trans_id: u64,
    rng: StdRng,
}

/// Modifiable member properties, and read-only ones that a client may echo back unchanged (clients
/// often PUT back what they GET).
const MODIFIABLE: [&str; 11] = [
    "ratio",
    "priorityGroup",
    "connectionLimit",
    "dynamicRatio",
    "session",
    "state",
    "description",
    "monitor",
    "rateLimit",
    "logging",
    "inheritProfile",
];
const ECHOABLE: [&str; 8] =
    ["kind", "name", "partition", "fullPath", "generation", "selfLink", "address", "ephemeral"];

impl State {
    pub fn new(cfg: DoubleConfig) -> State {
        let rng = StdRng::seed_from_u64(cfg.seed);
        let mut users = BTreeMap::new();
        // Every BIG-IP has the built-in `admin` account.
        users.insert("admin".to_string(), UserSpec::new("admin", "admin", Role::Admin));
        State {
            cfg,
            users,
            tokens: BTreeMap::new(),
            pools: BTreeMap::new(),
            txns: BTreeMap::new(),
            faults: Vec::new(),
            log: Vec::new(),
            generation: 1,
            rest_op: 1000,
            offset: Duration::ZERO,
            failover: "ACTIVE".into(),
            in_flight: 0,
            max_in_flight: 0,
            last_trans_id: 0,
            rng,
        }
    }

    /// `GET /mgmt/tm/cm/failover-status`, shaped like BIG-IP's tmstats answers.
    pub fn failover_status(&self) -> Reply {
        let color = if self.failover == "ACTIVE" { "green" } else { "gray" };
        let link = "https://localhost/mgmt/tm/cm/failover-status/0";
        Reply::ok(serde_json::json!({
            "kind": "tm:cm:failover-status:failover-statusstats",
            "selfLink": self.self_link("/mgmt/tm/cm/failover-status"),
            "entries": { link: { "nestedStats": { "entries": {
                "color": {"description": color},
                "status": {"description": self.failover},
                "summary": {"description": format!("1/1 {}", self.failover.to_lowercase())},
                "https://localhost/mgmt/tm/cm/failoverStatus/0/details": {"nestedStats": {"entries": {}}}
            }}}}
        }))
    }

    // ---------------------------------------------------------------- clock and identities

    pub fn now(&self) -> Instant {
        Instant::now() + self.offset
    }

    pub fn wall_micros(&self) -> u64 {
        let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default() + self.offset;
        d.as_micros() as u64
    }

    pub fn next_op(&mut self) -> u64 {
        self.rest_op += 1;
        self.rest_op
    }

    fn bump_generation(&mut self) -> u64 {
        self.generation += 1;
        self.generation
    }

    fn self_link(&self, path: &str) -> String {
        format!("https://localhost{path}?ver={}", self.cfg.version)
    }

    /// Drop expired tokens and transactions, as BIG-IP's housekeeping does.
    pub fn expire(&mut self) {
        let now = self.now();
        self.tokens.retain(|_, t| t.started + Duration::from_secs(t.timeout_s) > now);
        let ttl = Duration::from_secs(self.cfg.transaction_timeout_s);
        self.txns.retain(|_, t| t.state != TxnState::Started || t.touched + ttl > now);
    }

    /// The first injected fault matching this request, consumed.
    pub fn take_fault(&mut self, method: &str, path: &str) -> Option<FaultKind> {
        let i = self.faults.iter().position(|f| f.matches(method, path))?;
        let kind = self.faults[i].kind.clone();
        self.faults[i].times -= 1;
        if self.faults[i].times == 0 {
            self.faults.remove(i);
        }
        Some(kind)
    }

    // ---------------------------------------------------------------- seeding (test API)

    pub fn add_pool(&mut self, spec: PoolSpec) {
        let (partition, name) = split_full_path(&spec.full_path)
            .unwrap_or_else(|| panic!("pool {:?} must be /Partition/name", spec.full_path));
        let generation = self.bump_generation();
        let mut pool = Pool {
            partition,
            name,
            full_path: spec.full_path.clone(),
            lb_mode: spec.lb_mode,
            members: Vec::new(),
            generation,
            min_active_members: spec.min_active_members,
        };
        for m in spec.members {
            pool.members.push(self.make_member(&spec.full_path, m, &pool.members));
        }
        self.pools.insert(spec.full_path, pool);
    }

    pub fn add_member(&mut self, pool: &str, spec: MemberSpec) {
        let existing =
            self.pools.get(pool).unwrap_or_else(|| panic!("no pool {pool} in the double")).members.clone();
        let m = self.make_member(pool, spec, &existing);
        if let Some(p) = self.pools.get_mut(pool) {
            p.members.push(m);
        }
    }

    fn make_member(&mut self, pool: &str, spec: MemberSpec, existing: &[Member]) -> Member {
        check_member_name(&spec.name, &spec.address);
        assert!(
            !existing.iter().any(|m| m.name == spec.name && m.partition == spec.partition),
            "member /{}/{} is already in pool {pool}",
            spec.partition,
            spec.name
        );
        assert!((1..=65_535).contains(&spec.ratio), "ratio {} outside 1..=65535", spec.ratio);
        let generation = self.bump_generation();
        Member {
            partition: spec.partition,
            name: spec.name,
            address: spec.address,
            props: MemberProps { ratio: spec.ratio, ..MemberProps::default() },
            generation,
        }
    }

    pub fn pool_mut(&mut self, pool: &str) -> &mut Pool {
        self.pools.get_mut(pool).unwrap_or_else(|| panic!("no pool {pool} in the double"))
    }

    // ---------------------------------------------------------------- authentication

    /// Who sent the request: `X-F5-Auth-Token` first, then basic auth.
    pub fn authenticate(
        &mut self,
        token: Option<&str>,
        basic: Option<(String, String)>,
        path: &str,
    ) -> Result<String, Reply> {
        self.expire();
        let op = self.next_op();
        if let Some(t) = token {
            // An unknown, deleted or expired token is answered like this (the message is the one
            // client libraries match on to decide to log in again).
            return match self.tokens.get(t) {
                Some(tok) => Ok(tok.user.clone()),
                None => Err(Reply::rest_error(401, "X-F5-Auth-Token does not exist.", op)),
            };
        }
        if let Some((user, password)) = basic {
            // Basic auth is for local users only (F5: token auth exists so remote users can use REST).
            return match self.users.get(&user) {
                Some(u) if u.password == password && !u.remote => Ok(user),
                _ => Err(Reply::rest_error(401, "Authentication failed.", op)),
            };
        }
        Err(Reply::rest_error(
            401,
            format!(
                "Authorization failed: no user authentication header or token detected. Uri:http://localhost:8100{path} \
                 Referrer:127.0.0.1 Sender:127.0.0.1"
            ),
            op,
        ))
    }

    /// `POST /mgmt/shared/authn/login`.
    pub fn login(&mut self, body: &Value) -> Reply {
        self.expire();
        let op = self.next_op();
        let field = |k: &str| body.get(k).and_then(Value::as_str).map(str::to_string);
        let (Some(username), Some(password)) = (field("username"), field("password")) else {
            return Reply::rest_error(400, "username and password are required", op);
        };
        let provider = field("loginProviderName").unwrap_or_else(|| "tmos".into());
        let Some(user) = self.users.get(&username).cloned() else {
            return Reply::rest_error(401, "Authentication failed.", op);
        };
        if user.password != password {
            return Reply::rest_error(401, "Authentication failed.", op);
        }
        if provider != "tmos" && Some(&provider) != user.login_provider.as_ref() {
            return Reply::rest_error(400, format!("loginProviderName {provider:?} is not configured"), op);
        }
        // At most 100 live tokens per user, the built-in admin excepted (DevCentral, "iControl REST
        // Authentication Token Management"); the refusal names the user by its UUID.
        let live = self.tokens.values().filter(|t| t.user == username).count();
        if username != "admin" && live >= self.cfg.max_tokens_per_user {
            return Reply::rest_error(
                400,
                format!("user {} has reached maximum active login tokens", user_uuid(&username)),
                op,
            );
        }
        let value: String = (0..26)
            .map(|_| {
                let c = self.rng.gen_range(0..36u8);
                char::from(if c < 26 { b'A' + c } else { b'2' + (c - 26) % 8 })
            })
            .collect();
        let now_micros = self.wall_micros();
        let token = Token {
            value: value.clone(),
            user: username.clone(),
            provider: provider.clone(),
            started: self.now(),
            start_micros: now_micros,
            timeout_s: self.cfg.token_lifetime_s,
            generation: 1,
            last_update_micros: now_micros,
        };
        let item = self.token_json(&token);
        self.tokens.insert(value, token);
        Reply::ok(json!({
            "username": username,
            "loginReference": {"link": "https://localhost/mgmt/cm/system/authn/providers/tmos/1f44a60e-11a7-3c51-a49f-82983026b41b/login"},
            "loginProviderName": provider,
            "token": item,
            "generation": 0,
            "lastUpdateMicros": 0
        }))
    }

    /// Shape of a token object (`kind: shared:authz:tokens:authtokenitemstate`), as printed in F5's
    /// automation labs and the DevCentral token article.
    pub fn token_json(&self, t: &Token) -> Value {
        json!({
            "token": t.value,
            "name": t.value,
            "userName": t.user,
            "authProviderName": t.provider,
            "user": {"link": format!("https://localhost/mgmt/shared/authz/users/{}", t.user)},
            "groupReferences": [],
            "timeout": t.timeout_s,
            "startTime": iso_time(t.start_micros),
            "address": "127.0.0.1",
            "partition": "[All]",
            "generation": t.generation,
            "lastUpdateMicros": t.last_update_micros,
            "expirationMicros": t.start_micros + t.timeout_s * 1_000_000,
            "kind": "shared:authz:tokens:authtokenitemstate",
            "selfLink": format!("https://localhost/mgmt/shared/authz/tokens/{}", t.value),
        })
    }

    /// GET/PATCH/DELETE `/mgmt/shared/authz/tokens/TOKEN` by `caller`. Only the owner may touch a
    /// token; `timeout` counts from the token's start and may not exceed the absolute maximum.
    pub fn token_op(&mut self, caller: &str, method: &str, value: &str, body: Option<&Value>) -> Reply {
        let op = self.next_op();
        let Some(t) = self.tokens.get(value).cloned() else {
            return Reply::rest_error(404, format!("Object not found - {value}"), op);
        };
        if t.user != caller && caller != "admin" {
            return Reply::rest_error(400, "Authorization failed", op);
        }
        match method {
            "GET" => Reply::ok(self.token_json(&t)),
            "DELETE" => {
                self.tokens.remove(value);
                Reply::ok(self.token_json(&t))
            }
            "PATCH" => {
                let Some(timeout) = body.and_then(|b| b.get("timeout")).and_then(Value::as_u64) else {
                    return Reply::rest_error(
                        400,
                        "only an integer \"timeout\" can be changed on a token",
                        op,
                    );
                };
                if timeout > self.cfg.max_token_timeout_s {
                    return Reply::rest_error(
                        400,
                        format!(
                            "Auth-token absolute timeout ({} seconds) exceeded",
                            self.cfg.max_token_timeout_s
                        ),
                        op,
                    );
                }
                let now_micros = self.wall_micros();
                let Some(t) = self.tokens.get_mut(value) else {
                    return Reply::rest_error(404, format!("Object not found - {value}"), op);
                };
                t.timeout_s = timeout;
                t.generation += 1;
                t.last_update_micros = now_micros;
                let t = t.clone();
                Reply::ok(self.token_json(&t))
            }
            _ => Reply::rest_error(405, format!("method {method} is not supported on tokens"), op),
        }
    }

    // ---------------------------------------------------------------- LTM pools and members

    fn pool_not_found(full_path: &str) -> Reply {
        Reply::tm_error(404, format!("01020036:3: The requested Pool ({full_path}) was not found."), 3)
    }

    /// Public record: `01020036:3: The requested Pool Member (/PART/POOL /PART/1.1.1.1 80) was not
    /// found.` (node part and port separated by a space).
    fn member_not_found(pool: &str, partition: &str, name: &str) -> Reply {
        let (node, port) = split_member_name(name).unwrap_or((name.to_string(), "0".to_string()));
        Reply::tm_error(
            404,
            format!(
                "01020036:3: The requested Pool Member ({pool} /{partition}/{node} {port}) was not found."
            ),
            3,
        )
    }

    pub fn pool_json(&self, p: &Pool) -> Value {
        let seg = object_segment(&p.full_path);
        json!({
            "kind": "tm:ltm:pool:poolstate",
            "name": p.name,
            "partition": p.partition,
            "fullPath": p.full_path,
            "generation": p.generation,
            "selfLink": self.self_link(&format!("/mgmt/tm/ltm/pool/{seg}")),
            "allowNat": "yes",
            "allowSnat": "yes",
            "ignorePersistedWeight": "disabled",
            "ipTosToClient": "pass-through",
            "ipTosToServer": "pass-through",
            "linkQosToClient": "pass-through",
            "linkQosToServer": "pass-through",
            "loadBalancingMode": p.lb_mode,
            "minActiveMembers": p.min_active_members,
            "minUpMembers": 0,
            "minUpMembersAction": "failover",
            "minUpMembersChecking": "disabled",
            "queueDepthLimit": 0,
            "queueOnConnectionLimit": "disabled",
            "queueTimeLimit": 0,
            "reselectTries": 0,
            "serviceDownAction": "none",
            "slowRampTime": 10,
            "membersReference": {
                "link": self.self_link(&format!("/mgmt/tm/ltm/pool/{seg}/members")),
                "isSubcollection": true
            }
        })
    }

    pub fn member_json(&self, p: &Pool, m: &Member) -> Value {
        let link = format!(
            "/mgmt/tm/ltm/pool/{}/members/{}",
            object_segment(&p.full_path),
            object_segment(&format!("/{}/{}", m.partition, m.name))
        );
        let mut v = json!({
            "kind": "tm:ltm:pool:members:membersstate",
            "name": m.name,
            "partition": m.partition,
            "fullPath": format!("/{}/{}", m.partition, m.name),
            "generation": m.generation,
            "selfLink": self.self_link(&link),
            "address": m.address,
            "connectionLimit": m.props.connection_limit,
            "dynamicRatio": m.props.dynamic_ratio,
            "ephemeral": "false",
            "fqdn": {"autopopulate": "disabled"},
            "inheritProfile": m.props.inherit_profile,
            "logging": m.props.logging,
            "monitor": m.props.monitor,
            "priorityGroup": m.props.priority_group,
            "rateLimit": m.props.rate_limit,
            "ratio": m.props.ratio,
            "session": m.props.session,
            "state": m.props.state,
        });
        if let (Some(d), Some(obj)) = (&m.props.description, v.as_object_mut()) {
            obj.insert("description".into(), json!(d));
        }
        v
    }

    pub fn pools_get(&self) -> Reply {
        let items: Vec<Value> = self.pools.values().map(|p| self.pool_json(p)).collect();
        Reply::ok(json!({
            "kind": "tm:ltm:pool:poolcollectionstate",
            "selfLink": self.self_link("/mgmt/tm/ltm/pool"),
            "items": items
        }))
    }

    pub fn pool_get(&self, pool: &str) -> Reply {
        match self.pools.get(pool) {
            Some(p) => Reply::ok(self.pool_json(p)),
            None => Self::pool_not_found(pool),
        }
    }

    /// PATCH of a pool: only `loadBalancingMode` and `minActiveMembers` are modelled (others are
    /// refused, not ignored).
    pub fn pool_patch(&mut self, user: &str, pool: &str, body: &Value) -> Reply {
        let op = self.next_op();
        if let Err(r) = self.may_edit(user, pool, op, false) {
            return r;
        }
        let Some(obj) = body.as_object() else {
            return Reply::tm_error(400, "the request body must be a JSON object", 1);
        };
        let generation = self.bump_generation();
        let Some(p) = self.pools.get_mut(pool) else {
            return Self::pool_not_found(pool);
        };
        for (k, v) in obj {
            match (k.as_str(), v.as_str()) {
                ("loadBalancingMode", Some(mode)) => p.lb_mode = mode.to_string(),
                ("minActiveMembers", None) => match v.as_u64().filter(|n| *n <= 65_535) {
                    Some(n) => p.min_active_members = n,
                    None => {
                        return Reply::tm_error(
                            400,
                            format!("01070734:3: Configuration error: invalid minActiveMembers value {v}: must be an integer from 0 to 65535"),
                            3,
                        )
                    }
                },
                _ => {
                    return Reply::tm_error(400, format!("the double does not model pool property {k:?}"), 1)
                }
            }
        }
        p.generation = generation;
        let p = p.clone();
        Reply::ok(self.pool_json(&p))
    }

    pub fn members_get(&self, pool: &str) -> Reply {
        let Some(p) = self.pools.get(pool) else {
            return Self::pool_not_found(pool);
        };
        let items: Vec<Value> = p.members.iter().map(|m| self.member_json(p, m)).collect();
        Reply::ok(json!({
            "kind": "tm:ltm:pool:members:memberscollectionstate",
            "selfLink": self.self_link(&format!("/mgmt/tm/ltm/pool/{}/members", object_segment(pool))),
            "items": items
        }))
    }

    pub fn member_get(&self, pool: &str, member: &(String, String)) -> Reply {
        let Some(p) = self.pools.get(pool) else {
            return Self::pool_not_found(pool);
        };
        match p.members.iter().find(|m| m.partition == member.0 && m.name == member.1) {
            Some(m) => Reply::ok(self.member_json(p, m)),
            None => Self::member_not_found(pool, &member.0, &member.1),
        }
    }

    /// Role check for configuration changes. Operators may only enable/disable members (F5 "User
    /// Roles": the Operator role can enable or disable nodes and pool members, nothing else); Guests
    /// read only. The answer for a denied write is modelled on restjavad's "Authorization failed".
    fn may_edit(&self, user: &str, resource: &str, op: u64, only_session_state: bool) -> Result<(), Reply> {
        let role = self.users.get(user).map(|u| u.role).unwrap_or(Role::Guest);
        let allowed = match role {
            Role::Admin | Role::Manager | Role::Editor | Role::ApplicationEditor => true,
            Role::Operator => only_session_state,
            Role::Guest => false,
        };
        if allowed {
            Ok(())
        } else {
            Err(Reply::rest_error(
                401,
                format!("Authorization failed: user={user} resource={resource} verb=PATCH role={role:?}"),
                op,
            ))
        }
    }

    /// Validate a PATCH/PUT body for a member. `Err` is BIG-IP's 400 answer.
    fn check_member_body(current: &Member, body: &Value, max_ratio: u64) -> Result<(), Reply> {
        let Some(obj) = body.as_object() else {
            return Err(Reply::tm_error(400, "the request body must be a JSON object", 1));
        };
        for (k, v) in obj {
            let k = k.as_str();
            if ECHOABLE.contains(&k) {
                let must_equal = match k {
                    "name" => Some(current.name.clone()),
                    "partition" => Some(current.partition.clone()),
                    "fullPath" => Some(format!("/{}/{}", current.partition, current.name)),
                    "address" => Some(current.address.clone()),
                    _ => None,
                };
                if let Some(expected) = must_equal {
                    if v.as_str() != Some(expected.as_str()) {
                        return Err(Reply::tm_error(
                            400,
                            format!("01070734:3: Configuration error: the {k} of a pool member cannot be modified ({v})"),
                            3,
                        ));
                    }
                }
                continue;
            }
            if !MODIFIABLE.contains(&k) {
                return Err(Reply::tm_error(
                    400,
                    format!("one or more properties must be specified; unknown property \"{k}\" for a pool member"),
                    1,
                ));
            }
            let int_range = match k {
                // BIG-IP: pool member ratio is an integer from 1 to 65535 (default 1).
                // Some versions and front ends (AS3, the Ansible modules) allow only 1..100:
                // `DoubleConfig::max_ratio` models those.
                "ratio" => Some((1u64, max_ratio)),
                "dynamicRatio" => Some((1u64, 65_535u64)),
                "priorityGroup" => Some((0, 65_535)),
                "connectionLimit" => Some((0, u32::MAX as u64)),
                _ => None,
            };
            match int_range {
                Some((lo, hi)) => match v.as_u64() {
                    Some(n) if (lo..=hi).contains(&n) => {}
                    _ => {
                        return Err(Reply::tm_error(
                            400,
                            format!(
                                "01070734:3: Configuration error: invalid {k} value {v} for pool member \
                                 /{}/{}: must be an integer from {lo} to {hi}",
                                current.partition, current.name
                            ),
                            3,
                        ))
                    }
                },
                None => {
                    if !v.is_string() {
                        return Err(Reply::tm_error(
                            400,
                            format!("property \"{k}\" must be a string, not {v}"),
                            1,
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Apply a validated PATCH (change only what the body names) or PUT (everything the body does not
    /// name returns to its default: F5 documents PUT as replacing the object's configuration).
    fn write_member(m: &mut Member, method: &str, body: &Value, generation: u64) {
        if method == "PUT" {
            m.props = MemberProps::default();
        }
        let Some(obj) = body.as_object() else { return };
        let p = &mut m.props;
        for (k, v) in obj {
            let s = || v.as_str().unwrap_or_default().to_string();
            let n = || v.as_u64().unwrap_or_default();
            match k.as_str() {
                "ratio" => p.ratio = n(),
                "priorityGroup" => p.priority_group = n(),
                "connectionLimit" => p.connection_limit = n(),
                "dynamicRatio" => p.dynamic_ratio = n(),
                "session" => p.session = s(),
                "state" => p.state = s(),
                "description" => p.description = Some(s()),
                "monitor" => p.monitor = s(),
                "rateLimit" => p.rate_limit = s(),
                "logging" => p.logging = s(),
                "inheritProfile" => p.inherit_profile = s(),
                _ => {}
            }
        }
        m.generation = generation;
    }

    /// Run one member write against `pools` (the live set or a transaction's scratch copy).
    fn run_member_write(
        pools: &mut BTreeMap<String, Pool>,
        method: &str,
        pool: &str,
        member: &(String, String),
        body: &Value,
        generation: u64,
        max_ratio: u64,
    ) -> Result<(), Reply> {
        let Some(p) = pools.get_mut(pool) else {
            return Err(Self::pool_not_found(pool));
        };
        let Some(m) = p.members.iter_mut().find(|m| m.partition == member.0 && m.name == member.1) else {
            return Err(Self::member_not_found(pool, &member.0, &member.1));
        };
        Self::check_member_body(m, body, max_ratio)?;
        Self::write_member(m, method, body, generation);
        Ok(())
    }

    fn only_session_state(body: &Value) -> bool {
        body.as_object().is_some_and(|o| o.keys().all(|k| k == "session" || k == "state"))
    }

    /// PATCH/PUT of a member, run now or queued into transaction `w.coordination`.
    pub fn member_write(&mut self, w: &MemberWrite<'_>) -> Reply {
        let op = self.next_op();
        if let Err(r) = self.may_edit(w.user, w.pool, op, Self::only_session_state(w.body)) {
            return r;
        }
        if let Some(id) = w.coordination {
            return self.enqueue(id, w);
        }
        let generation = self.bump_generation();
        let max_ratio = self.cfg.max_ratio;
        match Self::run_member_write(
            &mut self.pools,
            w.method,
            w.pool,
            w.member,
            w.body,
            generation,
            max_ratio,
        ) {
            Ok(()) => self.member_get(w.pool, w.member),
            Err(r) => r,
        }
    }

    pub fn member_delete(&mut self, user: &str, pool: &str, member: &(String, String)) -> Reply {
        let op = self.next_op();
        if let Err(r) = self.may_edit(user, pool, op, false) {
            return r;
        }
        let Some(p) = self.pools.get_mut(pool) else {
            return Self::pool_not_found(pool);
        };
        let before = p.members.len();
        p.members.retain(|m| !(m.partition == member.0 && m.name == member.1));
        if p.members.len() == before {
            return Self::member_not_found(pool, &member.0, &member.1);
        }
        Reply { status: 200, body: ReplyBody::Empty }
    }

    // ---------------------------------------------------------------- transactions

    pub fn txn_json(&self, t: &Txn) -> Value {
        json!({
            "transId": t.id,
            "state": t.state.as_str(),
            "timeoutSeconds": self.cfg.transaction_timeout_s,
            "asyncExecution": false,
            "validateOnly": t.validate_only,
            "executionTimeout": 300,
            "executionTime": 0,
            "failureReason": t.failure_reason,
            "kind": "tm:transactionstate",
            "selfLink": self.self_link(&format!("/mgmt/tm/transaction/{}", t.id)),
        })
    }

    fn txn_not_found(&mut self, id: u64) -> Reply {
        let op = self.next_op();
        Reply::rest_error(404, format!("Transaction with id {id} not found (it may have timed out)"), op)
    }

    /// `POST /mgmt/tm/transaction {}`: ids look like BIG-IP's (a microsecond clock).
    pub fn txn_create(&mut self, user: &str) -> Reply {
        self.expire();
        let id = self.wall_micros().max(self.last_trans_id + 1);
        self.last_trans_id = id;
        let t = Txn {
            id,
            user: user.to_string(),
            state: TxnState::Started,
            commands: Vec::new(),
            touched: self.now(),
            failure_reason: String::new(),
            validate_only: false,
        };
        let v = self.txn_json(&t);
        self.txns.insert(id, t);
        Reply::ok(v)
    }

    pub fn txn_list(&mut self) -> Reply {
        self.expire();
        let items: Vec<Value> = self.txns.values().map(|t| self.txn_json(t)).collect();
        Reply::ok(json!({
            "kind": "tm:transactioncollectionstate",
            "selfLink": self.self_link("/mgmt/tm/transaction"),
            "items": items
        }))
    }

    pub fn txn_get(&mut self, id: u64) -> Reply {
        self.expire();
        match self.txns.get(&id) {
            Some(t) => Reply::ok(self.txn_json(t)),
            None => self.txn_not_found(id),
        }
    }

    fn command_json(&self, txn: u64, c: &Command) -> Value {
        json!({
            "method": c.method,
            "uri": c.uri,
            "body": c.body,
            "evalOrder": c.id,
            "commandId": c.id,
            "kind": "tm:transaction:commandsstate",
            "selfLink": self.self_link(&format!("/mgmt/tm/transaction/{txn}/commands/{}", c.id)),
        })
    }

    pub fn txn_commands(&mut self, id: u64) -> Reply {
        self.expire();
        let Some(t) = self.txns.get(&id) else {
            return self.txn_not_found(id);
        };
        let items: Vec<Value> = t.commands.iter().map(|c| self.command_json(id, c)).collect();
        Reply::ok(json!({
            "kind": "tm:transaction:commandscollectionstate",
            "selfLink": self.self_link(&format!("/mgmt/tm/transaction/{id}/commands")),
            "items": items
        }))
    }

    /// A request carrying `X-F5-REST-Coordination-Id` is queued, not run; the answer describes the
    /// queued command (`kind: tm:transaction:commandsstate`, as shown in F5's transaction docs and
    /// client READMEs). Validation happens at commit.
    fn enqueue(&mut self, id: u64, w: &MemberWrite<'_>) -> Reply {
        self.expire();
        let now = self.now();
        let op = self.next_op();
        let Some(t) = self.txns.get_mut(&id) else {
            return self.txn_not_found(id);
        };
        if t.user != w.user {
            return Reply::rest_error(400, format!("Transaction {id} belongs to another user"), op);
        }
        if t.state != TxnState::Started {
            return Reply::rest_error(
                400,
                format!("Transaction {id} is {}; no command can be added", t.state.as_str()),
                op,
            );
        }
        let c = Command {
            id: t.commands.len() as u64 + 1,
            method: w.method.to_string(),
            uri: format!("https://localhost{}", w.uri),
            pool: w.pool.to_string(),
            member: w.member.clone(),
            body: w.body.clone(),
        };
        t.commands.push(c.clone());
        t.touched = now;
        Reply::ok(self.command_json(id, &c))
    }

    /// `PATCH /mgmt/tm/transaction/ID {"state":"VALIDATING"}`: run every queued command or none.
    pub fn txn_commit(&mut self, user: &str, id: u64, body: &Value, with_coordination_header: bool) -> Reply {
        self.expire();
        let op = self.next_op();
        if with_coordination_header {
            // F5's automation labs: a request that still carries the coordination header is taken as
            // a command to add, and changing the transaction itself that way is refused with 400
            // "Transaction XXXXX operation .... is not allowed to be added to transaction."
            return Reply::rest_error(
                400,
                format!("Transaction {id} operation PATCH https://localhost/mgmt/tm/transaction/{id} is not allowed to be added to transaction."),
                op,
            );
        }
        let Some(t) = self.txns.get(&id).cloned() else {
            return self.txn_not_found(id);
        };
        if t.user != user {
            return Reply::rest_error(400, format!("Transaction {id} belongs to another user"), op);
        }
        if body.get("state").and_then(Value::as_str) != Some("VALIDATING") {
            return Reply::rest_error(400, "a transaction is submitted with {\"state\":\"VALIDATING\"}", op);
        }
        if t.state != TxnState::Started {
            return Reply::rest_error(400, format!("Transaction {id} is already {}", t.state.as_str()), op);
        }
        if t.commands.is_empty() {
            // An empty transaction cannot be committed; BIG-IP answers 404 (one public client reports
            // "Missing transaction ID for this call." with code 404 for exactly this mistake).
            return Reply::rest_error(404, "Missing transaction ID for this call.", op);
        }
        let validate_only = body.get("validateOnly").and_then(Value::as_bool).unwrap_or(false);
        let mut scratch = self.pools.clone();
        let generation = self.bump_generation();
        let max_ratio = self.cfg.max_ratio;
        for c in &t.commands {
            if let Err(r) = Self::run_member_write(
                &mut scratch,
                &c.method,
                &c.pool,
                &c.member,
                &c.body,
                generation,
                max_ratio,
            ) {
                // All or nothing: the live pools are untouched.
                let reason = match &r.body {
                    ReplyBody::Json(v) => v.get("message").and_then(Value::as_str).unwrap_or("").to_string(),
                    _ => String::new(),
                };
                if let Some(t) = self.txns.get_mut(&id) {
                    t.state = TxnState::Failed;
                    t.failure_reason = reason.clone();
                }
                return Reply::tm_error(400, format!("transaction failed:{reason}"), 2);
            }
        }
        if !validate_only {
            self.pools = scratch;
        }
        let Some(t) = self.txns.get_mut(&id) else {
            return self.txn_not_found(id);
        };
        t.state = TxnState::Completed;
        t.validate_only = validate_only;
        let t = t.clone();
        Reply::ok(self.txn_json(&t))
    }

    pub fn txn_delete(&mut self, id: u64) -> Reply {
        self.expire();
        match self.txns.remove(&id) {
            Some(_) => Reply { status: 200, body: ReplyBody::Empty },
            None => self.txn_not_found(id),
        }
    }
}

/// `/Common/llm_pool` -> (`Common`, `llm_pool`); `/Common/app.app/pool` -> (`Common`, `pool`).
pub fn split_full_path(full: &str) -> Option<(String, String)> {
    let rest = full.strip_prefix('/')?;
    let parts: Vec<&str> = rest.split('/').collect();
    if parts.len() < 2 || parts.iter().any(|p| p.is_empty()) {
        return None;
    }
    Some((parts[0].to_string(), parts[parts.len() - 1].to_string()))
}

/// How an object's full path appears in a URL: `/` as `~`, `%` as `%25`.
pub fn object_segment(full_path: &str) -> String {
    full_path.replace('/', "~").replace('%', "%25")
}

/// `10.1.1.1%2:80` -> (`10.1.1.1%2`, `80`); `2001:db8::1.80` -> (`2001:db8::1`, `80`).
pub fn split_member_name(name: &str) -> Option<(String, String)> {
    let sep = if name.matches(':').count() > 1 { '.' } else { ':' };
    let (node, port) = name.rsplit_once(sep)?;
    port.parse::<u16>().ok()?;
    Some((node.to_string(), port.to_string()))
}

/// Members seeded into the double must be named the way BIG-IP names them.
fn check_member_name(name: &str, address: &str) {
    let (node, _) = split_member_name(name)
        .unwrap_or_else(|| panic!("member name {name:?} must be node:port (IPv6: address.port)"));
    let ip_part = address.split('%').next().unwrap_or(address);
    assert!(
        ip_part.parse::<std::net::IpAddr>().is_ok(),
        "member address {address:?} must be an IP (with %RD)"
    );
    let node_is_ip = node.split('%').next().unwrap_or(&node).parse::<std::net::IpAddr>().is_ok();
    assert!(
        !node_is_ip || node == address,
        "member {name:?}: an address-named member must carry its address {address:?}"
    );
}

/// A stable UUID-looking id per user (BIG-IP names users by UUID in the token-limit message).
fn user_uuid(user: &str) -> String {
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for b in user.bytes() {
        h ^= b as u128;
        h = h.wrapping_mul(0x0000000001000000000000000000013B);
    }
    let s = format!("{h:032x}");
    format!("{}-{}-{}-{}-{}", &s[0..8], &s[8..12], &s[12..16], &s[16..20], &s[20..32])
}

/// `2026-12-02T13:16:08.123-0000`, the shape of a token's `startTime`.
fn iso_time(micros: u64) -> String {
    let secs = micros / 1_000_000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}-0000",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        micros % 1_000_000 / 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_names_split() {
        assert_eq!(split_member_name("10.1.1.1%2:80"), Some(("10.1.1.1%2".into(), "80".into())));
        assert_eq!(split_member_name("2001:db8::1.80"), Some(("2001:db8::1".into(), "80".into())));
        assert_eq!(split_member_name("node-a:8000"), Some(("node-a".into(), "8000".into())));
        assert_eq!(split_member_name("nope"), None);
    }

    #[test]
    fn times_format() {
        assert_eq!(iso_time(0), "1970-01-01T00:00:00.000-0000");
        assert_eq!(iso_time(1_495_940_163_849_480), "2017-05-28T02:56:03.849-0000");
    }

    #[test]
    fn segments() {
        assert_eq!(object_segment("/Common/10.1.1.1%2:80"), "~Common~10.1.1.1%252:80");
    }
}
