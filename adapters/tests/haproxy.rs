//! The HAProxy sink against a real HAProxy (Debian 2.6), started per test on free ports with a generated
//! config. Weights are checked with the launcher's own runtime-API client, not the sink's.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use llm_lc_adapters::haproxy::{HaproxyConfig, HaproxySink, MatchBy, RuntimeAddr, RuntimeClient};
use llm_lc_adapters::{Applied, MemberId, RatioSink, Ratios, SinkError};
use llm_lc_testkit::haproxy::{standard_config, Haproxy};

fn ratios(pairs: &[(&str, u32)]) -> Ratios {
    pairs.iter().map(|(m, r)| (MemberId::from(*m), *r)).collect()
}

/// Three servers that need not exist (no health checks): only weights are looked at.
async fn three_server_haproxy() -> (Haproxy, [String; 3]) {
    let hx = Haproxy::start(&standard_config(
        "backend be\n    balance roundrobin\n    server s1 127.0.0.1:{{PORT:a}}\n    server s2 127.0.0.1:{{PORT:b}}\n    \
         server s3 127.0.0.1:{{PORT:c}}\n\nbackend bs\n    balance static-rr\n    server x 127.0.0.1:{{PORT:x}}\n",
    ))
    .await;
    let ids = ["a", "b", "c"].map(|n| format!("127.0.0.1:{}", hx.port(n)));
    (hx, ids)
}

fn sink(cfg: HaproxyConfig) -> HaproxySink {
    HaproxySink::new(&cfg, "test-pool").expect("valid haproxy sink config")
}

#[tokio::test]
async fn weights_show_up_in_get_weight_and_servers_state() {
    let (hx, [a, b, c]) = three_server_haproxy().await;
    let s = sink(HaproxyConfig::runtime(hx.runtime_address(), "be"));

    let mut expected_members = vec![MemberId::new(&a), MemberId::new(&b), MemberId::new(&c)];
    expected_members.sort();
    assert_eq!(s.members().await.unwrap(), Some(expected_members), "membership comes from the backend");

    // b already has weight 1 (from haproxy.cfg): only a and c are pushed.
    let applied = s.apply(&ratios(&[(&a, 3), (&b, 1), (&c, 200)])).await.unwrap();
    assert_eq!(applied, Applied { changed: 2, unchanged: 1, warnings: vec![] });
    assert_eq!(hx.weight("be", "s1").await, (3, 1));
    assert_eq!(hx.weight("be", "s2").await, (1, 1));
    assert_eq!(hx.weight("be", "s3").await, (200, 1));
    let state = hx.state_weights("be").await;
    assert_eq!(
        state.into_iter().collect::<Vec<_>>(),
        vec![("s1".into(), 3), ("s2".into(), 1), ("s3".into(), 200)]
    );
    assert_eq!(s.current().await.unwrap(), Some(ratios(&[(&a, 3), (&b, 1), (&c, 200)])));

    // Same ratios again: nothing to push.
    let again = s.apply(&ratios(&[(&a, 3), (&b, 1), (&c, 200)])).await.unwrap();
    assert_eq!((again.changed, again.unchanged), (0, 3));

    // The TCP runtime socket works the same.
    let tcp = sink(HaproxyConfig::runtime(hx.runtime_tcp_address(), "be"));
    let applied = tcp.apply(&ratios(&[(&a, 7)])).await.unwrap();
    assert_eq!(applied.changed, 1);
    assert_eq!(hx.weight("be", "s1").await, (7, 1));
}

#[tokio::test]
async fn scaled_ratios_name_matching_and_drain() {
    let (hx, [a, b, c]) = three_server_haproxy().await;

    // ratio_max 1000 -> weights 1..256, proportional; current() converts back.
    let scaled =
        sink(HaproxyConfig { ratio_max: Some(1000), ..HaproxyConfig::runtime(hx.runtime_address(), "be") });
    scaled.apply(&ratios(&[(&a, 500), (&b, 1000), (&c, 1)])).await.unwrap();
    assert_eq!(hx.state_weights("be").await.into_values().collect::<Vec<_>>(), vec![128, 256, 1]);
    // current() reports the applied ratios exactly (ratio 1 became weight 1, which alone would read
    // back as ratio 4), so the controller sees "already applied" and skips the push.
    assert_eq!(scaled.current().await.unwrap(), Some(ratios(&[(&a, 500), (&b, 1000), (&c, 1)])));
    // Hand edit: drift shows, converted back through ratio_max.
    hx.command("set server be/s1 weight 64").await;
    assert_eq!(scaled.current().await.unwrap().unwrap().get(&MemberId::new(&a)), Some(250));

    // match_by name: the member id is the server name.
    let by_name =
        sink(HaproxyConfig { match_by: MatchBy::Name, ..HaproxyConfig::runtime(hx.runtime_address(), "be") });
    by_name.apply(&ratios(&[("s2", 9)])).await.unwrap();
    assert_eq!(hx.weight("be", "s2").await.0, 9);
    assert_eq!(by_name.current().await.unwrap().unwrap().get(&MemberId::new("s2")), Some(9));

    // Ratio 0 without allow_drain: weight 1, never 0.
    let plain = sink(HaproxyConfig::runtime(hx.runtime_address(), "be"));
    plain.apply(&ratios(&[(&a, 0), (&b, 4), (&c, 4)])).await.unwrap();
    assert_eq!(hx.weight("be", "s1").await.0, 1);
    assert_eq!(plain.current().await.unwrap(), Some(ratios(&[(&a, 0), (&b, 4), (&c, 4)])));

    // With allow_drain: one server may go to 0 ...
    let drain =
        sink(HaproxyConfig { allow_drain: true, ..HaproxyConfig::runtime(hx.runtime_address(), "be") });
    drain.apply(&ratios(&[(&a, 0), (&b, 4), (&c, 4)])).await.unwrap();
    assert_eq!(hx.weight("be", "s1").await.0, 0);
    // ... but never all of them; HAProxy is left as it was.
    let err = drain.apply(&ratios(&[(&a, 0), (&b, 0), (&c, 0)])).await.unwrap_err();
    assert!(matches!(err, SinkError::Rejected { .. }), "{err}");
    assert!(err.to_string().contains("every server of backend be"), "{err}");
    assert_eq!(hx.state_weights("be").await.into_values().collect::<Vec<_>>(), vec![0, 4, 4]);
}

/// An HTTP server that counts the requests it answers.
async fn counting_server() -> (u16, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    let app = axum::Router::new().fallback(move || {
        let counter = counter.clone();
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            "ok"
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (port, hits)
}

async fn send_requests(client: &reqwest::Client, url: &str, n: usize) {
    for _ in 0..n {
        let r = client.get(url).send().await.expect("request through HAProxy");
        assert!(r.status().is_success(), "HAProxy answered {}", r.status());
    }
}

#[tokio::test]
async fn traffic_split_follows_the_weights() {
    let (pa, hits_a) = counting_server().await;
    let (pb, hits_b) = counting_server().await;
    let hx = Haproxy::start(&standard_config(&format!(
        "frontend fe\n    bind 127.0.0.1:{{{{PORT:fe}}}}\n    default_backend be\n\nbackend be\n    balance roundrobin\n    \
         server a 127.0.0.1:{pa}\n    server b 127.0.0.1:{pb}\n"
    )))
    .await;
    let (a, b) = (format!("127.0.0.1:{pa}"), format!("127.0.0.1:{pb}"));
    let url = format!("http://127.0.0.1:{}/v1/completions", hx.port("fe"));
    let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().unwrap();
    let s = sink(HaproxyConfig::runtime(hx.runtime_address(), "be"));

    s.apply(&ratios(&[(&a, 3), (&b, 1)])).await.unwrap();
    send_requests(&client, &url, 400).await;
    let (na, nb) = (hits_a.swap(0, Ordering::SeqCst), hits_b.swap(0, Ordering::SeqCst));
    assert_eq!(na + nb, 400);
    let share = na as f64 / nb as f64;
    eprintln!("weights 3:1 -> {na}:{nb} ({share:.2})");
    assert!((2.7..=3.3).contains(&share), "3:1 weights gave {na}:{nb}");

    // Reversed weights reverse the split: it is the weights, not server order.
    s.apply(&ratios(&[(&a, 1), (&b, 3)])).await.unwrap();
    send_requests(&client, &url, 400).await;
    let (na, nb) = (hits_a.load(Ordering::SeqCst), hits_b.load(Ordering::SeqCst));
    eprintln!("weights 1:3 -> {na}:{nb}");
    assert!((2.7..=3.3).contains(&(nb as f64 / na as f64)), "1:3 weights gave {na}:{nb}");
}

#[tokio::test]
async fn weights_come_back_after_haproxy_restarts() {
    let (mut hx, [a, b, _]) = three_server_haproxy().await;
    let s = sink(HaproxyConfig::runtime(hx.runtime_address(), "be"));
    let desired = ratios(&[(&a, 5), (&b, 2)]);
    s.apply(&desired).await.unwrap();
    assert_eq!((hx.weight("be", "s1").await.0, hx.weight("be", "s2").await.0), (5, 2));

    // A restart drops runtime weights: HAProxy is back at haproxy.cfg's weights.
    hx.restart().await;
    assert_eq!(
        (hx.weight("be", "s1").await.0, hx.weight("be", "s2").await.0),
        (1, 1),
        "restart kept weights?"
    );
    let after = s.current().await.unwrap().unwrap();
    assert_eq!(
        (after.get(&MemberId::new(&a)), after.get(&MemberId::new(&b))),
        (Some(1), Some(1)),
        "drift visible"
    );
    let mut cycles = 0;
    while hx.weight("be", "s1").await.0 != 5 || hx.weight("be", "s2").await.0 != 2 {
        assert!(cycles < 2, "weights not restored within two cycles");
        let applied = s.apply(&desired).await.unwrap();
        assert_eq!(applied.changed, 2, "the cycle after a restart must see the drift");
        cycles += 1;
    }
    eprintln!("restored after {cycles} cycle(s)");

    // HAProxy down: a retryable error, quickly; the next cycle after it is back restores again.
    hx.stop().await;
    let t = Instant::now();
    let err = s.apply(&desired).await.unwrap_err();
    assert!(matches!(err, SinkError::Unreachable { .. }) && err.retryable(), "{err}");
    assert!(err.to_string().contains("backend be"), "error names the backend: {err}");
    assert!(t.elapsed() < Duration::from_secs(1), "socket gone should fail fast, took {:?}", t.elapsed());
    assert!(s.members().await.is_err());
    hx.start_again().await;
    let t = Instant::now();
    assert_eq!(s.apply(&desired).await.unwrap().changed, 2);
    eprintln!("apply (read + push) after start: {:?}", t.elapsed());
    assert_eq!((hx.weight("be", "s1").await.0, hx.weight("be", "s2").await.0), (5, 2));
}

#[tokio::test]
async fn unknown_backend_is_rejected_with_haproxys_words() {
    let (hx, [a, ..]) = three_server_haproxy().await;
    let s = sink(HaproxyConfig::runtime(hx.runtime_address(), "nope"));
    let err = s.apply(&ratios(&[(&a, 3)])).await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, SinkError::Rejected { .. }) && !err.retryable(), "{msg}");
    assert!(msg.contains("nope") && msg.contains("Can't find backend"), "{msg}");
    assert!(s.members().await.is_err());
    // The loop goes on: the same sink answers the next call the same way, and HAProxy is untouched.
    assert!(s.apply(&ratios(&[(&a, 3)])).await.is_err());
    assert_eq!(hx.weight("be", "s1").await.0, 1);
}

#[tokio::test]
async fn unknown_members_and_servers() {
    let (hx, [a, ..]) = three_server_haproxy().await;
    let s = sink(HaproxyConfig::runtime(hx.runtime_address(), "be"));

    // A member HAProxy does not have: a warning naming it; the others are still pushed.
    let applied = s.apply(&ratios(&[(&a, 6), ("10.9.9.9:8000", 2)])).await.unwrap();
    assert_eq!(applied.changed, 1);
    assert_eq!(applied.warnings.len(), 1, "{:?}", applied.warnings);
    assert!(applied.warnings[0].contains("10.9.9.9:8000") && applied.warnings[0].contains("be"));
    assert_eq!(hx.weight("be", "s1").await.0, 6);

    // A server that vanished between read and write (the runtime API answers per command): the refused
    // command is reported with HAProxy's text; the others in the same chain are applied.
    let client =
        RuntimeClient::new(RuntimeAddr::parse(&hx.runtime_address()).unwrap(), Duration::from_secs(2));
    let refused = client.set_weights("be", &[("ghost".into(), 3), ("s2".into(), 4)]).await.unwrap();
    assert_eq!(refused.len(), 1);
    assert_eq!((refused[0].server.as_str(), refused[0].message.as_str()), ("ghost", "No such server."));
    assert_eq!(hx.weight("be", "s2").await.0, 4);
    assert_eq!(client.get_weight("be", "s2").await.unwrap(), (4, 1));

    // A name no command may carry is not sent and is reported; the good ones beside it still are.
    let refused = client
        .set_weights("be", &[("s1".into(), 7), ("s2;shutdown sessions".into(), 9), ("s3".into(), 8)])
        .await
        .unwrap();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].server, "s2;shutdown sessions");
    assert!(refused[0].message.contains("not sent"), "{}", refused[0].message);
    assert_eq!(
        (hx.weight("be", "s1").await.0, hx.weight("be", "s2").await.0, hx.weight("be", "s3").await.0),
        (7, 4, 8)
    );
    // Nothing sendable: the refusal is the answer, and no connection is made for an empty chain
    // (this address has no listener, so an attempt would be an error).
    let nobody = RuntimeClient::new(
        RuntimeAddr::parse(&format!("127.0.0.1:{}", llm_lc_testkit::ports::free_port())).unwrap(),
        Duration::from_secs(2),
    );
    let refused = nobody.set_weights("be", &[("bad name".into(), 1)]).await.unwrap();
    assert_eq!(refused.len(), 1);
}

#[tokio::test]
async fn non_admin_socket_reads_but_cannot_write() {
    let (hx, [a, b, _]) = three_server_haproxy().await;
    let s = sink(HaproxyConfig::runtime(hx.user_runtime_address(), "be"));
    assert_eq!(s.members().await.unwrap().map(|m| m.len()), Some(3), "level user may read");
    let err = s.apply(&ratios(&[(&a, 3), (&b, 2)])).await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, SinkError::Auth { .. }), "{msg}");
    assert!(
        msg.contains("Permission denied") && msg.contains("be/s1") && msg.contains("level admin"),
        "{msg}"
    );
    assert_eq!(hx.weight("be", "s1").await.0, 1, "nothing changed");
    // The loop goes on: an admin sink on the same HAProxy works.
    let admin = sink(HaproxyConfig::runtime(hx.runtime_address(), "be"));
    assert_eq!(admin.apply(&ratios(&[(&a, 3), (&b, 2)])).await.unwrap().changed, 2);
}

#[tokio::test]
async fn static_rr_backend_is_rejected_naming_the_server() {
    let (hx, [a, ..]) = three_server_haproxy().await;
    let x = format!("127.0.0.1:{}", hx.port("x"));
    let s = sink(HaproxyConfig::runtime(hx.runtime_address(), "bs"));
    for _ in 0..2 {
        let err = s.apply(&ratios(&[(&x, 3)])).await.unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, SinkError::Rejected { .. }), "{msg}");
        assert!(msg.contains("bs/x") && msg.contains(&x) && msg.contains("static LB algorithm"), "{msg}");
        assert!(msg.contains("balance roundrobin"), "says what to do: {msg}");
    }
    // Other backends of the same HAProxy keep working.
    let be = sink(HaproxyConfig::runtime(hx.runtime_address(), "be"));
    assert_eq!(be.apply(&ratios(&[(&a, 2)])).await.unwrap().changed, 1);
}

#[tokio::test]
async fn every_exchange_has_a_timeout() {
    // Something that accepts connections and never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let _hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = silent.accept().await {
            held.push(sock);
        }
    });
    let s = sink(HaproxyConfig {
        timeout: Duration::from_millis(300),
        ..HaproxyConfig::runtime(addr.to_string(), "be")
    });
    let t = Instant::now();
    let err = s.apply(&ratios(&[("10.0.0.1:80", 1)])).await.unwrap_err();
    assert!(matches!(err, SinkError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains("no complete answer within 300ms"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2), "took {:?}", t.elapsed());

    // A socket path with nothing behind it.
    let s = sink(HaproxyConfig::runtime("unix:/nonexistent/haproxy.sock", "be"));
    let err = s.current().await.unwrap_err();
    assert!(err.retryable() && err.to_string().contains("/nonexistent/haproxy.sock"), "{err}");
}
