//! [`MemberMap`]: one value per member of a pool, in member order, stored densely.
//!
//! Everything a control cycle holds per member (samples, ratios, policy memory, what was last
//! written) is built once per cycle in member order and then walked and merged with other
//! member-ordered data far more often than it is looked up by id. A sorted vector does that without
//! a tree node per member, and a position in it is a dense index: data of the same pool lines up by
//! position, so a cycle joins its stages by walking them side by side instead of looking every
//! member up in each. Lookups by id stay available (binary search).
//!
//! Member ids are shared (`Arc<str>`), so merging two maps of the same pool compares pointers, not
//! strings, whenever both came from the same member list.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::MemberId;

/// Values keyed by member, sorted by member, each member once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberMap<V>(Vec<(MemberId, V)>);

impl<V> Default for MemberMap<V> {
    fn default() -> Self {
        MemberMap(Vec::new())
    }
}

impl<V> MemberMap<V> {
    /// An empty map with room for `n` members: a pool's maps are rebuilt every cycle at the same
    /// size, so growing them one member at a time would reallocate several times per map.
    pub fn with_capacity(n: usize) -> Self {
        MemberMap(Vec::with_capacity(n))
    }

    fn position(&self, m: &MemberId) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| k.cmp(m))
    }

    pub fn get(&self, m: &MemberId) -> Option<&V> {
        self.position(m).ok().map(|i| &self.0[i].1)
    }

    pub fn get_mut(&mut self, m: &MemberId) -> Option<&mut V> {
        self.position(m).ok().map(|i| &mut self.0[i].1)
    }

    pub fn contains_key(&self, m: &MemberId) -> bool {
        self.position(m).is_ok()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Set one member's value, in order. Appending in member order costs one comparison.
    pub fn insert(&mut self, m: MemberId, v: V) -> Option<V> {
        if self.0.last().is_none_or(|(last, _)| *last < m) {
            self.0.push((m, v));
            return None;
        }
        match self.position(&m) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, v)),
            Err(i) => {
                self.0.insert(i, (m, v));
                None
            }
        }
    }

    pub fn remove(&mut self, m: &MemberId) -> Option<V> {
        self.position(m).ok().map(|i| self.0.remove(i).1)
    }

    /// Members and values, in member order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&MemberId, &V)> + ExactSizeIterator + Clone {
        self.0.iter().map(|(k, v)| (k, v))
    }

    pub fn iter_mut(&mut self) -> impl DoubleEndedIterator<Item = (&MemberId, &mut V)> + ExactSizeIterator {
        self.0.iter_mut().map(|(k, v)| (&*k, v))
    }

    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &MemberId> + ExactSizeIterator + Clone {
        self.0.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl DoubleEndedIterator<Item = &V> + ExactSizeIterator + Clone {
        self.0.iter().map(|(_, v)| v)
    }

    /// The value at a dense index (the member's position in this map).
    pub fn at(&self, i: usize) -> Option<(&MemberId, &V)> {
        self.0.get(i).map(|(k, v)| (k, v))
    }

    /// The value at a dense index, to change it.
    pub fn at_mut(&mut self, i: usize) -> Option<&mut V> {
        self.0.get_mut(i).map(|(_, v)| v)
    }

    /// The same members, each with a value computed from its own (in order; nothing to sort or
    /// check, the keys are already ordered).
    pub fn map<U>(&self, mut f: impl FnMut(&MemberId, &V) -> U) -> MemberMap<U> {
        MemberMap(self.0.iter().map(|(k, v)| (k.clone(), f(k, v))).collect())
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&MemberId, &mut V) -> bool) {
        self.0.retain_mut(|(k, v)| keep(k, v));
    }

    /// For each of `keys` (ascending), its value here: one walk of both, no lookups; or, when this
    /// map is far larger than `keys` (a few members out of a whole query's rows), a lookup each.
    /// Lazy, so a cycle that only walks the result allocates nothing.
    pub fn aligned<'a, K>(&'a self, keys: K) -> Aligned<'a, V, K>
    where
        K: ExactSizeIterator,
        K::Item: std::borrow::Borrow<MemberId>,
    {
        let lookup = self.0.len() > 4 * keys.len();
        Aligned { rows: &self.0, pos: 0, keys, lookup }
    }

    /// Make this map hold exactly `keys` (ascending), in their order: values of members already
    /// here are kept, new members get `new()`, members not in `keys` are dropped. Afterwards index
    /// `i` here is the `i`-th of `keys`. When nothing changed (the usual cycle) this is one walk of
    /// pointer comparisons.
    pub fn sync_to<'k>(
        &mut self,
        keys: impl ExactSizeIterator<Item = &'k MemberId> + Clone,
        new: impl Fn() -> V,
    ) {
        if keys.len() == self.0.len() && keys.clone().zip(&self.0).all(|(k, (m, _))| k == m) {
            return;
        }
        let mut old = std::mem::take(&mut self.0).into_iter().peekable();
        let mut next = Vec::with_capacity(keys.len());
        for k in keys {
            while old.next_if(|(m, _)| m < k).is_some() {}
            let v = old.next_if(|(m, _)| m == k).map(|(_, v)| v).unwrap_or_else(&new);
            next.push((k.clone(), v));
        }
        self.0 = next;
    }
}

/// The values of a [`MemberMap`] for a run of ascending member ids (see [`MemberMap::aligned`]).
pub struct Aligned<'a, V, K> {
    rows: &'a [(MemberId, V)],
    pos: usize,
    keys: K,
    lookup: bool,
}

impl<'a, V, K> Iterator for Aligned<'a, V, K>
where
    K: Iterator,
    K::Item: std::borrow::Borrow<MemberId>,
{
    type Item = Option<&'a V>;

    fn next(&mut self) -> Option<Self::Item> {
        use std::borrow::Borrow;
        let key = self.keys.next()?;
        let k: &MemberId = key.borrow();
        if self.lookup {
            return Some(self.rows.binary_search_by(|(m, _)| m.cmp(k)).ok().map(|i| &self.rows[i].1));
        }
        while self.rows.get(self.pos).is_some_and(|(m, _)| m < k) {
            self.pos += 1;
        }
        match self.rows.get(self.pos) {
            Some((m, v)) if m == k => {
                self.pos += 1;
                Some(Some(v))
            }
            _ => Some(None),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.keys.size_hint()
    }
}

impl<V, K> ExactSizeIterator for Aligned<'_, V, K>
where
    K: ExactSizeIterator,
    K::Item: std::borrow::Borrow<MemberId>,
{
}

impl<V> FromIterator<(MemberId, V)> for MemberMap<V> {
    /// Pairs in member order (the usual case) are taken as they come; otherwise they are sorted. A
    /// member given twice keeps its last value, as a map insert would.
    fn from_iter<I: IntoIterator<Item = (MemberId, V)>>(iter: I) -> Self {
        let mut v: Vec<(MemberId, V)> = iter.into_iter().collect();
        if !v.windows(2).all(|w| w[0].0 < w[1].0) {
            // Stable: of equal members the one given last ends up last, and is the one kept.
            v.sort_by(|a, b| a.0.cmp(&b.0));
            let mut out: Vec<(MemberId, V)> = Vec::with_capacity(v.len());
            for (m, x) in v {
                match out.last_mut() {
                    Some(last) if last.0 == m => last.1 = x,
                    _ => out.push((m, x)),
                }
            }
            v = out;
        }
        MemberMap(v)
    }
}

/// `map[&member]`, for tests and callers that know the member is there; panics otherwise, like a
/// map's index.
impl<V> std::ops::Index<&MemberId> for MemberMap<V> {
    type Output = V;

    fn index(&self, m: &MemberId) -> &V {
        match self.get(m) {
            Some(v) => v,
            None => panic!("member {m} is not in this map"),
        }
    }
}

impl<'a, V> IntoIterator for &'a MemberMap<V> {
    type Item = (&'a MemberId, &'a V);
    type IntoIter =
        std::iter::Map<std::slice::Iter<'a, (MemberId, V)>, fn(&'a (MemberId, V)) -> (&'a MemberId, &'a V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl<V> IntoIterator for MemberMap<V> {
    type Item = (MemberId, V);
    type IntoIter = std::vec::IntoIter<(MemberId, V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<V: Serialize> Serialize for MemberMap<V> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

/// A member named twice is refused, not resolved by "last wins": JSON parsers disagree on which
/// of two equal keys counts, so a map with both could mean one thing here and another to whoever
/// else reads it. The member is named shortened ([`crate::name::shorten`]): it is outside text.
impl<'de, V: Deserialize<'de>> Deserialize<'de> for MemberMap<V> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> serde::de::Visitor<'de> for Visit<V> {
            type Value = MemberMap<V>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map from member to value, each member once")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
                let mut m = BTreeMap::<MemberId, V>::new();
                while let Some((k, v)) = a.next_entry::<MemberId, V>()? {
                    if m.contains_key(&k) {
                        return Err(serde::de::Error::custom(format_args!(
                            "member {} appears twice",
                            crate::name::shorten(k.as_str())
                        )));
                    }
                    m.insert(k, v);
                }
                Ok(MemberMap(m.into_iter().collect()))
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(s: &[&str]) -> Vec<MemberId> {
        s.iter().map(|m| MemberId::from(*m)).collect()
    }

    #[test]
    fn a_member_named_twice_in_input_is_refused() {
        let twice: Result<MemberMap<u32>, _> = serde_json::from_str(r#"{"a:1": 1, "b:1": 2, "a:1": 3}"#);
        let err = twice.expect_err("refused").to_string();
        assert!(err.contains("member a:1 appears twice"), "{err}");
        let once: MemberMap<u32> = serde_json::from_str(r#"{"b:1": 2, "a:1": 3}"#).expect("reads");
        assert_eq!(once.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>(), [("a:1", 3), ("b:1", 2)]);
    }

    #[test]
    fn collects_unsorted_input_in_order_keeping_the_last_value_of_a_repeated_member() {
        let m: MemberMap<u32> =
            [("b:1", 1), ("a:1", 2), ("b:1", 3)].into_iter().map(|(k, v)| (MemberId::from(k), v)).collect();
        assert_eq!(m.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>(), [("a:1", 2), ("b:1", 3)]);
        assert_eq!(m.get(&MemberId::from("b:1")), Some(&3));
        assert_eq!(m.get(&MemberId::from("c:1")), None);
    }

    #[test]
    fn insert_keeps_order_and_replaces() {
        let mut m = MemberMap::default();
        for (k, v) in [("b:1", 1), ("d:1", 2), ("a:1", 3), ("c:1", 4), ("b:1", 5)] {
            m.insert(MemberId::from(k), v);
        }
        assert_eq!(m.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["a:1", "b:1", "c:1", "d:1"]);
        assert_eq!(m.get(&MemberId::from("b:1")), Some(&5));
    }

    #[test]
    fn sync_keeps_known_members_adds_new_ones_and_drops_the_departed() {
        let mut m: MemberMap<u32> = ids(&["a:1", "b:1", "c:1"]).into_iter().zip([1, 2, 3]).collect();
        let now = ids(&["b:1", "bb:1", "d:1"]);
        m.sync_to(now.iter(), || 0);
        assert_eq!(
            m.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>(),
            [("b:1", 2), ("bb:1", 0), ("d:1", 0)]
        );
        // The same members again: nothing changes.
        m.sync_to(now.iter(), || 9);
        assert_eq!(m.values().copied().collect::<Vec<_>>(), [2, 0, 0]);
    }

    #[test]
    fn aligned_walks_both_in_order() {
        let m: MemberMap<u32> = ids(&["a:1", "c:1"]).into_iter().zip([1, 3]).collect();
        let keys = ids(&["a:1", "b:1", "c:1", "d:1"]);
        assert_eq!(m.aligned(keys.iter()).collect::<Vec<_>>(), [Some(&1), None, Some(&3), None]);
    }

    #[test]
    fn serializes_as_a_map() {
        let m: MemberMap<u32> = ids(&["b:1", "a:1"]).into_iter().zip([1, 2]).collect();
        let json = serde_json::to_string(&m).expect("serialize");
        assert_eq!(json, r#"{"a:1":2,"b:1":1}"#);
        let back: MemberMap<u32> = serde_json::from_str(&json).expect("deserialize");
        assert_eq!(back, m);
    }
}
