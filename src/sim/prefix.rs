//! The prefix cache of one replica, as vLLM's automatic prefix caching keeps it.
//!
//! A prompt is a chain of 16-token blocks; block `i`'s hash covers its tokens *and* every block
//! before it ([`chain`]), so two prompts share block `i` only when they share everything up to its
//! end. A full block whose KV has been computed is registered under its hash. While a request uses a
//! cached block the block is referenced; when the last user lets go it stays cached but becomes
//! evictable, at the back of an LRU. A new block is taken from never-used free memory first and only
//! then by evicting the least recently freed cached block (vLLM pops the head of one free queue that
//! holds both; taking empty blocks first is the same order once the cache is warm, and simpler).
//!
//! The engine counts memory; this module only knows which hashes exist, who holds them and in which
//! order they go. Its invariant with the engine: every evictable entry is one of the engine's free
//! blocks.

use std::collections::{BTreeMap, HashMap};

use super::profile::BLOCK_SIZE;

#[derive(Debug, Clone, Copy)]
struct Entry {
    refs: u32,
    /// Position in the LRU while `refs == 0`.
    stamp: u64,
}

/// Cached blocks by hash, with reference counts and an eviction order. See the module doc.
#[derive(Debug, Clone, Default)]
pub struct PrefixCache {
    entries: HashMap<u64, Entry>,
    /// Unreferenced entries, least recently freed first.
    lru: BTreeMap<u64, u64>,
    clock: u64,
}

impl PrefixCache {
    /// Cached blocks nobody uses: free memory that still holds a prefix.
    pub fn evictable(&self) -> u32 {
        self.lru.len() as u32
    }

    /// Cached blocks in all.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Is this block cached?
    pub fn contains(&self, hash: u64) -> bool {
        self.entries.contains_key(&hash)
    }

    /// Is this block cached and unused (so taking it consumes a free block)?
    pub fn is_evictable(&self, hash: u64) -> bool {
        self.entries.get(&hash).is_some_and(|e| e.refs == 0)
    }

    /// Start using a cached block (a prefix hit). Returns false when it is not cached.
    pub fn acquire(&mut self, hash: u64) -> bool {
        let Some(e) = self.entries.get_mut(&hash) else { return false };
        if e.refs == 0 {
            self.lru.remove(&e.stamp);
        }
        e.refs += 1;
        true
    }

    /// Register a block just computed, held by its computer. False when the hash is cached already
    /// (another request computed the same block at the same time): the caller's copy stays plain.
    pub fn insert(&mut self, hash: u64) -> bool {
        if self.entries.contains_key(&hash) {
            return false;
        }
        self.entries.insert(hash, Entry { refs: 1, stamp: 0 });
        true
    }

    /// Stop using a block; the last user's release puts it at the back of the LRU and returns true
    /// (its memory is free now, though still cached).
    pub fn release(&mut self, hash: u64) -> bool {
        let Some(e) = self.entries.get_mut(&hash) else { return false };
        e.refs = e.refs.saturating_sub(1);
        if e.refs > 0 {
            return false;
        }
        self.clock += 1;
        e.stamp = self.clock;
        self.lru.insert(self.clock, hash);
        true
    }

    /// Forget the least recently freed unused block, to reuse its memory. False when none is.
    pub fn evict_one(&mut self) -> bool {
        let Some((_, hash)) = self.lru.pop_first() else { return false };
        self.entries.remove(&hash);
        true
    }
}

/// The hash chain of a sequence whose block `i` has content id `ids[i]`: block `i`'s hash mixes
/// the previous block's hash with its own content, so equal hashes mean equal prefixes.
pub fn chain(ids: impl IntoIterator<Item = u64>) -> Vec<u64> {
    let mut prev = 0x243f_6a88_85a3_08d3_u64;
    ids.into_iter()
        .map(|id| {
            prev = mix(prev ^ mix(id));
            prev
        })
        .collect()
}

/// The hash chain of a text, one block per 64 characters (16 tokens at the simulator's 4 characters
/// per token); a last partial block has no hash (only full blocks are cached).
pub fn text_chain(text: &str) -> Vec<u64> {
    let chars_per_block = 4 * BLOCK_SIZE as usize;
    let bytes: Vec<char> = text.chars().collect();
    chain(
        bytes
            .chunks_exact(chars_per_block)
            .map(|c| llm_lc_common::fnv1a64_words(c.iter().map(|&ch| u64::from(ch)))),
    )
}

/// The hash chain of a prompt given as token ids, 16 ids per block.
pub fn token_chain(ids: &[u64]) -> Vec<u64> {
    chain(
        ids.chunks_exact(BLOCK_SIZE as usize).map(|c| c.iter().fold(0x51_7cc1_b727_220a, |h, &t| mix(h ^ t))),
    )
}

use llm_lc_common::splitmix64 as mix;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_share_hashes_only_up_to_the_first_difference() {
        let a = chain([1, 2, 3]);
        let b = chain([1, 2, 4]);
        let c = chain([9, 2, 3]);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert!(a.iter().all(|h| !c.contains(h)), "a different first block changes every hash");
        let t = text_chain(&"x".repeat(64 * 3 + 10));
        assert_eq!(t.len(), 3, "the partial last block has no hash");
        assert_eq!(text_chain(&format!("{}{}", "x".repeat(128), "y".repeat(64)))[..2], t[..2]);
    }

    #[test]
    fn released_blocks_are_evicted_least_recently_freed_first() {
        let mut c = PrefixCache::default();
        for h in [10, 20, 30] {
            assert!(c.insert(h));
        }
        assert!(!c.insert(20), "a second copy of a cached block stays plain");
        assert_eq!(c.evictable(), 0);
        assert!(c.release(20) && c.release(10));
        assert_eq!(c.evictable(), 2);
        assert!(c.acquire(20) && c.acquire(20) && c.is_evictable(10) && !c.is_evictable(20));
        assert!(!c.release(20), "still held once");
        assert!(c.release(20)); // now 10 was freed before 20
        assert!(c.evict_one());
        assert!(!c.contains(10) && c.contains(20) && c.contains(30));
        assert!(c.evict_one());
        assert!(!c.evict_one(), "30 is still held");
        assert!(!c.acquire(10));
    }
}
