//! Prefix affinity on real vLLM (0.32, the CPU build, `tests/vllm/`): three servers with a small
//! KV cache (8 MiB: 3,968 tokens, fewer than the load's openings take together) behind real
//! HAProxy, closed-loop streaming clients whose prompts share one of eight ~690-token openings
//! (at least 512 tokens of the tiny model's tokenizer; on CPU vLLM caches whole 128-token blocks),
//! once through the shipped deploy/haproxy/haproxy-prefix.cfg with its opt-in body key (the first
//! 512 bytes) and once through the same file's `balance leastconn` backend. The share of prompt
//! tokens vLLM found cached (`vllm:prefix_cache_hits_total` over `..._queries_total`) and TTFT
//! are compared, interleaved, twice. `tests/vllm/prefix.sh` runs it; src/bench/RESULTS.md has the
//! table.
//!
//! The servers are started once and shared by the rows: each row draws its openings from its own
//! set (a row's seed picks them), so what an earlier row left in a cache is never asked for again
//! and only costs the room it takes until evicted, as on fresh servers.

use std::time::Duration;

use llm_lc_testkit::haproxy::{prefix_pair, Haproxy, PrefixLb as Lb};
use llm_lc_testkit::load::{closed_loop_of, group_of, grouped_prompt, LoadStats};
use llm_lc_testkit::vllm::{Options, VllmServer, MODEL};

/// Openings per row, and their length in words (~690 tokens of the tiny model's tokenizer, which
/// spends about 3.4 tokens on each of these words).
const GROUPS: u64 = 8;
const SHARED_WORDS: usize = 200;
/// Tokens out: short, so the prompt's prefill is most of a request's time.
const TOKENS: u32 = 16;
const CLIENTS: usize = 3;

struct Row {
    stats: LoadStats,
    /// Cached prompt tokens / prompt tokens queried, over the three servers, during the row.
    hit_share: f64,
}

/// (hits, queries) of the prefix cache so far, in tokens, summed over the servers.
async fn prefix_counters(servers: &[VllmServer]) -> (f64, f64) {
    let mut out = (0.0, 0.0);
    for s in servers {
        out.0 += s.gauge("vllm:prefix_cache_hits_total").await.unwrap_or(0.0);
        out.1 += s.gauge("vllm:prefix_cache_queries_total").await.unwrap_or(0.0);
    }
    out
}

/// Request `n` of client `c` in the row seeded `seed`: one of the row's openings drawn by a seeded
/// hash, then 12 words of its own. No per-request `seed` (`vllm_engine.rs` says why).
fn body(seed: u64, c: usize, n: u64) -> serde_json::Value {
    let group = seed * 1000 + group_of(seed, c, n, GROUPS);
    serde_json::json!({
        "model": MODEL,
        "prompt": grouped_prompt(group, n * 64 + c as u64, SHARED_WORDS, 12),
        "max_tokens": TOKENS,
        "ignore_eos": true,
        "stream": true,
        "temperature": 1.0,
    })
}

async fn row(servers: &[VllmServer], hx: &Haproxy, lb: Lb, secs: u64, seed: u64) -> Row {
    let port = lb.port(hx);
    row_through(servers, &format!("http://127.0.0.1:{port}"), &format!("{lb:?}"), secs, seed).await
}

/// A row through whatever listens at `base`.
async fn row_through(servers: &[VllmServer], base: &str, what: &str, secs: u64, seed: u64) -> Row {
    let before = prefix_counters(servers).await;
    let stats = closed_loop_of(base, CLIENTS, Duration::from_secs(secs), move |c, n| body(seed, c, n)).await;
    let after = prefix_counters(servers).await;
    assert!(stats.completed > 0 && stats.failed == 0, "{what}: {stats:?}\n{}", servers[0].log_tail());
    Row { stats, hit_share: (after.0 - before.0) / (after.1 - before.1).max(1.0) }
}

fn line(lb: impl std::fmt::Debug, seed: u64, r: &Row) -> String {
    format!(
        "| {lb:?} (seed {seed}) | {:.0}% | {:.0} ms | {:.0} ms | {:.0} ms | {} | {:.0} |",
        r.hit_share * 100.0,
        r.stats.ttft_quantile(0.5).as_secs_f64() * 1e3,
        r.stats.ttft_quantile(0.9).as_secs_f64() * 1e3,
        r.stats.ttft_quantile(0.99).as_secs_f64() * 1e3,
        r.stats.completed,
        r.stats.tokens_per_second()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a 4-minute measurement; tests/vllm/prefix.sh runs it"]
async fn real_vllm_prefix_table() {
    let secs: u64 = std::env::var("LLMLC_PREFIX_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    let servers =
        VllmServer::start_all(&[Options::new(4, 8, 0), Options::new(4, 8, 1), Options::new(4, 8, 0)]).await;
    let members: Vec<String> = servers.iter().map(|s| s.addr()).collect();
    let hx = prefix_pair(&members).await;
    println!(
        "\n| LB | prompt tokens cached | TTFT p50 | p90 | p99 | requests | tok/s |\n|---|---|---|---|---|---|---|"
    );
    // Interleaved, twice, so a drift of the machine's speed hits both alike.
    let mut rows = Vec::new();
    for (seed, lb) in [(31, Lb::PrefixHash), (32, Lb::Leastconn), (33, Lb::Leastconn), (34, Lb::PrefixHash)] {
        let r = row(&servers, &hx, lb, secs, seed).await;
        println!("{}", line(lb, seed, &r));
        rows.push((lb, r));
    }
    for pair in rows.chunks(2) {
        let (hash, lc) =
            if pair[0].0 == Lb::PrefixHash { (&pair[0].1, &pair[1].1) } else { (&pair[1].1, &pair[0].1) };
        assert!(hash.hit_share > lc.hit_share, "cached share {:.2} vs {:.2}", hash.hit_share, lc.hit_share);
        assert!(hash.stats.ttft_quantile(0.5) < lc.stats.ttft_quantile(0.5), "TTFT p50");
    }
}

/// The reference proxy in front of the three servers with one algorithm (`prefix-affinity` with
/// its opt-in body key: the model and the prompt's first 256 characters).
async fn proxy_with(members: &[String], algorithm: &str) -> llm_lc_proxy::ProxyHandle {
    let list = members.iter().map(|m| format!("'{m}'")).collect::<Vec<_>>().join(", ");
    let yaml = format!(
        "algorithm: {algorithm}\nprefix_key_from_body: true\ntimeouts:\n  first_byte: 120s\npools:\n  - name: llm\n    members: [{list}]\nroutes:\n  steps:\n    - id: all\n      field: model\n      op: exists\n      match: {{ pool: llm }}\n      miss: {{ reject: 400 }}\n"
    );
    llm_lc_testkit::proxy::start_proxy(&yaml).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a 6-minute measurement; tests/vllm/picker.sh runs it"]
async fn real_vllm_picker_table() {
    let secs: u64 = std::env::var("LLMLC_PREFIX_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    let servers =
        VllmServer::start_all(&[Options::new(4, 8, 0), Options::new(4, 8, 1), Options::new(4, 8, 0)]).await;
    let members: Vec<String> = servers.iter().map(|s| s.addr()).collect();
    let algorithms = ["picker", "prefix-affinity", "weighted-least-request"];
    let mut proxies = Vec::new();
    for a in algorithms {
        proxies.push(proxy_with(&members, a).await);
    }
    println!(
        "\n| proxy algorithm | prompt tokens cached | TTFT p50 | p90 | p99 | requests | tok/s |\n|---|---|---|---|---|---|---|"
    );
    // Interleaved, forwards then backwards, so a drift of the machine's speed hits all alike.
    let order = [0, 1, 2, 2, 1, 0];
    let mut rows: Vec<(usize, Row)> = Vec::new();
    for (k, &a) in order.iter().enumerate() {
        let seed = 41 + k as u64;
        let base = format!("http://{}", proxies[a].addr());
        let r = row_through(&servers, &base, algorithms[a], secs, seed).await;
        println!("{}", line(algorithms[a], seed, &r));
        rows.push((a, r));
    }
    let of = |a: usize| rows.iter().filter(move |(x, _)| *x == a).map(|(_, r)| r);
    for (p, w) in of(0).zip(of(2)) {
        assert!(p.hit_share > w.hit_share, "cached share {:.2} vs {:.2}", p.hit_share, w.hit_share);
    }
    for p in proxies {
        p.shutdown().await;
    }
}
