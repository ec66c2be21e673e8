//! The F5 sink against the strict BIG-IP double: authentication, member matching, minimal and atomic
//! pushes, retries, and a long run through faults that must end with the double holding the desired
//! ratios.

use std::collections::BTreeMap;
use std::time::Duration;

use llm_lc_adapters::f5::{AuthMode, F5Config, F5Sink, Username};
use llm_lc_adapters::{MemberId, RatioSink, Ratios, SecretRef, SinkError};
use llm_lc_testkit::bigip::{
    BigIpDouble, DoubleConfig, Fault, FaultKind, MemberSpec, PoolSpec, Recorded, RecordedAuth, Role, UserSpec,
};
use rand::{Rng, SeedableRng};
use serde_json::json;

const POOL: &str = "/Common/llm_pool";
const USER: &str = "svc-llm";
const PASSWORD: &str = "S3cret-pw!";

fn config(d: &BigIpDouble, pool: &str) -> F5Config {
    F5Config {
        auth: AuthMode::Token,
        timeout: Duration::from_secs(2),
        retries: 3,
        retry_backoff: Duration::from_millis(20),
        ..F5Config::new(&d.url(), pool, Username::Plain(USER.into()), SecretRef::Value(PASSWORD.into()))
    }
}

async fn double_with(cfg: DoubleConfig) -> BigIpDouble {
    let d = BigIpDouble::start_with(cfg).await;
    d.add_user(UserSpec::new(USER, PASSWORD, Role::ApplicationEditor));
    d.add_pool(
        PoolSpec::new(POOL)
            .mode("ratio-least-connections-member")
            .member(MemberSpec::ip("10.0.0.1", 8000))
            .member(MemberSpec::ip("10.0.0.2", 8000))
            .member(MemberSpec::ip("10.0.0.3", 8000)),
    );
    d
}

async fn double() -> BigIpDouble {
    double_with(DoubleConfig::default()).await
}

fn ratios(pairs: &[(&str, u32)]) -> Ratios {
    pairs.iter().map(|(k, v)| (MemberId::from(*k), *v)).collect()
}

fn names(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn count(log: &[Recorded], f: impl Fn(&Recorded) -> bool) -> usize {
    log.iter().filter(|r| f(r)).count()
}

fn logins(log: &[Recorded]) -> usize {
    count(log, |r| r.method == "POST" && r.path == "/mgmt/shared/authn/login")
}

/// No request the sink ever sends may be a PUT (it would reset the member's other properties).
fn assert_no_put(d: &BigIpDouble) {
    let puts: Vec<_> = d.requests().into_iter().filter(|r| r.method == "PUT").collect();
    assert!(puts.is_empty(), "the sink sent PUT: {puts:?}");
}

#[tokio::test]
async fn logs_in_once_and_reuses_the_token() {
    let d = double().await;
    let sink = F5Sink::new(&config(&d, POOL), "llm").unwrap();
    let want = ratios(&[("10.0.0.1:8000", 5), ("10.0.0.2:8000", 3), ("10.0.0.3:8000", 1)]);
    let a = sink.apply(&want).await.unwrap();
    assert_eq!((a.changed, a.unchanged), (2, 1));
    assert!(a.warnings.is_empty(), "{:?}", a.warnings);
    for _ in 0..3 {
        let a = sink.apply(&want).await.unwrap();
        assert_eq!((a.changed, a.unchanged), (0, 3));
    }
    assert_eq!(d.ratios(POOL), names(&[("10.0.0.1:8000", 5), ("10.0.0.2:8000", 3), ("10.0.0.3:8000", 1)]));
    let log = d.requests();
    assert_eq!(logins(&log), 1);
    assert_eq!(d.live_tokens(USER), 1);
    assert!(log
        .iter()
        .filter(|r| r.path != "/mgmt/shared/authn/login")
        .all(|r| r.auth == RecordedAuth::Token));
    assert_eq!(sink.current().await.unwrap(), Some(want.clone()));
    let ids = sink.members().await.unwrap().unwrap();
    assert_eq!(ids, want.members().cloned().collect::<Vec<_>>());
    sink.shutdown().await;
    assert_eq!(d.live_tokens(USER), 0, "shutdown deletes the token");
    assert_no_put(&d);
}

#[tokio::test]
async fn basic_auth_sends_credentials_each_time_and_never_logs_in() {
    let d = double().await;
    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("password");
    std::fs::write(&pw, format!("{PASSWORD}\n")).unwrap();
    let mut cfg = config(&d, POOL);
    cfg.auth = AuthMode::Basic;
    cfg.password = SecretRef::File(pw);
    let sink = F5Sink::new(&cfg, "llm").unwrap();
    sink.apply(&ratios(&[("10.0.0.1:8000", 2)])).await.unwrap();
    assert_eq!(d.ratio(POOL, "10.0.0.1:8000"), Some(2));
    let log = d.requests();
    assert_eq!(logins(&log), 0);
    assert!(log.iter().all(|r| r.auth == RecordedAuth::Basic(USER.into())));

    // A remote (LDAP) user cannot use basic auth: the error says so without leaking the password.
    d.add_user(UserSpec::new("ldap-svc", PASSWORD, Role::ApplicationEditor).remote());
    cfg.username = Username::Plain("ldap-svc".into());
    let sink = F5Sink::new(&cfg, "llm").unwrap();
    let err = sink.apply(&ratios(&[("10.0.0.1:8000", 3)])).await.unwrap_err();
    assert!(matches!(err, SinkError::Auth { .. }), "{err}");
    assert!(!err.to_string().contains(PASSWORD));
    // The same remote user works with token auth.
    cfg.auth = AuthMode::Token;
    let sink = F5Sink::new(&cfg, "llm").unwrap();
    sink.apply(&ratios(&[("10.0.0.1:8000", 3)])).await.unwrap();
    assert_eq!(d.ratio(POOL, "10.0.0.1:8000"), Some(3));
}

#[tokio::test]
async fn refused_credentials_and_token_limit_are_clear_auth_errors() {
    let d = double_with(DoubleConfig { max_tokens_per_user: 2, ..DoubleConfig::default() }).await;
    let mut cfg = config(&d, POOL);
    cfg.password = SecretRef::Value("wrong-password".into());
    let err = F5Sink::new(&cfg, "llm").unwrap().apply(&ratios(&[("10.0.0.1:8000", 2)])).await.unwrap_err();
    assert!(matches!(err, SinkError::Auth { .. }), "{err}");
    assert!(err.to_string().contains(USER) && !err.to_string().contains("wrong-password"), "{err}");
    assert_eq!(logins(&d.requests()), 1, "a refused login is not retried");

    // Someone else left the user's token slots full.
    for _ in 0..2 {
        let r = reqwest::Client::new()
            .post(format!("{}/mgmt/shared/authn/login", d.url()))
            .json(&json!({"username": USER, "password": PASSWORD, "loginProviderName": "tmos"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let err = F5Sink::new(&config(&d, POOL), "llm")
        .unwrap()
        .apply(&ratios(&[("10.0.0.1:8000", 2)]))
        .await
        .unwrap_err();
    assert!(matches!(err, SinkError::Auth { .. }), "{err}");
    assert!(err.to_string().contains("maximum active login tokens"), "{err}");
    assert!(err.to_string().contains("DELETE /mgmt/shared/authz/tokens"), "says what to do: {err}");
}

#[tokio::test]
async fn token_is_extended_before_it_expires() {
    // Two-second tokens: a run of four seconds needs the token kept alive, without a 401 and
    // without a second token.
    let d = double_with(DoubleConfig { token_lifetime_s: 2, ..DoubleConfig::default() }).await;
    let sink = F5Sink::new(&config(&d, POOL), "llm").unwrap();
    let start = std::time::Instant::now();
    let mut i = 0u32;
    while start.elapsed() < Duration::from_secs(4) {
        sink.apply(&ratios(&[("10.0.0.1:8000", 1 + i % 3)])).await.unwrap();
        i += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = d.requests();
    assert_eq!(logins(&log), 1, "one login for the whole run");
    assert_eq!(count(&log, |r| r.status == 401), 0, "never used an expired token");
    let extensions = count(&log, |r| r.method == "PATCH" && r.path.starts_with("/mgmt/shared/authz/tokens/"));
    assert!(extensions >= 1, "token extended ({extensions} times)");
    assert_eq!(d.live_tokens(USER), 1);
    assert!(d.token_timeouts(USER)[0] >= 4, "timeout grew: {:?}", d.token_timeouts(USER));
}

#[tokio::test]
async fn token_is_replaced_when_it_cannot_be_extended_and_the_old_one_deleted() {
    // BIG-IP caps a token's life (36000 s; 3 s here): past the cap the sink logs in anew and deletes
    // the old token, so live tokens never pile up.
    let d =
        double_with(DoubleConfig { token_lifetime_s: 2, max_token_timeout_s: 3, ..DoubleConfig::default() })
            .await;
    let sink = F5Sink::new(&config(&d, POOL), "llm").unwrap();
    let start = std::time::Instant::now();
    let mut max_live = 0;
    while start.elapsed() < Duration::from_millis(5500) {
        sink.apply(&ratios(&[("10.0.0.2:8000", 4)])).await.unwrap();
        max_live = max_live.max(d.live_tokens(USER));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = d.requests();
    assert!(logins(&log) >= 2, "renewed by logging in again ({} logins)", logins(&log));
    assert_eq!(count(&log, |r| r.status == 401), 0);
    assert!(count(&log, |r| r.method == "DELETE" && r.path.starts_with("/mgmt/shared/authz/tokens/")) >= 1);
    assert_eq!(max_live, 1, "never more than one live token");
}

#[tokio::test]
async fn expired_token_mid_run_logs_in_again_once() {
    let d = double().await;
    let sink = F5Sink::new(&config(&d, POOL), "llm").unwrap();
    sink.apply(&ratios(&[("10.0.0.1:8000", 2)])).await.unwrap();
    d.expire_tokens(); // a BIG-IP restart, or an admin deleting tokens
    d.clear_requests();
    sink.apply(&ratios(&[("10.0.0.1:8000", 6)])).await.unwrap();
    assert_eq!(d.ratio(POOL, "10.0.0.1:8000"), Some(6));
    let log = d.requests();
    assert_eq!(count(&log, |r| r.status == 401), 1, "{log:?}");
    assert_eq!(logins(&log), 1);
    assert_eq!(d.live_tokens(USER), 1);

    // The clock jumping past the lifetime is the same story.
    d.advance_clock(Duration::from_secs(1300));
    sink.apply(&ratios(&[("10.0.0.1:8000", 7)])).await.unwrap();
    assert_eq!(d.ratio(POOL, "10.0.0.1:8000"), Some(7));
    assert_eq!(d.live_tokens(USER), 1);
}

#[tokio::test]
async fn partitions_route_domains_ipv6_and_named_nodes() {
    let d = BigIpDouble::start().await;
    d.add_user(UserSpec::new(USER, PASSWORD, Role::ApplicationEditor));
    let pool = "/Tenant/llm_pool";
    d.add_pool(
        PoolSpec::new(pool)
            .mode("ratio-member")
            .member(MemberSpec::ip("10.1.1.1%2", 8000))
            .member(MemberSpec::ip("10.1.1.1", 8000).partition("Tenant"))
            .member(MemberSpec::ip("2001:db8::1", 8000).partition("Tenant"))
            .member(MemberSpec::ip("2001:db8::2%3", 8000))
            .member(MemberSpec::named("vllm-0", "10.2.0.1", 8000)),
    );
    let sink = F5Sink::new(&config(&d, pool), "llm").unwrap();
    let want = ratios(&[
        ("10.1.1.1%2:8000", 11),
        ("10.1.1.1:8000", 12),
        ("[2001:db8::1]:8000", 13),
        ("[2001:db8::2%3]:8000", 14),
        ("10.2.0.1:8000", 15),
    ]);
    let ids = sink.members().await.unwrap().unwrap();
    assert_eq!(
        ids,
        want.members().cloned().collect::<Vec<_>>(),
        "ids are address:port, bracketed IPv6, %RD kept"
    );
    let a = sink.apply(&want).await.unwrap();
    assert_eq!(a.changed, 5);
    assert!(a.warnings.is_empty(), "{:?}", a.warnings);
    assert_eq!(
        d.ratios(pool),
        names(&[
            ("10.1.1.1%2:8000", 11),
            ("10.1.1.1:8000", 12),
            ("2001:db8::1.8000", 13),
            ("2001:db8::2%3.8000", 14),
            ("vllm-0:8000", 15),
        ])
    );
    let paths: Vec<String> =
        d.requests().into_iter().filter(|r| r.is_member_write()).map(|r| r.path).collect();
    assert!(
        paths.iter().any(|p| p.ends_with("/~Tenant~llm_pool/members/~Common~10.1.1.1%252:8000")),
        "{paths:?}"
    );
    assert!(paths.iter().any(|p| p.ends_with("/members/~Common~2001:db8::2%253.8000")), "{paths:?}");
    assert!(paths.iter().any(|p| p.ends_with("/members/~Tenant~2001:db8::1.8000")), "{paths:?}");
    assert_eq!(sink.current().await.unwrap(), Some(want));
}

#[tokio::test]
async fn patches_only_members_that_differ_and_repairs_drift() {
    let d = double().await;
    d.set_ratio(POOL, "10.0.0.1:8000", 5);
    let sink = F5Sink::new(&config(&d, POOL), "llm").unwrap();
    let want = ratios(&[("10.0.0.1:8000", 5), ("10.0.0.2:8000", 2), ("10.0.0.3:8000", 1)]);
    let a = sink.apply(&want).await.unwrap();
    assert_eq!((a.changed, a.unchanged), (1, 2));
    let writes: Vec<Recorded> = d.requests().into_iter().filter(Recorded::is_member_write).collect();
    assert_eq!(writes.len(), 1, "{writes:?}");
    assert!(writes[0].path.ends_with("~Common~10.0.0.2:8000") && writes[0].coordination.is_none());
    assert_eq!(
        count(&d.requests(), |r| r.path.starts_with("/mgmt/tm/transaction")),
        0,
        "one change goes direct"
    );

    // Someone edits a ratio by hand; the next push puts it back, touching nothing else.
    d.set_ratio(POOL, "10.0.0.3:8000", 40);
    d.clear_requests();
    let a = sink.apply(&want).await.unwrap();
    assert_eq!((a.changed, a.unchanged), (1, 2));
    assert_eq!(d.ratio(POOL, "10.0.0.3:8000"), Some(1));
    assert_eq!(count(&d.requests(), Recorded::is_member_write), 1);
    assert_no_put(&d);
}

#[tokio::test]
async fn several_changes_go_in_one_transaction() {
    let d = double().await;
    let sink = F5Sink::new(&config(&d, POOL), "llm").unwrap();
    let a = sink
        .apply(&ratios(&[("10.0.0.1:8000", 7), ("10.0.0.2:8000", 8), ("10.0.0.3:8000", 9)]))
        .await
        .unwrap();
    assert_eq!(a.changed, 3);
    let log = d.requests();
    let tx_posts = count(&log, |r| r.method == "POST" && r.path == "/mgmt/tm/transaction");
    assert_eq!(tx_posts, 1);
    let writes: Vec<&Recorded> = log.iter().filter(|r| r.is_member_write()).collect();
    assert_eq!(writes.len(), 3);
    assert!(writes.iter().all(|w| w.coordination.is_some()), "every change queued: {writes:?}");
    let commits: Vec<&Recorded> =
        log.iter().filter(|r| r.method == "PATCH" && r.path.starts_with("/mgmt/tm/transaction/")).collect();
    assert_eq!(commits.len(), 1);
    assert!(commits[0].coordination.is_none() && commits[0].status == 200);
    assert_eq!(d.ratios(POOL), names(&[("10.0.0.1:8000", 7), ("10.0.0.2:8000", 8), ("10.0.0.3:8000", 9)]));
    assert_eq!(d.transactions().iter().filter(|t| t.1 == "STARTED").count(), 0, "no transaction left open");
}

#[tokio::test]
async fn a_failed_transaction_leaves_the_pool_untouched() {
    let d = double().await;
    let sink = F5Sink::new(&config(&d, POOL), "llm").unwrap();
    // The second queued change is refused: nothing of the push may show.
    d.inject(
        Fault::new(FaultKind::Status(400, json!({"code": 400, "message": "01070734:3: Configuration error: injected", "errorStack": [], "apiError": 3})))
            .on("PATCH", "~Common~10.0.0.2:8000"),
    );
    let err = sink
        .apply(&ratios(&[("10.0.0.1:8000", 7), ("10.0.0.2:8000", 8), ("10.0.0.3:8000", 9)]))
        .await
        .unwrap_err();
    assert!(matches!(err, SinkError::Rejected { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("/Common/llm_pool") && msg.contains("/Common/10.0.0.2:8000") && msg.contains("injected"),
        "{msg}"
    );
    assert_eq!(d.ratios(POOL), names(&[("10.0.0.1:8000", 1), ("10.0.0.2:8000", 1), ("10.0.0.3:8000", 1)]));
    assert!(
        d.transactions().iter().all(|t| t.1 != "STARTED"),
        "abandoned transaction deleted: {:?}",
        d.transactions()
    );

    // A member removed between the read and the commit fails the commit as a whole.
    d.inject(Fault::new(FaultKind::Delay(Duration::from_millis(300))).on("PATCH", "/mgmt/tm/transaction/"));
    let want = ratios(&[("10.0.0.1:8000", 7), ("10.0.0.3:8000", 9)]);
    let push = sink.apply(&want);
    let remove = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        d.remove_member(POOL, "10.0.0.3:8000");
    };
    let (res, ()) = tokio::join!(push, remove);
    let err = res.unwrap_err();
    assert!(err.to_string().contains("transaction failed"), "{err}");
    assert_eq!(d.ratio(POOL, "10.0.0.1:8000"), Some(1), "rolled back");
}

#[tokio::test]
async fn server_errors_and_timeouts_are_retried() {
    let d = double().await;
    let mut cfg = config(&d, POOL);
    cfg.timeout = Duration::from_millis(300);
    let sink = F5Sink::new(&cfg, "llm").unwrap();
    sink.apply(&ratios(&[("10.0.0.1:8000", 1)])).await.unwrap(); // logged in
    d.inject(Fault::new(FaultKind::McpdLost).on("GET", "/members"));
    d.inject(Fault::new(FaultKind::Restarting).on("PATCH", "/members/").times(2));
    d.inject(Fault::new(FaultKind::Hang(Duration::from_secs(2))).on("PATCH", "/members/"));
    d.clear_requests();
    let a = sink.apply(&ratios(&[("10.0.0.1:8000", 4)])).await.unwrap();
    assert_eq!(a.changed, 1);
    assert_eq!(d.ratio(POOL, "10.0.0.1:8000"), Some(4));
    assert_eq!(d.pending_faults(), 0);
    let log = d.requests();
    assert_eq!(count(&log, |r| r.status == 500), 1);
    // The hang is logged only when it ends (after the client gave up), so only the 503s show yet.
    assert_eq!(count(&log, |r| r.status == 503), 2, "two restarting answers");
    assert_eq!(count(&log, |r| r.is_member_write() && r.status == 200), 1);

    // Retries are bounded: a BIG-IP that stays down is an error worth retrying later.
    d.inject(Fault::new(FaultKind::Restarting).times(10));
    let err = sink.apply(&ratios(&[("10.0.0.1:8000", 5)])).await.unwrap_err();
    assert!(err.retryable(), "{err}");
    assert!(matches!(err, SinkError::Temporary { .. }), "{err}");
}

#[tokio::test]
async fn a_commit_whose_answer_is_lost_is_not_applied_twice_blindly() {
    let d = double().await;
    let mut cfg = config(&d, POOL);
    cfg.timeout = Duration::from_millis(300);
    let sink = F5Sink::new(&cfg, "llm").unwrap();
    // The commit runs only after the client gave up: the sink must find out by asking, and succeed.
    d.inject(Fault::new(FaultKind::Delay(Duration::from_millis(700))).on("PATCH", "/mgmt/tm/transaction/"));
    sink.apply(&ratios(&[("10.0.0.1:8000", 3), ("10.0.0.2:8000", 4)])).await.unwrap();
    assert_eq!(d.ratio(POOL, "10.0.0.1:8000"), Some(3));
    assert_eq!(d.ratio(POOL, "10.0.0.2:8000"), Some(4));
    let log = d.requests();
    assert!(
        count(&log, |r| r.method == "GET" && r.path.starts_with("/mgmt/tm/transaction/")) >= 1,
        "state checked"
    );

    // Worse: the first commit lands while the sink re-sends it, so the second is refused. The push
    // still succeeded, and the sink must say so.
    d.clear_requests();
    d.inject(Fault::new(FaultKind::Delay(Duration::from_millis(450))).on("PATCH", "/mgmt/tm/transaction/"));
    d.inject(Fault::new(FaultKind::Delay(Duration::from_millis(200))).on("PATCH", "/mgmt/tm/transaction/"));
    sink.apply(&ratios(&[("10.0.0.1:8000", 5), ("10.0.0.2:8000", 6)])).await.unwrap();
    assert_eq!(d.ratio(POOL, "10.0.0.1:8000"), Some(5));
    let commits: Vec<u16> = d
        .requests()
        .iter()
        .filter(|r| r.method == "PATCH" && r.path.starts_with("/mgmt/tm/transaction/"))
        .map(|r| r.status)
        .collect();
    assert!(commits.contains(&400), "the re-sent commit was refused: {commits:?}");
}

#[tokio::test]
async fn rejections_are_not_retried_and_name_pool_and_member() {
    let d = double().await;
    let sink = F5Sink::new(&config(&d, POOL), "llm").unwrap();
    d.inject(
        Fault::new(FaultKind::Status(
            400,
            json!({"code": 400, "message": "01070734:3: Configuration error: refused", "errorStack": [], "apiError": 3}),
        ))
        .on("PATCH", "/members/")
        .times(5),
    );
    let err = sink.apply(&ratios(&[("10.0.0.3:8000", 6)])).await.unwrap_err();
    assert!(matches!(err, SinkError::Rejected { .. }) && !err.retryable(), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("pool /Common/llm_pool") && msg.contains("member /Common/10.0.0.3:8000"), "{msg}");
    assert!(msg.contains("HTTP 400") && msg.contains("refused"), "{msg}");
    assert_eq!(count(&d.requests(), Recorded::is_member_write), 1, "a 400 is not retried");

    // An unknown pool says which pool and what to check.
    let err = F5Sink::new(&config(&d, "/Common/nope"), "llm").unwrap().apply(&ratios(&[])).await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, SinkError::Rejected { .. }), "{err}");
    assert!(msg.contains("/Common/nope") && msg.contains("01020036:3") && msg.contains("partition"), "{msg}");
}

#[tokio::test]
async fn membership_mismatches_are_reported_not_fatal() {
    let d = double().await;
    let sink = F5Sink::new(&config(&d, POOL), "llm").unwrap();
    let a = sink
        .apply(&ratios(&[("10.0.0.1:8000", 4), ("10.0.0.2:8000", 2), ("10.9.9.9:8000", 8)]))
        .await
        .unwrap();
    assert_eq!(a.changed, 2);
    assert_eq!(a.warnings.len(), 2, "{:?}", a.warnings);
    assert!(a
        .warnings
        .iter()
        .any(|w| w.contains("10.9.9.9:8000") && w.contains("not in BIG-IP pool /Common/llm_pool")));
    assert!(a.warnings.iter().any(|w| w.contains("/Common/10.0.0.3:8000") && w.contains("no ratio")));
    assert_eq!(d.ratios(POOL), names(&[("10.0.0.1:8000", 4), ("10.0.0.2:8000", 2), ("10.0.0.3:8000", 1)]));
}

#[tokio::test]
async fn ratios_are_clamped_into_bigip_range() {
    let d = double().await;
    let mut cfg = config(&d, POOL);
    cfg.max_ratio = 65_535;
    let sink = F5Sink::new(&cfg, "llm").unwrap();
    let a = sink
        .apply(&ratios(&[("10.0.0.1:8000", 0), ("10.0.0.2:8000", 100_000), ("10.0.0.3:8000", 65_535)]))
        .await
        .unwrap();
    assert_eq!(
        d.ratios(POOL),
        names(&[("10.0.0.1:8000", 1), ("10.0.0.2:8000", 65_535), ("10.0.0.3:8000", 65_535)])
    );
    assert_eq!(
        a.warnings.iter().filter(|w| w.contains("outside the sink's 1..=65535")).count(),
        2,
        "{:?}",
        a.warnings
    );
}

#[tokio::test]
async fn ratios_stay_within_100_unless_the_sink_opts_in_to_more() {
    // A BIG-IP (or front end) that enforces F5's documented 1..100.
    let d = double_with(DoubleConfig { max_ratio: 100, ..DoubleConfig::default() }).await;
    let want = ratios(&[("10.0.0.1:8000", 250), ("10.0.0.2:8000", 40), ("10.0.0.3:8000", 7)]);
    let sink = F5Sink::new(&config(&d, POOL), "llm").unwrap();
    let a = sink.apply(&want).await.unwrap();
    assert_eq!(d.ratios(POOL), names(&[("10.0.0.1:8000", 100), ("10.0.0.2:8000", 40), ("10.0.0.3:8000", 7)]));
    assert!(a.warnings.iter().any(|w| w.contains("1..=100")), "{:?}", a.warnings);

    // Opting in to more against such a BIG-IP: the transaction fails whole, nothing is half-applied.
    let mut cfg = config(&d, POOL);
    cfg.max_ratio = 1000;
    let sink = F5Sink::new(&cfg, "llm").unwrap();
    let want = ratios(&[("10.0.0.1:8000", 250), ("10.0.0.2:8000", 20), ("10.0.0.3:8000", 9)]);
    let err = sink.apply(&want).await.unwrap_err();
    assert!(matches!(err, SinkError::Rejected { .. }) && err.to_string().contains("from 1 to 100"), "{err}");
    assert_eq!(d.ratios(POOL), names(&[("10.0.0.1:8000", 100), ("10.0.0.2:8000", 40), ("10.0.0.3:8000", 7)]));
}

#[tokio::test]
async fn warns_once_when_the_mode_ignores_ratios() {
    let d = double().await;
    d.set_lb_mode(POOL, "round-robin");
    let sink = F5Sink::new(&config(&d, POOL), "llm").unwrap();
    let want = ratios(&[("10.0.0.1:8000", 2), ("10.0.0.2:8000", 1), ("10.0.0.3:8000", 1)]);
    let first = sink.apply(&want).await.unwrap();
    assert_eq!(first.warnings.len(), 1, "{:?}", first.warnings);
    assert!(
        first.warnings[0].contains("round-robin")
            && first.warnings[0].contains("ratio-least-connections-member")
    );
    let second = sink.apply(&want).await.unwrap();
    assert!(second.warnings.is_empty(), "warned once: {:?}", second.warnings);
    assert_eq!(d.ratio(POOL, "10.0.0.1:8000"), Some(2), "ratios are still kept in sync");
    d.set_lb_mode(POOL, "ratio-least-connections-member");
    assert!(sink.apply(&want).await.unwrap().warnings.is_empty());
    d.set_lb_mode(POOL, "least-connections-member");
    assert_eq!(sink.apply(&want).await.unwrap().warnings.len(), 1, "a new bad mode warns again");
}

#[tokio::test]
async fn pools_on_one_bigip_share_one_token() {
    let d = double().await;
    d.add_pool(PoolSpec::new("/Common/other").mode("ratio-member").member(MemberSpec::ip("10.0.1.1", 80)));
    let a = F5Sink::new(&config(&d, POOL), "a").unwrap();
    let b = F5Sink::new(&config(&d, "/Common/other"), "b").unwrap();
    let (wa, wb) = (ratios(&[("10.0.0.1:8000", 2)]), ratios(&[("10.0.1.1:80", 3)]));
    let (ra, rb) = tokio::join!(a.apply(&wa), b.apply(&wb));
    ra.unwrap();
    rb.unwrap();
    assert_eq!(logins(&d.requests()), 1);
    assert_eq!(d.live_tokens(USER), 1);
    a.shutdown().await;
    assert_eq!(d.live_tokens(USER), 1, "still used by the other pool");
    // A sink dropped without shutdown gives up its share too.
    let c = F5Sink::new(&config(&d, POOL), "c").unwrap();
    c.apply(&ratios(&[("10.0.0.1:8000", 2)])).await.unwrap();
    drop(c);
    b.apply(&ratios(&[("10.0.1.1:80", 4)])).await.unwrap();
    assert_eq!(logins(&d.requests()), 1, "the third sink reused the session too");
    b.shutdown().await;
    llm_lc_testkit::wait::until(Duration::from_secs(5), "the last holder to delete the token", || async {
        (d.live_tokens(USER) == 0).then_some(())
    })
    .await;
}

/// The whole story: a long run of pushes with changing ratios while the BIG-IP misbehaves in every
/// way it can. Individual pushes may fail; the run goes on, and once the faults stop the BIG-IP holds
/// exactly the last desired ratios, with one live token and no PUT ever sent.
#[tokio::test]
async fn keeps_going_through_faults_and_converges() {
    let d = double_with(DoubleConfig { token_lifetime_s: 3, ..DoubleConfig::default() }).await;
    d.add_member(POOL, MemberSpec::ip("10.0.0.4%2", 8000));
    d.add_member(POOL, MemberSpec::ip("2001:db8::4", 8000));
    let ids = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4%2:8000", "[2001:db8::4]:8000"];
    let mut cfg = config(&d, POOL);
    cfg.timeout = Duration::from_millis(300);
    cfg.retries = 2;
    let sink = F5Sink::new(&cfg, "llm").unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut desired = Ratios::default();
    let (mut ok, mut failed) = (0, 0);
    for cycle in 0..60 {
        match cycle % 10 {
            1 => d.inject(Fault::new(FaultKind::McpdLost).times(2)),
            3 => d.inject(Fault::new(FaultKind::Restarting).times(5)),
            4 => d.expire_tokens(),
            5 => d.inject(Fault::new(FaultKind::Hang(Duration::from_millis(600))).on("PATCH", "/")),
            7 => d.set_ratio(POOL, "10.0.0.2:8000", 999),
            8 => d.inject(
                Fault::new(FaultKind::Delay(Duration::from_millis(500))).on("PATCH", "/mgmt/tm/transaction/"),
            ),
            _ => {}
        }
        desired = ids.iter().map(|id| (MemberId::from(*id), rng.gen_range(1..=100))).collect();
        match sink.apply(&desired).await {
            Ok(_) => ok += 1,
            Err(e) => {
                assert!(!matches!(e, SinkError::Config(_)), "{e}");
                failed += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Faults have stopped: within a few cycles the pool must match.
    let mut converged = false;
    for _ in 0..5 {
        if sink.apply(&desired).await.is_ok() && sink.current().await.ok().flatten() == Some(desired.clone())
        {
            converged = true;
            break;
        }
    }
    assert!(converged, "BIG-IP state {:?} != desired {desired:?}", d.ratios(POOL));
    assert!(ok > 30, "most cycles succeed despite faults: {ok} ok, {failed} failed");
    let expected: BTreeMap<String, u64> = [
        ("10.0.0.1:8000", "10.0.0.1:8000"),
        ("10.0.0.2:8000", "10.0.0.2:8000"),
        ("10.0.0.3:8000", "10.0.0.3:8000"),
        ("10.0.0.4%2:8000", "10.0.0.4%2:8000"),
        ("2001:db8::4.8000", "[2001:db8::4]:8000"),
    ]
    .iter()
    .map(|(name, id)| (name.to_string(), desired.get(&MemberId::from(*id)).unwrap() as u64))
    .collect();
    assert_eq!(d.ratios(POOL), expected);
    assert_no_put(&d);
    assert!(d.live_tokens(USER) <= 1, "tokens did not pile up: {}", d.live_tokens(USER));
    assert!(
        d.transactions().iter().all(|t| t.1 != "STARTED"),
        "no dangling transaction: {:?}",
        d.transactions()
    );
    sink.shutdown().await;
    assert_eq!(d.live_tokens(USER), 0);
    eprintln!("fault run: {ok} pushes ok, {failed} failed, {} requests", d.requests().len());
}

/// Priority tiers on BIG-IP: members of an inactive tier (ratio 0 from the controller) sit in the
/// standby priority group, and with priority group activation on BIG-IP sends them nothing until
/// the controller spills over. The double answers in 150 ms, as a busy management plane does.
#[tokio::test]
async fn inactive_tiers_become_the_standby_priority_group() {
    const TIERED: &str = "/Common/tiered";
    let d =
        BigIpDouble::start_with(DoubleConfig { latency: Duration::from_millis(150), ..Default::default() })
            .await;
    d.add_user(UserSpec::new(USER, PASSWORD, Role::ApplicationEditor));
    d.add_pool(
        PoolSpec::new(TIERED)
            .mode("ratio-least-connections-member")
            .member(MemberSpec::ip("10.0.0.1", 8000))
            .member(MemberSpec::ip("10.0.0.2", 8000))
            .member(MemberSpec::ip("10.9.0.1", 8000))
            .member(MemberSpec::ip("10.9.0.2", 8000)),
    );
    let sink = F5Sink::new(&F5Config { priority_groups: true, ..config(&d, TIERED) }, "tiered").unwrap();
    let east_only =
        ratios(&[("10.0.0.1:8000", 50), ("10.0.0.2:8000", 60), ("10.9.0.1:8000", 0), ("10.9.0.2:8000", 0)]);

    // Priority group activation off: the standby group would still get traffic. Refused, nothing written.
    let err = sink.apply(&east_only).await.unwrap_err();
    assert!(matches!(err, SinkError::Rejected { .. }), "{err:?}");
    assert!(err.to_string().contains("min-active-members 1"), "{err}");
    assert_eq!(count(&d.requests(), |r| r.is_member_write()), 0);

    // Members the sink has not grouped yet (group 0) read back with their ratios, not as standby.
    let untouched = sink.current().await.unwrap().expect("f5 reads back");
    assert_eq!(untouched.get(&MemberId::from("10.9.0.1:8000")), Some(1));

    // On: east carries traffic, west stands by with its ratio untouched.
    d.set_min_active_members(TIERED, 1);
    let a = sink.apply(&east_only).await.unwrap();
    assert_eq!((a.changed, a.unchanged), (4, 0));
    assert!(a.warnings.is_empty(), "ratio 0 is a group here, not a clamp: {:?}", a.warnings);
    assert_eq!(
        d.priority_groups(TIERED),
        names(&[("10.0.0.1:8000", 2), ("10.0.0.2:8000", 2), ("10.9.0.1:8000", 1), ("10.9.0.2:8000", 1)])
    );
    assert_eq!(
        d.ratios(TIERED),
        names(&[("10.0.0.1:8000", 50), ("10.0.0.2:8000", 60), ("10.9.0.1:8000", 1), ("10.9.0.2:8000", 1)])
    );
    assert_eq!(d.serving(TIERED), vec!["10.0.0.1:8000".to_string(), "10.0.0.2:8000".to_string()]);
    assert_eq!(sink.current().await.unwrap(), Some(east_only.clone()));
    // Reconciled: the same ratios again write nothing.
    let again = sink.apply(&east_only).await.unwrap();
    assert_eq!((again.changed, again.unchanged), (0, 4));

    // Spill over: west joins the active group with its ratios, in one transaction.
    let before = d.requests().len();
    let spilled =
        ratios(&[("10.0.0.1:8000", 50), ("10.0.0.2:8000", 60), ("10.9.0.1:8000", 30), ("10.9.0.2:8000", 20)]);
    assert_eq!(sink.apply(&spilled).await.unwrap().changed, 2);
    let log = d.requests();
    let writes: Vec<&Recorded> = log[before..].iter().filter(|r| r.is_member_write()).collect();
    assert_eq!(writes.len(), 2);
    assert!(writes.iter().all(|w| w.coordination.is_some()), "both queued in one transaction: {writes:?}");
    assert_eq!(d.serving(TIERED).len(), 4);
    assert_eq!(d.ratio(TIERED, "10.9.0.1:8000"), Some(30));

    // Back: west to standby again; its last ratios stay for the next spill.
    sink.apply(&east_only).await.unwrap();
    assert_eq!(d.serving(TIERED), vec!["10.0.0.1:8000".to_string(), "10.0.0.2:8000".to_string()]);
    assert_eq!(d.ratio(TIERED, "10.9.0.2:8000"), Some(20));
}
