//! The HAProxy sink with several runtime addresses: two real HAProxy instances serving the same
//! backend (router replicas, an HA pair). Each is weighted; one down does not block the other; the
//! per-instance outcome is reported; and an instance that comes back is weighted on the very next
//! apply (the sink holds no backoff).

use llm_lc_adapters::haproxy::{HaproxyConfig, HaproxySink};
use llm_lc_adapters::{MemberId, RatioSink, Ratios, SinkError};
use llm_lc_testkit::haproxy::{standard_config, Haproxy};
use llm_lc_testkit::ports::free_port;

fn ratios(pairs: &[(&str, u32)]) -> Ratios {
    pairs.iter().map(|(m, r)| (MemberId::from(*m), *r)).collect()
}

/// Two HAProxy instances with the same backend servers (fixed ports, written into both configs).
async fn pair() -> (Haproxy, Haproxy, [String; 2]) {
    let (pa, pb) = (free_port(), free_port());
    let body = format!(
        "backend be\n    balance roundrobin\n    server s1 127.0.0.1:{pa}\n    server s2 127.0.0.1:{pb}\n"
    );
    let one = Haproxy::start(&standard_config(&body)).await;
    let two = Haproxy::start(&standard_config(&body)).await;
    (one, two, [format!("127.0.0.1:{pa}"), format!("127.0.0.1:{pb}")])
}

fn two_instance_sink(one: &Haproxy, two: &Haproxy) -> HaproxySink {
    let cfg: HaproxyConfig = serde_json::from_value(serde_json::json!({
        "addresses": [one.runtime_address(), two.runtime_tcp_address()],
        "backend": "be",
        "timeout": "500ms",
    }))
    .expect("config");
    assert!(cfg.validate().is_empty(), "{:?}", cfg.validate());
    HaproxySink::new(&cfg, "pool").expect("sink")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_instance_is_weighted_and_one_down_does_not_block_the_other() {
    let (one, mut two, [a, b]) = pair().await;
    let sink = two_instance_sink(&one, &two);

    let applied = sink.apply(&ratios(&[(&a, 30), (&b, 70)])).await.expect("both up");
    assert_eq!((applied.changed, applied.unchanged), (2, 0));
    assert!(applied.warnings.is_empty(), "{:?}", applied.warnings);
    for hx in [&one, &two] {
        assert_eq!(hx.weight("be", "s1").await.0, 30);
        assert_eq!(hx.weight("be", "s2").await.0, 70);
    }
    let outcomes = sink.instance_outcomes();
    assert_eq!(outcomes.len(), 2);
    assert!(outcomes.iter().all(|o| o.ok && o.changed == 2 && o.error.is_none()), "{outcomes:?}");
    assert_eq!(sink.current().await.expect("current"), Some(ratios(&[(&a, 30), (&b, 70)])));

    // Instance two goes down: instance one still gets the new weights; the failure is named.
    two.stop().await;
    let applied = sink.apply(&ratios(&[(&a, 60), (&b, 40)])).await.expect("one instance suffices");
    assert_eq!(applied.changed, 2);
    assert_eq!(one.weight("be", "s1").await.0, 60);
    assert_eq!(applied.warnings.len(), 1, "{:?}", applied.warnings);
    let w = &applied.warnings[0];
    let two_addr = format!("127.0.0.1:{}", two.admin_port());
    assert!(w.contains(&two_addr) && w.contains("not weighted"), "{w}");
    let outcomes = sink.instance_outcomes();
    assert!(outcomes[0].ok, "{outcomes:?}");
    assert!(!outcomes[1].ok && outcomes[1].address == two_addr, "{outcomes:?}");
    assert!(outcomes[1].error.as_deref().is_some_and(|e| e.contains(&two_addr)), "{outcomes:?}");
    assert_eq!(
        sink.members().await.expect("members from the instance that answers").map(|m| m.len()),
        Some(2)
    );

    // Back (restarted: haproxy.cfg weights again): the very next apply repairs it, no backoff.
    two.start_again().await;
    assert_eq!(two.weight("be", "s1").await.0, 1, "a restart loses runtime weights");
    let current = sink.current().await.expect("current").expect("some");
    assert_eq!(current.get(&MemberId::from(a.as_str())), Some(1), "drift on the restarted instance shows");
    let applied = sink.apply(&ratios(&[(&a, 60), (&b, 40)])).await.expect("both up again");
    assert!(applied.warnings.is_empty(), "{:?}", applied.warnings);
    assert_eq!(two.weight("be", "s1").await.0, 60);
    assert_eq!(two.weight("be", "s2").await.0, 40);
    assert!(sink.instance_outcomes().iter().all(|o| o.ok));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_instances_down_is_an_error() {
    let (mut one, mut two, [a, _]) = pair().await;
    let sink = two_instance_sink(&one, &two);
    one.stop().await;
    two.stop().await;
    let e = sink.apply(&ratios(&[(&a, 5)])).await.expect_err("nothing weighted");
    assert!(matches!(e, SinkError::Unreachable { .. }), "{e}");
    assert!(sink.instance_outcomes().iter().all(|o| !o.ok));
    assert!(sink.members().await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_three_instances_and_two_down_the_warnings_count_one_weighted() {
    let (pa, pb) = (free_port(), free_port());
    let body = format!(
        "backend be\n    balance roundrobin\n    server s1 127.0.0.1:{pa}\n    server s2 127.0.0.1:{pb}\n"
    );
    let one = Haproxy::start(&standard_config(&body)).await;
    let mut two = Haproxy::start(&standard_config(&body)).await;
    let mut three = Haproxy::start(&standard_config(&body)).await;
    let cfg: HaproxyConfig = serde_json::from_value(serde_json::json!({
        "addresses": [one.runtime_address(), two.runtime_address(), three.runtime_address()],
        "backend": "be",
        "timeout": "500ms",
    }))
    .expect("config");
    let sink = HaproxySink::new(&cfg, "pool").expect("sink");
    two.stop().await;
    three.stop().await;
    let a = format!("127.0.0.1:{pa}");
    let applied = sink.apply(&ratios(&[(&a, 60)])).await.expect("one instance suffices");
    assert_eq!(applied.warnings.len(), 2, "{:?}", applied.warnings);
    for w in &applied.warnings {
        assert!(w.contains("(1 of 3 instances were)"), "{w}");
    }
}
