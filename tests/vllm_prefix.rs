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

use std::path::Path;

use llm_lc_testkit::controller::Running;
use llm_lc_testkit::envoy::Envoy;
use llm_lc_testkit::haproxy::{prefix_pair, start_shipped_spoe, Haproxy, PrefixLb as Lb};
use llm_lc_testkit::load::{closed_loop_keyed, closed_loop_of, group_of, grouped_prompt, LoadStats};
use llm_lc_testkit::vllm::{Options, VllmServer, MODEL};
use llm_lc_testkit::{ports, wait};

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

/// The controller with the endpoint picker for the three servers: pool `llm` feeding Envoy's EDS
/// and serving ext_proc at `epp`, pool `llm-hx` pushing weights into `hx` (the SPOE HAProxy's
/// runtime API) and serving its agent at `spoe`.
fn picker_controller(members: &[String], epp: u16, spoe: u16, hx_runtime: &str) -> Running {
    let list = members.iter().map(|m| format!("'{m}'")).collect::<Vec<_>>().join(", ");
    Running::start(
        Path::new(env!("CARGO_BIN_EXE_llm-load-controller")),
        "2s",
        &format!(
            "sources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members: {{ static: [{list}] }}\n    sink: {{ kind: envoy, cluster: vllm }}\n    picker: {{ ext_proc: '127.0.0.1:{epp}', refresh: 100ms }}\n  - name: llm-hx\n    source: direct\n    members: {{ static: [{list}] }}\n    sink: {{ kind: haproxy, address: '{hx_runtime}', backend: llm }}\n    picker: {{ spoe: '127.0.0.1:{spoe}', refresh: 100ms }}\n"
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a 12-minute measurement; tests/vllm/doors.sh runs it"]
async fn real_vllm_doors_table() {
    let secs: u64 = std::env::var("LLMLC_PREFIX_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    let servers =
        VllmServer::start_all(&[Options::new(4, 8, 0), Options::new(4, 8, 1), Options::new(4, 8, 0)]).await;
    let members: Vec<String> = servers.iter().map(|s| s.addr()).collect();
    let (epp, spoe) = (ports::free_port(), ports::free_port());
    let dir = tempfile::tempdir().expect("tmp");
    let hx_spoe = start_shipped_spoe(&members, spoe, dir.path(), "llm-hx").await;
    let hx_hash = prefix_pair(&members).await;
    let controller = picker_controller(&members, epp, spoe, &hx_spoe.runtime_tcp_address());
    let envoy_picker = Envoy::start_shipped_epp(controller.listen(), epp, &[]).await;
    let envoy_hash = Envoy::start_shipped_ring_hash(controller.listen()).await;
    for (e, clusters) in [(&envoy_picker, &["vllm"][..]), (&envoy_hash, &["vllm", "vllm_prefix"][..])] {
        for c in clusters {
            wait::until(Duration::from_secs(30), "Envoy has the servers", || async {
                e.weights(c).await.filter(|w| w.len() == 3).map(|_| ())
            })
            .await;
        }
    }
    // Through the picker doors the clients send nothing but the body; the ring hash is given the
    // best key it could have (the client's own group id), HAProxy's hash its shipped body key.
    let url = |port: u16| format!("http://127.0.0.1:{port}");
    let envoy_port = |e: &Envoy| {
        let e = e.admin_url().to_string();
        async move {
            let v: serde_json::Value =
                reqwest::get(format!("{e}/listeners?format=json")).await.ok()?.json().await.ok()?;
            v["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]
                .as_u64()
                .map(|p| p as u16)
        }
    };
    let picker_port = envoy_port(&envoy_picker).await.expect("listener");
    let hash_port = envoy_port(&envoy_hash).await.expect("listener");
    let rows: [(&str, String, bool); 5] = [
        ("Envoy + picker (ext_proc)", url(picker_port), false),
        ("Envoy ring hash (client key)", url(hash_port), true),
        ("Envoy least request", url(hash_port), false),
        ("HAProxy + picker (SPOE)", url(hx_spoe.port("fe")), false),
        ("HAProxy prefix hash (body key)", url(Lb::PrefixHash.port(&hx_hash)), false),
    ];
    println!(
        "\n| LB | prompt tokens cached | TTFT p50 | p90 | p99 | requests | tok/s |\n|---|---|---|---|---|---|---|"
    );
    // Interleaved, forwards then backwards, so a drift of the machine's speed hits all alike.
    let order = [0, 1, 2, 3, 4, 4, 3, 2, 1, 0];
    let mut results: Vec<(usize, Row)> = Vec::new();
    for (k, &i) in order.iter().enumerate() {
        let seed = 61 + k as u64;
        let (name, base, keyed) = &rows[i];
        let before = prefix_counters(&servers).await;
        let keyed = *keyed;
        let stats = closed_loop_keyed(
            base,
            CLIENTS,
            Duration::from_secs(secs),
            move |c, n| body(seed, c, n),
            move |c, n| keyed.then(|| format!("group-{}", seed * 1000 + group_of(seed, c, n, GROUPS))),
        )
        .await;
        let after = prefix_counters(&servers).await;
        assert!(stats.completed > 0 && stats.failed == 0, "{name}: {stats:?}\n{}", controller.log());
        let r = Row { stats, hit_share: (after.0 - before.0) / (after.1 - before.1).max(1.0) };
        println!("{}", line(name, seed, &r).replace('"', ""));
        results.push((i, r));
    }
    let share =
        |i: usize| results.iter().filter(|(x, _)| *x == i).map(|(_, r)| r.hit_share).sum::<f64>() / 2.0;
    assert!(
        share(0) > share(2),
        "the picker caches more than least request: {:.2} vs {:.2}",
        share(0),
        share(2)
    );
    assert!(share(3) > share(2), "SPOE picker caches more than least request");
}
