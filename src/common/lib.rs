//! Small rules several crates of the workspace share, written once: the stable hashes that must
//! agree across processes and releases ([`fnv1a64`], [`splitmix64`]), the one percentile rule
//! every report quotes ([`percentile`]), the palette every chart
//! is drawn with ([`PALETTE`]), and the reader of model servers' metrics pages ([`exposition`]:
//! the controller's scrapes and the proxy's endpoint picker read pages alike). Its one dependency is
//! memchr, so any crate can use it without pulling more.

#![forbid(unsafe_code)]

pub mod exposition;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a, 64 bits, of `bytes`: stable across processes and releases (prefix keys sent to a load
/// balancer, Envoy resource versions, per-pool seeds all depend on it staying the same).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_words(bytes.iter().map(|&b| u64::from(b)))
}

/// FNV-1a, 64 bits, one step per word instead of per byte (the simulator hashes characters).
/// Equal to [`fnv1a64`] on words below 256.
pub fn fnv1a64_words(words: impl IntoIterator<Item = u64>) -> u64 {
    words.into_iter().fold(FNV_OFFSET, |h, w| (h ^ w).wrapping_mul(FNV_PRIME))
}

/// splitmix64's finalizer: a cheap, well-spread 64-bit mix (ring points, hash chains, ids).
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The nearest-rank percentile of `sorted` (ascending), `q` in 0..=1: the smallest value with at
/// least `q` of the values at or below it (p99 of 100 values is the 99th). `None` when empty. Every
/// TTFT quoted by the bench, the demo and the tests' measurements uses this rule, so a p99 here
/// and a p99 there are the same statistic.
pub fn percentile<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted.get(rank.min(sorted.len()) - 1).copied()
}

/// The colours of every chart we draw, as RGB: Okabe-Ito without its yellow (unreadable on white),
/// readable by colour-blind readers. Series `i` takes `PALETTE[i % PALETTE.len()]`.
pub const PALETTE: [(u8, u8, u8); 8] = [
    (0, 114, 178),
    (230, 159, 0),
    (0, 158, 115),
    (204, 121, 167),
    (86, 180, 233),
    (213, 94, 0),
    (0, 0, 0),
    (128, 128, 128),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_is_nearest_rank() {
        let v: Vec<u32> = (1..=100).collect();
        assert_eq!(
            (percentile(&v, 0.5), percentile(&v, 0.99), percentile(&v, 1.0)),
            (Some(50), Some(99), Some(100))
        );
        assert_eq!(
            (percentile(&v, 0.0), percentile(&[7], 0.99), percentile::<u32>(&[], 0.5)),
            (Some(1), Some(7), None)
        );
    }

    #[test]
    fn the_hashes_keep_their_published_values() {
        // FNV-1a's reference vectors; a change here changes every key and version on the wire.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(fnv1a64_words("foobar".chars().map(u64::from)), fnv1a64(b"foobar"));
        // splitmix64 seeded with 0 gives this first output.
        assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
    }
}
