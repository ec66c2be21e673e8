//! `demo` end to end in a short run: fleet, proxy, controller and load generator start, every phase
//! runs, the controller's weights favour the fast replicas by the end of phase 2, the summary is
//! printed and the HTML report is written.

use std::process::Command;

#[test]
fn short_demo_runs_every_phase_weights_the_slow_replica_down_and_writes_the_report() {
    let dir = tempfile::tempdir().expect("tmp");
    let report = dir.path().join("report.html");
    let out = Command::new(env!("CARGO_BIN_EXE_llm-load-controller"))
        .args(["demo", "--duration", "30s", "--plain", "--report"])
        .arg(&report)
        .output()
        .expect("run demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for phase in ["1. round robin", "2. dynamic ratios", "3. spike"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(phase))
            .unwrap_or_else(|| panic!("no {phase} row in\n{stdout}"));
        // The phase name fills the first 18 columns; the request count comes next.
        let requests: u64 = line
            .get(18..)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!(requests > 0, "{line}");
    }
    // The weights at the end of phase 2 (the status line at t=20 s, where phase 3 starts): the
    // controller has moved them off equal, and the slow replica (the last, at 0.4x speed) has less
    // than every fast one. (With the controller doing nothing they stay [1 1 1 1].)
    let line = stdout
        .lines()
        .find(|l| l.starts_with("t= 20.0s"))
        .unwrap_or_else(|| panic!("no t=20 s line:\n{stdout}"));
    let weights: Vec<f64> = line
        .rsplit_once("weights [")
        .and_then(|(_, w)| w.strip_suffix(']'))
        .map(|w| w.split_whitespace().filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_default();
    let (fast, slow) = weights.split_at(weights.len().saturating_sub(1));
    let mean_fast = fast.iter().sum::<f64>() / fast.len().max(1) as f64;
    assert!(weights.len() == 4 && fast.iter().all(|f| slow[0] < *f) && slow[0] <= 0.85 * mean_fast, "{line}");
    let html = std::fs::read_to_string(&report).expect("report written");
    assert!(html.contains("<svg") && html.contains("KV-cache usage per replica"), "report lacks charts");
}
