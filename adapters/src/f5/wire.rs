//! The JSON shapes this sink reads from and writes to iControl REST. Only the fields we use are
//! declared; BIG-IP sends many more (`kind`, `selfLink`, `generation`, ...) and serde ignores them.

use serde::{Deserialize, Serialize};

/// `POST /mgmt/shared/authn/login` body.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LoginRequest<'a> {
    pub username: &'a str,
    pub password: &'a str,
    pub login_provider_name: &'a str,
}

/// The part of the login answer we need: `{"token": {"token": "...", "timeout": 1200, ...}}`.
#[derive(Deserialize)]
pub struct LoginResponse {
    pub token: TokenItem,
}

/// A token object (`kind: shared:authz:tokens:authtokenitemstate`).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenItem {
    pub token: String,
    /// Seconds from the token's start until it expires. BIG-IP's default is 1200.
    pub timeout: u64,
}

/// `PATCH /mgmt/shared/authz/tokens/TOKEN` body: the new lifetime in seconds, counted from the
/// token's start (F5 caps it at 36000).
#[derive(Serialize)]
pub struct TokenTimeout {
    pub timeout: u64,
}

/// `GET /mgmt/tm/ltm/pool/~P~NAME`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Pool {
    #[serde(default)]
    pub load_balancing_mode: Option<String>,
    /// Priority group activation: 0 is off (every member takes traffic whatever its group).
    #[serde(default)]
    pub min_active_members: Option<u32>,
}

/// `GET .../members` (`kind: tm:ltm:pool:members:memberscollectionstate`). An empty pool may come
/// without `items` at all.
#[derive(Deserialize)]
pub struct MemberCollection {
    #[serde(default)]
    pub items: Vec<Member>,
}

/// One pool member (`kind: tm:ltm:pool:members:membersstate`).
#[derive(Deserialize, Clone, Debug)]
pub struct Member {
    pub name: String,
    #[serde(default = "common")]
    pub partition: String,
    pub address: String,
    #[serde(default = "one")]
    pub ratio: u32,
    #[serde(default, rename = "priorityGroup")]
    pub priority_group: u32,
}

fn common() -> String {
    "Common".to_string()
}

fn one() -> u32 {
    1
}

/// The only properties this sink ever changes: the ratio, and the priority group when the pool has
/// priority tiers. Sent with PATCH, never PUT: a PUT resets every property it does not carry to its
/// default.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MemberPatch {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority_group: Option<u32>,
}

/// `POST /mgmt/tm/transaction` answer and `GET /mgmt/tm/transaction/ID` (`kind: tm:transactionstate`).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Transaction {
    pub trans_id: u64,
    pub state: String,
    #[serde(default)]
    pub failure_reason: Option<String>,
}

/// `PATCH /mgmt/tm/transaction/ID` body that submits the queued commands.
#[derive(Serialize)]
pub struct Commit {
    pub state: &'static str,
}

/// BIG-IP's error body. Two families exist: the config layer's
/// `{"code":404,"message":"01020036:3: ...","errorStack":[],"apiError":3}` and the REST framework's
/// `{"code":401,"message":"...","referer":"...","restOperationId":N,"kind":":resterrorresponse"}`.
/// Both carry `code` and `message`.
#[derive(Deserialize)]
pub struct ErrorBody {
    #[serde(default)]
    pub code: Option<u16>,
    #[serde(default)]
    pub message: Option<String>,
}

/// The unit's failover status from `GET /mgmt/tm/cm/failover-status`, shaped like every tmstats
/// answer: `{"entries": {"https://localhost/mgmt/tm/cm/failover-status/0": {"nestedStats": {"entries":
/// {"status": {"description": "ACTIVE"}, "color": ..., "summary": ...}}}}}`.
pub fn failover_status(v: &serde_json::Value) -> Option<String> {
    v.get("entries")?.as_object()?.values().find_map(|e| {
        let status = e.get("nestedStats")?.get("entries")?.get("status")?.get("description")?;
        status.as_str().map(|s| s.trim().to_ascii_uppercase())
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn failover_status_is_read_from_the_nested_stats() {
        let v = serde_json::json!({
            "kind": "tm:cm:failover-status:failover-statusstats",
            "entries": {"https://localhost/mgmt/tm/cm/failover-status/0": {"nestedStats": {"entries": {
                "color": {"description": "green"},
                "status": {"description": "ACTIVE"},
                "summary": {"description": "1/1 active"}
            }}}}
        });
        assert_eq!(super::failover_status(&v).as_deref(), Some("ACTIVE"));
        assert_eq!(super::failover_status(&serde_json::json!({"entries": {}})), None);
    }
}
