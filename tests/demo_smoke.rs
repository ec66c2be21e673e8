//! `demo` end to end in a short run: fleet, proxy, controller and load generator start, every phase
//! runs, the summary is printed and the HTML report is written.

use std::process::Command;

#[test]
fn short_demo_runs_every_phase_and_writes_the_report() {
    let dir = tempfile::tempdir().expect("tmp");
    let report = dir.path().join("report.html");
    let out = Command::new(env!("CARGO_BIN_EXE_llm-load-controller"))
        .args(["demo", "--duration", "15s", "--plain", "--report"])
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
    let html = std::fs::read_to_string(&report).expect("report written");
    assert!(html.contains("<svg") && html.contains("KV-cache usage per replica"), "report lacks charts");
}
