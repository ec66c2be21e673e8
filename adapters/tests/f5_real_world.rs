//! The F5 sink against a BIG-IP as admins meet it: a slow management plane, pushes cut short, a wrong
//! password, a role that cannot write, an HA pair failing over, and pools owned by CIS (sideband).

use std::time::{Duration, Instant};

use llm_lc_adapters::f5::{F5Config, F5Mode, F5Sink, Username};
use llm_lc_adapters::{MemberId, RatioSink, Ratios, SecretRef, SinkError};
use llm_lc_testkit::bigip::{BigIpDouble, DoubleConfig, MemberSpec, PoolSpec, Recorded, Role, UserSpec};

const POOL: &str = "/Common/llm_pool";
const USER: &str = "svc-llm";
const PASSWORD: &str = "S3cret-pw!";

fn config(url: &str) -> F5Config {
    F5Config {
        timeout: Duration::from_secs(2),
        retry_backoff: Duration::from_millis(20),
        ..F5Config::new(url, POOL, Username::Plain(USER.into()), SecretRef::Value(PASSWORD.into()))
    }
}

/// A double with `n` members 10.0.1.1.. in a ratio pool, the service user an Application Editor.
async fn double(cfg: DoubleConfig, n: usize) -> BigIpDouble {
    let d = BigIpDouble::start_with(cfg).await;
    d.add_user(UserSpec::new(USER, PASSWORD, Role::ApplicationEditor));
    let mut pool = PoolSpec::new(POOL).mode("ratio-least-connections-member");
    for i in 0..n {
        pool = pool.member(MemberSpec::ip(&format!("10.0.1.{}", i + 1), 8000));
    }
    d.add_pool(pool);
    d
}

/// Member `i` gets ratio `2 + (i + shift) % 50`: every member changes when `shift` does.
fn spread(n: usize, shift: usize) -> Ratios {
    (0..n).map(|i| (MemberId::new(format!("10.0.1.{}:8000", i + 1)), 2 + ((i + shift) % 50) as u32)).collect()
}

fn logins(log: &[Recorded]) -> usize {
    log.iter().filter(|r| r.path == "/mgmt/shared/authn/login").count()
}

fn started_transactions(d: &BigIpDouble) -> usize {
    d.transactions().iter().filter(|(_, state, _)| state == "STARTED").count()
}

async fn eventually(what: &str, deadline: Duration, mut ok: impl FnMut() -> bool) {
    let end = Instant::now() + deadline;
    while !ok() {
        assert!(Instant::now() < end, "not within {deadline:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn forty_members_on_a_150ms_management_plane_apply_in_a_few_round_trips() {
    let d = double(DoubleConfig { latency: Duration::from_millis(150), ..DoubleConfig::default() }, 40).await;
    let sink = F5Sink::new(&config(&d.url()), "llm").expect("sink");
    let want = spread(40, 0);
    let started = Instant::now();
    let applied = sink.apply(&want).await.expect("push");
    let took = started.elapsed();
    assert_eq!(applied.changed, 40);
    assert_eq!(sink.current().await.expect("read"), Some(want));
    // login + pool + members + start + 40 PATCHes 8 at a time + commit = 10 round trips, ~1.5 s;
    // one after another it would be 45 (6.8 s), more than three 2 s cycles.
    assert!(took < Duration::from_millis(3000), "push took {took:?}");
    assert!((2..=8).contains(&d.max_in_flight()), "in flight at once: {}", d.max_in_flight());
    assert_eq!(logins(&d.requests()), 1);
    assert_eq!(started_transactions(&d), 0);
}

#[tokio::test]
async fn a_push_cut_short_leaves_no_transaction_open() {
    let d = double(DoubleConfig { latency: Duration::from_millis(100), ..DoubleConfig::default() }, 40).await;
    let mut cfg = config(&d.url());
    cfg.concurrency = 1;
    let sink = F5Sink::new(&cfg, "llm").expect("sink");
    // The controller's push_timeout drops the push while PATCHes are being queued.
    let cut = tokio::time::timeout(Duration::from_millis(900), sink.apply(&spread(40, 0))).await;
    assert!(cut.is_err(), "the push was meant to be cut short");
    assert!(d.transactions().iter().any(|(_, _, queued)| *queued > 0), "a transaction was being filled");
    eventually("the abandoned transaction is deleted", Duration::from_secs(3), || {
        started_transactions(&d) == 0
    })
    .await;
    assert!(d.requests().iter().any(|r| r.method == "DELETE" && r.path.starts_with("/mgmt/tm/transaction/")));
    assert_eq!(d.ratio(POOL, "10.0.1.1:8000"), Some(1), "nothing applied");
    // The next push, with time enough, applies everything.
    sink.apply(&spread(40, 0)).await.expect("push");
    assert_eq!(d.ratio(POOL, "10.0.1.40:8000"), Some(2 + 39));
}

#[tokio::test]
async fn a_wrong_password_backs_off_and_a_rotated_one_is_used_at_once() {
    let d = double(DoubleConfig::default(), 3).await;
    let dir = tempfile::tempdir().expect("tmp");
    let pw = dir.path().join("password");
    std::fs::write(&pw, "wrong\n").expect("write");
    let mut cfg = config(&d.url());
    cfg.password = SecretRef::File(pw.clone());
    // Scaled down from the default 15 s so the test runs in seconds: 0, 0.3, 0.9, 2.1 s ...
    cfg.login_backoff = Duration::from_millis(300);
    let sink = F5Sink::new(&cfg, "llm").expect("sink");

    // A controller cycling every 100 ms, membership read from the pool, for 1.8 s.
    let start = Instant::now();
    let mut errors = Vec::new();
    while start.elapsed() < Duration::from_millis(1800) {
        match sink.members().await {
            Err(e) => errors.push(e),
            Ok(m) => panic!("logged in with a wrong password: {m:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let tried = logins(&d.requests());
    assert!((2..=3).contains(&tried), "{tried} logins in 1.8 s");
    assert!(errors.iter().all(|e| matches!(e, SinkError::Auth { .. })), "{errors:?}");
    let waiting = errors.last().map(ToString::to_string).unwrap_or_default();
    assert!(waiting.contains("not sending them again") && waiting.contains("password changes"), "{waiting}");
    assert!(!errors.iter().any(|e| e.to_string().contains("wrong")), "the password never appears");

    // The Secret is fixed: the very next cycle logs in, without waiting out the backoff.
    std::fs::write(&pw, format!("{PASSWORD}\n")).expect("write");
    let members = sink.members().await.expect("logged in with the rotated password");
    assert_eq!(members.map(|m| m.len()), Some(3));
    assert_eq!(logins(&d.requests()), tried + 1);
}

#[tokio::test]
async fn a_role_that_cannot_write_is_reported_as_such_without_logging_in_again() {
    let d = double(DoubleConfig::default(), 3).await;
    d.add_user(UserSpec::new("operator", PASSWORD, Role::Operator));
    let mut cfg = config(&d.url());
    cfg.username = Username::Plain("operator".into());
    let sink = F5Sink::new(&cfg, "llm").expect("sink");
    for _ in 0..3 {
        let err = sink.apply(&spread(3, 0)).await.expect_err("an Operator may not change ratios");
        assert!(matches!(err, SinkError::Forbidden { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("role cannot modify pool members") && msg.contains(POOL), "{msg}");
        assert_eq!(err.kind(), "forbidden");
    }
    assert_eq!(logins(&d.requests()), 1, "the token was fine: no login loop");
}

#[tokio::test]
async fn an_ha_pair_is_written_on_its_active_unit_and_a_failover_is_followed() {
    let a = double(DoubleConfig::default(), 3).await;
    let b = double(DoubleConfig::default(), 3).await;
    b.set_failover_status("STANDBY");
    let mut cfg = config("");
    cfg.url = String::new();
    cfg.urls = vec![a.url(), b.url()];
    let sink = F5Sink::new(&cfg, "llm").expect("sink");

    sink.apply(&spread(3, 0)).await.expect("push");
    assert_eq!(a.ratio(POOL, "10.0.1.1:8000"), Some(2));
    assert!(b.requests().iter().all(|r| !r.is_member_write()), "nothing written on the standby");

    // Failover: b takes over. The next push finds it and writes there only.
    a.set_failover_status("STANDBY");
    b.set_failover_status("ACTIVE");
    a.clear_requests();
    sink.apply(&spread(3, 7)).await.expect("push after failover");
    assert_eq!(b.ratio(POOL, "10.0.1.1:8000"), Some(9));
    assert!(a.requests().iter().all(|r| !r.is_member_write()), "nothing written on the old active unit");

    // Neither active (both rebooting, or split brain resolved to none): a passing error, no write.
    b.set_failover_status("OFFLINE");
    let err = sink.apply(&spread(3, 11)).await.expect_err("no active unit");
    assert!(
        matches!(err, SinkError::Temporary { .. }) && err.to_string().contains("no unit is ACTIVE"),
        "{err}"
    );
    assert!(err.to_string().contains("STANDBY") && err.to_string().contains("OFFLINE"), "{err}");
    assert_eq!(b.ratio(POOL, "10.0.1.1:8000"), Some(9));

    // Credentials neither unit accepts: an authentication error, not "no unit is ACTIVE".
    let mut wrong = cfg.clone();
    wrong.username = Username::Plain("nobody".into());
    let err = F5Sink::new(&wrong, "llm").expect("sink").apply(&spread(3, 11)).await.expect_err("refused");
    assert!(matches!(err, SinkError::Auth { .. }), "{err}");
}

#[tokio::test]
async fn sideband_mode_reads_members_and_never_writes() {
    let d = double(DoubleConfig::default(), 3).await;
    let mut cfg = config(&d.url());
    cfg.mode = F5Mode::Sideband;
    let sink = F5Sink::new(&cfg, "llm").expect("sink");
    assert_eq!(sink.kind(), "f5-sideband");
    assert_eq!(sink.members().await.expect("members").map(|m| m.len()), Some(3));
    let applied = sink.apply(&spread(3, 5)).await.expect("apply");
    assert_eq!(applied.changed, 0);
    assert!(d.requests().iter().all(|r| r.method == "GET" || r.path == "/mgmt/shared/authn/login"));
    assert_eq!(d.ratio(POOL, "10.0.1.1:8000"), Some(1));
}
