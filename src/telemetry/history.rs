//! A short memory of the last cycles for the status page: per pool and member, the weight the
//! controller wanted and the load it saw, kept compact (no full reports) and served as columns by
//! `GET /v1/history`.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::Arc;

use serde::Serialize;

use crate::report::CycleReport;

/// How many cycles the status page can chart.
pub const DEPTH: usize = 60;

/// One member in one cycle. `f32` is plenty for a chart and halves the memory of a big fleet.
#[derive(Debug, Clone, Copy)]
struct Point {
    weight: u32,
    waiting: Option<f32>,
    running: Option<f32>,
    kv_usage: Option<f32>,
}

#[derive(Debug)]
struct Frame {
    ts: Arc<str>,
    pools: Vec<PoolFrame>,
}

#[derive(Debug)]
struct PoolFrame {
    pool: Arc<str>,
    saturation: Option<f32>,
    members: Vec<(Arc<str>, Point)>,
}

/// The last [`DEPTH`] cycles. Names are interned so 60 frames of a pool share one copy of each.
#[derive(Debug, Default)]
pub struct History {
    frames: VecDeque<Frame>,
    names: HashSet<Arc<str>>,
}

/// `GET /v1/history`: per pool, the cycle times and one series per member, oldest first, aligned
/// with `ts` (`null` where the member had no value in that cycle).
#[derive(Debug, Serialize, Default, PartialEq)]
pub struct HistoryView {
    pub depth: usize,
    pub pools: BTreeMap<String, PoolHistory>,
}

#[derive(Debug, Serialize, Default, PartialEq)]
pub struct PoolHistory {
    pub ts: Vec<String>,
    pub saturation: Vec<Option<f32>>,
    pub members: BTreeMap<String, MemberHistory>,
}

#[derive(Debug, Serialize, Default, PartialEq)]
pub struct MemberHistory {
    pub weight: Vec<Option<u32>>,
    /// Waiting plus running requests: what the member carries.
    pub load: Vec<Option<f32>>,
    pub kv_usage: Vec<Option<f32>>,
}

impl History {
    fn intern(&mut self, s: &str) -> Arc<str> {
        if let Some(a) = self.names.get(s) {
            return a.clone();
        }
        let a: Arc<str> = Arc::from(s);
        self.names.insert(a.clone());
        a
    }

    pub fn push(&mut self, r: &CycleReport) {
        let ts = Arc::from(r.ts.as_str());
        let mut pools = Vec::with_capacity(r.pools.len());
        for p in &r.pools {
            let name = self.intern(&p.pool);
            let members = p
                .members
                .iter()
                .map(|m| {
                    let point = Point {
                        weight: m.ratio,
                        waiting: m.waiting.map(|v| v as f32),
                        running: m.running.map(|v| v as f32),
                        kv_usage: m.kv_usage.map(|v| v as f32),
                    };
                    (self.intern(&m.member), point)
                })
                .collect();
            pools.push(PoolFrame { pool: name, saturation: p.saturation.map(|s| s as f32), members });
        }
        self.frames.push_back(Frame { ts, pools });
        while self.frames.len() > DEPTH {
            self.frames.pop_front();
        }
        // Names only the interner still holds belong to members that left more than DEPTH cycles ago.
        if self.names.len() > 64
            && self.names.iter().filter(|a| Arc::strong_count(a) == 1).count() * 2 > self.names.len()
        {
            self.names.retain(|a| Arc::strong_count(a) > 1);
        }
    }

    /// Pivot the frames into per-member columns.
    pub fn view(&self) -> HistoryView {
        let mut out = HistoryView { depth: DEPTH, pools: BTreeMap::new() };
        for (i, f) in self.frames.iter().enumerate() {
            for PoolFrame { pool, saturation, members } in &f.pools {
                let ph = out.pools.entry(pool.to_string()).or_default();
                // A pool that appeared mid-history (config reload) starts with empty columns.
                while ph.ts.len() < i {
                    ph.ts.push(String::new());
                    ph.saturation.push(None);
                }
                let col = ph.ts.len();
                ph.ts.push(f.ts.to_string());
                ph.saturation.push(*saturation);
                for (m, p) in members {
                    let mh = ph.members.entry(m.to_string()).or_default();
                    pad(mh, col);
                    mh.weight.push(Some(p.weight));
                    mh.load.push(match (p.waiting, p.running) {
                        (None, None) => None,
                        (w, r) => Some(w.unwrap_or(0.0) + r.unwrap_or(0.0)),
                    });
                    mh.kv_usage.push(p.kv_usage);
                }
            }
        }
        for ph in out.pools.values_mut() {
            let n = ph.ts.len();
            for mh in ph.members.values_mut() {
                pad(mh, n);
            }
        }
        out
    }
}

fn pad(mh: &mut MemberHistory, len: usize) {
    while mh.weight.len() < len {
        mh.weight.push(None);
        mh.load.push(None);
        mh.kv_usage.push(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{MemberReport, PoolReport};

    fn cycle(i: usize, members: &[&str]) -> CycleReport {
        CycleReport {
            ts: format!("t{i}"),
            pools: vec![PoolReport {
                pool: "llm".into(),
                saturation: Some(0.5),
                members: members
                    .iter()
                    .map(|m| MemberReport {
                        member: m.to_string(),
                        ratio: i as u32,
                        waiting: Some(1.0),
                        running: Some(i as f64),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }],
        }
    }

    #[test]
    fn keeps_the_last_depth_cycles_aligned_per_member() {
        let mut h = History::default();
        for i in 0..DEPTH + 5 {
            // b joins at cycle 10 and leaves at the end: its column is padded with nulls.
            let ms: &[&str] = if (10..DEPTH + 4).contains(&i) { &["a", "b"] } else { &["a"] };
            h.push(&cycle(i, ms));
        }
        let v = h.view();
        let p = &v.pools["llm"];
        assert_eq!(p.ts.len(), DEPTH);
        assert_eq!(p.ts[0], "t5");
        assert_eq!(p.ts[DEPTH - 1], format!("t{}", DEPTH + 4));
        let a = &p.members["a"];
        let b = &p.members["b"];
        assert_eq!(a.weight.len(), DEPTH);
        assert_eq!(b.weight.len(), DEPTH);
        assert_eq!(a.weight[0], Some(5));
        assert_eq!(a.load[0], Some(6.0));
        assert_eq!(b.weight[0..5], [None; 5]);
        assert_eq!(b.weight[5], Some(10));
        assert_eq!(b.weight[DEPTH - 1], None);
    }

    #[test]
    fn a_pool_added_midway_is_padded_to_the_frame_it_appeared_in() {
        let mut h = History::default();
        h.push(&CycleReport { ts: "t0".into(), pools: vec![] });
        h.push(&cycle(1, &["a"]));
        let p = &h.view().pools["llm"];
        assert_eq!(p.ts, vec![String::new(), "t1".into()]);
        assert_eq!(p.members["a"].weight, vec![None, Some(1)]);
    }

    #[test]
    fn names_of_long_gone_members_are_dropped() {
        let mut h = History::default();
        for i in 0..DEPTH * 3 {
            let name = format!("m{i}");
            h.push(&cycle(i, &[name.as_str()]));
        }
        // Only members still in some frame (plus the pool name) stay interned, with slack.
        assert!(h.names.len() <= 2 * (DEPTH + 1) + 1, "{}", h.names.len());
    }
}
