//! Leader election against a fake API server that enforces the Lease rules (resourceVersion
//! conflicts, MicroTime format, tokens): one leader at a time, takeover after expiry, release on
//! shutdown, conflicts. Short real durations; every wait polls with a deadline.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use llm_lc_testkit::kube::FakeKube;
use llm_lc_testkit::wait;
use llm_load_controller::adapters::SecretRef;
use llm_load_controller::kube::{ApiError, KubeApi};
use llm_load_controller::leader::{Elector, LeaderElectionConfig, Leadership, Settings};
use tokio::sync::watch;

const NS: &str = "llm";
const LEASE: &str = "llm-load-controller";

fn config(lease_ms: u64, renew_ms: u64, retry_ms: u64) -> LeaderElectionConfig {
    LeaderElectionConfig {
        lease_duration: Duration::from_millis(lease_ms),
        renew_deadline: Duration::from_millis(renew_ms),
        retry_period: Duration::from_millis(retry_ms),
        ..Default::default()
    }
}

/// A candidate named `id` that authenticates with token `tok-ID`.
fn elector(kube: &FakeKube, cfg: &LeaderElectionConfig, id: &str) -> Elector {
    let api = KubeApi::new(
        &kube.url(),
        Some(SecretRef::Value(format!("tok-{id}"))),
        None,
        Duration::from_millis(300),
    )
    .expect("client");
    Elector::new(api, Settings::new(cfg, NS, id))
}

/// Samples every candidate's belief every 5 ms and remembers the most that believed at once.
struct Watcher {
    max_at_once: Arc<Mutex<usize>>,
    task: tokio::task::JoinHandle<()>,
}

impl Watcher {
    fn start(rxs: Vec<watch::Receiver<bool>>) -> Watcher {
        let max_at_once = Arc::new(Mutex::new(0));
        let m = max_at_once.clone();
        let task = tokio::spawn(async move {
            loop {
                let n = rxs.iter().filter(|r| *r.borrow()).count();
                {
                    let mut g = m.lock().expect("lock");
                    *g = (*g).max(n);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        Watcher { max_at_once, task }
    }
    fn max(&self) -> usize {
        *self.max_at_once.lock().expect("lock")
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn until_leader(l: &Leadership, want: bool, timeout: Duration, what: &str) -> Instant {
    let rx = l.subscribe();
    wait::until(timeout, what, || {
        let v = *rx.borrow();
        async move { (v == want).then(Instant::now) }
    })
    .await
}

fn transitions(kube: &FakeKube) -> i64 {
    kube.lease(NS, LEASE).and_then(|l| l["spec"]["leaseTransitions"].as_i64()).expect("leaseTransitions")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_api_server_enforces_lease_rules() {
    let kube = FakeKube::start(&["tok-a"]).await;
    let http = reqwest::Client::new();
    let base = format!("{}/apis/coordination.k8s.io/v1/namespaces/{NS}/leases", kube.url());
    let lease = |rv: Option<&str>, renew: &str| {
        let mut v = serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": LEASE},
            "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15, "renewTime": renew}
        });
        if let Some(rv) = rv {
            v["metadata"]["resourceVersion"] = rv.into();
        }
        v
    };
    let good = "2024-05-01T12:00:00.000001Z";
    let r = http.post(&base).json(&lease(None, good)).send().await.expect("post");
    assert_eq!(r.status(), 401, "no token");
    let r = http.post(&base).bearer_auth("tok-a").json(&lease(None, good)).send().await.expect("post");
    assert_eq!(r.status(), 201);
    let rv = r.json::<serde_json::Value>().await.expect("json")["metadata"]["resourceVersion"]
        .as_str()
        .expect("rv")
        .to_string();
    let r = http.post(&base).bearer_auth("tok-a").json(&lease(None, good)).send().await.expect("post");
    assert_eq!(r.status(), 409, "second create");
    let body: serde_json::Value = r.json().await.expect("status json");
    assert_eq!(body["reason"], "AlreadyExists");
    let one = format!("{base}/{LEASE}");
    let r = http.put(&one).bearer_auth("tok-a").json(&lease(None, good)).send().await.expect("put");
    assert_eq!(r.status(), 422, "update without resourceVersion");
    let r =
        http.put(&one).bearer_auth("tok-a").json(&lease(Some(&rv), "2024-05-01T12:00:00.001Z")).send().await;
    assert_eq!(r.expect("put").status(), 400, "MicroTime with three digits");
    let r = http.put(&one).bearer_auth("tok-a").json(&lease(Some(&rv), good)).send().await.expect("put");
    assert_eq!(r.status(), 200);
    let r = http.put(&one).bearer_auth("tok-a").json(&lease(Some(&rv), good)).send().await.expect("put");
    assert_eq!(r.status(), 409, "stale resourceVersion");
    assert_eq!(r.json::<serde_json::Value>().await.expect("json")["reason"], "Conflict");

    // The client maps the same answers.
    let api = KubeApi::new(&kube.url(), Some(SecretRef::Value("tok-a".into())), None, Duration::from_secs(2))
        .expect("client");
    let stored = api.get(NS, LEASE).await.expect("get").expect("exists");
    assert_eq!(stored.spec.holder(), Some("a"));
    let mut stale = stored.clone();
    stale.metadata.resource_version = Some(rv);
    assert!(matches!(api.update(&stale).await, Err(ApiError::Conflict(_))));
    assert!(matches!(
        api.create(&stored).await,
        Err(ApiError::Conflict(_) | ApiError::Status { code: 400, .. })
    ));
    assert!(api.get(NS, "absent").await.expect("get").is_none());
    let wrong =
        KubeApi::new(&kube.url(), Some(SecretRef::Value("nope".into())), None, Duration::from_secs(2))
            .expect("client");
    let e = wrong.get(NS, LEASE).await.expect_err("401");
    assert!(matches!(e, ApiError::Unauthorized(_)), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_of_three_leads_and_keeps_leading() {
    let kube = FakeKube::start(&["tok-a", "tok-b", "tok-c"]).await;
    let cfg = config(1000, 600, 100);
    let all: Vec<Leadership> =
        ["a", "b", "c"].iter().map(|id| Leadership::spawn(elector(&kube, &cfg, id))).collect();
    let watcher = Watcher::start(all.iter().map(|l| l.subscribe()).collect());
    let leader = wait::until(Duration::from_secs(5), "a leader", || {
        let idx = all.iter().position(|l| l.is_leader());
        async move { idx }
    })
    .await;
    let id = ["a", "b", "c"][leader];
    // Healthy renewals for three lease durations: the same leader throughout, and never two.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        assert!(all[leader].is_leader(), "{id} lost leadership while healthy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(watcher.max(), 1, "two replicas believed they led at once");
    assert_eq!(kube.holder(NS, LEASE).as_deref(), Some(id));
    assert_eq!(transitions(&kube), 0);
    for (i, l) in all.iter().enumerate() {
        if i != leader {
            assert_eq!(l.holder().borrow().as_deref(), Some(id), "followers see who leads");
        }
    }
    assert!(kube.errors().is_empty(), "the API server rejected requests: {:?}", kube.errors());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_takes_over_after_the_leader_stops_renewing() {
    let kube = FakeKube::start(&["tok-a", "tok-b"]).await;
    let cfg = config(1000, 600, 100);
    let a = Leadership::spawn(elector(&kube, &cfg, "a"));
    until_leader(&a, true, Duration::from_secs(5), "a to lead").await;
    let b = Leadership::spawn(elector(&kube, &cfg, "b"));
    let watcher = Watcher::start(vec![a.subscribe(), b.subscribe()]);
    wait::until(Duration::from_secs(2), "b to see a as leader", || {
        let h = b.holder().borrow().clone();
        async move { (h.as_deref() == Some("a")).then_some(()) }
    })
    .await;

    // The API server becomes unreachable for a: it can no longer renew.
    let cut = Instant::now();
    kube.set_down_for("tok-a", true);
    let a_down = until_leader(&a, false, Duration::from_secs(3), "a to step down").await;
    let b_up = until_leader(&b, true, Duration::from_secs(5), "b to take over").await;
    assert!(a_down.duration_since(cut) <= Duration::from_millis(600 + 100 + 700), "a stepped down late");
    assert!(b_up >= a_down, "b led before a stepped down");
    assert!(
        b_up.duration_since(cut) >= Duration::from_millis(1000 - 150),
        "b took over before the lease could expire ({:?} after a's last chance to renew)",
        b_up.duration_since(cut)
    );
    assert_eq!(watcher.max(), 1, "two leaders at once");
    assert_eq!(kube.holder(NS, LEASE).as_deref(), Some("b"));
    assert_eq!(transitions(&kube), 1);

    // a comes back: it sees b renewing and stays a follower.
    kube.set_down_for("tok-a", false);
    wait::until(Duration::from_secs(3), "a to see b as leader", || {
        let h = a.holder().borrow().clone();
        async move { (h.as_deref() == Some("b")).then_some(()) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // longer than a lease: a must not grab it
    assert!(!a.is_leader() && b.is_leader());
    assert_eq!(watcher.max(), 1);
    assert!(kube.errors().is_empty(), "{:?}", kube.errors());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_on_shutdown_hands_over_without_waiting_for_expiry() {
    let kube = FakeKube::start(&["tok-a", "tok-b"]).await;
    // A long lease: without a release, b would wait about 5 s.
    let cfg = config(5000, 3000, 100);
    let a = Leadership::spawn(elector(&kube, &cfg, "a"));
    until_leader(&a, true, Duration::from_secs(5), "a to lead").await;
    let b = Leadership::spawn(elector(&kube, &cfg, "b"));
    let watcher = Watcher::start(vec![a.subscribe(), b.subscribe()]);
    // b has read the lease (it names a as holder), and follows.
    wait::until(Duration::from_secs(2), "b to see a as leader", || {
        let h = b.holder().borrow().clone();
        async move { (h.as_deref() == Some("a")).then_some(()) }
    })
    .await;
    assert!(!b.is_leader());

    let a_rx = a.subscribe();
    let stopped = Instant::now();
    a.stop().await;
    assert!(!*a_rx.borrow(), "a stepped down");
    let released = kube.lease(NS, LEASE).expect("lease");
    let b_up = until_leader(&b, true, Duration::from_secs(3), "b to take the released lease").await;
    assert!(
        b_up.duration_since(stopped) < Duration::from_millis(1500),
        "b took {:?}: the release did not hand over",
        b_up.duration_since(stopped)
    );
    assert!(
        released["spec"]["holderIdentity"] == "" || kube.holder(NS, LEASE).as_deref() == Some("b"),
        "released lease: {released}"
    );
    let now = kube.lease(NS, LEASE).expect("lease");
    assert_eq!(now["spec"]["holderIdentity"], "b");
    assert_eq!(now["spec"]["leaseDurationSeconds"], 5, "b writes its own lease duration back");
    assert_eq!(watcher.max(), 1);
    assert!(kube.errors().is_empty(), "{:?}", kube.errors());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicts_do_not_depose_and_a_foreign_holder_does() {
    let kube = FakeKube::start(&["tok-a"]).await;
    let cfg = config(1000, 600, 100);
    let a = Leadership::spawn(elector(&kube, &cfg, "a"));
    until_leader(&a, true, Duration::from_secs(5), "a to lead").await;
    let watcher = Watcher::start(vec![a.subscribe()]);

    // Two renewals answered 409: within the renew deadline, so a stays leader and renews after.
    let before = kube.stats().conflicts;
    kube.inject_conflicts(2);
    wait::until(Duration::from_secs(2), "two conflicts", || {
        let n = kube.stats().conflicts;
        async move { (n >= before + 2).then_some(()) }
    })
    .await;
    let rv_after_conflicts = kube.lease(NS, LEASE).expect("lease")["metadata"]["resourceVersion"].clone();
    wait::until(Duration::from_secs(2), "a to renew again", || {
        let rv = kube.lease(NS, LEASE).expect("lease")["metadata"]["resourceVersion"].clone();
        let changed = rv != rv_after_conflicts;
        async move { changed.then_some(()) }
    })
    .await;
    assert!(a.is_leader(), "conflicts within the renew deadline must not depose");
    assert_eq!(watcher.max(), 1);

    // Someone else writes itself in as holder (as a successor would after expiry): a steps down at
    // its next renewal instead of overwriting.
    kube.write_spec(
        NS,
        LEASE,
        serde_json::json!({"holderIdentity": "intruder", "leaseDurationSeconds": 1,
                           "renewTime": llm_load_controller::leader::micro_time_now(), "leaseTransitions": 1}),
    );
    let down = until_leader(&a, false, Duration::from_millis(500), "a to step down for the new holder").await;
    assert_eq!(a.holder().borrow().as_deref(), Some("intruder"));
    // The intruder never renews: a takes the lease back once it expires (1 s after a saw it).
    let up = until_leader(&a, true, Duration::from_secs(3), "a to take the expired lease back").await;
    assert!(up.duration_since(down) >= Duration::from_millis(850), "took over an unexpired lease");
    assert_eq!(transitions(&kube), 2);
    assert!(kube.errors().is_empty(), "{:?}", kube.errors());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_creates_have_one_winner() {
    for round in 0..5 {
        let kube = FakeKube::start(&["tok-a", "tok-b"]).await;
        let cfg = config(1000, 600, 100);
        let (mut a, mut b) = (elector(&kube, &cfg, "a"), elector(&kube, &cfg, "b"));
        let (ra, rb) = tokio::join!(a.try_acquire_or_renew(), b.try_acquire_or_renew());
        let won = |r: &Result<bool, ApiError>| matches!(r, Ok(true));
        assert!(won(&ra) ^ won(&rb), "round {round}: a={ra:?} b={rb:?}");
        for r in [&ra, &rb] {
            assert!(matches!(r, Ok(_) | Err(ApiError::Conflict(_))), "round {round}: {r:?}");
        }
        let winner = if won(&ra) { "a" } else { "b" };
        assert_eq!(kube.holder(NS, LEASE).as_deref(), Some(winner));
        // A second round right away: the winner renews, the loser still loses.
        assert!(matches!(a.try_acquire_or_renew().await, Ok(w) if w == (winner == "a")));
        assert!(matches!(b.try_acquire_or_renew().await, Ok(w) if w == (winner == "b")));
    }
}
