//! Live config reload of the real binary, with the config laid out like a ConfigMap volume
//! (symlink swaps): a good change applies, a bad change is rejected while the old config keeps
//! working, a change that cannot be built is rejected too, and reverting clears the rejection.

mod leader_support;

use std::path::Path;
use std::time::Duration;

use leader_support::{configmap_write, Proc};
use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::{ports, wait};

const FILE: &str = "controller.yaml";

fn config(listen: u16, members: &[String], max: u32, second_pool: bool) -> String {
    let list = members.iter().map(|m| format!("'{m}'")).collect::<Vec<_>>().join(", ");
    let mut s = format!(
        "interval: 300ms\nlisten: 127.0.0.1:{listen}\nsources:\n  direct: {{ kind: scrape, timeout: 1s }}\n\
         pools:\n  - name: llm\n    source: direct\n    members: {{ static: [{list}] }}\n    ratio: {{ min: 1, max: {max} }}\n"
    );
    if second_pool {
        s.push_str(&format!(
            "  - name: llm-b\n    source: direct\n    members: {{ static: [{list}] }}\n    ratio: {{ min: 1, max: {max} }}\n"
        ));
    }
    s
}

/// Pool name -> largest ratio in the last cycle.
async fn max_ratios(p: &Proc) -> Option<Vec<(String, u64)>> {
    let r = p.report().await?;
    r["pools"]
        .as_array()?
        .iter()
        .map(|pool| {
            let max = pool["members"].as_array()?.iter().filter_map(|m| m["ratio"].as_u64()).max()?;
            Some((pool["pool"].as_str()?.to_string(), max))
        })
        .collect()
}

async fn metric(p: &Proc, series: &str) -> f64 {
    p.metric(series).await.unwrap_or(0.0)
}

async fn started(dir: &Path, first: &str, listen: u16) -> Proc {
    configmap_write(dir, FILE, first, 1);
    let p = Proc::start(&dir.join(FILE), listen, &[], &dir.join("stderr.log"));
    let url = format!("http://127.0.0.1:{listen}/readyz");
    wait::http_ok(&url, Duration::from_secs(10)).await;
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn good_change_applies_bad_change_is_rejected_and_old_config_keeps_working() {
    let targets = [MetricsTarget::vllm(0.0, 2.0, 0.1).await, MetricsTarget::vllm(8.0, 50.0, 0.9).await];
    let members: Vec<String> = targets.iter().map(|t| t.member()).collect();
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path();
    let listen = ports::free_port();
    let mut p = started(dir, &config(listen, &members, 100, false), listen).await;
    let first = max_ratios(&p).await.expect("a report");
    assert_eq!(first.len(), 1);
    assert!(first[0].1 > 10, "the idle member should be above 10 of 100 before the change: {first:?}");

    // 1. A good change, delivered as a ConfigMap update (new version dir, `..data` swapped): a second
    //    pool, a narrower range, and a new listen address that cannot apply without a restart.
    let other = ports::free_port();
    configmap_write(dir, FILE, &config(other, &members, 10, true), 2);
    let after = wait::until(Duration::from_secs(10), "the good change to apply", || async {
        let r = max_ratios(&p).await?;
        (r.len() == 2 && r.iter().all(|(_, max)| *max <= 10)).then_some(r)
    })
    .await;
    assert_eq!(after[1].0, "llm-b");
    assert_eq!(metric(&p, "llmlc_config_reloads_total{result=\"applied\"}").await, 1.0);
    assert_eq!(metric(&p, "llmlc_config_last_reload_successful").await, 1.0);
    assert!(p.log().contains("the listener stays where it is"), "{}", p.log());
    assert!(p.get("/readyz").await.is_some(), "still served on the original port");

    // 2. A bad change (written in place, as an editor would): rejected, old config keeps running.
    let bad = config(other, &members, 10, true).replace("max: 10", "max: 0");
    std::fs::write(dir.join("..v2").join(FILE), bad).expect("write bad config");
    wait::until(Duration::from_secs(10), "the bad change to be rejected", || async {
        (metric(&p, "llmlc_config_reloads_total{result=\"rejected\"}").await == 1.0).then_some(())
    })
    .await;
    assert_eq!(metric(&p, "llmlc_config_last_reload_successful").await, 0.0);
    let (code, body) = p.get("/readyz").await.expect("readyz");
    assert_eq!(code, 200, "a rejected change does not make a working replica unready: {body}");
    assert!(body.contains("config: change rejected") && body.contains("pools[0].ratio.max"), "{body}");
    assert!(p.log().contains("config change rejected"), "{}", p.log());
    let cycles = metric(&p, "llmlc_cycles_total{result=\"ok\"}").await;
    wait::until(Duration::from_secs(5), "cycles to go on with the old config", || async {
        let r = max_ratios(&p).await?;
        let more = metric(&p, "llmlc_cycles_total{result=\"ok\"}").await >= cycles + 3.0;
        (more && r.len() == 2 && r.iter().all(|(_, m)| *m <= 10 && *m >= 1)).then_some(())
    })
    .await;

    // 3. Back to the content in force: the rejection clears, nothing is rebuilt.
    std::fs::write(dir.join("..v2").join(FILE), config(other, &members, 10, true)).expect("revert");
    wait::until(Duration::from_secs(10), "the rejection to clear", || async {
        let (_, body) = p.get("/readyz").await?;
        (!body.contains("rejected")).then_some(())
    })
    .await;
    assert_eq!(metric(&p, "llmlc_config_last_reload_successful").await, 1.0);
    assert_eq!(metric(&p, "llmlc_config_reloads_total{result=\"applied\"}").await, 1.0);

    let status = p.stop().await;
    assert!(status.success(), "exit status {status:?}\n{}", p.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_config_that_cannot_be_built_is_rejected() {
    let target = MetricsTarget::vllm(1.0, 10.0, 0.3).await;
    let members = vec![target.member()];
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path();
    let listen = ports::free_port();
    let good = config(listen, &members, 100, false);
    let p = started(dir, &good, listen).await;

    // Passes `check` (a directory is named), but the directory does not exist when the sink is built.
    let missing = dir.join("no-such-dir");
    let bad = format!(
        "{good}    sink: {{ kind: envoy, cluster: vllm, mode: file, directory: '{}' }}\n",
        missing.display()
    );
    let check = std::process::Command::new(leader_support::BIN)
        .args(["check", "--config", "/dev/stdin"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().expect("stdin").write_all(bad.as_bytes())?;
            c.wait()
        })
        .expect("run check");
    assert!(check.success(), "the config itself must be valid for this test");
    configmap_write(dir, FILE, &bad, 2);
    wait::until(Duration::from_secs(10), "the unbuildable change to be rejected", || async {
        (metric(&p, "llmlc_config_reloads_total{result=\"rejected\"}").await == 1.0).then_some(())
    })
    .await;
    let (code, body) = p.get("/readyz").await.expect("readyz");
    assert!(body.contains("does not exist"), "{code} {body}");
    // The old config was rebuilt and keeps cycling with the dry-run sink.
    let cycles = metric(&p, "llmlc_cycles_total{result=\"ok\"}").await;
    wait::until(Duration::from_secs(5), "cycles with the old config", || async {
        let r = p.report().await?;
        let dry = r["pools"][0]["push"] == "dry_run";
        let more = metric(&p, "llmlc_cycles_total{result=\"ok\"}").await >= cycles + 2.0;
        (dry && more).then_some(())
    })
    .await;
}
