//! Signed division by a constant as a multiply and shifts (the CPU back end's index
//! arithmetic: flat indices unflattened over extents, windows split into taps).
//!
//! The runtime compiles kernels without Cranelift's e-graph optimizer (it sinks loop-
//! invariant index arithmetic into inner loops, `runtime/src/cpu.rs`), so nothing turns a
//! constant division into a multiply there: `sdiv` by a constant would be an `idiv`, 40 to
//! 90 cycles on x86-64. The CLIF generator emits the multiply itself, with the magic
//! numbers of Granlund and Montgomery ("Division by invariant integers using
//! multiplication", 1994) as Hacker's Delight (chapter 10) derives them.

/// How `n / d` (rounding toward zero, as `sdiv`) is computed for a constant `d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DivBy {
    /// `d == 1`: `n`.
    One,
    /// `d == 2^k`, `k` in `1..=62`: `(n + ((n >> 63) >>> (64 - k))) >> k`.
    Pow2(u32),
    /// `d >= 3`, not a power of two: `q = mulhi(n, m)`, plus `n` when `add`, then `q >> s`,
    /// plus 1 when that is negative.
    Magic { m: i64, add: bool, s: u32 },
    /// Anything else (0, negative divisors, `i64::MIN`): a plain `sdiv`.
    Plain,
}

impl DivBy {
    /// The sequence for divisor `d`.
    pub fn of(d: i64) -> DivBy {
        if d == 1 {
            return DivBy::One;
        }
        if d < 2 {
            return DivBy::Plain;
        }
        if d & (d - 1) == 0 {
            return DivBy::Pow2(d.trailing_zeros());
        }
        let (m, s) = magic(d as u64);
        DivBy::Magic {
            m: m as i64,
            add: (m as i64) < 0,
            s,
        }
    }

    /// `n / d` computed as the emitted code does (its tests' model). `Plain` stands for
    /// an `sdiv`, which traps where this gives 0 (`d == 0`, `i64::MIN / -1`); the CPU back
    /// end emits it only for divisors that are never 0 or -1 in index arithmetic.
    pub fn apply(self, n: i64, d: i64) -> i64 {
        match self {
            DivBy::One => n,
            DivBy::Pow2(k) => {
                let bias = ((n >> 63) as u64 >> (64 - k)) as i64;
                n.wrapping_add(bias) >> k
            }
            DivBy::Magic { m, add, s } => {
                let mut q = ((n as i128 * m as i128) >> 64) as i64;
                if add {
                    q = q.wrapping_add(n);
                }
                q >>= s;
                q + ((q as u64) >> 63) as i64
            }
            DivBy::Plain => n.checked_div(d).unwrap_or(0),
        }
    }
}

/// The magic multiplier (as the bits of an i64) and shift for a divisor `d >= 3` that is not
/// a power of two (Hacker's Delight, figure 10-1, for 64-bit words).
fn magic(d: u64) -> (u64, u32) {
    const TWO63: u64 = 1 << 63;
    // |nc|: the largest value whose remainder by d is d - 1, below 2^63.
    let t = TWO63;
    let anc = t - 1 - t % d;
    let mut p = 63u32;
    let (mut q1, mut r1) = (TWO63 / anc, TWO63 % anc);
    let (mut q2, mut r2) = (TWO63 / d, TWO63 % d);
    loop {
        p += 1;
        q1 = q1.wrapping_mul(2);
        r1 = r1.wrapping_mul(2);
        if r1 >= anc {
            q1 = q1.wrapping_add(1);
            r1 -= anc;
        }
        q2 = q2.wrapping_mul(2);
        r2 = r2.wrapping_mul(2);
        if r2 >= d {
            q2 = q2.wrapping_add(1);
            r2 -= d;
        }
        let delta = d - r2;
        if !(q1 < delta || (q1 == delta && r1 == 0)) {
            break;
        }
    }
    (q2.wrapping_add(1), p - 64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EDGES: [i64; 12] = [
        0,
        1,
        -1,
        2,
        -2,
        1000,
        -1000,
        i64::MAX,
        i64::MIN,
        i64::MAX - 1,
        i64::MIN + 1,
        1 << 40,
    ];

    /// Every divisor kind agrees with `/` on the edges of the range and on a spread of
    /// values near multiples of the divisor.
    #[test]
    fn constant_division_matches_sdiv() {
        let mut divisors: Vec<i64> = (1..=4096).collect();
        divisors.extend([
            6272,
            25088,
            100_003,
            1 << 31,
            (1 << 31) + 1,
            (1 << 40) - 1,
            i64::MAX,
            i64::MAX - 1,
            (1 << 62) + 1,
            -3,
            0,
        ]);
        for &d in &divisors {
            let how = DivBy::of(d);
            let mut ns: Vec<i64> = EDGES.to_vec();
            for k in [-3i64, -1, 0, 1, 2, 7, 1 << 20] {
                for off in [-1i64, 0, 1] {
                    ns.push(d.wrapping_mul(k).wrapping_add(off));
                }
            }
            for n in ns {
                let want = if d == 0 {
                    0
                } else {
                    n.checked_div(d).unwrap_or(0)
                };
                if d == -1 && n == i64::MIN {
                    continue;
                }
                assert_eq!(how.apply(n, d), want, "{n} / {d} by {how:?}");
            }
        }
    }

    #[test]
    fn divisors_pick_the_cheapest_form() {
        assert_eq!(DivBy::of(1), DivBy::One);
        assert_eq!(DivBy::of(1024), DivBy::Pow2(10));
        assert_eq!(DivBy::of(0), DivBy::Plain);
        assert_eq!(DivBy::of(-7), DivBy::Plain);
        assert!(matches!(DivBy::of(28), DivBy::Magic { .. }));
        // Hacker's Delight, table 10-2 (64 bits).
        let m3 = DivBy::Magic {
            m: 0x5555_5555_5555_5556,
            add: false,
            s: 0,
        };
        assert_eq!(DivBy::of(3), m3);
        assert!(DivBy::of(3).apply(-7, 3) == -2 && DivBy::of(3).apply(7, 3) == 2);
    }
}
