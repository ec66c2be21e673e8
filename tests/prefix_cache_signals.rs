//! The controller reads each engine's prefix-cache counters and shows every member's hit rate (the
//! share of prompt tokens served from the cache) in `/v1/ratios` (`prompt_cached`) and in its own
//! metrics (`llmlc_member_prompt_cached_ratio`), for each engine's way of publishing it: vLLM's
//! counters of queried and hit tokens, older vLLM's and SGLang's hit-rate gauge, llama.cpp's
//! cached-token counter.
//!
//! One simulated replica gets the same prompt over and over (all but its last partial block found
//! in the cache), the other a new prompt each time (nothing found).

use std::time::Duration;

use llm_lc_sim::{MetricsStyle, ModelProfile};
use llm_lc_testkit::controller::Running;
use llm_lc_testkit::sim::{client, fleet, prompt_of, shared_prompt_of};
use llm_lc_testkit::wait;
use serde_json::{json, Value};

fn bin() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_llm-load-controller"))
}

async fn complete(url: &str, prompt: String) {
    let r = client()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .expect("completion");
    assert!(r.status().is_success(), "{}", r.status());
    r.text().await.expect("body");
}

fn member_field(pool: &Value, member: &str, field: &str) -> Option<f64> {
    pool["members"].as_array()?.iter().find(|m| m["member"] == member)?[field].as_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_engine_style_shows_each_members_prefix_cache_hit_rate() {
    for (style, profile) in [
        (MetricsStyle::Vllm, "vllm"),
        (MetricsStyle::VllmLegacy, "vllm-legacy"),
        (MetricsStyle::Sglang, "sglang"),
        (MetricsStyle::Llamacpp, "llamacpp"),
    ] {
        let f = fleet(ModelProfile::tiny(), &[1.0, 1.0], |c| c.metrics_style = style).await;
        let (cached, fresh) = (f.addrs()[0].to_string(), f.addrs()[1].to_string());
        let urls = f.urls();
        let ctl = Running::start(
            bin(),
            "300ms",
            &format!(
                "sources:\n  direct: {{kind: scrape}}\npools:\n  - name: llm\n    source: direct\n    \
                 profile: {profile}\n    members: {{static: ['{cached}', '{fresh}']}}\n    sink: {{kind: dry-run}}\n"
            ),
        );
        // Counters are read as rates between two pages: keep the traffic going while waiting.
        let pool = wait::until(Duration::from_secs(30), &format!("{profile}: both hit rates"), || async {
            complete(&urls[0], shared_prompt_of(200)).await;
            complete(&urls[1], prompt_of(200)).await;
            let p = ctl.pool("llm").await?;
            let hit = member_field(&p, &cached, "prompt_cached")?;
            let miss = member_field(&p, &fresh, "prompt_cached")?;
            (hit > 0.5).then_some(p).filter(|_| miss < 0.05)
        })
        .await;
        // 200 tokens: 12 whole blocks of 16 are found of each repeat (192/200 = 0.96), none of a
        // new prompt.
        let hit = member_field(&pool, &cached, "prompt_cached").expect("hit rate");
        assert!((0.5..=0.96).contains(&hit), "{profile}: repeated prompt hit rate {hit}");
        assert_eq!(member_field(&pool, &fresh, "prompt_cached"), Some(0.0), "{profile}: fresh prompts");

        let metrics = ctl.metrics().await;
        let line = metrics
            .lines()
            .find(|l| {
                l.starts_with("llmlc_member_prompt_cached_ratio{")
                    && l.contains(&format!("member=\"{cached}\""))
                    && l.contains("pool=\"llm\"")
            })
            .unwrap_or_else(|| panic!("{profile}: no hit-rate gauge for {cached} in\n{metrics}"));
        let v: f64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("gauge value");
        assert!(v > 0.5, "{profile}: {line}");
    }
}
