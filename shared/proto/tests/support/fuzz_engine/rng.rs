//! The fuzzer's seeded generator: SplitMix64 and the draws built on it.

/// SplitMix64: small, fast, and the same sequence everywhere for a seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.u64() % n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    pub fn chance(&mut self, p: f64) -> bool {
        (self.u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    pub fn bool(&mut self) -> bool {
        self.u64() & 1 == 1
    }

    /// A finite f32, now and then an edge value.
    pub fn f32(&mut self) -> f32 {
        if self.chance(0.05) {
            return self.pick(&[
                0.0,
                -0.0,
                f32::MAX,
                f32::MIN,
                f32::MIN_POSITIVE,
                1e-45,
                -1e-45,
                1.0,
                -1.0,
            ]);
        }
        ((self.u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 20.0
    }

    /// A finite f64, now and then an edge value.
    pub fn f64(&mut self) -> f64 {
        if self.chance(0.05) {
            return self.pick(&[
                0.0,
                -0.0,
                f64::MAX,
                f64::MIN,
                f64::MIN_POSITIVE,
                5e-324,
                500.0,
            ]);
        }
        ((self.u64() >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 1000.0
    }

    pub fn non_finite_f32(&mut self) -> f32 {
        self.pick(&[f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY])
    }

    pub fn u64_any(&mut self) -> u64 {
        match self.below(4) {
            0 => self.below(10) as u64,
            1 => self.pick(&[0, 1, u32::MAX as u64, u64::MAX, u64::MAX - 1]),
            _ => self.u64() >> self.below(64),
        }
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.u64() as u8).collect()
    }

    /// Any string: ASCII, controls, multi-byte characters.
    pub fn text(&mut self, max: usize) -> String {
        const CHARS: &[char] = &[
            'a', 'z', 'A', 'Q', '0', '9', '_', '-', '.', ' ', '\n', '\t', '\0', '"', '\\', '{',
            'é', 'ß', '€', '日', '🦀', '\u{7f}', '\u{feff}',
        ];
        let len = self.range(0, max);
        (0..len).map(|_| self.pick(CHARS)).collect()
    }

    /// `1..=max` characters from `alphabet`.
    pub fn ident(&mut self, alphabet: &[u8], max: usize) -> String {
        let len = self.range(1, max);
        (0..len).map(|_| self.pick(alphabet) as char).collect()
    }
}
