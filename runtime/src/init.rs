//! Parameter initialisation: the recipes an artifact records instead of the values
//! (`normal(mean, std)`, `uniform(lo, hi)`, `zeros`, `ones`, with the seed), and the one
//! function that turns a recipe into values. The compiler's interpreter and `tcc build`
//! call the same function, so a param materialised at load is bit for bit the one the
//! interpreter starts from.
//!
//! Each element is a pure function of (seed, param name, element index): a splitmix64 hash
//! gives uniform draws in (0, 1), `normal` applies Box–Muller to draws `2i` and `2i + 1`.
//! The values are computed in f64 and rounded once to f32.

use crate::artifact::DType;
use serde::{Deserialize, Serialize};

/// A splitmix64 step: the hash behind dropout masks and parameter initialisation.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of a param's name: params with different names draw different streams.
pub fn name_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The `i`-th standard uniform draw in (0, 1) of the stream `key`.
pub fn uniform(key: u64, i: u64) -> f64 {
    let h = splitmix64(splitmix64(key).wrapping_add(i));
    ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// How a param's initial values are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "dist", rename_all = "lowercase")]
pub enum Dist {
    Zeros,
    Ones,
    Uniform { lo: f64, hi: f64 },
    Normal { mean: f64, std: f64 },
}

/// A param's initialiser as an artifact records it: the distribution and the run's seed
/// (the param's name, which keys its stream, is the slot's).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recipe {
    #[serde(flatten)]
    pub dist: Dist,
    pub seed: u64,
}

/// Element `i` of the param `name` drawn from `dist` under `seed`, in f64.
pub fn value(dist: Dist, key: u64, i: u64) -> f64 {
    match dist {
        Dist::Zeros => 0.0,
        Dist::Ones => 1.0,
        Dist::Uniform { lo, hi } => lo + (hi - lo) * uniform(key, i),
        Dist::Normal { mean, std } => {
            let (u1, u2) = (uniform(key, 2 * i), uniform(key, 2 * i + 1));
            mean + std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
        }
    }
}

/// The stream key of param `name` under `seed`.
pub fn key(name: &str, seed: u64) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ name_hash(name)
}

/// Elements `[first, first + out.len())` of param `name`, in f64.
pub fn fill_f64(name: &str, recipe: Recipe, first: u64, out: &mut [f64]) {
    let k = key(name, recipe.seed);
    for (j, v) in out.iter_mut().enumerate() {
        *v = value(recipe.dist, k, first + j as u64);
    }
}

/// Below this many elements one thread draws the whole param.
const PARALLEL_MIN: usize = 1 << 16;

/// Writes param `name`'s values into `out` as little-endian `dtype` elements (f64 rounded
/// once to the dtype, as the interpreter stores them), drawing on up to `threads` threads
/// (elements are independent, so the bytes do not depend on it). Returns false, writing
/// nothing, for a dtype that is not floating point or an `out` that is not a whole number
/// of elements.
pub fn fill_le(name: &str, recipe: Recipe, dtype: DType, out: &mut [u8], threads: usize) -> bool {
    let size = dtype.size_bytes();
    let encode: fn(f64, &mut [u8]) = match dtype {
        DType::F32 => |v, b| b.copy_from_slice(&(v as f32).to_le_bytes()),
        DType::F16 => |v, b| b.copy_from_slice(&half::f16::from_f64(v).to_le_bytes()),
        DType::Bf16 => |v, b| b.copy_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
        DType::I32 | DType::Bool => return false,
    };
    if !out.len().is_multiple_of(size) {
        return false;
    }
    let k = key(name, recipe.seed);
    let n = out.len() / size;
    let threads = threads.clamp(1, n.div_ceil(PARALLEL_MIN).max(1));
    let per = n.div_ceil(threads).max(1) * size;
    std::thread::scope(|s| {
        for (c, chunk) in out.chunks_mut(per).enumerate() {
            let first = (c * per / size) as u64;
            let mut work = move || {
                for (j, b) in chunk.chunks_exact_mut(size).enumerate() {
                    encode(value(recipe.dist, k, first + j as u64), b);
                }
            };
            if threads == 1 {
                work();
            } else {
                s.spawn(work);
            }
        }
    });
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_do_not_change_the_values() {
        let r = Recipe {
            dist: Dist::Normal {
                mean: 0.5,
                std: 0.02,
            },
            seed: 7,
        };
        let n = 3 * PARALLEL_MIN + 5;
        let mut one = vec![0u8; 4 * n];
        let mut many = vec![0u8; 4 * n];
        assert!(fill_le("w", r, DType::F32, &mut one, 1));
        assert!(fill_le("w", r, DType::F32, &mut many, 8));
        assert_eq!(one, many);
        let mut f = vec![0.0; n];
        fill_f64("w", r, 0, &mut f);
        for (i, c) in one.chunks_exact(4).enumerate() {
            let got = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            assert_eq!(got.to_bits(), (f[i] as f32).to_bits(), "element {i}");
        }
        // Another name draws another stream.
        let mut other = vec![0u8; 4 * n];
        assert!(fill_le("v", r, DType::F32, &mut other, 1));
        assert_ne!(one, other);
        // 16-bit params round once from f64.
        let mut h = vec![0u8; 2 * n];
        assert!(fill_le("w", r, DType::Bf16, &mut h, 3));
        for (i, c) in h.chunks_exact(2).enumerate() {
            assert_eq!(
                u16::from_le_bytes([c[0], c[1]]),
                half::bf16::from_f64(f[i]).to_bits()
            );
        }
        assert!(!fill_le("w", r, DType::I32, &mut other, 1));
    }
}
