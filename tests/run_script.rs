//! The test command must never stop processes it did not start: on a developer's machine
//! `pkill -x prometheus` would kill their own Prometheus.

#[test]
fn run_sh_stops_nothing_by_process_name() {
    let script =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/run.sh")).expect("run.sh");
    for (i, line) in script.lines().enumerate() {
        let code = line.split('#').next().unwrap_or_default();
        for forbidden in ["pkill", "killall", "kill -9 $(pidof", "pidof"] {
            assert!(!code.contains(forbidden), "tests/run.sh:{}: stops processes by name: {line}", i + 1);
        }
    }
    // Services of freshly installed packages are kept from starting instead.
    assert!(script.contains("policy-rc.d"), "expected a policy-rc.d guard around apt-get install");
}
