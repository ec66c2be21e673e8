//! Load on an OpenAI-compatible server (a real llama-server, a real vLLM, the proxy in front of
//! them): closed-loop and open-loop streaming clients, seeded prompts (plain or sharing an opening
//! by group), what a run measured ([`LoadStats`]), and reading a gauge off a metrics page.

use std::time::{Duration, Instant};

/// What a closed-loop run measured.
#[derive(Debug, Clone, Default)]
pub struct LoadStats {
    /// Time to the first streamed token of each completed request, sorted.
    pub ttft: Vec<Duration>,
    pub completed: usize,
    pub failed: usize,
    /// Why the first few failed requests failed.
    pub errors: Vec<String>,
    pub tokens: usize,
    pub wall: Duration,
    /// The server's queue gauge (`llamacpp:requests_deferred`, `vllm:num_requests_waiting`) read
    /// every [`QUEUE_SAMPLE`] during an open-loop run.
    pub deferred: Vec<f64>,
}

/// How often an open-loop run reads the server's queue.
pub const QUEUE_SAMPLE: Duration = Duration::from_millis(50);

impl LoadStats {
    /// The `q` quantile (0..=1) of TTFT, nearest rank.
    pub fn ttft_quantile(&self, q: f64) -> Duration {
        llm_lc_common::percentile(&self.ttft, q).unwrap_or(Duration::MAX)
    }

    /// Count one request's outcome (the first few errors are kept).
    fn record(&mut self, outcome: Result<(Duration, usize), String>) {
        match outcome {
            Ok((ttft, got)) => {
                self.ttft.push(ttft);
                self.completed += 1;
                self.tokens += got;
            }
            Err(e) => {
                self.failed += 1;
                if self.errors.len() < 3 {
                    self.errors.push(e);
                }
            }
        }
    }

    /// Mean of the queue readings (0 when there are none).
    pub fn mean_deferred(&self) -> f64 {
        self.deferred.iter().sum::<f64>() / (self.deferred.len().max(1) as f64)
    }

    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.wall.as_secs_f64().max(1e-9)
    }
}

/// A prompt of about `words` words, different for each `(seed, n)`, so no two requests share a
/// prefix longer than the template's and the prompt cache does not make them free.
pub fn prompt(seed: u64, n: u64, words: usize) -> String {
    const WORDS: &[&str] = &[
        "river", "stone", "cloud", "engine", "garden", "winter", "copper", "signal", "harbor", "lantern",
        "meadow", "orbit", "pepper", "quartz", "saddle", "timber", "velvet", "willow", "yarrow", "zephyr",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ n.wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut out = format!("Request {n}:");
    for _ in 0..words {
        // xorshift: cheap, seeded, good enough to vary words.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(' ');
        out.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
    }
    out
}

/// A prompt that starts with group `group`'s shared part of about `shared_words` words (the same
/// for every request of the group, different from the first word on for other groups) and ends
/// with request `n`'s own `own_words` words: what a shared system prompt or document looks like
/// to the prompt cache.
pub fn grouped_prompt(group: u64, n: u64, shared_words: usize, own_words: usize) -> String {
    let shared = prompt(0x5EED, group, shared_words).replacen("Request", "Group", 1);
    format!("{shared}. {}", prompt(group.wrapping_add(0xABCD), n, own_words))
}

/// Which of `groups` groups client `client`'s `n`th request of a run seeded `seed` belongs to: a
/// seeded mix (splitmix-style), so every run draws the same groups in the same order.
pub fn group_of(seed: u64, client: usize, n: u64, groups: u64) -> u64 {
    let mut x =
        seed ^ (client as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ n.wrapping_mul(0xD1B5_4A32_D192_ED03);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    x % groups.max(1)
}

/// The load generators' client: a new connection per request, because llama-server closes idle
/// keep-alive connections on its own schedule and a request sent on one it just closed fails
/// before reaching it.
fn load_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .pool_max_idle_per_host(0)
        .build()
        .expect("client")
}

/// Request `n` of a load: a streaming completion of `tokens` tokens whatever the sampler draws.
fn completion(seed: u64, n: u64, tokens: u32) -> serde_json::Value {
    serde_json::json!({
        "prompt": prompt(seed, n, 40),
        "max_tokens": tokens,
        "ignore_eos": true,
        "stream": true,
        "temperature": 1.0,
        "seed": n,
    })
}

/// `clients` closed-loop clients, each sending streaming `/v1/completions` of `tokens` tokens
/// (`ignore_eos`) to `base_url` one after the other for `duration`; requests still running at the
/// end are finished and counted. TTFT is the time to the first chunk that carries text.
pub async fn closed_loop(
    base_url: &str,
    clients: usize,
    tokens: u32,
    duration: Duration,
    seed: u64,
) -> LoadStats {
    closed_loop_of(base_url, clients, duration, move |c, n| completion(seed ^ c as u64, n, tokens)).await
}

/// [`closed_loop`] with the bodies of its choosing: `body(client, n)` is client `client`'s `n`th
/// request (a streaming completion; keep `ignore_eos`).
pub async fn closed_loop_of(
    base_url: &str,
    clients: usize,
    duration: Duration,
    body: impl Fn(usize, u64) -> serde_json::Value + Send + Sync + 'static,
) -> LoadStats {
    closed_loop_keyed(base_url, clients, duration, body, |_, _| None).await
}

/// [`closed_loop_of`] where request `n` of client `c` may carry a prefix key header
/// (`x-llm-prefix-key: key(c, n)`), as a client that knows its session sends it.
pub async fn closed_loop_keyed(
    base_url: &str,
    clients: usize,
    duration: Duration,
    body: impl Fn(usize, u64) -> serde_json::Value + Send + Sync + 'static,
    key: impl Fn(usize, u64) -> Option<String> + Send + Sync + 'static,
) -> LoadStats {
    let client = load_client();
    let body = std::sync::Arc::new(body);
    let key = std::sync::Arc::new(key);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (client, url, body, key) =
            (client.clone(), format!("{base_url}/v1/completions"), body.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let mut stats = LoadStats::default();
            let mut n = 0u64;
            while start.elapsed() < duration {
                n += 1;
                stats.record(one_stream(&client, &url, &body(c, n), key(c, n).as_deref()).await);
            }
            stats
        }));
    }
    let mut all = LoadStats::default();
    for t in tasks {
        let s = t.await.expect("client task");
        all.ttft.extend(s.ttft);
        all.completed += s.completed;
        all.failed += s.failed;
        all.errors.extend(s.errors);
        all.tokens += s.tokens;
    }
    all.wall = start.elapsed();
    all.ttft.sort();
    all
}

/// Open-loop load: `requests` streaming completions of `tokens` tokens (`ignore_eos`) sent to
/// `base_url` at Poisson arrival times of mean `rate` per second (seeded, so a real server and a
/// simulated one get the same schedule and the same prompts), each on its own connection, however
/// many are still running; meanwhile the server's `llamacpp:requests_deferred` is read every
/// [`QUEUE_SAMPLE`]. Returns when the last request has finished.
pub async fn open_loop(base_url: &str, rate: f64, requests: u64, tokens: u32, seed: u64) -> LoadStats {
    open_loop_of(base_url, rate, requests, seed, "llamacpp:requests_deferred", move |n| {
        completion(seed, n, tokens)
    })
    .await
}

/// [`open_loop`] with the bodies of its choosing (`body(n)` is request `n`, a streaming
/// completion) and the queue read from `queue_metric` (summed over its series: vLLM labels every
/// one with `engine` and `model_name`).
pub async fn open_loop_of(
    base_url: &str,
    rate: f64,
    requests: u64,
    seed: u64,
    queue_metric: &'static str,
    body: impl Fn(u64) -> serde_json::Value,
) -> LoadStats {
    use rand::{Rng, SeedableRng};
    let client = load_client();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut at, mut schedule) = (0.0f64, Vec::new());
    for _ in 0..requests {
        at += -(1.0 - rng.gen::<f64>()).ln() / rate;
        schedule.push(Duration::from_secs_f64(at));
    }
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (client, url, done) = (client.clone(), format!("{base_url}/metrics"), done.clone());
        tokio::spawn(async move {
            let mut out = Vec::new();
            let mut tick = tokio::time::interval(QUEUE_SAMPLE);
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                tick.tick().await;
                if let Some(v) = read_gauge(&client, &url, queue_metric).await {
                    out.push(v);
                }
            }
            out
        })
    };
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (n, due) in schedule.into_iter().enumerate() {
        tokio::time::sleep_until((start + due).into()).await;
        let (client, url, body) = (client.clone(), format!("{base_url}/v1/completions"), body(n as u64));
        tasks.push(tokio::spawn(async move { one_stream(&client, &url, &body, None).await }));
    }
    let mut all = LoadStats::default();
    for t in tasks {
        all.record(t.await.expect("request task"));
    }
    all.wall = start.elapsed();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    all.deferred = sampler.await.expect("queue sampler");
    all.ttft.sort();
    all
}

/// One unlabelled sample of `base_url`'s `/metrics` (llama-server's shape), or `None`.
pub async fn metric(base_url: &str, name: &str) -> Option<f64> {
    read_gauge(&reqwest::Client::new(), &format!("{base_url}/metrics"), name).await
}

/// One gauge from a metrics page, summed over its series (llama-server's are unlabelled, vLLM's
/// carry `engine` and `model_name`), or `None` if unreadable or absent.
async fn read_gauge(client: &reqwest::Client, url: &str, name: &str) -> Option<f64> {
    let page = client.get(url).timeout(Duration::from_secs(2)).send().await.ok()?.text().await.ok()?;
    sum_of_series(&page, name)
}

/// The sum of the samples of `name` on a text exposition `page` (`None`: no sample).
pub fn sum_of_series(page: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = page
        .lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(['{', ' '])))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// One streamed completion: its TTFT and the number of text chunks, or why it failed (no answer,
/// an error status, a chunk that is not JSON, an end without `[DONE]`).
async fn one_stream(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    key: Option<&str>,
) -> Result<(Duration, usize), String> {
    let sent = Instant::now();
    let mut req = client.post(url).json(body);
    if let Some(k) = key {
        req = req.header("x-llm-prefix-key", k);
    }
    let mut resp = req.send().await.map_err(|e| format!("send: {e}"))?;
    if !resp.status().is_success() {
        let status = resp.status();
        return Err(format!("HTTP {status}: {}", resp.text().await.unwrap_or_default()));
    }
    let (mut ttft, mut chunks, mut done, mut buf) = (None, 0usize, false, String::new());
    while let Some(bytes) = resp.chunk().await.map_err(|e| format!("read: {e}"))? {
        buf.push_str(&String::from_utf8_lossy(&bytes));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
            let text = v["choices"][0]["text"].as_str().unwrap_or_default();
            if !text.is_empty() {
                ttft.get_or_insert_with(|| sent.elapsed());
                chunks += 1;
            }
        }
    }
    match (done, ttft) {
        (true, Some(t)) => Ok((t, chunks)),
        (false, _) => Err(format!("ended without [DONE] after {chunks} chunks")),
        (true, None) => Err("no text".into()),
    }
}
