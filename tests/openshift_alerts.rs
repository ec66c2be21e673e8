//! The alert rules (deploy/openshift/base/prometheusrule.yaml) run through Prometheus' own tools:
//! `promtool check rules` on the full rules (templates included) and `promtool test rules` on the
//! cases in tests/openshift_alerts/rules_test.yaml, where every alert fires and then resolves.
//! Breaking any one alert's expression must make those cases fail (so each alert is really tested),
//! and every metric the rules name is one the controller exports.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use llm_load_controller::telemetry::Telemetry;
use serde_yaml_ng::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn rule_file() -> Value {
    let p = root().join("deploy/openshift/base/prometheusrule.yaml");
    serde_yaml_ng::from_str(&std::fs::read_to_string(&p).expect("read the PrometheusRule")).expect("YAML")
}

/// Debian's promtool (package `prometheus`, installed by tests/run.sh), else whatever is on PATH.
fn promtool() -> PathBuf {
    let debian = PathBuf::from("/usr/bin/promtool");
    if debian.exists() {
        debian
    } else {
        "promtool".into()
    }
}

fn run(args: &[&str], dir: &Path) -> Output {
    Command::new(promtool())
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run promtool ({e}); it ships with Debian's prometheus package"))
}

/// The PrometheusRule's groups as a plain rule file, optionally without annotations.
fn groups(rule: &Value, annotations: bool) -> Value {
    let mut g = rule["spec"]["groups"].clone();
    if !annotations {
        for group in g.as_sequence_mut().expect("groups") {
            for r in group["rules"].as_sequence_mut().expect("rules") {
                r.as_mapping_mut().expect("rule").remove("annotations");
            }
        }
    }
    let mut m = serde_yaml_ng::Mapping::new();
    m.insert("groups".into(), g);
    Value::Mapping(m)
}

fn alerts(rule: &Value) -> Vec<(String, String)> {
    rule["spec"]["groups"]
        .as_sequence()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_sequence().expect("rules").iter())
        .filter_map(|r| Some((r["alert"].as_str()?.to_string(), r["expr"].as_str()?.to_string())))
        .collect()
}

/// A temp dir holding rules.yaml (from `rules`) and the unit-test cases.
fn workspace(rules: &Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("rules.yaml"), serde_yaml_ng::to_string(rules).expect("yaml"))
        .expect("write");
    std::fs::copy(root().join("tests/openshift_alerts/rules_test.yaml"), dir.path().join("rules_test.yaml"))
        .expect("copy the cases");
    dir
}

#[test]
fn rules_pass_promtool_check_with_their_templates() {
    let dir = tempfile::tempdir().expect("tmp");
    let f = dir.path().join("full.yaml");
    std::fs::write(&f, serde_yaml_ng::to_string(&groups(&rule_file(), true)).expect("yaml")).expect("write");
    let out = run(&["check", "rules", "full.yaml"], dir.path());
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn every_alert_fires_and_resolves_in_promtool_unit_tests() {
    let rule = rule_file();
    let names: BTreeSet<String> = alerts(&rule).into_iter().map(|(a, _)| a).collect();
    // The operations the issue asks to page on, each by its alert.
    for want in [
        "LLMLoadControllerDown",
        "LLMLoadControllerNoLeader",
        "LLMLoadControllerTwoLeaders",
        "LLMLoadControllerPoolNotPushing",
        "LLMLoadControllerStaleData",
        "LLMLoadControllerConfigReloadFailing",
        "LLMLoadControllerMembersWithoutData",
        "LLMLoadControllerPushErrors",
    ] {
        assert!(names.contains(want), "missing alert {want}");
    }

    // The cases: for every alert, some test expects it firing and, later in the same test, not.
    let cases: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(root().join("tests/openshift_alerts/rules_test.yaml")).expect("read"),
    )
    .expect("YAML");
    let mut covered = BTreeSet::new();
    for t in cases["tests"].as_sequence().expect("tests") {
        let mut fired_at: BTreeMap<String, Duration> = BTreeMap::new();
        for c in t["alert_rule_test"].as_sequence().expect("alert_rule_test") {
            let name = c["alertname"].as_str().expect("alertname").to_string();
            let at =
                humantime::parse_duration(c["eval_time"].as_str().expect("eval_time")).expect("duration");
            let firing = !c["exp_alerts"].as_sequence().expect("exp_alerts").is_empty();
            if firing {
                fired_at.entry(name).or_insert(at);
            } else if fired_at.get(&name).is_some_and(|f| *f < at) {
                covered.insert(name);
            }
        }
    }
    let missing: Vec<&String> = names.iter().filter(|n| !covered.contains(*n)).collect();
    assert!(missing.is_empty(), "alerts without a fire-then-resolve case: {missing:?}");

    let dir = workspace(&groups(&rule, false));
    let out = run(&["test", "rules", "rules_test.yaml"], dir.path());
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn breaking_any_alert_fails_its_cases() {
    let rule = rule_file();
    for (alert, _) in alerts(&rule) {
        // The alert's expression replaced by one that is never true.
        let mut broken = groups(&rule, false);
        for g in broken["groups"].as_sequence_mut().expect("groups") {
            for r in g["rules"].as_sequence_mut().expect("rules") {
                if r["alert"].as_str() == Some(alert.as_str()) {
                    r["expr"] = Value::from("vector(1) == 0");
                }
            }
        }
        let dir = workspace(&broken);
        let out = run(&["test", "rules", "rules_test.yaml"], dir.path());
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "{alert}: the cases still pass with a dead expression");
        assert!(text.contains(&format!("alertname: {alert}")), "{alert}: failure does not name it:\n{text}");
    }
}

#[test]
fn rules_name_only_metrics_the_controller_exports() {
    let exposition = Telemetry::new(Duration::from_secs(5), 3).metrics.encode();
    let mut exported: BTreeSet<String> = ["up".to_string()].into();
    for l in exposition.lines() {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("kind");
            match kind {
                "counter" => exported.insert(format!("{name}_total")),
                "histogram" => {
                    ["_bucket", "_sum", "_count"].iter().all(|s| exported.insert(format!("{name}{s}")))
                }
                _ => exported.insert(name.to_string()),
            };
        }
    }
    let ident = regex::Regex::new(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{").expect("regex");
    for (alert, expr) in alerts(&rule_file()) {
        let names: Vec<String> = ident.captures_iter(&expr).map(|c| c[1].to_string()).collect();
        assert!(!names.is_empty(), "{alert}: no metric selector found");
        for n in names {
            assert!(exported.contains(&n), "{alert}: {n} is not exported by the controller");
            assert_ne!(n, "llmlc_member_ratio", "{alert}: use llmlc_member_weight (the old name goes away)");
        }
        assert!(expr.contains("job=\"llm-load-controller\""), "{alert}: scope every selector to the job");
    }
}
