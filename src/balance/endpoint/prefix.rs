//! An approximate prefix index: the block hashes a picker sent to one member, least recently sent
//! evicted first, holding as many blocks as the member's KV cache. It is what the picker believes
//! the member caches, not what the member reports (llm-d's approximate prefix-cache scorer).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

/// Block hashes sent to one member, bounded, LRU.
///
/// The recency order is a queue of (stamp, hash) in the order they were sent; a hash sent again
/// gets a new stamp and its old entry goes stale (skipped when it reaches the front). Recording
/// and evicting are O(1) amortised, where an ordered map cost a tree operation per block (a
/// 250-block prompt was most of a pick's 60 us).
#[derive(Debug, Clone, Default)]
pub struct PrefixIndex {
    stamp_of: HashMap<u64, u64, BuildHasherDefault<BlockHasher>>,
    order: VecDeque<(u64, u64)>,
    clock: u64,
    capacity: usize,
}

/// Block hashes are hashes already: one multiply spreads them over the table, where SipHash
/// would hash them again.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockHasher(u64);

impl Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
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
            self.stamp_of.insert(h, self.clock);
            self.order.push_back((self.clock, h));
        }
        while self.stamp_of.len() > self.capacity {
            let Some((stamp, h)) = self.order.pop_front() else { break };
            if self.stamp_of.get(&h) == Some(&stamp) {
                self.stamp_of.remove(&h);
            }
        }
        // Stale entries of hashes sent again pile up behind; drop them when they outnumber the
        // live ones, so memory stays within twice the capacity.
        if self.order.len() > 2 * self.stamp_of.len() + 64 {
            let live = &self.stamp_of;
            self.order.retain(|(stamp, h)| live.get(h) == Some(stamp));
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

    #[test]
    fn a_block_sent_again_is_young_again_and_stale_entries_do_not_pile_up() {
        let mut index = PrefixIndex::with_capacity(3);
        index.record(&[1, 2, 3]);
        index.record(&[1]);
        // 2 is now the oldest: a new block evicts it, not 1.
        index.record(&[4]);
        assert_eq!((index.matched(&[1]), index.matched(&[2]), index.matched(&[3])), (1, 0, 1));
        for _ in 0..10_000 {
            index.record(&[1, 3, 4]);
        }
        assert!(index.order.len() <= 2 * index.len() + 64 + 3, "{}", index.order.len());
        assert_eq!(index.len(), 3);
    }
}
