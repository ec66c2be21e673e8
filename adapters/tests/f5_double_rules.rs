//! The BIG-IP double enforces BIG-IP's rules. These tests speak raw HTTP to it, so that the sink's
//! tests (f5_sink.rs) can trust that a passing push would also pass against a real BIG-IP.

use std::time::Duration;

use llm_lc_testkit::bigip::{
    BigIpDouble, DoubleConfig, Fault, FaultKind, MemberSpec, PoolSpec, Role, UserSpec,
};
use reqwest::{Client, Method, StatusCode};
use serde_json::{json, Value};

const POOL: &str = "/Common/llm_pool";

async fn double() -> BigIpDouble {
    double_with(DoubleConfig::default()).await
}

async fn double_with(cfg: DoubleConfig) -> BigIpDouble {
    let d = BigIpDouble::start_with(cfg).await;
    d.add_user(UserSpec::new("svc", "pw", Role::ApplicationEditor));
    d.add_user(UserSpec::new("op", "pw", Role::Operator));
    d.add_user(UserSpec::new("ldapuser", "pw", Role::ApplicationEditor).remote());
    d.add_pool(
        PoolSpec::new(POOL)
            .mode("ratio-least-connections-member")
            .member(MemberSpec::ip("10.1.1.1", 80).ratio(3))
            .member(MemberSpec::ip("10.1.1.1%2", 80))
            .member(MemberSpec::ip("2001:db8::1", 80))
            .member(MemberSpec::named("vllm-0", "10.2.0.1", 8000).partition("Tenant")),
    );
    d
}

/// Send one request as `svc` with basic auth; returns status and JSON (Null if not JSON).
async fn call(
    d: &BigIpDouble,
    method: Method,
    path: &str,
    body: Option<Value>,
    extra: &[(&str, &str)],
) -> (StatusCode, Value) {
    let mut rb = Client::new().request(method, format!("{}{path}", d.url())).basic_auth("svc", Some("pw"));
    for (k, v) in extra {
        rb = rb.header(*k, *v);
    }
    if let Some(b) = body {
        rb = rb.json(&b);
    }
    let resp = rb.send().await.expect("double answers");
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

async fn login(d: &BigIpDouble, user: &str, pw: &str) -> (StatusCode, Value) {
    let resp = Client::new()
        .post(format!("{}/mgmt/shared/authn/login", d.url()))
        .json(&json!({"username": user, "password": pw, "loginProviderName": "tmos"}))
        .send()
        .await
        .expect("double answers");
    (resp.status(), resp.json().await.unwrap_or(Value::Null))
}

async fn with_token(
    d: &BigIpDouble,
    token: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut rb = Client::new().request(method, format!("{}{path}", d.url())).header("X-F5-Auth-Token", token);
    if let Some(b) = body {
        rb = rb.json(&b);
    }
    let resp = rb.send().await.expect("double answers");
    (resp.status(), resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn answers_are_shaped_like_bigip() {
    let d = double().await;
    let (s, pool) = call(&d, Method::GET, "/mgmt/tm/ltm/pool/~Common~llm_pool", None, &[]).await;
    assert_eq!(s, 200);
    assert_eq!(pool["kind"], "tm:ltm:pool:poolstate");
    assert_eq!(pool["fullPath"], POOL);
    assert_eq!(pool["loadBalancingMode"], "ratio-least-connections-member");
    assert!(pool["selfLink"].as_str().unwrap().ends_with("/mgmt/tm/ltm/pool/~Common~llm_pool?ver=15.1.8"));
    assert!(pool["generation"].as_u64().unwrap() > 0);

    let (s, coll) = call(&d, Method::GET, "/mgmt/tm/ltm/pool/~Common~llm_pool/members", None, &[]).await;
    assert_eq!(s, 200);
    assert_eq!(coll["kind"], "tm:ltm:pool:members:memberscollectionstate");
    let items = coll["items"].as_array().unwrap();
    let names: Vec<&str> = items.iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["10.1.1.1:80", "10.1.1.1%2:80", "2001:db8::1.80", "vllm-0:8000"]);
    let rd = &items[1];
    assert_eq!(rd["kind"], "tm:ltm:pool:members:membersstate");
    assert_eq!(rd["address"], "10.1.1.1%2");
    assert_eq!(rd["fullPath"], "/Common/10.1.1.1%2:80");
    assert!(rd["selfLink"].as_str().unwrap().contains("/members/~Common~10.1.1.1%252:80?ver="));
    assert_eq!(items[3]["partition"], "Tenant");
    assert_eq!(items[3]["address"], "10.2.0.1");
}

#[tokio::test]
async fn path_encoding_is_exact() {
    let d = double().await;
    let base = "/mgmt/tm/ltm/pool/~Common~llm_pool/members";
    let (s, m) = call(&d, Method::GET, &format!("{base}/~Common~10.1.1.1%252:80"), None, &[]).await;
    assert_eq!((s, m["address"].as_str()), (StatusCode::OK, Some("10.1.1.1%2")));
    // `%2:` is not an escape: a BIG-IP front end rejects the URL.
    let (s, _) = call(&d, Method::GET, &format!("{base}/~Common~10.1.1.1%2:80"), None, &[]).await;
    assert_eq!(s, 400);
    let (s, m) = call(&d, Method::GET, &format!("{base}/~Common~2001:db8::1.80"), None, &[]).await;
    assert_eq!((s, m["address"].as_str()), (StatusCode::OK, Some("2001:db8::1")));
    // The member's own partition, not the pool's, addresses it.
    let (s, _) = call(&d, Method::GET, &format!("{base}/~Tenant~vllm-0:8000"), None, &[]).await;
    assert_eq!(s, 200);
    let (s, e) = call(&d, Method::GET, &format!("{base}/~Common~vllm-0:8000"), None, &[]).await;
    assert_eq!(s, 404);
    assert_eq!(
        e["message"],
        "01020036:3: The requested Pool Member (/Common/llm_pool /Common/vllm-0 8000) was not found."
    );
    assert_eq!(e["apiError"], 3);
    let (s, e) = call(&d, Method::GET, "/mgmt/tm/ltm/pool/~Common~nope/members", None, &[]).await;
    assert_eq!(s, 404);
    assert_eq!(e["message"], "01020036:3: The requested Pool (/Common/nope) was not found.");
    assert_eq!(e["code"], 404);
    let (s, e) = call(&d, Method::GET, "/mgmt/tm/ltm/pools", None, &[]).await;
    assert_eq!(s, 404);
    assert_eq!(e["kind"], ":resterrorresponse");
}

#[tokio::test]
async fn patch_changes_one_property_and_put_resets_the_rest() {
    let d = double().await;
    let path = "/mgmt/tm/ltm/pool/~Common~llm_pool/members/~Common~10.1.1.1:80";
    let (s, _) =
        call(&d, Method::PATCH, path, Some(json!({"priorityGroup": 5, "description": "gpu-a"})), &[]).await;
    assert_eq!(s, 200);
    let (s, m) = call(&d, Method::PATCH, path, Some(json!({"ratio": 9})), &[]).await;
    assert_eq!(s, 200);
    assert_eq!((m["ratio"].as_u64(), m["priorityGroup"].as_u64()), (Some(9), Some(5)));
    assert_eq!(m["description"], "gpu-a");
    let (s, m) = call(&d, Method::PUT, path, Some(json!({"ratio": 4})), &[]).await;
    assert_eq!(s, 200);
    assert_eq!((m["ratio"].as_u64(), m["priorityGroup"].as_u64()), (Some(4), Some(0)), "PUT resets");
    assert!(m.get("description").is_none(), "PUT drops the description");
}

#[tokio::test]
async fn ratio_range_and_body_rules() {
    let d = double().await;
    let path = "/mgmt/tm/ltm/pool/~Common~llm_pool/members/~Common~10.1.1.1:80";
    for bad in [json!({"ratio": 0}), json!({"ratio": 65_536}), json!({"ratio": "5"}), json!({"ratio": -1})] {
        let (s, e) = call(&d, Method::PATCH, path, Some(bad.clone()), &[]).await;
        assert_eq!(s, 400, "{bad}");
        assert_eq!(e["code"], 400);
        assert!(e["message"].as_str().unwrap().contains("ratio"), "{e}");
        assert!(e.get("errorStack").is_some() && e.get("apiError").is_some(), "BIG-IP error shape: {e}");
    }
    for ok in [1, 65_535] {
        let (s, _) = call(&d, Method::PATCH, path, Some(json!({ "ratio": ok })), &[]).await;
        assert_eq!(s, 200);
    }
    let (s, _) = call(&d, Method::PATCH, path, Some(json!({"ratioo": 2})), &[]).await;
    assert_eq!(s, 400, "unknown properties are refused");
    let (s, _) = call(&d, Method::PATCH, path, Some(json!({"address": "10.9.9.9"})), &[]).await;
    assert_eq!(s, 400, "address is read-only");
    // Bodies must be labelled JSON.
    let resp = Client::new()
        .patch(format!("{}{path}", d.url()))
        .basic_auth("svc", Some("pw"))
        .body(r#"{"ratio":2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(d.ratio(POOL, "10.1.1.1:80"), Some(65_535));
}

#[tokio::test]
async fn auth_rules() {
    let d = double_with(DoubleConfig { max_tokens_per_user: 3, ..DoubleConfig::default() }).await;
    let path = "/mgmt/tm/ltm/pool/~Common~llm_pool";
    let resp = Client::new().get(format!("{}{path}", d.url())).send().await.unwrap();
    assert_eq!(resp.status(), 401, "no credentials");
    let resp =
        Client::new().get(format!("{}{path}", d.url())).basic_auth("svc", Some("bad")).send().await.unwrap();
    assert_eq!(resp.status(), 401);
    let resp = Client::new()
        .get(format!("{}{path}", d.url()))
        .basic_auth("ldapuser", Some("pw"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401, "basic auth is for local users only");

    let (s, l) = login(&d, "ldapuser", "pw").await;
    assert_eq!(s, 200, "remote users log in for a token");
    let tok = l["token"]["token"].as_str().unwrap().to_string();
    assert_eq!(l["token"]["kind"], "shared:authz:tokens:authtokenitemstate");
    assert_eq!(l["token"]["timeout"], 1200);
    let span =
        l["token"]["expirationMicros"].as_u64().unwrap() - l["token"]["lastUpdateMicros"].as_u64().unwrap();
    assert_eq!(span, 1_200_000_000);
    let (s, _) = with_token(&d, &tok, Method::GET, path, None).await;
    assert_eq!(s, 200);
    let (s, e) = with_token(&d, "NOTATOKEN", Method::GET, path, None).await;
    assert_eq!(s, 401);
    assert_eq!(e["message"], "X-F5-Auth-Token does not exist.");

    let (s, _) = login(&d, "svc", "wrong").await;
    assert_eq!(s, 401);
    let mut svc_tokens = Vec::new();
    for _ in 0..3 {
        let (s, l) = login(&d, "svc", "pw").await;
        assert_eq!(s, 200);
        svc_tokens.push(l["token"]["token"].as_str().unwrap().to_string());
    }
    let (s, e) = login(&d, "svc", "pw").await;
    assert_eq!(s, 400);
    assert!(e["message"].as_str().unwrap().ends_with("has reached maximum active login tokens"), "{e}");
    assert_eq!(d.live_tokens("svc"), 3);
    // Someone else's token cannot be touched; one's own can be extended within the cap, and deleted.
    let tpath = format!("/mgmt/shared/authz/tokens/{}", svc_tokens[0]);
    let (s, _) = with_token(&d, &tok, Method::DELETE, &tpath, None).await;
    assert_eq!(s, 400);
    let (s, t) = with_token(&d, &svc_tokens[0], Method::PATCH, &tpath, Some(json!({"timeout": 3600}))).await;
    assert_eq!((s, t["timeout"].as_u64()), (StatusCode::OK, Some(3600)));
    let (s, _) =
        with_token(&d, &svc_tokens[0], Method::PATCH, &tpath, Some(json!({"timeout": 36_001}))).await;
    assert_eq!(s, 400, "absolute cap");
    let (s, _) = with_token(&d, &svc_tokens[0], Method::DELETE, &tpath, None).await;
    assert_eq!(s, 200);
    let (s, _) = with_token(&d, &svc_tokens[0], Method::GET, path, None).await;
    assert_eq!(s, 401, "deleted token");
    let (s, _) = login(&d, "svc", "pw").await;
    assert_eq!(s, 200, "a deleted token frees a slot");
    // admin is exempt from the limit.
    for _ in 0..5 {
        assert_eq!(login(&d, "admin", "admin").await.0, 200);
    }
    // Tokens expire with the clock.
    d.advance_clock(Duration::from_secs(1201));
    let (s, _) = with_token(&d, &tok, Method::GET, path, None).await;
    assert_eq!(s, 401);
    assert_eq!(d.live_tokens("svc"), 0, "the extended token was deleted; the others expired");
}

#[tokio::test]
async fn roles_limit_writes() {
    let d = double().await;
    let path = format!("{}/mgmt/tm/ltm/pool/~Common~llm_pool/members/~Common~10.1.1.1:80", d.url());
    let resp = Client::new()
        .patch(&path)
        .basic_auth("op", Some("pw"))
        .json(&json!({"ratio": 7}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401, "an Operator may not change ratios");
    let resp = Client::new()
        .patch(&path)
        .basic_auth("op", Some("pw"))
        .json(&json!({"session": "user-disabled"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "an Operator may disable a member");
    assert_eq!(d.ratio(POOL, "10.1.1.1:80"), Some(3));
}

#[tokio::test]
async fn transactions_queue_commit_and_roll_back() {
    let d = double().await;
    let member = |n: &str| format!("/mgmt/tm/ltm/pool/~Common~llm_pool/members/~Common~{n}");
    let (s, t) = call(&d, Method::POST, "/mgmt/tm/transaction", Some(json!({})), &[]).await;
    assert_eq!(s, 200);
    assert_eq!((t["state"].as_str(), t["kind"].as_str()), (Some("STARTED"), Some("tm:transactionstate")));
    assert_eq!(t["timeoutSeconds"], 120);
    let id = t["transId"].as_u64().unwrap().to_string();
    let commit_path = format!("/mgmt/tm/transaction/{id}");

    // Empty transactions cannot be committed.
    let (s, _) = call(&d, Method::PATCH, &commit_path, Some(json!({"state": "VALIDATING"})), &[]).await;
    assert_eq!(s, 404);

    let hdr = [("X-F5-REST-Coordination-Id", id.as_str())];
    let (s, c) = call(&d, Method::PATCH, &member("10.1.1.1:80"), Some(json!({"ratio": 10})), &hdr).await;
    assert_eq!(s, 200);
    assert_eq!(c["kind"], "tm:transaction:commandsstate");
    assert_eq!(c["method"], "PATCH");
    let (s, _) = call(&d, Method::PATCH, &member("2001:db8::1.80"), Some(json!({"ratio": 20})), &hdr).await;
    assert_eq!(s, 200);
    assert_eq!(d.ratio(POOL, "10.1.1.1:80"), Some(3), "queued, not applied");
    // Committing while still sending the coordination header is refused.
    let (s, e) = call(&d, Method::PATCH, &commit_path, Some(json!({"state": "VALIDATING"})), &hdr).await;
    assert_eq!(s, 400);
    assert!(e["message"].as_str().unwrap().contains("not allowed to be added to transaction"));
    let (s, t) = call(&d, Method::PATCH, &commit_path, Some(json!({"state": "VALIDATING"})), &[]).await;
    assert_eq!((s, t["state"].as_str()), (StatusCode::OK, Some("COMPLETED")));
    assert_eq!(d.ratio(POOL, "10.1.1.1:80"), Some(10));
    assert_eq!(d.ratio(POOL, "2001:db8::1.80"), Some(20));

    // One bad command fails the whole transaction; nothing applies.
    let (_, t) = call(&d, Method::POST, "/mgmt/tm/transaction", Some(json!({})), &[]).await;
    let id = t["transId"].as_u64().unwrap().to_string();
    let hdr = [("X-F5-REST-Coordination-Id", id.as_str())];
    call(&d, Method::PATCH, &member("10.1.1.1:80"), Some(json!({"ratio": 11})), &hdr).await;
    call(&d, Method::PATCH, &member("10.9.9.9:80"), Some(json!({"ratio": 12})), &hdr).await;
    let (s, e) = call(
        &d,
        Method::PATCH,
        &format!("/mgmt/tm/transaction/{id}"),
        Some(json!({"state": "VALIDATING"})),
        &[],
    )
    .await;
    assert_eq!(s, 400);
    assert!(e["message"].as_str().unwrap().starts_with("transaction failed:01020036:3"), "{e}");
    assert_eq!(d.ratio(POOL, "10.1.1.1:80"), Some(10), "rolled back");
    let (_, t) = call(&d, Method::GET, &format!("/mgmt/tm/transaction/{id}"), None, &[]).await;
    assert_eq!(t["state"], "FAILED");

    // Idle transactions expire.
    let (_, t) = call(&d, Method::POST, "/mgmt/tm/transaction", Some(json!({})), &[]).await;
    let id = t["transId"].as_u64().unwrap();
    d.advance_clock(Duration::from_secs(121));
    let (s, _) = call(&d, Method::GET, &format!("/mgmt/tm/transaction/{id}"), None, &[]).await;
    assert_eq!(s, 404);
}

#[tokio::test]
async fn faults_strike_then_clear() {
    let d = double().await;
    d.inject(Fault::new(FaultKind::McpdLost).on("GET", "/members"));
    d.inject(Fault::new(FaultKind::Restarting).on("GET", "~llm_pool").times(1));
    let path = "/mgmt/tm/ltm/pool/~Common~llm_pool/members";
    let (s, e) = call(&d, Method::GET, path, None, &[]).await;
    assert_eq!(s, 500);
    assert_eq!(e["message"], "The connection to mcpd has been lost, try again.");
    let resp =
        Client::new().get(format!("{}{path}", d.url())).basic_auth("svc", Some("pw")).send().await.unwrap();
    assert_eq!(resp.status(), 503);
    assert!(resp.text().await.unwrap().contains("restarting"));
    let (s, _) = call(&d, Method::GET, path, None, &[]).await;
    assert_eq!(s, 200);
    assert_eq!(d.pending_faults(), 0);

    d.inject(Fault::new(FaultKind::Hang(Duration::from_secs(2))));
    let r = Client::new()
        .get(format!("{}{path}", d.url()))
        .basic_auth("svc", Some("pw"))
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(r.is_err_and(|e| e.is_timeout()));
    let log = d.requests();
    assert!(log.iter().filter(|r| r.fault).count() >= 2);
}
