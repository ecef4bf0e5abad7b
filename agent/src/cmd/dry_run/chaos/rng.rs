//! The chaos schedule's random numbers: SplitMix64 (Steele, Lea and Flood, 2014), a 64-bit
//! generator small enough to keep here and fixed forever, so that a seed gives the same schedule
//! on every machine and in every later muster: a schedule printed in a bug report can be replayed.
//! No cryptographic quality is wanted, only an even spread.

/// A SplitMix64 stream.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`0` when `n` is 0). The modulo bias is below 2^-32 for the small `n`
    /// a schedule uses.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// A number in `[lo, hi]`, in milliseconds' steps.
    pub fn millis_between(&mut self, lo_ms: u64, hi_ms: u64) -> u64 {
        let (lo, hi) = if lo_ms <= hi_ms {
            (lo_ms, hi_ms)
        } else {
            (hi_ms, lo_ms)
        };
        lo + self.below(hi - lo + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_splitmix64s() {
        // The reference outputs for seed 1234567 (from the C reference implementation).
        let mut r = SplitMix64::new(1_234_567);
        assert_eq!(r.next_u64(), 6_457_827_717_110_365_317);
        assert_eq!(r.next_u64(), 3_203_168_211_198_807_973);
        assert_eq!(r.next_u64(), 9_817_491_932_198_370_423);
    }

    #[test]
    fn ranges_hold() {
        let mut r = SplitMix64::new(7);
        for _ in 0..1000 {
            assert!(r.below(3) < 3);
            let v = r.millis_between(500, 700);
            assert!((500..=700).contains(&v));
        }
        assert_eq!(r.below(0), 0);
        assert_eq!(r.millis_between(5, 5), 5);
    }
}
