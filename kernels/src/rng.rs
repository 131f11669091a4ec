//! The one pseudo-random generator of Leap's checks and tests: Marsaglia's xorshift64
//! (shifts 13, 7, 17). Cheap, and the same sequence from the same seed on every machine, so a
//! check's inputs and a failing test reproduce. Not for anything that needs real randomness
//! (sampling has its own generator, seeded by the request).

/// A xorshift64 generator.
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    /// From `seed` (0, which xorshift cannot leave, is replaced by a fixed odd constant).
    pub const fn new(seed: u64) -> Self {
        Self(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }

    /// The next 64 bits.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A value in `[-0.5, 0.5)` (24 bits of it).
    pub fn centered(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }

    /// A value in `[-1, 1)`.
    pub fn signed(&mut self) -> f32 {
        2.0 * self.centered()
    }

    /// A value in `0..n` (`n` > 0; the modulo's bias is nothing to a test).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[cfg(test)]
mod tests {
    use super::XorShift;

    #[test]
    fn the_sequence_is_xorshift64() {
        let mut r = XorShift::new(1);
        // 1 -> x ^= x<<13 -> 8193; ^= >>7 -> 8257; ^= <<17 -> 1082269761.
        assert_eq!(r.next(), 1_082_269_761);
        let mut z = XorShift::new(0);
        assert_ne!(z.next(), 0, "a zero seed does not stick");
        let mut c = XorShift::new(42);
        for _ in 0..1000 {
            let v = c.centered();
            assert!((-0.5..0.5).contains(&v));
            assert!(c.below(7) < 7);
        }
    }
}
