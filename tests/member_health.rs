//! Per-member health: a member that cannot be read is counted by reason, warned about once (not
//! every cycle), and the pool keeps computing ratios for the others.

use std::sync::Arc;

use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::ports;
use llm_load_controller::config;
use llm_load_controller::controller::Controller;
use llm_load_controller::telemetry::Telemetry;

#[tokio::test]
async fn an_unreachable_member_is_counted_per_cycle_and_the_pool_still_computes() {
    let good = MetricsTarget::vllm(1.0, 10.0, 0.3).await;
    let dead = format!("127.0.0.1:{}", ports::free_port());
    let doc = serde_json::json!({
        "interval": "1s",
        "sources": {"direct": {"kind": "scrape", "timeout": "300ms"}},
        "pools": [{"name": "p", "source": "direct", "members": {"static": [good.member(), dead]}, "sink": {"kind": "dry-run"}}],
    });
    let cfg = config::parse(std::path::Path::new("<test>"), &doc.to_string()).expect("valid config");
    let telemetry: Arc<Telemetry> = Telemetry::new(cfg.interval, cfg.unready_after_cycles);
    let mut ctl = Controller::new(&cfg, telemetry.clone(), false, &Default::default()).expect("builds");
    for _ in 0..3 {
        let (report, _) = ctl.cycle().await;
        let pool = &report.pools[0];
        assert!(pool.state.is_ok(), "one readable member is enough: {pool:?}");
        assert_eq!(pool.members.len(), 2, "both members are reported");
    }
    let text = telemetry.metrics.encode();
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in:\n{text}"))
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .expect("a value")
    };
    let dead_errors = text
        .lines()
        .find(|l| l.starts_with("llmlc_member_errors_total{") && l.contains(&format!("member=\"{dead}\"")))
        .unwrap_or_else(|| panic!("no error count for {dead} in:\n{text}"));
    assert!(dead_errors.contains("reason=\"unreachable\""), "{dead_errors}");
    assert!(dead_errors.ends_with(" 3"), "one error per cycle: {dead_errors}");
    assert!(!text.contains(&format!("member=\"{}\",reason", good.member())), "the good member has no errors");
    assert_eq!(line("llmlc_pool_members{"), 2.0);
    assert_eq!(line("llmlc_pool_fresh_members{"), 1.0);
}
