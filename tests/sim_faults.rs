//! Runtime fault injection on the simulated fleet, through the Rust handle and `/admin` over HTTP:
//! speed, failure rate, hang, down and back up.

use std::time::Duration;

use llm_lc_sim::{ModelProfile, ReplicaStatus};
use llm_lc_testkit::sim::*;
use llm_lc_testkit::wait;
use serde_json::json;

fn completion() -> String {
    json!({"prompt": "hello", "max_tokens": 3}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_rate_answers_500_for_that_fraction() {
    let f = fleet(ModelProfile::tiny(), &[1.0, 1.0], |c| c.seed = 42).await;
    let admin = format!("{}/admin/replicas/1/fail", f.urls()[0]);
    let (s, _) = post(&admin, r#"{"rate": 1.0}"#).await;
    assert_eq!(s, 200);
    let url = format!("{}/v1/completions", f.urls()[1]);
    let (s, body) = post(&url, &completion()).await;
    assert_eq!(s, 500);
    assert_eq!(body["error"]["type"], "InternalServerError");
    assert!(body["error"]["message"].as_str().unwrap().contains("/admin/replicas/1/fail"));
    // Replica 0 is unaffected.
    let (s, _) = post(&format!("{}/v1/completions", f.urls()[0]), &completion()).await;
    assert_eq!(s, 200);

    f.set_fail_rate(1, 0.3).unwrap();
    let mut failed = 0;
    for _ in 0..200 {
        let (s, _) = post(&url, &completion()).await;
        assert!(s == 200 || s == 500, "{s}");
        failed += usize::from(s == 500);
    }
    assert!((35..=85).contains(&failed), "{failed}/200 failed at rate 0.3");
    f.set_fail_rate(1, 0.0).unwrap();
    assert_eq!(post(&url, &completion()).await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_queues_requests_and_resumes() {
    let f = fleet(ModelProfile::tiny(), &[1.0], |_| {}).await;
    let base = f.urls()[0].clone();
    let (s, _) = post(&format!("{base}/admin/replicas/0/hang"), r#"{"hang": true}"#).await;
    assert_eq!(s, 200);
    let pending: Vec<_> = (0..3)
        .map(|_| {
            let url = format!("{base}/v1/completions");
            tokio::spawn(async move { post(&url, &completion()).await })
        })
        .collect();
    wait::until(Duration::from_secs(5), "3 requests waiting on the hung replica", || {
        let base = base.clone();
        async move { (metric(&metrics_text(&base).await, "vllm:num_requests_waiting", &[])? == 3.0).then_some(()) }
    })
    .await;
    // Still answers health and metrics, like a vLLM whose GPU is stuck.
    assert_eq!(client().get(format!("{base}/health")).send().await.unwrap().status(), 200);
    assert!(pending.iter().all(|h| !h.is_finished()));
    let status: Vec<ReplicaStatus> =
        client().get(format!("{base}/admin/replicas")).send().await.unwrap().json().await.unwrap();
    assert!(status[0].hang);

    f.set_hang(0, false).unwrap();
    for h in pending {
        let (s, _) = tokio::time::timeout(Duration::from_secs(10), h).await.unwrap().unwrap();
        assert_eq!(s, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn down_closes_the_port_and_up_restarts_empty() {
    let f = fleet(ModelProfile::llama_8b_h100(), &[1.0, 1.0], |_| {}).await;
    let addr = f.addrs()[1];
    let url = format!("{}/v1/completions", f.urls()[1]);
    assert_eq!(post(&url, &completion()).await.0, 200);
    // An in-flight streaming request loses its connection when the replica goes down.
    let resp = client()
        .post(&url)
        .json(&json!({"prompt": "x", "max_tokens": 1000, "stream": true}))
        .send()
        .await
        .unwrap();
    let reader = tokio::spawn(async move {
        let mut s = futures::StreamExt::boxed(resp.bytes_stream());
        let mut saw_error = false;
        let mut text = String::new();
        while let Some(c) = futures::StreamExt::next(&mut s).await {
            match c {
                Ok(b) => text.push_str(&String::from_utf8_lossy(&b)),
                Err(_) => {
                    saw_error = true;
                    break;
                }
            }
        }
        (saw_error, text.contains("[DONE]"))
    });
    wait::until(Duration::from_secs(5), "the stream to start", || async {
        (f.stats(1).ok()?.running == 1).then_some(())
    })
    .await;
    f.down(1).await.unwrap();
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "port still open after down");
    let (broken, done) = tokio::time::timeout(Duration::from_secs(5), reader).await.unwrap().unwrap();
    assert!(broken && !done, "the in-flight stream must break, not finish");
    assert!(matches!(f.down(1).await, Err(llm_lc_sim::SimError::AlreadyDown(1))));
    // The other replica still serves.
    assert_eq!(post(&format!("{}/v1/completions", f.urls()[0]), &completion()).await.0, 200);

    f.up(1).await.unwrap();
    assert_eq!(post(&url, &completion()).await.0, 200);
    let text = metrics_text(&f.urls()[1]).await;
    assert_eq!(
        metric(&text, "vllm:request_success_total", &["finished_reason=\"length\""]),
        Some(1.0),
        "a restarted replica starts its counters from zero"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_over_http_down_for_a_while_and_speed() {
    let f = fleet(ModelProfile::tiny(), &[1.0, 1.0], |_| {}).await;
    let admin0 = format!("{}/admin/replicas", f.urls()[0]);
    let port1 = f.addrs()[1].port();
    // A replica can take itself down; it comes back by itself after for_s.
    let (s, body) = post(&format!("{}/admin/replicas/1/down", f.urls()[1]), r#"{"for_s": 1.0}"#).await;
    assert_eq!(s, 202, "{body}");
    wait::until(Duration::from_secs(5), "replica 1's port to close", || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port1)).await.is_err().then_some(())
    })
    .await;
    let status: Vec<ReplicaStatus> = client().get(&admin0).send().await.unwrap().json().await.unwrap();
    assert!(!status[1].up && status[0].up);
    wait::port_open(port1, Duration::from_secs(10)).await;
    assert_eq!(post(&format!("{}/v1/completions", f.urls()[1]), &completion()).await.0, 200);

    // Speed, through replica 0's admin for replica 1.
    let (s, _) = post(&format!("{admin0}/1/speed"), r#"{"speed": 0.25}"#).await;
    assert_eq!(s, 200);
    let status: Vec<ReplicaStatus> = client().get(&admin0).send().await.unwrap().json().await.unwrap();
    assert_eq!(status[1].speed, 0.25);

    // Bad admin input is refused with a reason.
    for (path, body, code) in [
        ("/1/speed", r#"{"speed": 0}"#, 400),
        ("/1/speed", r#"{"speed": "fast"}"#, 400),
        ("/1/fail", r#"{"rate": 1.5}"#, 400),
        ("/9/hang", r#"{"hang": true}"#, 404),
        ("/x/hang", r#"{"hang": true}"#, 400),
        ("/0/up", "", 409),
        ("/1/down", r#"{"for_s": -1}"#, 400),
    ] {
        let (s, v) = post(&format!("{admin0}{path}"), body).await;
        assert_eq!(s, code, "{path} {body}: {v}");
        assert!(v["error"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slower_speed_makes_requests_slower() {
    let f = fleet(ModelProfile::llama_8b_h100(), &[1.0], |_| {}).await;
    let url = format!("{}/v1/completions", f.urls()[0]);
    let body = json!({"prompt": prompt_of(100), "max_tokens": 40}).to_string();
    let t = std::time::Instant::now();
    assert_eq!(post(&url, &body).await.0, 200);
    let fast = t.elapsed();
    f.set_speed(0, 0.25).unwrap();
    let t = std::time::Instant::now();
    assert_eq!(post(&url, &body).await.0, 200);
    let slow = t.elapsed();
    // 40 tokens at ~6 ms vs ~24 ms: at least twice as slow even with HTTP overhead.
    assert!(slow > fast * 2, "fast {fast:?} slow {slow:?}");
}
