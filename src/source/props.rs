//! llama.cpp's `GET /props`: the slot count (`total_slots`, its `--parallel`), which its metrics
//! page does not carry. Read once per member and kept; read again when the member is new, when it
//! restarted (a counter of its page went down, or the page could not be read in between), every
//! [`REFRESH`] in case it was redeployed on the same address, and, after a failed read, at most
//! every [`RETRY`]. A member whose `/props` is missing or unreadable keeps working on what its page
//! shows: the failure is logged once per member (until a read succeeds) and counted by the caller.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use llm_lc_adapters::MemberId;

use super::MAX_SLOTS;

/// How often a known slot count is read again anyway.
pub const REFRESH: Duration = Duration::from_secs(300);
/// How soon a failed read is tried again.
pub const RETRY: Duration = Duration::from_secs(30);
/// Largest `/props` answer read (it carries the chat template, a few KiB as a rule).
pub const MAX_BYTES: usize = 1 << 20;

/// What is known of one member's `/props`.
#[derive(Debug, Clone)]
struct Known {
    slots: Option<f64>,
    at: Instant,
    /// The counter that tells restarts, as last seen.
    marker: Option<f64>,
    /// A failure was logged and not yet followed by a success.
    logged: bool,
}

/// The slot counts of a source's members.
#[derive(Debug, Default)]
pub struct SlotCache {
    known: HashMap<MemberId, Known>,
}

/// What a cycle should do about one member's `/props`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Due {
    /// Use this (possibly unknown) count; no read.
    Keep(Option<f64>),
    /// Read `/props` now.
    Read,
}

impl SlotCache {
    /// Whether to read `/props` of `m` now, given the restart marker on its page (a counter).
    pub fn due(&mut self, m: &MemberId, marker: Option<f64>, now: Instant) -> Due {
        let Some(k) = self.known.get_mut(m) else { return Due::Read };
        let restarted = matches!((k.marker, marker), (Some(before), Some(now)) if now < before);
        k.marker = marker.or(k.marker);
        let age = now.saturating_duration_since(k.at);
        if restarted || age >= REFRESH || (k.slots.is_none() && age >= RETRY) {
            return Due::Read;
        }
        Due::Keep(k.slots)
    }

    /// Record a read. Returns whether a failure should be logged (the first since a success).
    pub fn record(
        &mut self,
        m: &MemberId,
        marker: Option<f64>,
        result: &Result<f64, String>,
        now: Instant,
    ) -> bool {
        let before = self.known.get(m);
        let was_logged = before.is_some_and(|k| k.logged);
        // A failed re-read keeps the count known before: the server did not stop having slots.
        let slots = match result {
            Ok(n) => Some(*n),
            Err(_) => before.and_then(|k| k.slots),
        };
        let log = result.is_err() && !was_logged;
        self.known.insert(
            m.clone(),
            Known { slots, at: now, marker, logged: result.is_err() && (log || was_logged) },
        );
        log
    }

    /// The count known for `m`.
    pub fn get(&self, m: &MemberId) -> Option<f64> {
        self.known.get(m).and_then(|k| k.slots)
    }

    /// Forget members that left (or whose page could not be read: a restart may be under way).
    pub fn retain(&mut self, keep: impl Fn(&MemberId) -> bool) {
        self.known.retain(|m, _| keep(m));
    }
}

/// `total_slots` of a `/props` answer, checked: a count of 0, a fraction or an absurd number is
/// refused with the reason.
pub fn parse_total_slots(body: &[u8]) -> Result<f64, String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("/props is not JSON: {e}"))?;
    let n = v.get("total_slots").ok_or("/props has no total_slots")?;
    let n = n.as_u64().ok_or_else(|| format!("/props total_slots is not a whole number: {n}"))?;
    if n == 0 || n as f64 > MAX_SLOTS {
        return Err(format!("/props total_slots {n} is out of range (1..={MAX_SLOTS})"));
    }
    Ok(n as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const REAL: &str = include_str!("../../tests/llamacpp/fixtures/props.json");

    #[test]
    fn the_real_servers_answer_gives_its_slots_and_bad_ones_are_refused() {
        assert_eq!(parse_total_slots(REAL.as_bytes()), Ok(4.0));
        for (body, says) in [
            (r#"{"total_slots":0}"#, "out of range"),
            (r#"{"total_slots":1e9}"#, "not a whole number"),
            (r#"{"total_slots":10000000}"#, "out of range"),
            (r#"{"total_slots":-1}"#, "not a whole number"),
            (r#"{"model_path":"x"}"#, "no total_slots"),
            ("<html>", "not JSON"),
        ] {
            let e = parse_total_slots(body.as_bytes()).expect_err(body);
            assert!(e.contains(says), "{body}: {e}");
        }
    }

    #[test]
    fn read_once_then_again_on_restart_refresh_or_after_a_failure() {
        let mut c = SlotCache::default();
        let m = MemberId::from("a:1");
        let t0 = Instant::now();
        assert_eq!(c.due(&m, Some(10.0), t0), Due::Read, "new member");
        assert!(!c.record(&m, Some(10.0), &Ok(4.0), t0));
        assert_eq!(c.due(&m, Some(20.0), t0 + Duration::from_secs(5)), Due::Keep(Some(4.0)));
        assert_eq!(c.due(&m, Some(3.0), t0 + Duration::from_secs(10)), Due::Read, "counter went down");
        // The re-read fails: the count known stays, the failure is logged once.
        assert!(c.record(&m, Some(3.0), &Err("refused".into()), t0 + Duration::from_secs(10)));
        assert_eq!(c.get(&m), Some(4.0));
        assert!(!c.record(&m, Some(3.0), &Err("refused".into()), t0 + Duration::from_secs(11)), "once");
        assert_eq!(c.due(&m, Some(4.0), t0 + Duration::from_secs(12)), Due::Keep(Some(4.0)));
        assert_eq!(c.due(&m, Some(5.0), t0 + Duration::from_secs(11) + REFRESH), Due::Read, "refresh");

        let n = MemberId::from("b:1");
        assert!(c.record(&n, None, &Err("404".into()), t0));
        assert_eq!(c.due(&n, None, t0 + Duration::from_secs(1)), Due::Keep(None), "no retry storm");
        assert_eq!(c.due(&n, None, t0 + RETRY), Due::Read);
        assert!(!c.record(&n, None, &Ok(2.0), t0 + RETRY));
        assert!(c.record(&n, None, &Err("again".into()), t0 + RETRY * 2), "logged again after a success");
    }
}
