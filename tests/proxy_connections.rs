//! Connection hygiene: a client that never finishes its request head (slowloris) is dropped within
//! `timeouts.header_read`; an idle kept-alive connection within `timeouts.keep_alive_idle`; past
//! `limits.max_connections` the next connection gets a clear 503 JSON answer and is closed while
//! the existing ones keep working.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use llm_lc_testkit::proxy::*;
use llm_lc_testkit::wait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn config(member: SocketAddr, extra: &str) -> String {
    format!(
        "# proxy config\n{extra}pools:\n  - name: llm\n    members: ['{member}']\nroutes:\n  steps:\n    - id: all\n      field: model\n      op: exists\n      match: {{ pool: llm }}\n      miss: {{ reject: 400 }}\n"
    )
}

/// Read until the peer closes (Ok(bytes)) or `limit` passes (Err).
async fn read_to_close(s: &mut TcpStream, limit: Duration) -> Result<Vec<u8>, &'static str> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return Err("still open"),
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(out),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_is_dropped_within_the_header_timeout() {
    let proxy = start_proxy(&config(
        hold_backend().await,
        "timeouts: { header_read: 300ms, keep_alive_idle: 10s }\n",
    ))
    .await;
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    let t0 = Instant::now();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    // Trickle a header line every 50 ms: activity must not extend the deadline.
    let trickle = async {
        for i in 0..100 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if s.write_all(format!("x-slow-{i}: y\r\n").as_bytes()).await.is_err() {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(3), trickle).await.ok();
    let mut s2 = TcpStream::connect(proxy.addr()).await.unwrap();
    let closed = read_to_close(&mut s, Duration::from_millis(100)).await;
    let took = t0.elapsed();
    assert!(closed.is_ok(), "the slow client is still connected after {took:?}");
    assert!(took < Duration::from_secs(3), "dropped only after {took:?}");
    // A silent connection (no byte at all) goes the same way.
    let t1 = Instant::now();
    assert!(read_to_close(&mut s2, Duration::from_secs(3)).await.is_ok(), "a silent connection is dropped");
    assert!(t1.elapsed() >= Duration::from_millis(250), "not before the timeout: {:?}", t1.elapsed());
    let m = proxy.metrics_text();
    assert!(metric_sum(&m, "llmlc_proxy_connections_timed_out_total", &["listener=\"api\""]) >= 2.0, "{m}");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_are_closed() {
    let proxy = start_proxy(&config(
        hold_backend().await,
        "timeouts: { header_read: 10s, keep_alive_idle: 300ms }\n",
    ))
    .await;
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut buf = [0u8; 1024];
    let n = s.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
    let t0 = Instant::now();
    assert!(read_to_close(&mut s, Duration::from_secs(3)).await.is_ok(), "idle keep-alive connection closed");
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(3), "{took:?}");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_cap_the_next_connection_is_refused_clearly() {
    let proxy = start_proxy(&config(hold_backend().await, "limits: { max_connections: 2 }\n")).await;
    let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
    let _b = TcpStream::connect(proxy.addr()).await.unwrap();
    wait::until(Duration::from_secs(5), "two connections open", || async {
        (metric_sum(&proxy.metrics_text(), "llmlc_proxy_connections", &["listener=\"api\""]) == 2.0)
            .then_some(())
    })
    .await;
    let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let answer = read_to_close(&mut c, Duration::from_secs(5)).await.expect("refused and closed");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("retry-after: 1") && text.contains("\"code\":\"too_many_connections\""), "{text}");
    let json: serde_json::Value = serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap_or("")).unwrap();
    assert_eq!(json["error"]["type"], "service_unavailable_error");
    // The connections already open still work.
    a.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut buf = [0u8; 1024];
    let n = a.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
    assert_eq!(metric_sum(&proxy.metrics_text(), "llmlc_proxy_connections_refused_total", &[]), 1.0);
    // One closes: a new connection is served again.
    drop(a);
    wait::until(Duration::from_secs(5), "a slot frees up", || async {
        let r = client().get(format!("http://{}/health", proxy.addr())).send().await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    proxy.shutdown().await;
}
