//! guidellm (the vLLM project's load tester) runs clean against the proxy with its default backend
//! validation (`GET /health`, `GET /v1/models`), with a tokenizer built offline
//! (src/proxy/loadtest/make_tokenizer.py), and the proxy's accounting is back to zero afterwards.
//!
//! Needs guidellm: `$GUIDELLM` (path to its executable, e.g. a venv's `bin/guidellm`) or `guidellm`
//! on PATH, with the Python next to it. Without it the test says so and passes: the endpoints
//! guidellm checks are covered by tests/proxy_openai.rs either way.

use std::path::{Path, PathBuf};
use std::process::Command;

use llm_lc_testkit::proxy::*;
use serde_json::Value;

fn guidellm() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("GUIDELLM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("guidellm")).find(|p| p.is_file())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guidellm_runs_clean_against_the_proxy() {
    let Some(bin) = guidellm() else {
        eprintln!("SKIPPED: guidellm not found (set GUIDELLM or put it on PATH; pip install guidellm)");
        return;
    };
    let python =
        bin.parent().map(|d| d.join("python")).filter(|p| p.is_file()).unwrap_or_else(|| "python3".into());
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tokenizer");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/proxy/loadtest/make_tokenizer.py");
    let out = Command::new(&python).arg(&script).arg(&tok).output().expect("python runs");
    assert!(out.status.success(), "tokenizer: {}", String::from_utf8_lossy(&out.stderr));

    let f = fleet(constant_profile(), 2, &["llama-8b"], &[], 20.0).await;
    let proxy = start_proxy(&format!(
        "# proxy config\npools:\n  - name: llm\n    members: {}\n    models: [llama-8b]\nroutes:\n  steps:\n    - id: all\n      field: model\n      op: exists\n      match: {{ pool: llm }}\n      miss: {{ reject: 400 }}\n",
        members_yaml(&f.addrs())
    ))
    .await;
    let report = dir.path().join("report.json");
    let addr = proxy.addr();
    let (bin2, tok2, report2) = (bin.clone(), tok.clone(), report.clone());
    let out = tokio::task::spawn_blocking(move || {
        Command::new(&bin2)
            .args(["run", "--backend", &format!("kind=openai_http,target=http://{addr}")])
            .args(["--profile", "kind=concurrent,streams=8", "--constraint", "kind=max_requests,count=60"])
            .args(["--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=32"])
            .arg("--tokenizer")
            .arg(format!("kind=huggingface_auto,model={}", tok2.display()))
            .arg("--output")
            .arg(format!("kind=json,path={}", report2.display()))
            .arg("--disable-console-interactive")
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .output()
            .expect("guidellm runs")
    })
    .await
    .unwrap();
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "guidellm failed:\n{log}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(log.contains("backend validated with model llama-8b"), "{log}");
    let v: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let totals = &v["benchmarks"][0]["metrics"]["request_totals"];
    assert_eq!((totals["successful"].as_u64(), totals["errored"].as_u64()), (Some(60), Some(0)), "{totals}");
    assert_eq!(in_flight_and_queued(&proxy), (0, 0));
    proxy.shutdown().await;
}
