//! The Envoy sink over gRPC xDS (feature `ads`) against a real Envoy (1.40): the shipped ADS bootstrap,
//! and the same cluster on a plain EDS gRPC stream. Run with
//! `cargo test -p llm-lc-adapters --features ads --test envoy_ads`.
#![cfg(feature = "ads")]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use llm_lc_adapters::envoy::{EdsRegistry, EnvoyConfig, EnvoySink};
use llm_lc_adapters::{MemberId, RatioSink, Ratios};
use llm_lc_testkit::envoy::{rewrite, serve, CountingBackend, Envoy, Served};
use llm_lc_testkit::wait;

const READY: Duration = Duration::from_secs(20);
/// A pushed assignment has no poll period to wait for; this only covers a loaded machine.
const PUSHED: Duration = Duration::from_secs(1);

fn ads_bootstrap(eds_port: u16) -> String {
    let path = format!("{}/../deploy/envoy/envoy-ads.yaml", env!("CARGO_MANIFEST_DIR"));
    let shipped = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let eds = format!("address: 127.0.0.1, port_value: {eds_port}");
    rewrite(
        &shipped,
        &[
            ("address: 127.0.0.1, port_value: 9901", "address: 127.0.0.1, port_value: 0"),
            ("address: 0.0.0.0, port_value: 10000", "address: 127.0.0.1, port_value: 0"),
            ("address: llm-load-controller, port_value: 9090", &eds),
        ],
    )
}

/// The same cluster fed by a non-aggregated EDS gRPC stream (`api_config_source {api_type: GRPC}`).
fn eds_grpc_bootstrap(eds_port: u16) -> String {
    rewrite(
        &ads_bootstrap(eds_port),
        &[(
            "        ads: {}\n",
            "        api_config_source:\n          api_type: GRPC\n          transport_api_version: V3\n          \
             grpc_services: [{envoy_grpc: {cluster_name: llm-load-controller}}]\n",
        )],
    )
}

struct Controller {
    eds: Arc<EdsRegistry>,
    served: Served,
    sink: EnvoySink,
}

impl Controller {
    async fn start() -> Controller {
        let eds = Arc::new(EdsRegistry::new());
        let served = serve(eds.clone().router()).await;
        let cfg: EnvoyConfig = serde_json::from_value(serde_json::json!({"cluster": "vllm"})).unwrap();
        let sink = EnvoySink::new(&cfg, "pool-a", eds.clone()).unwrap();
        Controller { eds, served, sink }
    }

    async fn apply(&self, r: &[(&str, u32)]) {
        let ratios: Ratios = r.iter().map(|(m, w)| (MemberId::from(*m), *w)).collect();
        self.sink.apply(&ratios).await.unwrap();
    }
}

fn hosts(r: &[(&str, u32)]) -> BTreeMap<String, u32> {
    r.iter().map(|(m, w)| (m.to_string(), *w)).collect()
}

async fn pushes_reach_envoy(bootstrap: fn(u16) -> String, what: &str) {
    let ctl = Controller::start().await;
    let (a, b) = (CountingBackend::start("a").await, CountingBackend::start("b").await);

    // Nothing to send yet: the stream stays quiet and Envoy does not go live without endpoints.
    let mut envoy = Envoy::start(&bootstrap(ctl.served.port)).await;
    wait::until(READY, "Envoy to open its xDS stream", || async {
        (!ctl.eds.pollers("vllm").is_empty()).then_some(())
    })
    .await;
    assert!(!envoy.is_ready().await, "Envoy went live with no endpoints");

    ctl.apply(&[(&a.addr(), 3), (&b.addr(), 1)]).await;
    let took = envoy.wait_ready(PUSHED).await;
    eprintln!("{what}: live {took:?} after the first push");
    assert_eq!(envoy.weights("vllm").await, Some(hosts(&[(&a.addr(), 3), (&b.addr(), 1)])));

    for (wa, wb) in [(1, 5), (2, 0), (4, 4)] {
        ctl.apply(&[(&a.addr(), wa), (&b.addr(), wb)]).await;
        // A member at 0 is left out of what Envoy gets.
        let want: BTreeMap<String, u32> =
            [(a.addr(), wa), (b.addr(), wb)].into_iter().filter(|(_, w)| *w > 0).collect();
        let took = envoy.wait_weights("vllm", &want, PUSHED).await;
        eprintln!("{what}: {wa}:{wb} reached Envoy {took:?} after apply");
    }
    assert_eq!(envoy.stat("cluster.vllm.update_rejected").await, Some(0), "{}", envoy.log());
    let version = ctl.eds.assignment("vllm").unwrap().version;
    assert_eq!(envoy.text_stat("cluster.vllm.version_text").await.as_deref(), Some(version.as_str()));
    let pollers = ctl.eds.pollers("vllm");
    assert_eq!(pollers[0].node_id, "envoy-edge", "{pollers:?}");
    assert!(pollers[0].up_to_date, "ACK of the last push recorded: {pollers:?}");

    // A restarted Envoy comes up with the current weights.
    envoy.stop().await;
    ctl.apply(&[(&a.addr(), 1), (&b.addr(), 2)]).await;
    envoy.start_again().await;
    envoy.wait_ready(READY).await;
    assert_eq!(envoy.weights("vllm").await, Some(hosts(&[(&a.addr(), 1), (&b.addr(), 2)])));
}

#[tokio::test]
async fn ads_pushes_each_new_assignment_at_once() {
    pushes_reach_envoy(ads_bootstrap, "ADS").await;
}

#[tokio::test]
async fn eds_grpc_stream_pushes_each_new_assignment_at_once() {
    pushes_reach_envoy(eds_grpc_bootstrap, "EDS gRPC").await;
}
