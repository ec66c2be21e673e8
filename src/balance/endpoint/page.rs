//! An engine's `/metrics` page as the endpoint picker reads it: waiting and running requests and
//! KV-cache usage, under vLLM's names or llama.cpp's. The reading itself (when, how often, how
//! long it may take) belongs to whoever serves the picker: the reference proxy and the
//! controller's doors each poll their members and hand the result here.

use llm_lc_common::exposition::{self, Reading, Wanted};

use super::Gauges;

/// Where each gauge is read, in order of preference: vLLM's names (its older KV name too), then
/// llama.cpp's.
const WAITING: &[&str] = &["vllm:num_requests_waiting", "llamacpp:requests_deferred"];
const RUNNING: &[&str] = &["vllm:num_requests_running", "llamacpp:requests_processing"];
const KV_USAGE: &[&str] =
    &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio"];

/// A metrics page larger than this is not a model server's.
pub const MAX_PAGE_BYTES: usize = exposition::DEFAULT_MAX_BYTES;

/// Add `chunk` of a page being read to `page`; `false` once the page would pass
/// [`MAX_PAGE_BYTES`] (stop reading: no engine's page is that large, and a hostile or broken one
/// must not be held whole).
pub fn append_within(page: &mut Vec<u8>, chunk: &[u8]) -> bool {
    if page.len() + chunk.len() > MAX_PAGE_BYTES {
        return false;
    }
    page.extend_from_slice(chunk);
    true
}

fn wanted() -> Wanted {
    Wanted::new(WAITING.iter().chain(RUNNING).chain(KV_USAGE))
}

/// The first of `names` the page has, summed over its series (several engines' series, or one
/// per model, add up).
fn first_of(r: &Reading, names: &[&str]) -> Option<f64> {
    names.iter().find_map(|n| r.get(n)).map(|t| t.sum).filter(|v| v.is_finite() && *v >= 0.0)
}

/// The gauges of one page, `None` when it has no queue gauge at all.
pub fn gauges_of(page: &[u8]) -> Option<Gauges> {
    let r = exposition::read(page, wanted(), MAX_PAGE_BYTES).ok()?;
    let waiting = first_of(&r, WAITING)?;
    let running = first_of(&r, RUNNING).unwrap_or(0.0);
    let kv_usage = first_of(&r, KV_USAGE).unwrap_or(0.0);
    Some(Gauges { waiting: waiting.round() as u32, running: running.round() as u32, kv_usage })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_past_the_bound_stops_being_read() {
        let mut page = Vec::new();
        assert!(append_within(&mut page, &vec![b'#'; MAX_PAGE_BYTES - 1]));
        assert!(append_within(&mut page, b"\n"));
        assert!(!append_within(&mut page, b"x"), "one byte more is refused");
        assert_eq!(page.len(), MAX_PAGE_BYTES);
    }

    #[test]
    fn vllm_and_llamacpp_pages_give_their_gauges_and_others_none() {
        let vllm = b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 3\nvllm:num_requests_running{model_name=\"m\"} 7\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n";
        assert_eq!(gauges_of(vllm), Some(Gauges { waiting: 3, running: 7, kv_usage: 0.25 }));
        let llama = b"llamacpp:requests_deferred 1\nllamacpp:requests_processing 2\nllamacpp:kv_cache_usage_ratio 0.5\n";
        assert_eq!(gauges_of(llama), Some(Gauges { waiting: 1, running: 2, kv_usage: 0.5 }));
        assert_eq!(gauges_of(b"process_cpu_seconds_total 3\n"), None);
        assert_eq!(gauges_of(b"vllm:num_requests_waiting{ 3\n"), None, "a malformed page reads as nothing");
        // A negative or NaN KV usage is not a usage.
        let odd = b"vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc NaN\n";
        assert_eq!(gauges_of(odd), Some(Gauges { waiting: 0, running: 0, kv_usage: 0.0 }));
    }
}
