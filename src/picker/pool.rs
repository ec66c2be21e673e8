//! One pool's endpoint picker as the doors share it: the members by address, the picker itself
//! ([`RequestPicker`], the code the proxy and the benchmark run), the ids of picks still open and
//! since when.
//!
//! The members and their capacity come from the control cycle (its report's ratios, on every
//! replica, leader or not); the engines' gauges from the refresher; the requests from the doors.
//! A pick names its member and, after it, fallbacks in the order the picker would take them.
//! A door that hears how a request ends settles it (first token, end); one that never does
//! (the BIG-IP sideband) sends it unsettled, and a settled door's pick whose end never comes is
//! released after `max_open`.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use llm_lc_balance::endpoint::picker::{Choice, Request, Settings};
use llm_lc_balance::endpoint::prompt::{body_blocks, BLOCK_TOKENS};
use llm_lc_balance::endpoint::{Gauges, RequestPicker};
use llm_lc_common::fnv1a64;

/// Blocks each member's prefix index holds: about 1M tokens of KV cache at 16 tokens a block.
pub const INDEX_BLOCKS: usize = 1 << 16;

/// How a door learns what became of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// The door reports first token and end ([`PoolPicker::first_token`], [`PoolPicker::finished`]);
    /// a pick still open after `max_open` is released.
    Tracked,
    /// The door reports the end only when the request gets that far (HAProxy's `done` comes with
    /// the response headers, and nothing when the client hangs up before): released after this
    /// long at most, when its load shows in the engine's own gauges anyway.
    TrackedFor(Duration),
    /// The door never hears: the request loads its member until the member's next reading.
    Never,
}

/// A door's question: the request body as the door has it (whole or its first bytes), the
/// client's key header if any, and the endpoints it may choose from (none: all members).
#[derive(Debug, Clone, Copy, Default)]
pub struct Ask<'a> {
    pub body: &'a [u8],
    pub key: Option<&'a [u8]>,
    pub subset: Option<&'a [String]>,
    /// The request may be refused when the whole pool is saturated (criticality `sheddable`).
    pub sheddable: bool,
    /// List fallbacks after the pick (the door passes them on; each costs another pick).
    pub with_fallbacks: bool,
}

/// The answer: the request's id (for settling) and the endpoints, the pick first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    pub id: u64,
    pub endpoints: Vec<String>,
}

/// Why there is no pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoPick {
    /// The pool has no members yet (no cycle has run) or none at all.
    NoMembers,
    /// The subset hint names no member of the pool.
    OutsideSubset,
    /// A sheddable request, and every member is saturated: refuse it (429).
    Shed,
}

pub struct PoolPicker {
    pub name: String,
    fallbacks: usize,
    /// Blocks of a prompt hashed (the picker's setting, fixed at construction).
    max_blocks: usize,
    max_open: Duration,
    next_id: AtomicU64,
    state: Mutex<State>,
}

struct State {
    members: Vec<String>,
    /// Each member's address, when it is one (a subset hint is matched by address).
    addrs: Vec<Option<SocketAddr>>,
    picker: RequestPicker,
    /// Open picks of tracked doors: id -> (member, when it is released if nobody settles it).
    open: HashMap<u64, (usize, Instant)>,
}

impl PoolPicker {
    pub fn new(name: &str, settings: Settings, fallbacks: usize, max_open: Duration) -> PoolPicker {
        PoolPicker {
            name: name.to_string(),
            fallbacks,
            max_blocks: settings.max_blocks,
            max_open,
            next_id: AtomicU64::new(1),
            state: Mutex::new(State {
                members: Vec::new(),
                addrs: Vec::new(),
                picker: RequestPicker::new(0, INDEX_BLOCKS, settings),
                open: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The members and their ratios as the last cycle computed them. A member who stays keeps its
    /// prefix index; the ratios become capacity shares (0: drained, chosen only if all are).
    pub fn set_members(&self, members: &[(String, f64)]) {
        let mut st = self.lock();
        let same =
            st.members.len() == members.len() && st.members.iter().zip(members).all(|(a, (b, _))| a == b);
        if !same {
            let old_of: Vec<Option<usize>> =
                members.iter().map(|(m, _)| st.members.iter().position(|o| o == m)).collect();
            st.picker.remap(&old_of, INDEX_BLOCKS);
            st.members = members.iter().map(|(m, _)| m.clone()).collect();
            st.addrs = st.members.iter().map(|m| m.parse().ok()).collect();
            st.open.clear();
        }
        let weights: Vec<f64> = members.iter().map(|(_, w)| *w).collect();
        st.picker.set_capacity(&weights);
    }

    pub fn members(&self) -> Vec<String> {
        self.lock().members.clone()
    }

    /// Member `member`'s gauges as just read (`None`: could not be read).
    pub fn set_gauges(&self, member: &str, gauges: Option<Gauges>) {
        let mut st = self.lock();
        if let Some(i) = st.members.iter().position(|m| m == member) {
            st.picker.set_gauges(i, gauges);
        }
    }

    /// Choose for `ask`. With [`Settle::Tracked`] the request is open until settled.
    pub fn pick(&self, ask: Ask<'_>, settle: Settle) -> Result<Pick, NoPick> {
        // Hashing a prompt is the costly part of a pick: outside the lock.
        let prompt = body_blocks(ask.body, self.max_blocks).unwrap_or_default();
        let key = ask.key.filter(|k| !k.is_empty()).map(fnv1a64);
        let request =
            Request { blocks: &prompt.blocks, tokens: prompt.tokens, block_tokens: BLOCK_TOKENS, key };
        let mut st = self.lock();
        if st.members.is_empty() {
            return Err(NoPick::NoMembers);
        }
        let allowed: Vec<bool> = match ask.subset {
            None => vec![true; st.members.len()],
            Some(subset) => st.addrs.iter().zip(&st.members).map(|(a, m)| in_subset(m, *a, subset)).collect(),
        };
        if !allowed.iter().any(|a| *a) {
            return Err(NoPick::OutsideSubset);
        }
        let first = st.picker.pick(request, |i| allowed[i]).ok_or(NoPick::NoMembers)?;
        if ask.sheddable && st.picker.last_pick_all_saturated() {
            return Err(NoPick::Shed);
        }
        let mut order = vec![first.member];
        // Fallbacks: what the picker would choose were the ones before them gone.
        let fallbacks = if ask.with_fallbacks { self.fallbacks } else { 0 };
        while order.len() <= fallbacks {
            let next = st.picker.pick(request, |i| allowed[i] && !order.contains(&i));
            match next {
                Some(c) if !order.contains(&c.member) && allowed[c.member] => order.push(c.member),
                _ => break,
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        st.picker.remember(first, request);
        let lease = match settle {
            Settle::Tracked => Some(self.max_open),
            Settle::TrackedFor(d) => Some(d.min(self.max_open)),
            Settle::Never => None,
        };
        match lease {
            Some(lease) => {
                st.picker.open(id, first);
                st.open.insert(id, (first.member, Instant::now() + lease));
            }
            None => st.picker.sent_unsettled(first),
        }
        Ok(Pick { id, endpoints: order.iter().map(|&i| st.members[i].clone()).collect() })
    }

    /// The data plane reports it served request `id` on `endpoint`: when that is not the pick (a
    /// fallback was taken), the request's load moves there. Returns whether it was the pick
    /// (`None` for a request or endpoint the picker does not know).
    pub fn served(&self, id: u64, endpoint: &str) -> Option<bool> {
        let mut st = self.lock();
        let &(member, until) = st.open.get(&id)?;
        let at = st.members.iter().position(|m| m == endpoint)?;
        if at != member {
            st.picker.finished(id);
            st.picker.open(id, Choice { member: at, matched: 0, uncached: 0 });
            st.open.insert(id, (at, until));
        }
        Some(at == member)
    }

    /// Request `id`'s answer began: its prefill no longer loads its member.
    pub fn first_token(&self, id: u64) {
        self.lock().picker.first_token(id);
    }

    /// Request `id` ended, however.
    pub fn finished(&self, id: u64) {
        let mut st = self.lock();
        if st.open.remove(&id).is_some() {
            st.picker.finished(id);
        }
    }

    /// Release picks open past their lease (a door that lost the request's end).
    pub fn sweep(&self, now: Instant) -> usize {
        let mut st = self.lock();
        let old: Vec<u64> =
            st.open.iter().filter(|(_, (_, until))| now > *until).map(|(id, _)| *id).collect();
        for id in &old {
            st.open.remove(id);
            st.picker.finished(*id);
        }
        old.len()
    }

    /// Requests open through tracked doors, per member.
    pub fn in_flight(&self) -> Vec<(String, u32)> {
        let st = self.lock();
        st.members.iter().enumerate().map(|(i, m)| (m.clone(), st.picker.requests(i))).collect()
    }
}

/// Whether `member` is among `subset`'s `ip[:port]` entries (an entry without a port names every
/// port of its address; IPv6 with or without brackets).
fn in_subset(member: &str, addr: Option<SocketAddr>, subset: &[String]) -> bool {
    subset.iter().any(|entry| {
        let entry = entry.trim();
        if entry == member {
            return true;
        }
        let Some(addr) = addr else { return false };
        if let Ok(sa) = entry.parse::<SocketAddr>() {
            return sa == addr;
        }
        entry.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().is_ok_and(|ip| ip == addr.ip())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(members: &[&str]) -> PoolPicker {
        let p = PoolPicker::new("p", Settings::default(), 2, Duration::from_secs(60));
        p.set_members(&members.iter().map(|m| (m.to_string(), 10.0)).collect::<Vec<_>>());
        p
    }

    fn body(system: &str, user: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({"model": "m", "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]}))
        .expect("json")
    }

    #[test]
    fn a_prefix_stays_on_its_member_and_fallbacks_follow_in_order() {
        let p = pool(&["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]);
        let doc = "a shared document. ".repeat(100);
        let first = p
            .pick(Ask { body: &body(&doc, "q1"), with_fallbacks: true, ..Ask::default() }, Settle::Tracked)
            .expect("a pick");
        assert_eq!(first.endpoints.len(), 3);
        let unique: std::collections::HashSet<_> = first.endpoints.iter().collect();
        assert_eq!(unique.len(), 3, "fallbacks are the other members, once each");
        for q in ["q2", "q3", "q4"] {
            let again =
                p.pick(Ask { body: &body(&doc, q), ..Ask::default() }, Settle::Tracked).expect("a pick");
            assert_eq!(again.endpoints[0], first.endpoints[0]);
        }
        assert_eq!(p.in_flight().iter().map(|(_, n)| n).sum::<u32>(), 4);
        p.finished(first.id);
        p.finished(first.id);
        assert_eq!(p.in_flight().iter().map(|(_, n)| n).sum::<u32>(), 3, "a double release is one");
    }

    #[test]
    fn the_subset_hint_is_obeyed_and_one_outside_the_pool_is_no_pick() {
        let p = pool(&["10.0.0.1:8000", "10.0.0.2:8000", "[2001:db8::3]:8000"]);
        let only = vec!["10.0.0.2".to_string()];
        for _ in 0..5 {
            let got = p.pick(Ask { subset: Some(&only), ..Ask::default() }, Settle::Never).expect("a pick");
            assert_eq!(got.endpoints, vec!["10.0.0.2:8000".to_string()]);
        }
        let v6 = vec!["2001:db8::3".to_string(), "10.0.0.1:8000".to_string()];
        let got = p
            .pick(Ask { subset: Some(&v6), with_fallbacks: true, ..Ask::default() }, Settle::Never)
            .expect("a pick");
        assert_eq!(got.endpoints.len(), 2);
        assert!(got.endpoints.iter().all(|e| e != "10.0.0.2:8000"));
        let outside = vec!["10.9.9.9:8000".to_string()];
        assert_eq!(
            p.pick(Ask { subset: Some(&outside), ..Ask::default() }, Settle::Never),
            Err(NoPick::OutsideSubset)
        );
        let empty = PoolPicker::new("e", Settings::default(), 2, Duration::from_secs(60));
        assert_eq!(empty.pick(Ask::default(), Settle::Never), Err(NoPick::NoMembers));
    }

    #[test]
    fn a_sheddable_request_is_refused_only_when_every_member_is_saturated() {
        let p = PoolPicker::new(
            "p",
            Settings { saturation_tokens: 1000.0, ..Settings::default() },
            0,
            Duration::from_secs(60),
        );
        p.set_members(&[("a:1".into(), 1.0), ("b:1".into(), 1.0)]);
        // Prompts of 2,000 tokens, each its own (nothing cached anywhere).
        let long = |i: usize| format!("{i:04}") + &"x".repeat(8000);
        let shed = |p: &PoolPicker, i: usize| {
            p.pick(Ask { body: long(i).as_bytes(), sheddable: true, ..Ask::default() }, Settle::Tracked)
        };
        assert!(shed(&p, 0).is_ok(), "an idle pool takes it");
        assert!(shed(&p, 1).is_ok(), "the other member still has room");
        assert_eq!(shed(&p, 2), Err(NoPick::Shed));
        let standard = p.pick(Ask { body: long(3).as_bytes(), ..Ask::default() }, Settle::Tracked);
        assert!(standard.is_ok(), "only sheddable requests are refused");
    }

    #[test]
    fn a_fallback_served_moves_the_load_and_forgotten_picks_are_swept() {
        let p = pool(&["10.0.0.1:8000", "10.0.0.2:8000"]);
        let got = p.pick(Ask { with_fallbacks: true, ..Ask::default() }, Settle::Tracked).expect("a pick");
        let other = got.endpoints[1].clone();
        p.served(got.id, &other);
        let counts: HashMap<String, u32> = p.in_flight().into_iter().collect();
        assert_eq!((counts[&got.endpoints[0]], counts[&other]), (0, 1));
        assert_eq!(p.sweep(Instant::now()), 0);
        assert_eq!(p.sweep(Instant::now() + Duration::from_secs(61)), 1);
        assert_eq!(p.in_flight().iter().map(|(_, n)| n).sum::<u32>(), 0);
    }

    #[test]
    fn a_pick_whose_end_may_never_come_is_released_after_its_shorter_lease() {
        let p = pool(&["10.0.0.1:8000", "10.0.0.2:8000"]);
        let t0 = Instant::now();
        let short = p.pick(Ask::default(), Settle::TrackedFor(Duration::from_secs(5))).expect("a pick");
        let long = p.pick(Ask::default(), Settle::Tracked).expect("a pick");
        assert_eq!(p.sweep(t0 + Duration::from_secs(4)), 0);
        assert_eq!(p.sweep(t0 + Duration::from_secs(6)), 1, "the short lease ends first");
        p.finished(short.id);
        assert_eq!(p.in_flight().iter().map(|(_, n)| n).sum::<u32>(), 1, "the long one still counts");
        // A lease longer than max_open (60 s here) is cut to it.
        let capped = p.pick(Ask::default(), Settle::TrackedFor(Duration::from_secs(3600))).expect("a pick");
        assert_eq!(p.sweep(t0 + Duration::from_secs(62)), 2);
        p.finished(long.id);
        p.finished(capped.id);
    }

    #[test]
    fn fallbacks_are_listed_only_when_asked() {
        let p = pool(&["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]);
        assert_eq!(p.pick(Ask::default(), Settle::Never).expect("a pick").endpoints.len(), 1);
        let with = Ask { with_fallbacks: true, ..Ask::default() };
        assert_eq!(p.pick(with, Settle::Never).expect("a pick").endpoints.len(), 3);
    }

    #[test]
    fn a_drained_member_is_not_picked_and_membership_changes_keep_who_stays() {
        let p = PoolPicker::new("p", Settings::default(), 0, Duration::from_secs(60));
        p.set_members(&[("a:1".into(), 0.0), ("b:1".into(), 5.0)]);
        for _ in 0..5 {
            assert_eq!(
                p.pick(Ask::default(), Settle::Never).expect("a pick").endpoints,
                vec!["b:1".to_string()]
            );
        }
        let doc = "a shared document. ".repeat(100);
        p.set_members(&[("a:1".into(), 5.0), ("b:1".into(), 5.0)]);
        let home = p.pick(Ask { body: &body(&doc, "x"), ..Ask::default() }, Settle::Never).expect("a pick");
        // A third member joins: the prefix stays where its blocks are.
        p.set_members(&[("a:1".into(), 5.0), ("b:1".into(), 5.0), ("c:1".into(), 5.0)]);
        let again = p.pick(Ask { body: &body(&doc, "y"), ..Ask::default() }, Settle::Never).expect("a pick");
        assert_eq!(again.endpoints[0], home.endpoints[0]);
    }
}
