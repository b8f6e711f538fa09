//! Split the `k` of f32 matmuls that leave most of a GPU idle (CUDA only).
//!
//! A weight gradient `transpose(x) @ dy` of a transformer has a small output and a long `k`
//! (every token of the batch): gpt's `[3072, 768]` gradients are 144 output tiles of
//! 128×128 on 132 SMs, so their second wave runs 12 blocks while 120 SMs wait. Such a
//! matmul `a[m, k] @ b[k, n]` becomes
//!
//! ```text
//! p = permute(reshape(a, [m, s, k/s]), [1, 0, 2]) @ reshape(b, [s, k/s, n])
//! p[0] + p[1] + … + p[s-1]          (select(p, axis: 0, index: i), views)
//! ```
//!
//! a batched matmul of `s` slices of `k` (views, no copies) and the sum of its `s` partial
//! results, which takes the matmul's epilogue (its pointwise users fuse into the sum;
//! fusion stores the sum itself where it has other readers, `fuse::sums_partials`). The
//! sum is pointwise, so the back end moves four floats per load, and it adds the slices
//! in a fixed order, so results are the same on every run (split-K by atomic adds would
//! not be). The partials are an ordinary buffer of `s·m·n` floats in the
//! plan, which `--mem-budget` accounts for (it plans the graph this pass returns).
//!
//! The split `s` minimises a model of the run time: waves of 128×128 tiles times their
//! depth `k/s`, plus writing and reading the partials. Used by `artifact::plan_step` for
//! CUDA with exact f32 (`--allow-tf32` keeps its tensor-core tiles unsplit); the CPU runs
//! every matmul whole. Cost: one pass over the nodes; five new nodes per split.
//!
//! The back end may still split the `k` of what this pass leaves whole, within a cluster
//! of two blocks and without partial sums in memory (`back::ptx::k_split`): that pays
//! where `k` is too short for this split's partials.

use crate::back::ptx::{SG_BM as TILE, SG_MIN_BLOCKS, SMS};
use crate::ir::{BinaryOp, DType, Graph, NodeId, Op, Shape};

/// Time of one 128×128 tile for one step of `k` on one SM, in picoseconds (46.5 TFLOP/s
/// over 132 SMs, the 4096³ f32 GEMM on an H100).
pub(crate) const TILE_K_PS: u64 = 93_000;
/// The 64×64 tiles' time per 1000 FLOP (the back end's choice below [`SG_MIN_BLOCKS`]
/// tiles of `TILE`×`TILE`), in picoseconds (about 20 TFLOP/s on gpt's
/// `[768, 2304]` weight gradient).
pub(crate) const SMALL_KFLOP_PS: u64 = 50_000;
/// Starting and finishing a wave of blocks (first loads, epilogue), in picoseconds.
pub(crate) const WAVE_PS: u64 = 2_000_000;
/// Writing and then reading one partial float, in picoseconds (8 bytes at 3 TB/s).
const PARTIAL_PS: u64 = 3;
/// The sum's launch, in picoseconds.
const LAUNCH_PS: u64 = 2_000_000;
/// The most slices, and the least depth of one.
const MAX_SPLIT: usize = 8;
pub(crate) const MIN_DEPTH: usize = 256;
/// A split must save at least this share of the modelled time (in percent).
pub(crate) const MIN_GAIN_PCT: u64 = 10;

/// Modelled run time, in picoseconds, of `batch` matmuls of `m`×`n`×`k` split into `s`
/// slices of `k` each.
pub fn model_ps(batch: usize, m: usize, n: usize, k: usize, s: usize) -> u64 {
    let tiles = batch * m.div_ceil(TILE) * n.div_ceil(TILE) * s;
    let compute = if tiles < SG_MIN_BLOCKS {
        (2 * batch * m * n * k) as u64 / 1000 * SMALL_KFLOP_PS
    } else {
        let waves = tiles.div_ceil(SMS) as u64;
        waves * ((k.div_ceil(s) as u64) * TILE_K_PS + WAVE_PS)
    };
    if s == 1 {
        return compute;
    }
    compute + (s * batch * m * n) as u64 * PARTIAL_PS + LAUNCH_PS
}

/// The split of `batch` matmuls of `m`×`n`×`k` (1: none): the `s` dividing `k` with the
/// least modelled time, if it saves at least [`MIN_GAIN_PCT`].
pub fn choose_split(batch: usize, m: usize, n: usize, k: usize) -> usize {
    if m < 64 || n < 64 {
        return 1;
    }
    let whole = model_ps(batch, m, n, k, 1);
    let mut best = (whole, 1);
    for s in 2..=MAX_SPLIT {
        if !k.is_multiple_of(s) || k / s < MIN_DEPTH || !(k / s).is_multiple_of(8) {
            continue;
        }
        let t = model_ps(batch, m, n, k, s);
        if t < best.0 {
            best = (t, s);
        }
    }
    if best.0 * 100 <= whole * (100 - MIN_GAIN_PCT) {
        best.1
    } else {
        1
    }
}

/// How many slices of `k` a matmul of `batch` × `m`×`n`×`k` is split into.
pub type Chooser<'a> = &'a dyn Fn(usize, usize, usize, usize) -> usize;

/// The split of matmul node `n` (1: not split): f32, `a` of rank 2 or more (its leading
/// axes a batch), `b` of rank 2, and a split `choose` gives that divides `k`.
fn split_of(g: &Graph, n: NodeId, choose: Chooser) -> usize {
    let node = g.node(n);
    if !matches!(node.op, Op::MatMul) || node.ty.dtype != DType::F32 {
        return 1;
    }
    let (a, b) = (g.ty(node.inputs[0]), g.ty(node.inputs[1]));
    if a.rank() < 2 || b.rank() != 2 || a.dtype != DType::F32 || b.dtype != DType::F32 {
        return 1;
    }
    let r = a.rank();
    let (m, k, nn) = (a.dims()[r - 2], a.dims()[r - 1], b.dims()[1]);
    let batch: usize = a.dims()[..r - 2].iter().product();
    if batch == 0 {
        return 1;
    }
    match choose(batch, m, nn, k) {
        s if s > 1 && k.is_multiple_of(s) => s,
        _ => 1,
    }
}

/// Splits every f32 matmul that [`choose_split`] picks; returns the rewritten graph (node
/// order kept, each split matmul replaced in place by its views, batched matmul and sum).
pub fn split_matmuls(g: &Graph) -> Graph {
    split_matmuls_by(g, &choose_split)
}

/// [`split_matmuls`] with the splits `choose` gives (tests split small matmuls with it).
pub fn split_matmuls_by(g: &Graph, choose: Chooser) -> Graph {
    super::replace_in_order(g, |h, n| {
        let s = split_of(h, n, choose);
        if s <= 1 {
            return None;
        }
        let node = h.node(n).clone();
        let (a, b) = (node.inputs[0], node.inputs[1]);
        let ad = h.ty(a).dims().to_vec();
        let r = ad.len();
        let (k, nn) = (ad[r - 1], h.ty(b).dims()[1]);
        // a: [.., m, k] -> [.., m, s, k/s] -> [s, .., m, k/s];
        // b: [k, n] -> [s, 1 (one per batch axis of a), k/s, n].
        let mut a_split = ad[..r - 1].to_vec();
        a_split.extend([s, k / s]);
        let perm: Vec<usize> = std::iter::once(r - 1).chain(0..r - 1).chain([r]).collect();
        let mut b_split = vec![s];
        b_split.extend(std::iter::repeat_n(1, r - 2));
        b_split.extend([k / s, nn]);
        let mut added = Vec::new();
        let mut add = |h: &mut Graph, op: Op, inputs: Vec<NodeId>| {
            let x = h.add(op, inputs, node.span, node.checkpoint).ok()?;
            added.push(x);
            Some(x)
        };
        let shape = |d: Vec<usize>| Op::Reshape { shape: Shape(d) };
        let a3 = add(h, shape(a_split), vec![a])?;
        let a3 = add(h, Op::Permute { perm }, vec![a3])?;
        let b3 = add(h, shape(b_split), vec![b])?;
        let parts = add(h, Op::MatMul, vec![a3, b3])?;
        // The sum of the partials, in order, as adds of their slices (views): a pointwise
        // kernel, which the back end vectorizes, where a reduction over the leading axis
        // would load one float at a time (gpt on an H100: the [8, 512, 768] sums of two
        // partials took 20 µs, 1.9 TB/s).
        let slice = |i: usize| Op::Select { axis: 0, index: i };
        let mut sum = add(h, slice(0), vec![parts])?;
        for i in 1..s {
            let part = add(h, slice(i), vec![parts])?;
            sum = add(h, Op::Binary(BinaryOp::Add), vec![sum, part])?;
        }
        Some(added)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_only_what_leaves_sms_idle() {
        // gpt's weight gradients: 144 tiles, two waves of which the second is nearly
        // empty; 108 tiles, which would take the small tiles; 36 tiles.
        assert!(choose_split(1, 3072, 768, 4096) > 1);
        assert!(choose_split(1, 768, 2304, 4096) > 1);
        assert!(choose_split(1, 768, 768, 4096) > 1);
        // 192 tiles of a batch of 8 with a long k.
        assert!(choose_split(8, 512, 768, 3072) > 1);
        // Many tiles, or a short k: whole.
        assert_eq!(choose_split(1, 4096, 4096, 4096), 1);
        assert_eq!(choose_split(8, 512, 2304, 768), 1);
        assert_eq!(choose_split(1, 3072, 768, 256), 1);
        // A k with no divisor deep enough stays whole.
        assert_eq!(choose_split(1, 768, 768, 4099), 1);
        for (b, m, n, k) in [
            (1, 3072, 768, 4096),
            (1, 768, 768, 4096),
            (8, 512, 768, 3072),
        ] {
            let s = choose_split(b, m, n, k);
            assert!(k % s == 0 && k / s >= MIN_DEPTH, "{m}x{n}x{k}: {s}");
            assert!(model_ps(b, m, n, k, s) < model_ps(b, m, n, k, 1));
        }
    }
}
