//! The demo's load generator: Poisson arrivals of streaming completions with ShareGPT-like lengths,
//! sent to the reference proxy, with time to first token measured at the client.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp, LogNormal};

/// One finished (or failed) request.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub phase: usize,
    /// Seconds from send to the first token; `None` when none came.
    pub ttft: Option<f64>,
    pub e2e: f64,
    pub tokens: u32,
    pub ok: bool,
}

/// Request lengths: log-normal prompt and output lengths, clipped to what the model accepts.
#[derive(Debug, Clone, Copy)]
pub struct Lengths {
    pub prompt_median: f64,
    pub prompt_sigma: f64,
    pub output_median: f64,
    pub output_sigma: f64,
    pub max_total: u32,
}

impl Lengths {
    fn sample(&self, rng: &mut ChaCha8Rng) -> (u32, u32) {
        let draw = |median: f64, sigma: f64, rng: &mut ChaCha8Rng| {
            LogNormal::new(median.ln(), sigma).map(|d| d.sample(rng)).unwrap_or(median).round().max(1.0)
                as u32
        };
        let prompt = draw(self.prompt_median, self.prompt_sigma, rng).min(self.max_total / 2);
        let output = draw(self.output_median, self.output_sigma, rng).min(self.max_total - prompt);
        (prompt, output.max(1))
    }
}

/// Shared between the generator and the view: which phase we are in and how fast to send.
pub struct Control {
    pub phase: usize,
    pub rate: f64,
    pub stop: bool,
}

/// Send requests until `control.stop`, recording each outcome.
pub async fn generate(
    url: String,
    model: String,
    control: Arc<Mutex<Control>>,
    lengths: Lengths,
    seed: u64,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
) {
    let client = reqwest::Client::builder().pool_max_idle_per_host(256).build().unwrap_or_default();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let (rate, phase, stop) = match control.lock() {
            Ok(c) => (c.rate, c.phase, c.stop),
            Err(_) => break,
        };
        if stop {
            break;
        }
        let gap = Exp::new(rate.max(0.01)).map(|d| d.sample(&mut rng)).unwrap_or(1.0);
        tokio::time::sleep(Duration::from_secs_f64(gap)).await;
        let (prompt_tokens, max_tokens) = lengths.sample(&mut rng);
        let url = format!("{url}/v1/completions");
        let body = serde_json::json!({
            "model": model,
            // The simulator counts one token per four characters.
            "prompt": "lorem ipsum ".repeat(prompt_tokens as usize / 3 + 1).chars().take(prompt_tokens as usize * 4).collect::<String>(),
            "max_tokens": max_tokens,
            "ignore_eos": true,
            "stream": true,
        });
        let (client, outcomes) = (client.clone(), outcomes.clone());
        tasks.spawn(async move {
            let o = one_request(&client, &url, &body, phase).await;
            if let Ok(mut v) = outcomes.lock() {
                v.push(o);
            }
        });
        // Reap finished tasks so the set does not grow without bound.
        while tasks.try_join_next().is_some() {}
    }
    // Let in-flight requests finish briefly; the rest are cancelled.
    let _ =
        tokio::time::timeout(Duration::from_secs(5), async { while tasks.join_next().await.is_some() {} })
            .await;
    tasks.abort_all();
}

async fn one_request(client: &reqwest::Client, url: &str, body: &serde_json::Value, phase: usize) -> Outcome {
    let start = Instant::now();
    let mut out = Outcome { phase, ttft: None, e2e: 0.0, tokens: 0, ok: false };
    let resp = match client.post(url).json(body).send().await {
        Ok(r) if r.status().is_success() => r,
        _ => {
            out.e2e = start.elapsed().as_secs_f64();
            return out;
        }
    };
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else { break };
        buf.extend_from_slice(&chunk);
        // SSE events end with a blank line; count the data events that carry tokens.
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let text = String::from_utf8_lossy(&event);
            if text.contains("[DONE]") {
                out.ok = true;
            } else if text.contains("\"text\"") {
                out.tokens += 1;
                if out.ttft.is_none() {
                    out.ttft = Some(start.elapsed().as_secs_f64());
                }
            }
        }
    }
    out.e2e = start.elapsed().as_secs_f64();
    out
}
