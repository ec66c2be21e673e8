//! Two controller processes, one Lease (on the fake API server), one real HAProxy: only the leader
//! sets weights; the follower computes and serves the same ratios but pushes nothing; when the
//! leader stops (SIGTERM) it releases the Lease and the follower takes over at once and pushes.

mod leader_support;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use leader_support::Proc;
use llm_lc_testkit::haproxy::{standard_config, Haproxy};
use llm_lc_testkit::kube::FakeKube;
use llm_lc_testkit::metrics_target::{vllm_text, MetricsTarget};
use llm_lc_testkit::{ports, wait};

fn start(dir: &Path, id: &str, kube: &FakeKube, haproxy: &Haproxy) -> Proc {
    let listen = ports::free_port();
    let cfg = dir.join(format!("{id}.yaml"));
    std::fs::write(
        &cfg,
        format!(
            "interval: 300ms\nlisten: 127.0.0.1:{listen}\n\
             leader_election:\n  enabled: true\n  api_url: '{}'\n  namespace: llm\n  token: {{ env: KUBE_TOKEN }}\n  \
             lease_duration: 3s\n  renew_deadline: 2s\n  retry_period: 200ms\n\
             sources:\n  direct: {{ kind: scrape, timeout: 1s }}\n\
             pools:\n  - name: llm\n    source: direct\n    members: {{ from_lb: true }}\n    \
             sink: {{ kind: haproxy, address: '{}', backend: llm }}\n",
            kube.url(),
            haproxy.runtime_address()
        ),
    )
    .expect("write config");
    let token = format!("tok-{id}");
    Proc::start(&cfg, listen, &[("POD_NAME", id), ("KUBE_TOKEN", &token)], &dir.join(format!("{id}.log")))
}

/// member -> ratio, and the push outcome, of the last cycle.
async fn last(p: &Proc) -> Option<(BTreeMap<String, u64>, String)> {
    let r = p.report().await?;
    let pool = &r["pools"][0];
    let ratios = pool["members"]
        .as_array()?
        .iter()
        .filter_map(|m| Some((m["member"].as_str()?.to_string(), m["ratio"].as_u64()?)))
        .collect();
    Some((ratios, pool["push"].as_str()?.to_string()))
}

async fn pushes(p: &Proc, outcome: &str) -> f64 {
    p.metric(&format!("llmlc_pushes_total{{pool=\"llm\",sink=\"haproxy\",outcome=\"{outcome}\"}}"))
        .await
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_pushes_and_the_follower_takes_over_on_release() {
    let t = [MetricsTarget::vllm(0.0, 2.0, 0.10).await, MetricsTarget::vllm(12.0, 60.0, 0.95).await];
    let members: Vec<String> = t.iter().map(|x| x.member()).collect();
    let servers: String =
        members.iter().enumerate().map(|(i, m)| format!("    server s{i} {m} weight 1\n")).collect();
    let h = Haproxy::start(&standard_config(&format!("backend llm\n    balance leastconn\n{servers}"))).await;
    let kube = FakeKube::start(&["tok-a", "tok-b"]).await;
    let tmp = tempfile::tempdir().expect("tmp");

    // HAProxy's weights as member -> weight.
    let weights = || async {
        let w = h.state_weights("llm").await;
        (0..members.len())
            .map(|i| (members[i].clone(), w[&format!("s{i}")] as u64))
            .collect::<BTreeMap<_, _>>()
    };

    let mut a = start(tmp.path(), "a", &kube, &h);
    wait::until(Duration::from_secs(10), "a to lead and push", || async {
        let (ratios, _) = last(&a).await?;
        let led = a.metric("llmlc_leader").await? == 1.0;
        (led && ratios.len() == 2 && weights().await == ratios && ratios[&members[0]] > ratios[&members[1]])
            .then_some(())
    })
    .await;
    assert_eq!(kube.holder("llm", "llm-load-controller").as_deref(), Some("a"));

    let mut b = start(tmp.path(), "b", &kube, &h);
    let (b_ratios, _) = wait::until(Duration::from_secs(10), "b to compute as a follower", || async {
        let (ratios, push) = last(&b).await?;
        (push == "follower" && ratios.len() == 2).then_some((ratios, push))
    })
    .await;
    assert!(b_ratios[&members[0]] > b_ratios[&members[1]], "the follower computes too: {b_ratios:?}");
    assert_eq!(b.metric("llmlc_leader").await, Some(0.0));
    let (code, body) = b.get("/readyz").await.expect("readyz");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("follower (leader: a)"), "{body}");

    // A hand edit on HAProxy: only the leader repairs it, and the follower never pushed anything.
    h.command("set server llm/s0 weight 7").await;
    wait::until(Duration::from_secs(10), "the leader to repair the drift", || async {
        let (ratios, _) = last(&a).await?;
        (weights().await == ratios).then_some(())
    })
    .await;
    assert_eq!(pushes(&b, "pushed").await, 0.0, "the follower pushed");
    assert!(pushes(&b, "follower").await >= 1.0);
    assert!(pushes(&a, "pushed").await >= 2.0, "first push and the repair");

    // The leader stops: it releases the Lease, b takes over well before the 3 s lease would expire.
    let stopped = Instant::now();
    let status = a.stop().await;
    assert!(status.success(), "a exited {status:?}\n{}", a.log());
    assert!(a.log().contains("released the leader lease"), "{}", a.log());
    wait::until(Duration::from_secs(2), "b to lead after the release", || async {
        (b.metric("llmlc_leader").await? == 1.0).then_some(())
    })
    .await;
    assert!(stopped.elapsed() < Duration::from_millis(2500), "takeover took {:?}", stopped.elapsed());
    assert_eq!(kube.holder("llm", "llm-load-controller").as_deref(), Some("b"));

    // The load flips: the new leader pushes the new ratios.
    t[0].set(&vllm_text(12.0, 60.0, 0.95));
    t[1].set(&vllm_text(0.0, 2.0, 0.10));
    wait::until(Duration::from_secs(15), "b to push the flipped ratios", || async {
        let (ratios, _) = last(&b).await?;
        (ratios[&members[1]] > ratios[&members[0]] && weights().await == ratios).then_some(())
    })
    .await;
    assert!(pushes(&b, "pushed").await >= 1.0);
    let status = b.stop().await;
    assert!(status.success(), "b exited {status:?}\n{}", b.log());
    assert_eq!(kube.holder("llm", "llm-load-controller"), None, "b released on exit too");
    assert!(kube.errors().is_empty(), "{:?}", kube.errors());
}
