//! What the chaos tests draw their fault schedules from: a small seeded
//! generator, so that a failed run can be replayed with the seed it printed,
//! and the environment knobs of their long modes.

use std::time::Duration;

/// The run's seed: `IDEM_CHAOS_SEED` to replay a run, else one from the
/// clock and the process id.
///
/// # Panics
///
/// If `IDEM_CHAOS_SEED` is not a `u64`.
pub fn seed() -> u64 {
    std::env::var("IDEM_CHAOS_SEED")
        .ok()
        .map(|s| s.parse().expect("IDEM_CHAOS_SEED is a u64"))
        .unwrap_or_else(|| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos() as u64;
            nanos ^ ((std::process::id() as u64) << 32)
        })
}

/// A seeded SplitMix64 generator.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in `lo..=hi`.
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Uniform in `lo..=hi` milliseconds.
    pub fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.between(lo, hi))
    }

    /// One of `items`, uniformly.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.between(0, items.len() as u64 - 1) as usize]
    }

    /// Shuffles `items` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.between(0, i as u64) as usize);
        }
    }
}

/// Reads `name` from the environment, or `default`; panics on a value that
/// does not parse, rather than running a mode nobody asked for.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} does not parse")),
        Err(_) => default,
    }
}
