//! Poll a condition until it holds or a deadline passes. Tests wait for readiness with this, never
//! with a fixed sleep.

use std::future::Future;
use std::time::{Duration, Instant};

/// Poll `check` every 50 ms until it returns `Some`, or panic with `what` after `timeout`.
pub async fn until<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`until`], with `why()` (what was seen last) in the panic message.
pub async fn until_or<T, F, Fut>(timeout: Duration, what: &str, mut check: F, why: impl Fn() -> String) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}; {}", why());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Wait until something accepts TCP connections on `127.0.0.1:port`.
pub async fn port_open(port: u16, timeout: Duration) {
    until(timeout, &format!("127.0.0.1:{port} to accept connections"), || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok().map(|_| ())
    })
    .await
}

/// Wait until `url` answers 2xx.
pub async fn http_ok(url: &str, timeout: Duration) {
    let client = reqwest::Client::new();
    until(timeout, &format!("{url} to answer 2xx"), || {
        let client = client.clone();
        async move {
            match client.get(url).timeout(Duration::from_secs(2)).send().await {
                Ok(r) if r.status().is_success() => Some(()),
                _ => None,
            }
        }
    })
    .await
}
