//! An approximate prefix index: the block hashes a picker sent to one member, least recently sent
//! evicted first, holding as many blocks as the member's KV cache. It is what the picker believes
//! the member caches, not what the member reports (llm-d's approximate prefix-cache scorer).

use std::collections::{BTreeMap, HashMap};

/// Block hashes sent to one member, bounded, LRU.
#[derive(Debug, Clone, Default)]
pub struct PrefixIndex {
    stamp_of: HashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
    clock: u64,
    capacity: usize,
}

impl PrefixIndex {
    /// An empty index holding at most `capacity` blocks.
    pub fn with_capacity(capacity: usize) -> PrefixIndex {
        PrefixIndex { capacity, ..PrefixIndex::default() }
    }

    /// How many of `blocks`, from the first on, the index holds (a chain: a block's hash covers
    /// everything before it, so the first miss ends the match).
    pub fn matched(&self, blocks: &[u64]) -> usize {
        blocks.iter().take_while(|h| self.stamp_of.contains_key(h)).count()
    }

    /// Remember `blocks` as just sent, evicting the least recently sent past the capacity.
    pub fn record(&mut self, blocks: &[u64]) {
        for &h in blocks {
            self.clock += 1;
            if let Some(old) = self.stamp_of.insert(h, self.clock) {
                self.by_stamp.remove(&old);
            }
            self.by_stamp.insert(self.clock, h);
        }
        while self.stamp_of.len() > self.capacity {
            let Some((_, h)) = self.by_stamp.pop_first() else { break };
            self.stamp_of.remove(&h);
        }
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.stamp_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stamp_of.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_match_is_a_leading_chain_and_the_oldest_blocks_go_first() {
        let mut index = PrefixIndex::with_capacity(100);
        let a: Vec<u64> = (0..50).collect();
        index.record(&a);
        assert_eq!(index.matched(&a), 50);
        let half: Vec<u64> = (0..25).chain(1000..1025).collect();
        assert_eq!(index.matched(&half), 25);
        // Fifty other blocks fill the index to its capacity and evict nothing; a hundred more
        // push everything older out.
        index.record(&(5000..5050).collect::<Vec<_>>());
        assert_eq!(index.matched(&a), 50);
        index.record(&(6000..6100).collect::<Vec<_>>());
        assert_eq!((index.matched(&a), index.len()), (0, 100));
    }
}
