//! `k` split across a cluster of blocks in the FFMA SGEMM: a matmul whose 128×128 tiles
//! leave SMs idle, and whose `k` the graph-level split (`passes::split_matmuls`, whose
//! partial sums go through global memory and a sum kernel) left whole, runs each tile as a
//! cluster of `s` blocks (sm_90 thread block clusters, consecutive along `z`), the block
//! of rank `z % s` summing the `z % s`-th part of `k`'s stages. The blocks then add their
//! accumulators through distributed shared memory: each writes half of its tile to its own
//! shared memory at a time, and the block of rank `q` sums rows `q·64/s .. (q+1)·64/s` of
//! that half over the blocks in rank order `0, 1, .., s-1` (`ld.shared::cluster` at the
//! address `mapa` gives), then runs the kernel's epilogue on them. The order is fixed, so
//! results are the same on every run, and nothing but the result reaches global memory.
//!
//! gpt's output projection and its input gradient (`[4096, 768] @ [768, 768]`: 192 tiles,
//! 1.45 waves of two blocks an SM) went from 0.150 to 0.121 ms on an H100 with pairs of
//! blocks. Larger clusters were measured slower: the `[4096, 768]` product with
//! `k = 3072` took 0.494 ms in pairs and 0.564 in fours, and weight gradients in clusters
//! of 8 (`k = 4096`, where the graph split is used) 0.527 ms against the graph split's
//! 0.475, so clusters are pairs.
//!
//! The choice minimises a model of the run time: waves of 128×128 tiles (one an SM) times
//! their depth `k/s`, plus a wave's start and finish and the cluster's exchange (the
//! graph split's model, with the exchange in place of the partial sums).

use super::{epilogue_coords, Px, SG_BM, SG_BN, SG_STRIDE, SMS};
use crate::passes::split_matmuls::{MIN_DEPTH, MIN_GAIN_PCT, SMALL_KFLOP_PS, TILE_K_PS, WAVE_PS};

/// A cluster's exchange (each block writes its 64 KiB tile to shared memory and reads
/// `64/s` KiB from each of the `s` blocks) and barriers, per wave, in picoseconds (fitted
/// to the output projection's 0.121 ms).
const EXCHANGE_PS: u64 = 2_500_000;
/// The most blocks a tile's `k` is split across (see the module's notes).
pub(super) const MAX_BLOCKS: usize = 2;

/// Modelled run time, in picoseconds, of `batch` matmuls of `m`×`n`×`k` with `k` split
/// across `s` blocks (128×128 tiles, or the 64×64 ones where those are fewer than a wave).
pub fn model_ps(batch: usize, m: usize, n: usize, k: usize, s: usize) -> u64 {
    let tiles = batch * m.div_ceil(SG_BM) * n.div_ceil(SG_BN) * s;
    if tiles < super::SG_MIN_BLOCKS {
        return (2 * batch * m * n * k) as u64 / 1000 * SMALL_KFLOP_PS;
    }
    let waves = tiles.div_ceil(SMS) as u64;
    let exchange = if s > 1 { EXCHANGE_PS } else { 0 };
    waves * ((k.div_ceil(s) as u64) * TILE_K_PS + WAVE_PS + exchange)
}

/// The blocks across which the `k` of `batch` matmuls of `m`×`n`×`k` is split (1: whole):
/// the power of two up to [`MAX_BLOCKS`] with the least modelled time, if it saves at
/// least [`MIN_GAIN_PCT`].
pub fn choose(batch: usize, m: usize, n: usize, k: usize) -> usize {
    if m < 64 || n < 64 {
        return 1;
    }
    let whole = model_ps(batch, m, n, k, 1);
    let mut best = (whole, 1);
    let mut s = 2;
    while s <= MAX_BLOCKS && k / s >= MIN_DEPTH {
        let t = model_ps(batch, m, n, k, s);
        if t < best.0 {
            best = (t, s);
        }
        s *= 2;
    }
    if best.0 * 100 <= whole * (100 - MIN_GAIN_PCT) {
        best.1
    } else {
        1
    }
}

/// Bytes of shared memory the exchange needs: half a 128×128 tile, rows padded as the
/// stages' are.
pub(super) const EXCHANGE_BYTES: usize = 64 * SG_STRIDE * 4;

/// This thread's share of a tile's sum over the cluster ([`reduce`]): `sums[r * 4 + c]`
/// is at output row `rows[r]` and column `cols[c]` (with their in-range predicates), 4
/// consecutive columns from a multiple of 4.
pub(super) struct Reduced {
    pub rows: Vec<(String, String)>,
    pub cols: Vec<(String, String)>,
    pub sums: Vec<String>,
}

/// Emits the cluster's sum of the 128×128 tile whose accumulator `acc[r*8 + c]` is at row
/// `ty*4 + r%4 + 64*(r/4)`, column `tx*4 + c%4 + 64*(c/4)` of the tile (the SGEMM's
/// layout, `t = ty*16 + tx`; the tile at block `(x, y)` of an `m`×`n` output), through the
/// idle shared memory `mm_s` (at least [`EXCHANGE_BYTES`]). Sets `px.arena` anew. The caller
/// runs the epilogue on the result, then [`wait_for_readers`] before the kernel returns.
pub(super) fn reduce(
    px: &mut Px,
    blocks: usize,
    acc: &[String],
    (m, n): (usize, usize),
) -> Reduced {
    // Each block sums a whole number of 8-row groups of each half.
    debug_assert!(blocks.is_power_of_two() && (2..=8).contains(&blocks) && acc.len() == 64);
    let row_bytes = SG_STRIDE * 4;
    // The thread's and the tile's indices and the shared and arena bases are derived
    // again here: kept through the loop, which holds up to 128 registers (the launch
    // bounds'), they spilled.
    let (t, tx, ty, sbase) = (px.fresh("r"), px.fresh("r"), px.fresh("r"), px.fresh("r"));
    px.line(format!("mov.u32 {t}, %tid.x;"));
    px.line(format!("and.b32 {tx}, {t}, 15;"));
    px.line(format!("shr.u32 {ty}, {t}, 4;"));
    px.line(format!("mov.u32 {sbase}, mm_s;"));
    px.load_arena();
    let (tx, ty, sbase) = (tx.as_str(), ty.as_str(), sbase.as_str());
    let per = 64 / blocks;
    let q = px.fresh("r");
    px.line(format!("mov.u32 {q}, %cluster_ctarank;"));
    // Writes: row ty*4 + r%4 of the half, columns tx*4 + {0, 64}.
    let wr = px.fresh("r");
    px.line(format!("mul.lo.u32 {wr}, {ty}, {};", 4 * row_bytes));
    px.line(format!("mad.lo.u32 {wr}, {tx}, 16, {wr};"));
    px.line(format!("add.u32 {wr}, {wr}, {sbase};"));
    // Scalar stores: a vector's four registers must be consecutive, which the loop's
    // allocation of the accumulators does not give (vector stores spilled).
    let write_half = |px: &mut Px, half: usize| {
        for r in 4 * half..4 * half + 4 {
            for c in 0..8 {
                let off = (r % 4) * row_bytes + (c / 4) * 256 + (c % 4) * 4;
                px.line(format!("st.shared.f32 [{wr}+{off}], {};", acc[r * 8 + c]));
            }
        }
    };
    write_half(px, 0);
    // The read addresses once the first half's accumulators are free (computed before,
    // they took ptxas past 128 registers).
    let (rbase, cbase, remote) = read_addresses(px, blocks, &t, sbase, &q);
    let mut sums = Vec::new();
    for half in 0..2 {
        if half == 1 {
            write_half(px, 1);
        }
        cluster_sync(px);
        for i in 0..per / 8 {
            let off = i * 8 * row_bytes;
            let total: Vec<String> = (0..4).map(|_| px.fresh("f")).collect();
            for (p, addr) in remote.iter().enumerate() {
                let part: Vec<String> = if p == 0 {
                    total.clone()
                } else {
                    (0..4).map(|_| px.fresh("f")).collect()
                };
                px.line(format!(
                    "ld.shared::cluster.v4.f32 {{{}}}, [{addr}+{off}];",
                    part.join(", ")
                ));
                if p > 0 {
                    for (s, x) in total.iter().zip(&part) {
                        px.line(format!("add.rn.f32 {s}, {s}, {x};"));
                    }
                }
            }
            sums.extend(total);
        }
        if half == 0 {
            // Every block has read the first half before any overwrites it.
            cluster_sync(px);
        } else {
            // The last reads are done; the wait comes before the kernel returns.
            px.line("barrier.cluster.arrive.release.aligned;");
        }
    }
    let (by, bx) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("mov.u32 {by}, %ctaid.y;"));
    px.line(format!("mov.u32 {bx}, %ctaid.x;"));
    px.line(format!("mad.lo.u32 {rbase}, {by}, {SG_BM}, {rbase};"));
    px.line(format!("mad.lo.u32 {cbase}, {bx}, {SG_BN}, {cbase};"));
    let (rb, cb) = (px.fresh("rd"), px.fresh("rd"));
    px.line(format!("cvt.u64.u32 {rb}, {rbase};"));
    px.line(format!("cvt.u64.u32 {cb}, {cbase};"));
    let each = per / 8;
    let rows = epilogue_coords(px, &rb, m, 2 * each, &|i| 64 * (i / each) + 8 * (i % each));
    let cols = epilogue_coords(px, &cb, n, 4, &|c| c);
    Reduced { rows, cols, sums }
}

/// The thread's first row (`q*per + t/32`) and column (`(t%32)*4`) of each half that
/// block `q` sums, and their shared address in every block of the cluster, in rank order.
fn read_addresses(
    px: &mut Px,
    blocks: usize,
    t: &str,
    sbase: &str,
    q: &str,
) -> (String, String, Vec<String>) {
    let row_bytes = SG_STRIDE * 4;
    let per = 64 / blocks;
    let (rbase, cbase) = (px.fresh("r"), px.fresh("r"));
    // Row q*per + t/32 + 8i of the half, columns (t%32)*4 .. +4.
    let (tr, tc) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("shr.u32 {tr}, {t}, 5;"));
    px.line(format!("and.b32 {tc}, {t}, 31;"));
    px.line(format!("mad.lo.u32 {rbase}, {q}, {per}, {tr};"));
    let rd = px.fresh("r");
    px.line(format!("mul.lo.u32 {rd}, {rbase}, {row_bytes};"));
    px.line(format!("mad.lo.u32 {rd}, {tc}, 16, {rd};"));
    px.line(format!("add.u32 {rd}, {rd}, {sbase};"));
    px.line(format!("shl.b32 {cbase}, {tc}, 2;"));
    // The same address in every block of the cluster, in rank order.
    let remote: Vec<String> = (0..blocks)
        .map(|p| {
            let r = px.fresh("r");
            px.line(format!("mapa.shared::cluster.u32 {r}, {rd}, {p};"));
            r
        })
        .collect();
    (rbase, cbase, remote)
}

/// A whole cluster barrier (release, then acquire).
fn cluster_sync(px: &mut Px) {
    px.line("barrier.cluster.arrive.release.aligned;");
    px.line("barrier.cluster.wait.acquire.aligned;");
}

/// After [`reduce`]'s epilogue: no block leaves while another may still read its shared
/// memory.
pub(super) fn wait_for_readers(px: &mut Px) {
    px.line("barrier.cluster.wait.acquire.aligned;");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_only_where_sms_idle_and_k_is_short() {
        // gpt's output projection and its input gradient: 192 tiles, k = 768.
        assert_eq!(choose(8, 512, 768, 768), 2);
        assert_eq!(choose(1, 4096, 768, 768), 2);
        // What the graph split leaves of gpt's weight gradients and k = 3072 products.
        assert_eq!(choose(8, 768, 3072, 512), 1);
        assert_eq!(choose(16, 512, 768, 1536), 1);
        // Many tiles, or a short k: whole.
        assert_eq!(choose(1, 4096, 4096, 4096), 1);
        assert_eq!(choose(8, 512, 3072, 768), 1);
        assert_eq!(choose(1, 3072, 768, 256), 1);
        // Thin: whole.
        assert_eq!(choose(1, 32, 768, 1 << 20), 1);
        for (b, m, n, k) in [
            (8, 512, 768, 768),
            (1, 768, 640, 4099),
            (1, 4096, 768, 3072),
        ] {
            let s = choose(b, m, n, k);
            assert!(s.is_power_of_two() && s <= MAX_BLOCKS && k / s >= MIN_DEPTH);
            if s > 1 {
                assert!(
                    model_ps(b, m, n, k, s) < model_ps(b, m, n, k, 1),
                    "{m}x{n}x{k}"
                );
            }
        }
    }
}
