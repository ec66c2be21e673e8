//! The endpoint picker we ship: per request, the member where this request's first token comes
//! soonest, reckoned from what each member still has to prefill per unit of its **capacity**, kept
//! **sticky** to the members that hold the prompt's prefix until they are saturated, and with a
//! **home** per prefix that every replica of the picker computes alike, so several pickers sharing
//! a fleet (active-active) keep a prefix together without talking to each other.
//!
//! Per member it knows:
//! - its capacity share: the controller's ratio (a slow or small server is known as such), which
//!   no anchor of the field has;
//! - its own dispatches ([`Accounting`]): requests in flight, uncached prompt tokens until the
//!   first token; exact and instant, but only this replica's;
//! - the engine's own gauges (waiting, running, KV usage), a scrape old but counting everybody's
//!   requests: with several picker replicas they are what one replica knows of the others;
//! - an approximate prefix index ([`PrefixIndex`]) of the blocks it sent there.
//!
//! A pick, in three steps:
//! 1. **Backlog** of member `i`, in prefill tokens per unit of capacity: the larger of its own
//!    uncached tokens in flight and the engine's waiting requests at the mean uncached size
//!    dispatched; its **load**, in requests per unit of capacity: the larger of its own requests
//!    in flight and the engine's running and waiting ones. To the engine's numbers is added what
//!    this picker sent since they were read and is still open. A request's **cost** there is
//!    `request_tokens` per unit of load (decode shares the engine's steps with prefill), the
//!    backlog, its own uncached part over the capacity share, and KV pressure `k / (1 - k)`.
//! 2. **Sticky**: members whose index holds at least `affinity` of the prompt are warm; the
//!    cheapest warm member wins unless it is saturated: backlog over `saturation_tokens`, or load
//!    over `(1 + overload)` times the mean plus one.
//! 3. **Home**: otherwise the members within `home_slack_tokens` of the cheapest are the choice,
//!    and among them the prompt's home wins: the highest capacity-weighted rendezvous hash of the
//!    prompt's first block (or of the key header, which wins when sent). Every replica of the
//!    picker computes the same home, so a prefix cold on this replica is still sent where the
//!    others send it; a busy home is passed over for an idle member, which a hash decided blind
//!    (the load balancer's consistent hash) cannot do.
//!
//! Members the controller drained (ratio 0) are never chosen while another is open. Gauges that
//! are missing, stale, NaN or negative are ignored: the member is scored from the picker's own
//! accounting, so a fleet whose metrics all went stale is still served.

use std::collections::HashMap;

use llm_lc_common::splitmix64;

use super::{Accounting, Gauges, PrefixIndex};

/// What a pick weighs, and how much.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// Share of the prompt's blocks a member's index must hold to be warm.
    pub affinity: f64,
    /// Backlog (prefill tokens per unit of capacity) past which a warm member is saturated.
    pub saturation_tokens: f64,
    /// A warm member is also saturated when its requests per unit of capacity pass the open
    /// members' mean by this share (0.3: 30% over the mean), plus one request.
    pub overload: f64,
    /// A cold request goes home when home costs at most this much more than the cheapest member,
    /// plus `home_prompt` x its prompt's tokens (what a hit at home would save, if other
    /// replicas of the picker made home warm).
    pub home_slack_tokens: f64,
    pub home_prompt: f64,
    /// Prefill tokens one running request is worth in a member's backlog.
    pub request_tokens: f64,
    /// Prefill tokens a member's KV pressure `k / (1 - k)` is worth.
    pub kv_tokens: f64,
    /// Leading prompt blocks a pick looks at: a 10 MB prompt is matched by its beginning.
    pub max_blocks: usize,
    /// How much of the controller's capacity shares a pick believes: a member's share is
    /// `(ratio / mean ratio) ^ capacity` (0: all equal, 1: as pushed).
    pub capacity: f64,
}

impl Default for Settings {
    /// Chosen on the bench's tuning seeds 1-3 (src/bench/RESULTS.md, "The endpoint picker").
    fn default() -> Settings {
        Settings {
            affinity: 0.8,
            saturation_tokens: 20_000.0,
            overload: 1.0,
            home_slack_tokens: 2_000.0,
            home_prompt: 0.0,
            request_tokens: 100.0,
            kv_tokens: 500.0,
            max_blocks: 4096,
            capacity: 1.0,
        }
    }
}

impl Settings {
    /// The names [`Settings::set`] knows.
    pub const NAMES: &'static [&'static str] = &[
        "affinity",
        "saturation_tokens",
        "overload",
        "home_slack_tokens",
        "home_prompt",
        "request_tokens",
        "kv_tokens",
        "max_blocks",
        "capacity",
    ];

    /// Set one setting by name from `NAME=VALUE`: a finite number, not negative (`affinity` at
    /// most 1, `max_blocks` at least 1).
    pub fn set(&mut self, assignment: &str) -> Result<(), String> {
        let (name, value) = assignment
            .split_once('=')
            .ok_or_else(|| format!("picker setting {assignment:?}: expected NAME=VALUE"))?;
        let (name, value) = (name.trim(), value.trim());
        let v: f64 = value
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| format!("picker setting {name}: {value:?} is not a number >= 0"))?;
        match name {
            "affinity" if v <= 1.0 => self.affinity = v,
            "affinity" => {
                return Err(format!("picker setting affinity: {v} is over 1 (a share of the prompt)"))
            }
            "saturation_tokens" => self.saturation_tokens = v,
            "overload" => self.overload = v,
            "home_slack_tokens" => self.home_slack_tokens = v,
            "home_prompt" => self.home_prompt = v,
            "request_tokens" => self.request_tokens = v,
            "kv_tokens" => self.kv_tokens = v,
            "capacity" => self.capacity = v,
            "max_blocks" if v >= 1.0 => self.max_blocks = v as usize,
            "max_blocks" => return Err("picker setting max_blocks: at least 1".into()),
            _ => {
                return Err(format!("unknown picker setting {name:?}; known: {}", Settings::NAMES.join(", ")))
            }
        }
        Ok(())
    }
}

/// A request as the picker needs it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Request<'a> {
    /// Hash chain of the prompt's full blocks (a block's hash covers everything before it).
    pub blocks: &'a [u64],
    /// Prompt length in tokens.
    pub tokens: u64,
    /// Tokens per block.
    pub block_tokens: u64,
    /// The key header's hash, when the client sent one: it names the home and the warm set.
    pub key: Option<u64>,
}

/// Where a request went and what it will cost there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    pub member: usize,
    /// Leading blocks the member's index held.
    pub matched: usize,
    /// Prompt tokens the member still has to prefill.
    pub uncached: u64,
}

/// One member as the picker holds it.
#[derive(Debug, Clone, Default)]
struct Member {
    /// Capacity share, as pushed by the controller (0: drained).
    weight: f64,
    gauges: Option<Gauges>,
    /// Requests and uncached tokens this picker sent since the gauges were read, still open (and
    /// tokens still before their first token): what the engine's numbers do not show yet.
    sent_since_gauges: (u32, u64),
    /// Which reading of the gauges this is: a request counts in `sent_since_gauges` only while
    /// it is the reading it was sent after.
    reading: u64,
    index: PrefixIndex,
}

impl Member {
    /// A member as it joins: equal capacity, no gauges, an empty index of `cache_blocks`.
    fn fresh(cache_blocks: usize) -> Member {
        Member {
            weight: 1.0,
            gauges: None,
            sent_since_gauges: (0, 0),
            reading: 0,
            index: PrefixIndex::with_capacity(cache_blocks),
        }
    }
}

/// A member's numbers during one pick.
#[derive(Debug, Clone, Copy)]
struct Scored {
    index: usize,
    matched: usize,
    uncached: u64,
    /// Capacity share (1: the mean).
    share: f64,
    /// Requests per unit of capacity.
    load: f64,
    /// Prefill tokens per unit of capacity.
    backlog: f64,
    cost: f64,
}

/// The per-request picker: its settings, what it knows of each member, and its dispatches.
#[derive(Debug, Clone)]
pub struct RequestPicker {
    settings: Settings,
    members: Vec<Member>,
    accounting: Accounting,
    /// Mean uncached tokens per dispatch (exponentially weighted): the size of a waiting request.
    mean_uncached: f64,
    /// Picks without a home still need one that moves: a counter through splitmix64.
    unkeyed: u64,
    /// Open requests sent since their member's last reading: id -> (member, reading, uncached
    /// tokens still counted).
    since_reading: HashMap<u64, (usize, u64, u64)>,
    scored: Vec<Scored>,
}

/// Weight of the newest dispatch in the running mean of uncached tokens.
const MEAN_ALPHA: f64 = 0.05;
/// KV usage counted at most this full: `k / (1 - k)` stays finite.
const KV_CAP: f64 = 0.99;

impl RequestPicker {
    /// A picker for `members` members of equal capacity, each index holding `cache_blocks` blocks.
    pub fn new(members: usize, cache_blocks: usize, settings: Settings) -> RequestPicker {
        RequestPicker {
            settings,
            members: vec![Member::fresh(cache_blocks); members],
            accounting: Accounting::new(members),
            mean_uncached: 0.0,
            unkeyed: 0,
            since_reading: HashMap::new(),
            scored: Vec::with_capacity(members),
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Each member's index holds as many blocks as its KV cache (where the engine publishes it).
    pub fn set_cache_blocks(&mut self, blocks: &[usize]) {
        for (m, &b) in self.members.iter_mut().zip(blocks) {
            m.index = PrefixIndex::with_capacity(b);
        }
    }

    /// The controller's ratios: each member's capacity share. Non-finite or negative is 0.
    pub fn set_capacity(&mut self, weights: &[f64]) {
        for (m, &w) in self.members.iter_mut().zip(weights) {
            m.weight = if w.is_finite() && w > 0.0 { w } else { 0.0 };
        }
    }

    /// Member `i`'s gauges as of now, or `None` when they are missing or stale. A NaN or negative
    /// KV usage is dropped, the queue counts are kept.
    pub fn set_gauges(&mut self, i: usize, gauges: Option<Gauges>) {
        if let Some(m) = self.members.get_mut(i) {
            m.sent_since_gauges = (0, 0);
            m.reading += 1;
            m.gauges = gauges.map(|g| Gauges {
                kv_usage: if g.kv_usage.is_finite() && g.kv_usage >= 0.0 { g.kv_usage.min(1.0) } else { 0.0 },
                ..g
            });
        }
    }

    /// Choose a member for `request` among those `eligible` allows (none allowed: all are). The
    /// caller reports the dispatch with [`RequestPicker::dispatched`] once the request has an id.
    pub fn pick(&mut self, request: Request<'_>, eligible: impl Fn(usize) -> bool) -> Option<Choice> {
        let s = self.settings;
        let blocks = &request.blocks[..request.blocks.len().min(s.max_blocks)];
        let key_block = request.key.map(key_block);
        // Capacity shares relative to the mean of the open members: backlogs are in tokens of an
        // average member. Nobody open (all drained, or none eligible): everybody is.
        let open = |m: &Member, i: usize| eligible(i) && m.weight > 0.0;
        let any_open = self.members.iter().enumerate().any(|(i, m)| open(m, i));
        let any_eligible = (0..self.members.len()).any(&eligible);
        let admit = |m: &Member, i: usize| {
            if any_open {
                open(m, i)
            } else if any_eligible {
                eligible(i)
            } else {
                true
            }
        };
        let (sum, count) = self
            .members
            .iter()
            .enumerate()
            .filter(|(i, m)| admit(m, *i))
            .fold((0.0, 0usize), |(s, c), (_, m)| (s + m.weight, c + 1));
        let mean_weight = if sum > 0.0 { sum / count as f64 } else { 1.0 };
        self.scored.clear();
        for (i, m) in self.members.iter().enumerate() {
            if !admit(m, i) {
                continue;
            }
            let share = if m.weight > 0.0 { (m.weight / mean_weight).powf(s.capacity) } else { 1.0 };
            let key_held = key_block.is_some_and(|k| m.index.matched(&[k]) == 1);
            let matched = m.index.matched(blocks);
            let uncached =
                request.tokens.saturating_sub((matched as u64).saturating_mul(request.block_tokens));
            let own_tokens = self.accounting.tokens(i) as f64;
            let own_requests = f64::from(self.accounting.requests(i));
            // The engine's numbers count every picker's requests, as of its last scrape; what
            // this one sent since is added on top, so picks between two scrapes do not herd.
            let (sent, sent_tokens) = m.sent_since_gauges;
            let (queued, engine_requests, kv) = match m.gauges {
                Some(g) => (
                    f64::from(g.waiting) * self.mean_uncached + sent_tokens as f64,
                    f64::from(g.running.saturating_add(g.waiting).saturating_add(sent)),
                    g.kv_usage,
                ),
                None => (0.0, 0.0, 0.0),
            };
            let load = own_requests.max(engine_requests) / share;
            let backlog = own_tokens.max(queued) / share;
            let k = kv.min(KV_CAP);
            let cost =
                s.request_tokens * load + backlog + uncached as f64 / share + s.kv_tokens * k / (1.0 - k);
            // A held key counts as the whole prompt for warmth (the client's key wins).
            let matched = if key_held { blocks.len().max(1) } else { matched };
            self.scored.push(Scored { index: i, matched, uncached, share, load, backlog, cost });
        }
        let want = if key_block.is_some() { blocks.len().max(1) } else { blocks.len() };
        let warm = |c: &Scored| want > 0 && c.matched as f64 >= s.affinity * want as f64;
        let cheapest_warm = self.scored.iter().filter(|c| warm(c)).min_by(|a, b| a.cost.total_cmp(&b.cost));
        let mean_load = self.scored.iter().map(|c| c.load).sum::<f64>() / self.scored.len().max(1) as f64;
        let saturated =
            |c: &Scored| c.backlog > s.saturation_tokens || c.load > mean_load * (1.0 + s.overload) + 1.0;
        let choice = match cheapest_warm {
            Some(c) if !saturated(c) => *c,
            _ => {
                let cheapest = self.scored.iter().map(|c| c.cost).fold(f64::INFINITY, f64::min);
                let home = match (key_block, blocks.first()) {
                    (Some(k), _) => k,
                    (None, Some(&b)) => b,
                    (None, None) => {
                        self.unkeyed = self.unkeyed.wrapping_add(1);
                        self.unkeyed
                    }
                };
                let slack = if request.key.is_some() || !blocks.is_empty() {
                    s.home_slack_tokens + s.home_prompt * request.tokens as f64
                } else {
                    0.0
                };
                *self.scored.iter().filter(|c| c.cost <= cheapest + slack).max_by(|a, b| {
                    let ra = rendezvous(home, a.index, a.share);
                    let rb = rendezvous(home, b.index, b.share);
                    ra.total_cmp(&rb)
                })?
            }
        };
        Some(Choice {
            member: choice.index,
            matched: choice.matched.min(blocks.len()),
            uncached: choice.uncached,
        })
    }

    /// Request `id` went where `choice` says: [`RequestPicker::remember`] and
    /// [`RequestPicker::open`] at once.
    pub fn dispatched(&mut self, id: u64, choice: Choice, request: Request<'_>) {
        self.remember(choice, request);
        self.open(id, choice);
    }

    /// `request`'s blocks (and key) are now in the chosen member's index.
    pub fn remember(&mut self, choice: Choice, request: Request<'_>) {
        let Some(m) = self.members.get_mut(choice.member) else { return };
        let blocks = &request.blocks[..request.blocks.len().min(self.settings.max_blocks)];
        if let Some(k) = request.key {
            m.index.record(&[key_block(k)]);
        }
        m.index.record(blocks);
    }

    /// Request `id` and its uncached tokens are in flight on the chosen member.
    pub fn open(&mut self, id: u64, choice: Choice) {
        if let Some(m) = self.members.get_mut(choice.member) {
            m.sent_since_gauges.0 = m.sent_since_gauges.0.saturating_add(1);
            m.sent_since_gauges.1 = m.sent_since_gauges.1.saturating_add(choice.uncached);
            self.since_reading.insert(id, (choice.member, m.reading, choice.uncached));
            self.accounting.dispatched(id, choice.member, choice.uncached);
            self.mean_uncached += MEAN_ALPHA * (choice.uncached as f64 - self.mean_uncached);
        }
    }

    /// Request `id`'s first token arrived: its prefill no longer loads its member.
    pub fn first_token(&mut self, id: u64) {
        self.accounting.first_token(id);
        if let Some((member, reading, tokens)) = self.since_reading.get_mut(&id) {
            if let Some(m) = self.members.get_mut(*member).filter(|m| m.reading == *reading) {
                m.sent_since_gauges.1 = m.sent_since_gauges.1.saturating_sub(*tokens);
            }
            *tokens = 0;
        }
    }

    /// Request `id` ended, however it ended: a request sent since its member's last reading and
    /// already over is not load the next reading will show.
    pub fn finished(&mut self, id: u64) {
        self.accounting.finished(id);
        if let Some((member, reading, tokens)) = self.since_reading.remove(&id) {
            if let Some(m) = self.members.get_mut(member).filter(|m| m.reading == reading) {
                m.sent_since_gauges.0 = m.sent_since_gauges.0.saturating_sub(1);
                m.sent_since_gauges.1 = m.sent_since_gauges.1.saturating_sub(tokens);
            }
        }
    }

    /// `choice` went out through a door that never hears how the request ends (a BIG-IP
    /// sideband call): it loads its member in the picker's eyes until the member's next reading,
    /// which shows it, and is never in the picker's own accounting.
    pub fn sent_unsettled(&mut self, choice: Choice) {
        if let Some(m) = self.members.get_mut(choice.member) {
            m.sent_since_gauges.0 = m.sent_since_gauges.0.saturating_add(1);
            m.sent_since_gauges.1 = m.sent_since_gauges.1.saturating_add(choice.uncached);
            self.mean_uncached += MEAN_ALPHA * (choice.uncached as f64 - self.mean_uncached);
        }
    }

    /// The member set changed: new member `j` is old member `old_of[j]` (its capacity, gauges and
    /// prefix index kept) or a newcomer (`None`: equal capacity, empty index of `cache_blocks`).
    /// Requests in flight are forgotten (their later release is a no-op): a membership change is
    /// rare, and a leak across it would be worse than a moment's undercount.
    pub fn remap(&mut self, old_of: &[Option<usize>], cache_blocks: usize) {
        let fresh = Member::fresh(cache_blocks);
        let mut old: Vec<Option<Member>> = std::mem::take(&mut self.members).into_iter().map(Some).collect();
        self.members = old_of
            .iter()
            .map(|o| {
                let kept = o.and_then(|i| old.get_mut(i)).and_then(Option::take);
                kept.map(|m| Member { sent_since_gauges: (0, 0), ..m }).unwrap_or_else(|| fresh.clone())
            })
            .collect();
        self.accounting = Accounting::new(self.members.len());
        self.since_reading.clear();
    }

    /// Whether every member the last [`RequestPicker::pick`] weighed had more prefill backlog
    /// than `saturation_tokens` per unit of capacity: the pool as a whole is saturated, and a
    /// request that may be shed should be.
    pub fn last_pick_all_saturated(&self) -> bool {
        !self.scored.is_empty() && self.scored.iter().all(|c| c.backlog > self.settings.saturation_tokens)
    }

    /// Requests this picker has in flight on member `i`.
    pub fn requests(&self, i: usize) -> u32 {
        self.accounting.requests(i)
    }

    /// Uncached prompt tokens this picker has in flight on member `i` (before their first token).
    pub fn tokens(&self, i: usize) -> u64 {
        self.accounting.tokens(i)
    }

    /// Blocks member `i`'s index holds.
    pub fn indexed_blocks(&self, i: usize) -> usize {
        self.members.get(i).map_or(0, |m| m.index.len())
    }
}

/// The block a key header stands for in the index: apart from any body block's hash.
fn key_block(key: u64) -> u64 {
    splitmix64(key ^ 0x6b65_795f_6865_6164)
}

/// Weighted rendezvous score of `member` for `home`: the member with the highest score is home,
/// each member with probability proportional to its weight, and a member that leaves or joins
/// moves only its own share of homes.
fn rendezvous(home: u64, member: usize, weight: f64) -> f64 {
    let h = splitmix64(home ^ splitmix64(member as u64 + 1));
    // A uniform draw in (0, 1): never 0, so the log is finite.
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    if weight > 0.0 {
        -weight / u.ln()
    } else {
        -1.0 / u.ln() * 1e-9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(blocks: &[u64], tokens: u64) -> Request<'_> {
        Request { blocks, tokens, block_tokens: 16, key: None }
    }

    fn picker(n: usize) -> RequestPicker {
        RequestPicker::new(n, 10_000, Settings::default())
    }

    #[test]
    fn a_prefix_stays_where_it_was_sent_until_that_member_is_saturated() {
        let mut p = picker(4);
        let blocks: Vec<u64> = (0..100).collect();
        let first = p.pick(request(&blocks, 1600), |_| true).expect("a member");
        p.dispatched(1, first, request(&blocks, 1600));
        assert_eq!((first.matched, first.uncached), (0, 1600));
        // Warm now: the next request with the prefix stays, with nothing left to prefill.
        let again = p.pick(request(&blocks, 1600), |_| true).expect("a member");
        assert_eq!((again.member, again.matched, again.uncached), (first.member, 100, 0));
        // Past saturation (own tokens in flight over the threshold) it leaves for a cold member.
        p.dispatched(2, Choice { member: first.member, matched: 0, uncached: 30_000 }, request(&[], 0));
        let away = p.pick(request(&blocks, 1600), |_| true).expect("a member");
        assert_ne!(away.member, first.member);
        // The first tokens free the prefill load: home again.
        p.first_token(1);
        p.first_token(2);
        assert_eq!(p.tokens(first.member), 0);
        assert_eq!(p.pick(request(&blocks, 1600), |_| true).map(|c| c.member), Some(first.member));
    }

    #[test]
    fn a_cold_prefix_goes_to_the_same_home_from_every_replica_unless_home_is_busy() {
        let blocks: Vec<u64> = (500..600).collect();
        let mut a = picker(6);
        let mut b = picker(6);
        let home = a.pick(request(&blocks, 1600), |_| true).expect("a member").member;
        assert_eq!(b.pick(request(&blocks, 1600), |_| true).map(|c| c.member), Some(home));
        // Other prefixes have other homes.
        let homes: std::collections::HashSet<usize> = (0..60u64)
            .filter_map(|g| {
                let other: Vec<u64> = (g * 1000..g * 1000 + 10).collect();
                a.pick(request(&other, 160), |_| true).map(|c| c.member)
            })
            .collect();
        assert_eq!(homes.len(), 6);
        // A home busier than the slack loses the cold request to an idle member.
        b.set_gauges(home, Some(Gauges { waiting: 0, running: 40, kv_usage: 0.5 }));
        assert_ne!(b.pick(request(&blocks, 1600), |_| true).map(|c| c.member), Some(home));
    }

    #[test]
    fn capacity_divides_the_backlog_and_a_drained_member_is_never_chosen() {
        let mut p = picker(2);
        p.set_capacity(&[3.0, 1.0]);
        let mut counts = [0; 2];
        for id in 0..40 {
            let c = p.pick(request(&[], 100), |_| true).expect("a member");
            p.dispatched(id, c, request(&[], 100));
            counts[c.member] += 1;
        }
        assert_eq!(counts, [30, 10], "three times the capacity, three times the requests");
        p.set_capacity(&[0.0, 1.0]);
        assert!((0..10).all(|_| p.pick(request(&[], 100), |_| true).map(|c| c.member) == Some(1)));
        // All drained, or nobody eligible: everybody is a candidate rather than nobody.
        p.set_capacity(&[0.0, 0.0]);
        assert!(p.pick(request(&[], 100), |_| true).is_some());
        assert!(p.pick(request(&[], 100), |_| false).is_some());
        assert!(p.pick(request(&[], 100), |i| i == 0).is_some_and(|c| c.member == 0));
    }

    #[test]
    fn bad_gauges_are_ignored_and_a_key_header_wins_over_the_body() {
        let mut p = picker(2);
        p.set_gauges(0, Some(Gauges { waiting: 0, running: 0, kv_usage: f64::NAN }));
        p.set_gauges(1, Some(Gauges { waiting: 0, running: 0, kv_usage: -3.0 }));
        let c = p.pick(request(&[1, 2, 3], 48), |_| true).expect("a member");
        assert!(c.member < 2);
        // A key sent to member `m` brings every request with that key to `m`, whatever its body.
        fn keyed(blocks: &[u64]) -> Request<'_> {
            Request { blocks, tokens: 48, block_tokens: 16, key: Some(42) }
        }
        let first = p.pick(keyed(&[7, 8, 9]), |_| true).expect("a member");
        p.dispatched(1, first, keyed(&[7, 8, 9]));
        for body in [[10u64, 11, 12], [20, 21, 22], [30, 31, 32]] {
            assert_eq!(p.pick(keyed(&body), |_| true).map(|c| c.member), Some(first.member));
        }
    }

    #[test]
    fn requests_that_ended_between_two_readings_are_no_load() {
        let mut p = picker(3);
        for i in 0..3 {
            p.set_gauges(i, Some(Gauges { waiting: 0, running: 0, kv_usage: 0.0 }));
        }
        let keyed = |blocks: &'static [u64]| Request { blocks, tokens: 345, block_tokens: 16, key: Some(77) };
        let first = p.pick(keyed(&[1, 2, 3]), |_| true).expect("a member");
        p.dispatched(0, first, keyed(&[1, 2, 3]));
        p.first_token(0);
        p.finished(0);
        // Twenty quick requests with the key and no new reading: each has ended before the next,
        // so the member is never saturated by them and the key keeps them home.
        for id in 1..21 {
            let c = p.pick(keyed(&[9, 8, 7]), |_| true).expect("a member");
            assert_eq!(c.member, first.member, "request {id}");
            p.dispatched(id, c, keyed(&[9, 8, 7]));
            p.first_token(id);
            p.finished(id);
        }
        // Still open, they count until the next reading.
        for id in 100..130 {
            let c = Choice { member: first.member, matched: 0, uncached: 10 };
            p.dispatched(id, c, keyed(&[]));
        }
        assert_ne!(p.pick(keyed(&[9, 8, 7]), |_| true).map(|c| c.member), Some(first.member));
    }

    #[test]
    fn unsettled_sends_load_their_member_until_its_next_reading() {
        let mut p = picker(2);
        for i in 0..2 {
            p.set_gauges(i, Some(Gauges::default()));
        }
        let c = Choice { member: 0, matched: 0, uncached: 30_000 };
        p.sent_unsettled(c);
        assert_eq!(p.requests(0), 0, "never in the own accounting, so nothing to leak");
        assert_eq!(p.pick(request(&[], 100), |_| true).map(|c| c.member), Some(1));
        p.set_gauges(0, Some(Gauges::default()));
        p.set_gauges(1, Some(Gauges { waiting: 0, running: 3, kv_usage: 0.0 }));
        assert_eq!(p.pick(request(&[], 100), |_| true).map(|c| c.member), Some(0));
    }

    #[test]
    fn a_membership_change_keeps_the_index_and_capacity_of_who_stays() {
        let mut p = picker(3);
        p.set_capacity(&[1.0, 2.0, 1.0]);
        let blocks: Vec<u64> = (0..50).collect();
        let first = p.pick(request(&blocks, 800), |_| true).expect("a member");
        p.dispatched(1, first, request(&blocks, 800));
        // The chosen member moves to the last slot; a newcomer takes its place.
        let mut old_of = vec![Some(0), Some(1), Some(2)];
        old_of[first.member] = None;
        old_of.push(Some(first.member));
        p.remap(&old_of, 10_000);
        assert_eq!(p.len(), 4);
        assert_eq!(p.indexed_blocks(3), 50);
        assert_eq!(p.indexed_blocks(first.member), 0);
        assert_eq!((0..4).map(|i| p.requests(i)).sum::<u32>(), 0);
        p.finished(1);
        assert_eq!(p.pick(request(&blocks, 800), |_| true).map(|c| c.member), Some(3));
    }

    #[test]
    fn the_pool_is_saturated_only_when_every_member_is() {
        let mut p = picker(2);
        p.dispatched(1, Choice { member: 0, matched: 0, uncached: 30_000 }, request(&[], 0));
        p.pick(request(&[], 100), |_| true);
        assert!(!p.last_pick_all_saturated(), "one member still has room");
        p.dispatched(2, Choice { member: 1, matched: 0, uncached: 30_000 }, request(&[], 0));
        p.pick(request(&[], 100), |_| true);
        assert!(p.last_pick_all_saturated());
        p.first_token(2);
        p.pick(request(&[], 100), |_| true);
        assert!(!p.last_pick_all_saturated());
    }

    #[test]
    fn settings_are_set_by_name_and_bad_ones_are_named() {
        let mut s = Settings::default();
        s.set("overload = 0.5").expect("valid");
        s.set("max_blocks=128").expect("valid");
        assert_eq!((s.overload, s.max_blocks), (0.5, 128));
        for (bad, says) in [
            ("overload", "NAME=VALUE"),
            ("overload=-1", "not a number >= 0"),
            ("overload=NaN", "not a number >= 0"),
            ("affinity=1.5", "over 1"),
            ("max_blocks=0", "at least 1"),
            ("speed=3", "known: affinity"),
        ] {
            let e = s.set(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
        assert_eq!(s.overload, 0.5, "a refused setting changes nothing");
    }

    #[test]
    fn a_huge_prompt_is_matched_and_recorded_by_its_leading_blocks_only() {
        let mut p = RequestPicker::new(2, 1_000_000, Settings { max_blocks: 64, ..Settings::default() });
        let huge: Vec<u64> = (0..700_000).collect();
        let c = p.pick(request(&huge, 700_000 * 16), |_| true).expect("a member");
        p.dispatched(1, c, request(&huge, 700_000 * 16));
        assert_eq!(p.indexed_blocks(c.member), 64);
        // (Its 11 million uncached tokens would saturate the member until its first token.)
        p.first_token(1);
        let again = p.pick(request(&huge, 700_000 * 16), |_| true).expect("a member");
        assert_eq!((again.member, again.matched), (c.member, 64));
    }
}
