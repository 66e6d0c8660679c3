//! The seeded generator behind every synthetic task.
//!
//! Why not `rand`: `rand` documents that `StdRng`'s algorithm may change between releases, so a
//! seed would not name the same data set after an upgrade, and taking `&mut impl rand::Rng` in the
//! public API would tie this crate's semver to `rand`'s. SplitMix64 (Steele, Lea & Flood 2014) is
//! a dozen lines, passes BigCrush, and its stream for a seed is fixed forever.

/// A small, fast, seeded pseudo-random generator (SplitMix64) whose stream never changes.
///
/// Not for cryptography. Equal seeds give equal streams on every platform and release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeededRng {
    state: u64,
}

impl SeededRng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The generator's whole state, to resume its stream later with
    /// [`from_state`](Self::from_state) (a training checkpoint stores it).
    pub fn state(&self) -> u64 {
        self.state
    }

    /// The generator whose [`state`](Self::state) was `state`: it continues that stream.
    pub fn from_state(state: u64) -> Self {
        Self { state }
    }

    /// The next 64 uniformly random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform integer in `[0, n)`; `0` when `n == 0`.
    ///
    /// Lemire's multiply-shift with rejection, so small ranges carry no modulo bias.
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let n = n as u64;
        let threshold = n.wrapping_neg() % n;
        loop {
            let product = u128::from(self.next_u64()) * u128::from(n);
            if (product as u64) >= threshold {
                return (product >> 64) as usize;
            }
        }
    }

    /// A uniform integer in `[lo, hi)`; `lo` when the range is empty.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi.saturating_sub(lo))
    }

    /// A uniform float in `[0, 1)` with 53 random bits.
    pub fn unit_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// `count` distinct values drawn uniformly from `[lo, hi)`, in random order; all of them
    /// (shuffled) when `count ≥ hi − lo`.
    ///
    /// A partial Fisher–Yates shuffle of the range: `O(hi − lo)` memory, fine for vocabularies.
    pub fn distinct(&mut self, lo: usize, hi: usize, count: usize) -> Vec<usize> {
        let mut pool: Vec<usize> = (lo..hi.max(lo)).collect();
        let count = count.min(pool.len());
        for i in 0..count {
            let j = self.range(i, pool.len());
            pool.swap(i, j);
        }
        pool.truncate(count);
        pool
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_reference_values() {
        // The first outputs for seed 0 from the reference C implementation.
        let mut rng = SeededRng::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(rng.next_u64(), 0x06C4_5D18_8009_454F);
    }

    #[test]
    fn below_is_in_range_and_roughly_uniform() {
        let mut rng = SeededRng::new(7);
        let mut counts = [0usize; 6];
        for _ in 0..60_000 {
            counts[rng.below(6)] += 1;
        }
        // Each bin expects 10 000 with std ≈ 91; 500 is over five sigma.
        assert!(
            counts.iter().all(|&c| c.abs_diff(10_000) < 500),
            "{counts:?}"
        );
        assert_eq!(rng.below(0), 0);
    }

    #[test]
    fn distinct_values_are_distinct_and_in_range() {
        let mut rng = SeededRng::new(3);
        let v = rng.distinct(5, 25, 12);
        assert_eq!(v.len(), 12);
        let mut sorted = v.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 12);
        assert!(v.iter().all(|&x| (5..25).contains(&x)));
        assert_eq!(rng.distinct(0, 3, 10).len(), 3);
    }
}
