//! The HAProxy sink in agent mode: HAProxy's own `agent-check` pulls the weights from the controller.
//! Real HAProxy (Debian 2.6), no admin socket write involved.

use std::time::Duration;

use llm_lc_adapters::haproxy::{HaproxyConfig, HaproxySink};
use llm_lc_adapters::{MemberId, RatioSink, Ratios, SinkError};
use llm_lc_testkit::haproxy::{standard_config, Haproxy};
use llm_lc_testkit::wait;

fn ratios(pairs: &[(&str, u32)]) -> Ratios {
    pairs.iter().map(|(m, r)| (MemberId::from(*m), *r)).collect()
}

/// The haproxy.cfg lines the agent mode needs (same shape as deploy/haproxy/haproxy-agent.cfg):
/// `weight 100` so N% is weight N, and `agent-send` carrying the member id.
fn agent_backend(agent_port: u16, members: &[(&str, &str)]) -> String {
    let mut cfg = String::from("backend be\n    balance roundrobin\n");
    for (name, id) in members {
        cfg.push_str(&format!(
            "    server {name} {id} weight 100 agent-check agent-addr 127.0.0.1 agent-port {agent_port} \
             agent-inter 200ms agent-send \"{id}\\n\"\n"
        ));
    }
    cfg
}

async fn wait_weights(hx: &Haproxy, want: [u32; 2]) {
    wait::until(Duration::from_secs(5), &format!("HAProxy weights {want:?} from the agent"), || async {
        let got = [hx.weight("be", "a").await.0, hx.weight("be", "b").await.0];
        (got == want).then_some(())
    })
    .await
}

#[tokio::test]
async fn agent_check_drives_haproxy_weights() {
    let a = format!("127.0.0.1:{}", llm_lc_testkit::ports::free_port());
    let b = format!("127.0.0.1:{}", llm_lc_testkit::ports::free_port());
    // Bind first (port 0), then tell HAProxy where the agent is.
    let s = HaproxySink::new(&HaproxyConfig::agent("127.0.0.1:0", "be"), "agent-pool").unwrap();
    let agent_port = s.agent_addr().expect("agent mode listens").port();
    let hx = Haproxy::start(&standard_config(&agent_backend(agent_port, &[("a", &a), ("b", &b)]))).await;

    // Before any ratio the agent answers "no change": HAProxy keeps haproxy.cfg's weights.
    assert_eq!(s.current().await.unwrap(), None, "agent mode without address cannot read HAProxy");
    assert_eq!((hx.weight("be", "a").await.0, hx.weight("be", "b").await.0), (100, 100));

    let applied = s.apply(&ratios(&[(&a, 30), (&b, 10)])).await.unwrap();
    assert_eq!((applied.changed, applied.unchanged), (2, 0));
    wait_weights(&hx, [30, 10]).await;

    // Percentages above 100 work too (weight 100 x 180% = 180).
    s.apply(&ratios(&[(&a, 5), (&b, 180)])).await.unwrap();
    wait_weights(&hx, [5, 180]).await;

    // Draining every member is refused; the agent keeps its previous answers.
    let drain = HaproxyConfig { allow_drain: true, ..HaproxyConfig::agent("127.0.0.1:0", "be") };
    let ds = HaproxySink::new(&drain, "agent-pool").unwrap();
    assert!(matches!(ds.apply(&ratios(&[(&a, 0), (&b, 0)])).await, Err(SinkError::Rejected { .. })));

    // After shutdown the agent is gone; HAProxy keeps the last weights it got.
    s.shutdown().await;
    wait::until(Duration::from_secs(2), "agent port to close", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", agent_port)).await.is_err().then_some(())
    })
    .await;
    assert_eq!((hx.weight("be", "a").await.0, hx.weight("be", "b").await.0), (5, 180));
}

#[tokio::test]
async fn agent_mode_reads_through_a_user_level_socket() {
    let a = format!("127.0.0.1:{}", llm_lc_testkit::ports::free_port());
    let b = format!("127.0.0.1:{}", llm_lc_testkit::ports::free_port());
    let agent_port = llm_lc_testkit::ports::free_port();
    let hx = Haproxy::start(&standard_config(&agent_backend(agent_port, &[("a", &a), ("b", &b)]))).await;
    // The address is used only by members()/current(): `level user` suffices for reading.
    let cfg = HaproxyConfig {
        address: Some(hx.user_runtime_address()),
        ..HaproxyConfig::agent(format!("127.0.0.1:{agent_port}"), "be")
    };
    let s = HaproxySink::new(&cfg, "p").unwrap();

    let mut want = vec![MemberId::new(&a), MemberId::new(&b)];
    want.sort();
    assert_eq!(s.members().await.unwrap(), Some(want));
    s.apply(&ratios(&[(&a, 40), (&b, 20)])).await.unwrap();
    wait::until(Duration::from_secs(5), "current() to show the agent's weights", || async {
        (s.current().await.ok()? == Some(ratios(&[(&a, 40), (&b, 20)]))).then_some(())
    })
    .await;
}
