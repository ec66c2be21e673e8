//! Stage 2: one pool's members, their weights and in-flight counts, and the choice of a member.
//!
//! The choice itself is [`llm_lc_balance::Picker`], the code the benchmark measures. This module adds
//! what a live proxy needs around it: weights from the controller's ratios (equal until the first
//! ratios arrive; members the ratios do not name get the mean of those they do), passive health
//! (a member that refused a connection is skipped for a while), and a snapshot for live views.
//!
//! With `algorithm: picker` the pool also holds an endpoint picker ([`RequestPicker`]): a request
//! whose body has a prompt is placed by it (its accounting opened at the pick, its prefill load
//! released at the first response byte, the request at the end), with the members' gauges from
//! [`super::gauges`] and the ratios as capacity; a request without a prompt is a weighted
//! least-request pick on the ratios.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::Uri;
use llm_lc_adapters::{MemberId, Ratios};
use serde::Serialize;

use llm_lc_balance::endpoint::picker::{Request, Settings};
use llm_lc_balance::endpoint::{Gauges, RequestPicker};
use llm_lc_balance::{Algorithm, Picker};

use super::config::PoolConfig;
use super::criticality::Admission;
use super::upstream::member_uri;
use llm_lc_balance::endpoint::prompt::{PromptBlocks, BLOCK_TOKENS};

/// Where a pool's current weights came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightSource {
    /// No ratios yet: every member weighs 1.
    Equal,
    Webhook,
    Poll,
    /// Set through the library API.
    Api,
}

struct State {
    picker: Picker,
    /// `algorithm: picker`: the endpoint picker, when each member's gauges were last read, and
    /// the id of the next request it places.
    endpoint: Option<RequestPicker>,
    gauges: Vec<Option<(Gauges, Instant)>>,
    next_id: u64,
    ejected_until: Vec<Option<Instant>>,
    source: WeightSource,
    updated_unix: Option<f64>,
    /// The controller's pool saturation, 0..1, from the last poll.
    saturation: Option<f64>,
    /// When ratios naming members this pool lacks were last logged (the log is rate-limited).
    unknown_logged: Option<Instant>,
}

/// Blocks each member's prefix index holds under `algorithm: picker` (the engine's cache size is
/// not known to the proxy): 100,000 blocks of 16 tokens, 1.6 M tokens, more than a CPU engine
/// caches and about an 80 GB GPU's.
pub const INDEX_BLOCKS: usize = 100_000;

/// Names of unknown members echoed in an answer or a log line, at most; the rest are counted.
pub const ECHOED_NAMES: usize = 8;

/// Ratios naming members the pool lacks are logged at most once per this, per pool.
pub const UNKNOWN_LOG_EVERY: Duration = Duration::from_secs(60);

/// A pool of model servers.
pub struct Pool {
    pub name: String,
    pub members: Vec<MemberId>,
    /// `http://host:port` per member.
    pub bases: Vec<String>,
    /// Pre-built request URIs per member: `/v1/chat/completions` and `/v1/completions`.
    pub chat_uris: Vec<Uri>,
    pub completion_uris: Vec<Uri>,
    pub models: Vec<String>,
    pub admission: Admission,
    pub queue_timeout: Duration,
    pub shed_saturation: f64,
    pub eject_for: Duration,
    /// Forward the prefix key as `x-llm-prefix-key` (for an LB behind this pool).
    pub set_prefix_key: bool,
    /// `algorithm: picker`: how often members' metrics pages are read, or whether the gauges come
    /// from the controller's report instead.
    pub metrics_interval: Duration,
    pub gauges_from: super::config::GaugesFrom,
    /// `algorithm: picker`: fixed at construction, so the request path asks without the lock.
    endpoint_picker: bool,
    state: Mutex<State>,
}

/// What applying a set of ratios did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Applied {
    /// Weight now in force per member.
    pub weights: Vec<(MemberId, u32)>,
    /// Members named by the ratios that this pool does not have (ignored): the first
    /// [`ECHOED_NAMES`], shortened ([`llm_lc_adapters::name::shorten`]); outside text.
    pub unknown_members: Vec<String>,
    /// How many members the ratios named that this pool does not have.
    pub unknown_count: usize,
    /// Pool members the ratios did not name (given the mean).
    pub defaulted_members: Vec<MemberId>,
}

/// One member in a live view.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemberView {
    pub member: MemberId,
    pub weight: u32,
    pub in_flight: u32,
    pub ejected: bool,
    /// `algorithm: picker` only: what the endpoint picker knows of the member.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub picker: Option<PickerView>,
}

/// The endpoint picker's view of one member.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PickerView {
    /// Requests it placed there that have not ended.
    pub requests: u32,
    /// Prompt tokens it placed there that are not cached and not yet answered by a first byte.
    pub uncached_tokens: u64,
    /// Prompt blocks its index believes the member caches.
    pub indexed_blocks: usize,
    /// The member's own gauges, when fresh.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub running: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_usage: Option<f64>,
    /// Seconds since they were read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gauges_age_s: Option<f64>,
}

/// One pool in a live view.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolView {
    pub pool: String,
    pub algorithm: Algorithm,
    pub weights_from: WeightSource,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weights_updated_unix: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub controller_saturation: Option<f64>,
    pub in_flight: usize,
    pub queued: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<usize>,
    pub members: Vec<MemberView>,
}

impl Pool {
    pub fn new(cfg: &PoolConfig, default_algo: Algorithm, seed: u64) -> Result<Pool, String> {
        let n = cfg.members.len();
        let algorithm = cfg.algorithm.unwrap_or(default_algo);
        let uris =
            |path: &str| cfg.members.iter().map(|m| member_uri(m, path)).collect::<Result<Vec<_>, _>>();
        let chat_uris = uris("/v1/chat/completions")?;
        let completion_uris = uris("/v1/completions")?;
        let capacity = cfg.max_in_flight_per_member.map(|m| m as usize * n);
        let bases = cfg
            .members
            .iter()
            .map(|m| match m.host_port() {
                // IPv6 hosts need their brackets back in a URL.
                Some((h, p)) if h.contains(':') => format!("http://[{h}]:{p}"),
                Some((h, p)) => format!("http://{h}:{p}"),
                None => format!("http://{m}"),
            })
            .collect();
        Ok(Pool {
            name: cfg.name.clone(),
            members: cfg.members.clone(),
            bases,
            chat_uris,
            completion_uris,
            models: cfg.models.clone(),
            admission: Admission::new(capacity, cfg.queue_size),
            queue_timeout: cfg.queue_timeout,
            shed_saturation: cfg.shed_saturation,
            eject_for: cfg.eject_for,
            set_prefix_key: cfg.set_prefix_key,
            metrics_interval: cfg.metrics_interval,
            gauges_from: cfg.gauges_from,
            endpoint_picker: algorithm == Algorithm::Picker,
            state: Mutex::new(State {
                picker: Picker::new(algorithm, n, seed),
                endpoint: (algorithm == Algorithm::Picker)
                    .then(|| RequestPicker::new(n, INDEX_BLOCKS, Settings::default())),
                gauges: vec![None; n],
                next_id: 0,
                ejected_until: vec![None; n],
                source: WeightSource::Equal,
                updated_unix: None,
                saturation: None,
                unknown_logged: None,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Choose a member not in `tried` and count a request on it. Members ejected after a refused
    /// connection are only chosen when nothing else is left.
    pub fn pick(&self, tried: &[usize]) -> Option<usize> {
        self.pick_keyed(tried, None)
    }

    /// [`Pool::pick`] for a request with a prefix key (read by `algorithm: prefix-affinity` only).
    pub fn pick_keyed(&self, tried: &[usize], key: Option<u64>) -> Option<usize> {
        self.pick_request(tried, key, None).map(|(i, _)| i)
    }

    /// Whether this pool places requests with the endpoint picker (it wants their prompts).
    pub fn uses_endpoint_picker(&self) -> bool {
        self.endpoint_picker
    }

    /// Choose a member for a request, and count it there. With `algorithm: picker` and a prompt,
    /// the endpoint picker chooses and opens its accounting (the id it returns); otherwise the
    /// pool's algorithm does.
    pub fn pick_request(
        &self,
        tried: &[usize],
        key: Option<u64>,
        prompt: Option<&PromptBlocks>,
    ) -> Option<(usize, Option<u64>)> {
        let now = Instant::now();
        let mut st = self.lock();
        let healthy: Vec<bool> = st.ejected_until.iter().map(|e| e.is_none_or(|t| t <= now)).collect();
        let placed = match (prompt, &mut st.endpoint) {
            (Some(p), Some(endpoint)) => {
                let request =
                    Request { blocks: &p.blocks, tokens: p.tokens, block_tokens: BLOCK_TOKENS, key };
                let allowed = |i: usize| healthy[i] && !tried.contains(&i);
                // An ejected member only when nothing else is left, as for the other algorithms.
                let choice = if (0..healthy.len()).any(allowed) {
                    endpoint.pick(request, allowed)
                } else if (0..healthy.len()).any(|i| !tried.contains(&i)) {
                    endpoint.pick(request, |i| !tried.contains(&i))
                } else {
                    None
                };
                choice.map(|c| {
                    let id = st.next_id;
                    st.next_id += 1;
                    if let Some(endpoint) = &mut st.endpoint {
                        endpoint.dispatched(id, c, request);
                    }
                    (c.member, Some(id))
                })
            }
            _ => st
                .picker
                .pick_keyed(key, |i| healthy[i] && !tried.contains(&i))
                .or_else(|| st.picker.pick_keyed(key, |i| !tried.contains(&i)))
                .map(|i| (i, None)),
        };
        let (i, id) = placed?;
        st.picker.started(i);
        Some((i, id))
    }

    /// [`Pool::pick`] with the count held by a guard: dropping the guard (on any exit, the request's
    /// future dropped by a client that went away included) takes the count back.
    pub fn pick_counted(
        self: &Arc<Self>,
        tried: &[usize],
        key: Option<u64>,
        prompt: Option<&PromptBlocks>,
    ) -> Option<Picked> {
        self.pick_request(tried, key, prompt).map(|(member, id)| Picked { pool: self.clone(), member, id })
    }

    /// The first byte of request `id`'s answer arrived: its prefill no longer loads the member.
    fn first_byte(&self, id: u64) {
        if let Some(e) = &mut self.lock().endpoint {
            e.first_token(id);
        }
    }

    /// Member `i`'s gauges as just read, or `None` when they could not be read (the picker then
    /// scores the member from its own accounting).
    pub fn set_gauges(&self, i: usize, gauges: Option<Gauges>) {
        let mut st = self.lock();
        if let Some(g) = st.gauges.get_mut(i) {
            *g = gauges.map(|g| (g, Instant::now()));
        }
        if let Some(e) = &mut st.endpoint {
            e.set_gauges(i, gauges);
        }
    }

    /// The request on member `i` (the endpoint picker's `id`, if it placed it) ended.
    pub fn finish(&self, i: usize, id: Option<u64>) {
        let mut st = self.lock();
        st.picker.finished(i);
        if let (Some(e), Some(id)) = (&mut st.endpoint, id) {
            e.finished(id);
        }
    }

    /// Member `i` refused a connection: skip it for `eject_for`.
    pub fn eject(&self, i: usize) {
        let until = Instant::now() + self.eject_for;
        if let Some(e) = self.lock().ejected_until.get_mut(i) {
            *e = Some(until);
        }
    }

    pub fn in_flight(&self, i: usize) -> u32 {
        self.lock().picker.in_flight(i)
    }

    /// Apply a set of ratios as weights. Members not named get the mean of the named ones (so a
    /// member the controller has not sampled yet gets an average share, not all or nothing).
    /// Ratios above [`llm_lc_adapters::MAX_RATIO`] count as that.
    pub fn apply_ratios(&self, ratios: &Ratios, source: WeightSource) -> Applied {
        let known: Vec<Option<u32>> =
            self.members.iter().map(|m| ratios.get(m).map(|r| r.min(llm_lc_adapters::MAX_RATIO))).collect();
        let named: Vec<u32> = known.iter().flatten().copied().collect();
        let mean = if named.is_empty() {
            1
        } else {
            let m = named.iter().map(|&v| v as f64).sum::<f64>() / named.len() as f64;
            if m > 0.0 {
                (m.round() as u32).max(1)
            } else {
                0
            }
        };
        let weights: Vec<u32> = known.iter().map(|k| k.unwrap_or(mean)).collect();
        let unknown: Vec<&MemberId> =
            ratios.iter().map(|(m, _)| m).filter(|m| !self.members.contains(m)).collect();
        let unknown_members = unknown
            .iter()
            .take(ECHOED_NAMES)
            .map(|m| llm_lc_adapters::name::shorten(m.as_str()).into_owned())
            .collect();
        let defaulted_members =
            self.members.iter().zip(&known).filter(|(_, k)| k.is_none()).map(|(m, _)| m.clone()).collect();
        {
            let mut st = self.lock();
            st.picker.set_weights(&weights);
            if let Some(e) = &mut st.endpoint {
                e.set_capacity(&weights.iter().map(|&w| f64::from(w)).collect::<Vec<_>>());
            }
            st.source = source;
            st.updated_unix = Some(unix_now());
        }
        Applied {
            weights: self.members.iter().cloned().zip(weights).collect(),
            unknown_members,
            unknown_count: unknown.len(),
            defaulted_members,
        }
    }

    /// Whether ratios naming unknown members should be logged now: at most once per
    /// [`UNKNOWN_LOG_EVERY`] (a client posting such ratios in a loop must not fill the disk).
    pub fn log_unknown_now(&self, now: Instant) -> bool {
        let mut st = self.lock();
        let due = st.unknown_logged.is_none_or(|at| now.saturating_duration_since(at) >= UNKNOWN_LOG_EVERY);
        if due {
            st.unknown_logged = Some(now);
        }
        due
    }

    pub fn set_saturation(&self, s: Option<f64>) {
        self.lock().saturation = s.filter(|v| v.is_finite());
    }

    /// The controller reports this pool at or above its shedding threshold.
    pub fn controller_saturated(&self) -> bool {
        self.lock().saturation.is_some_and(|s| s >= self.shed_saturation)
    }

    pub fn weights(&self) -> Vec<u32> {
        self.lock().picker.weights()
    }

    pub fn view(&self) -> PoolView {
        let now = Instant::now();
        let st = self.lock();
        let weights = st.picker.weights();
        let members = self
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| MemberView {
                member: m.clone(),
                weight: weights.get(i).copied().unwrap_or(0),
                in_flight: st.picker.in_flight(i),
                ejected: st.ejected_until[i].is_some_and(|t| t > now),
                picker: st.endpoint.as_ref().map(|e| {
                    let g = st.gauges.get(i).copied().flatten();
                    PickerView {
                        requests: e.requests(i),
                        uncached_tokens: e.tokens(i),
                        indexed_blocks: e.indexed_blocks(i),
                        waiting: g.map(|(g, _)| g.waiting),
                        running: g.map(|(g, _)| g.running),
                        kv_usage: g.map(|(g, _)| g.kv_usage),
                        gauges_age_s: g.map(|(_, at)| now.saturating_duration_since(at).as_secs_f64()),
                    }
                }),
            })
            .collect();
        PoolView {
            pool: self.name.clone(),
            algorithm: st.picker.algorithm(),
            weights_from: st.source,
            weights_updated_unix: st.updated_unix,
            controller_saturation: st.saturation,
            in_flight: self.admission.in_flight(),
            queued: self.admission.queued(),
            capacity: self.admission.capacity(),
            members,
        }
    }
}

/// One request counted in flight on a member; dropping it uncounts it, exactly once.
pub struct Picked {
    pool: Arc<Pool>,
    pub member: usize,
    /// The endpoint picker's id for the request, when it placed it.
    id: Option<u64>,
}

impl Picked {
    /// The answer's first byte arrived (the end of the prefill, for the endpoint picker).
    pub fn first_byte(&self) {
        if let Some(id) = self.id {
            self.pool.first_byte(id);
        }
    }
}

impl Drop for Picked {
    fn drop(&mut self) {
        self.pool.finish(self.member, self.id);
    }
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(algo: Algorithm) -> Pool {
        let cfg: PoolConfig =
            serde_yaml_ng::from_str("name: p\nmembers: ['10.0.0.1:80', '10.0.0.2:80', '10.0.0.3:80']\n")
                .unwrap();
        Pool::new(&cfg, algo, 1).unwrap()
    }

    #[test]
    fn equal_until_ratios_then_mean_for_unnamed_members() {
        let p = pool(Algorithm::WeightedRoundRobin);
        assert_eq!(p.weights(), vec![1, 1, 1]);
        let r: Ratios = [
            (MemberId::from("10.0.0.1:80"), 60),
            (MemberId::from("10.0.0.2:80"), 20),
            (MemberId::from("9.9.9.9:1"), 5),
        ]
        .into_iter()
        .collect();
        let a = p.apply_ratios(&r, WeightSource::Webhook);
        assert_eq!(p.weights(), vec![60, 20, 40]);
        assert_eq!(a.unknown_members, vec!["9.9.9.9:1".to_string()]);
        assert_eq!(a.unknown_count, 1);
        assert_eq!(a.defaulted_members, vec![MemberId::from("10.0.0.3:80")]);
        assert_eq!(p.view().weights_from, WeightSource::Webhook);
    }

    #[test]
    fn a_dropped_pick_is_uncounted_once() {
        let p = Arc::new(pool(Algorithm::RoundRobin));
        let a = p.pick_counted(&[], None, None).unwrap();
        let b = p.pick_counted(&[], None, None).unwrap();
        assert_eq!(p.view().members.iter().map(|m| m.in_flight).sum::<u32>(), 2);
        drop(a);
        assert_eq!(p.view().members.iter().map(|m| m.in_flight).sum::<u32>(), 1);
        drop(b);
        assert!(p.view().members.iter().all(|m| m.in_flight == 0));
    }

    #[test]
    fn ejected_members_are_skipped_while_others_remain() {
        let p = pool(Algorithm::RoundRobin);
        p.eject(0);
        for _ in 0..10 {
            let i = p.pick(&[]).unwrap();
            assert_ne!(i, 0);
            p.finish(i, None);
        }
        // Everything else tried: the ejected member is still a last resort.
        assert_eq!(p.pick(&[1, 2]), Some(0));
        assert_eq!(p.pick(&[0, 1, 2]), None);
    }
}
