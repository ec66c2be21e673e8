//! Helpers shared by the `sim_*` integration tests: a fleet on free ports, an HTTP client, SSE
//! reading (feature `tools`).

use std::time::{Duration, Instant};

use futures::StreamExt;
use llm_lc_sim::{start_fleet, Fleet, FleetConfig, ModelProfile};
use serde_json::Value;

/// A fleet on free loopback ports.
pub async fn fleet(profile: ModelProfile, speeds: &[f64], tweak: impl FnOnce(&mut FleetConfig)) -> Fleet {
    let mut cfg = FleetConfig::new(profile, speeds);
    tweak(&mut cfg);
    start_fleet(cfg).await.expect("fleet starts on free ports")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("http client")
}

/// POST a JSON body (raw text, so tests can send broken JSON); returns status and parsed body.
pub async fn post(url: &str, body: &str) -> (u16, Value) {
    let r = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("request sent");
    let status = r.status().as_u16();
    let text = r.text().await.expect("body read");
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

/// Read an SSE response to its end: each event's payload (after `data: `) and when it arrived.
pub async fn sse_events(resp: reqwest::Response) -> Vec<(Instant, String)> {
    let mut buf = String::new();
    let mut out = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("stream chunk");
        buf.push_str(std::str::from_utf8(&chunk).expect("utf-8 SSE"));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let payload =
                event.strip_prefix("data: ").unwrap_or_else(|| panic!("bad SSE framing: {event:?}"));
            out.push((Instant::now(), payload.trim_end_matches('\n').to_string()));
        }
    }
    assert!(buf.is_empty(), "trailing bytes after the last event: {buf:?}");
    out
}

pub async fn metrics_text(base: &str) -> String {
    client().get(format!("{base}/metrics")).send().await.expect("scrape").text().await.expect("metrics body")
}

/// Value of the first sample of `name` whose label block contains every `labels` snippet.
/// Only for the simulator's own, known-good output.
pub fn metric(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        (n == name && labels.iter().all(|s| rest.contains(s))).then(|| value.parse().ok())?
    })
}

/// A prompt of exactly `tokens` tokens under the simulator's 4-characters-per-token rule, different
/// from every other prompt of this process from its first characters: the simulator caches
/// prefixes, and tests of queues and memory must not share any by accident.
pub fn prompt_of(tokens: usize) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut p = format!("{n:016x}");
    p.push_str(&"abcd".repeat(tokens));
    p.truncate(4 * tokens);
    p
}

/// A prompt of `tokens` tokens that is the same on every call (for tests of the prefix cache).
pub fn shared_prompt_of(tokens: usize) -> String {
    "abcd".repeat(tokens)
}
