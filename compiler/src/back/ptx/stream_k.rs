//! Stream-K for the FFMA SGEMM: a matmul whose 128×128 tiles fill the GPU's block slots
//! badly (gpt's `[4096, 768]` products: 192 tiles on 264 slots, 1.45 waves) runs on one
//! wave of blocks that split the tiles' `k` stages evenly between them. The `tiles ×
//! stages` units, tile-major, are cut into `ctas` equal ranges; block `c` takes range `c`,
//! which may start inside a tile (its first segment: a tile's later stages), cover whole
//! tiles, and end inside one (its last segment: a tile's first stages).
//!
//! A tile summed by several blocks is finished by its *owner*, the block whose segment
//! holds its first stage. Every other block of the tile summed a segment that was its
//! first, stores it as a partial tile (slot `c` of the scratch region, one per block) and
//! raises its flag; the owner, after its own stages, waits for the flags of blocks
//! `c + 1, c + 2, …` in that order, adds their partials in that order and runs the
//! epilogue. The order of the adds is fixed by the matmul's shape alone, so results are
//! the same on every run (unlike split-K by atomic adds), and nothing but the result and
//! one partial tile a block reaches global memory.
//!
//! This replaced two ways of splitting `k` (gpt on an H100, step 62.0 → 59.0 ms): a graph
//! pass that made such a matmul a batched matmul of `k`'s slices and a sum of the
//! partials (a kernel of its own, the partials a buffer of the plan), and clusters of two
//! blocks adding their halves through distributed shared memory. gpt's shapes, one
//! matmul a step (ms, before → stream-K): `[4096, 768] @ [768, 768]` 0.134 → 0.131,
//! its weight gradient 0.164 → 0.129, `[4096, 3072] @ [3072, 768]` 0.453 → 0.447,
//! `[768, 4096] @ [4096, 3072]` 0.474 → 0.425, `[768, 4096] @ [4096, 2304]` 0.374 →
//! 0.325, `[4096, 768] @ [768, 2304]` 0.362 → 0.349.
//!
//! Waiting cannot deadlock: the launch is one wave (two blocks an SM, [`MAX_CTAS`] on an
//! H100 or H200), so every block is resident; and where fewer fit (a GPU with fewer SMs,
//! or other kernels of the step running beside it), a block waits only on later blocks'
//! first segments, which wait on nothing, while the hardware starts blocks in the order of
//! their index, so the lowest waiting block's partials come from blocks that can run. The
//! owner resets each flag it consumed, so the flags are zero between launches (the arena
//! is zeroed when a session starts). Stream-K kernels share the scratch region, and
//! `analysis::launch_deps` orders them (they all write it).
//!
//! The scratch region, after the plan's arena: [`MAX_CTAS`] flags (u32), then one
//! 128×128 f32 tile a block, in the order of the block's registers (accumulator `i` of
//! thread `t` at float `i·256 + t`: each store of a warp is 128 consecutive bytes).

use super::px::Px;
use super::sgemm::{SG_BM, SG_BN};
use super::SMS;
use crate::target::TARGET;

/// Blocks of a stream-K launch: two an SM (the SGEMM's launch bounds).
pub(super) const MAX_CTAS: usize = 2 * SMS;
/// Bytes of the flags, aligned.
const FLAG_BYTES: u64 = (MAX_CTAS as u64 * 4).div_ceil(TARGET.align) * TARGET.align;
/// Bytes of one block's partial tile.
const PARTIAL_BYTES: u64 = (SG_BM * SG_BN * 4) as u64;
/// Bytes of the scratch region a stream-K launch of `ctas` blocks uses.
pub(super) fn scratch_bytes(ctas: usize) -> u64 {
    FLAG_BYTES + ctas as u64 * PARTIAL_BYTES
}
/// Stream-K is used where the tiles fill their waves' slots to less than this share (in
/// percent). Well-filled waves run faster whole: gpt's `[4096, 768] @ [768, 3072]` (768
/// tiles, 97%) took 0.435 ms whole and 0.456 stream-K on an H100, the gpt step 59.46 and
/// 59.89 ms.
const MAX_FILL_PCT: usize = 90;
/// The fewest stages a tile needs, and a block's range (shorter ones leave the partials
/// too large a share).
const MIN_STAGES: usize = 32;

/// The blocks of a stream-K launch over `tiles` 128×128 tiles of `stages` stages each, or
/// `None` where the tiles fill their waves (of [`MAX_CTAS`] blocks) well enough, or where
/// there is too little work for a block an SM with [`MIN_STAGES`] each (the 64×64 tiles
/// take those: mlp's `256×1024` layers, 16 tiles of 128 stages, ran 2% slower stream-K).
pub(super) fn choose(tiles: usize, stages: usize) -> Option<usize> {
    if tiles == 0 || stages < MIN_STAGES {
        return None;
    }
    // Unit indices stay within 32 bits.
    let units = tiles.checked_mul(stages)?;
    if units > u32::MAX as usize / 2 {
        return None;
    }
    let waves = tiles.div_ceil(MAX_CTAS);
    if tiles * 100 / (waves * MAX_CTAS) >= MAX_FILL_PCT {
        return None;
    }
    let ctas = MAX_CTAS.min(units / MIN_STAGES);
    (ctas >= SMS).then_some(ctas)
}

/// The registers of the segment a block is summing (u32), and the loop's labels.
pub(super) struct Segment {
    /// The block's index.
    c: String,
    /// The segment's first unit, and the end of the block's range.
    u: String,
    end: String,
    /// The tile's index, and the segment's stages `[kb, ke)` of it.
    tile: String,
    pub kb: String,
    pub ke: String,
    head: String,
    next: String,
    ctas: usize,
    units: usize,
    stages: usize,
}

/// The unit at which block `c` (u32 register) starts: `c · units / ctas`.
fn start_of(px: &mut Px, c: &str, units: usize, ctas: usize) -> String {
    let (w, s) = (px.fresh("rd"), px.fresh("r"));
    px.line(format!("mul.wide.u32 {w}, {c}, {units};"));
    px.line(format!("div.u64 {w}, {w}, {ctas};"));
    px.line(format!("cvt.u32.u64 {s}, {w};"));
    s
}

/// Opens the loop over the block's segments (after the block's prologue: `c` is
/// `%ctaid.x`): the segment's tile as block indices `(x, y, z)` over the `gx`×`gy`×`batch`
/// tiles, `x` fastest.
pub(super) fn open(
    px: &mut Px,
    c: &str,
    ctas: usize,
    (gx, gy, batch): (usize, usize, usize),
    stages: usize,
) -> (Segment, [String; 3]) {
    let units = gx * gy * batch * stages;
    px.line(format!(
        "// stream-K: {} tiles of {stages} stages over {ctas} blocks",
        gx * gy * batch
    ));
    let u = start_of(px, c, units, ctas);
    let c1 = px.fresh("r");
    px.line(format!("add.u32 {c1}, {c}, 1;"));
    let end = start_of(px, &c1, units, ctas);
    let (head, next) = (px.label("sk_seg"), px.label("sk_next"));
    px.body.push_str(&format!("{head}:\n"));
    px.load_arena();
    let (tile, kb, ke, left) = (px.fresh("r"), px.fresh("r"), px.fresh("r"), px.fresh("r"));
    px.line(format!("div.u32 {tile}, {u}, {stages};"));
    px.line(format!("mul.lo.u32 {kb}, {tile}, {stages};"));
    px.line(format!("sub.u32 {kb}, {u}, {kb};"));
    px.line(format!("sub.u32 {left}, {end}, {u};"));
    px.line(format!("add.u32 {ke}, {kb}, {left};"));
    px.line(format!("min.u32 {ke}, {ke}, {stages};"));
    let mut xyz = [String::new(), String::new(), String::new()];
    px.digits(&tile, &[batch, gy, gx], false, |_, i, r| xyz[2 - i] = r);
    (
        Segment {
            c: c.to_string(),
            u,
            end,
            tile,
            kb,
            ke,
            head,
            next,
            ctas,
            units,
            stages,
        },
        xyz,
    )
}

/// After the segment's stages: a segment that is not its tile's first stores its partial
/// and raises its flag, then goes on to the block's next segment; an owner adds the later
/// blocks' partials to `acc`. What follows (the epilogue) runs on whole tiles' sums.
/// `scratch` is the region's arena offset.
pub(super) fn finish_tile(px: &mut Px, s: &Segment, acc: &[String], scratch: u64) {
    let t = px.tid.clone();
    px.load_arena();
    let arena = px.arena.clone();
    let (flags, parts) = (px.fresh("rd"), px.fresh("rd"));
    px.line(format!("add.s64 {flags}, {arena}, {scratch};"));
    px.line(format!("add.s64 {parts}, {flags}, {FLAG_BYTES};"));
    let lead = px.fresh("p");
    px.line(format!("setp.eq.u32 {lead}, {t}, 0;"));
    // The address of thread `t`'s first float of block `b`'s partial.
    let slot = |px: &mut Px, b: &str| {
        let (w, a) = (px.fresh("rd"), px.fresh("rd"));
        px.line(format!("mul.wide.u32 {w}, {b}, {PARTIAL_BYTES};"));
        px.line(format!("add.s64 {a}, {parts}, {w};"));
        px.line(format!("mul.wide.u32 {w}, {t}, 4;"));
        px.line(format!("add.s64 {a}, {a}, {w};"));
        a
    };
    let flag = |px: &mut Px, b: &str| {
        let f = px.fresh("rd");
        px.line(format!("mul.wide.u32 {f}, {b}, 4;"));
        px.line(format!("add.s64 {f}, {flags}, {f};"));
        f
    };
    let owner = px.label("sk_owner");
    let whole = px.label("sk_whole");
    let p = px.fresh("p");
    px.line(format!("setp.eq.u32 {p}, {}, 0;", s.kb));
    px.line(format!("@{p} bra.uni {owner};"));
    // A later part of the tile: the partial, then the flag (after every thread's stores).
    let a = slot(px, &s.c);
    for (i, r) in acc.iter().enumerate() {
        px.line(format!("st.global.cg.f32 [{a}+{}], {r};", i * 256 * 4));
    }
    px.line("bar.sync 0;");
    let f = flag(px, &s.c);
    let one = px.fresh("r");
    px.line(format!("mov.u32 {one}, 1;"));
    px.line(format!("@{lead} fence.acq_rel.gpu;"));
    px.line(format!("@{lead} st.relaxed.gpu.global.u32 [{f}], {one};"));
    px.line(format!("bra.uni {};", s.next));
    // The tile's first stages: whole, or the later blocks' partials follow.
    px.body.push_str(&format!("{owner}:\n"));
    px.line(format!("setp.eq.u32 {p}, {}, {};", s.ke, s.stages));
    px.line(format!("@{p} bra.uni {whole};"));
    let (b, tile_end) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("add.u32 {b}, {}, 1;", s.c));
    px.line(format!(
        "mad.lo.u32 {tile_end}, {}, {}, {};",
        s.tile, s.stages, s.stages
    ));
    let more = px.label("sk_more");
    px.body.push_str(&format!("{more}:\n"));
    let f = flag(px, &b);
    let (spin, got) = (px.label("sk_spin"), px.label("sk_got"));
    px.line(format!("@!{lead} bra {got};"));
    px.body.push_str(&format!("{spin}:\n"));
    let v = px.fresh("r");
    px.line(format!("ld.acquire.gpu.global.u32 {v}, [{f}];"));
    px.line(format!("setp.eq.u32 {p}, {v}, 0;"));
    px.line(format!("@{p} bra {spin};"));
    let zero = px.fresh("r");
    px.line(format!("mov.u32 {zero}, 0;"));
    px.line(format!("st.relaxed.gpu.global.u32 [{f}], {zero};"));
    px.body.push_str(&format!("{got}:\n"));
    px.line("bar.sync 0;");
    let a = slot(px, &b);
    for (i, r) in acc.iter().enumerate() {
        let x = px.fresh("f");
        px.line(format!("ld.global.cg.f32 {x}, [{a}+{}];", i * 256 * 4));
        px.line(format!("add.rn.f32 {r}, {r}, {x};"));
    }
    // The next block, while it starts inside this tile.
    px.line(format!("add.u32 {b}, {b}, 1;"));
    let sb = start_of(px, &b, s.units, s.ctas);
    px.line(format!("setp.lt.u32 {p}, {sb}, {tile_end};"));
    px.line(format!("@{p} bra.uni {more};"));
    px.body.push_str(&format!("{whole}:\n"));
}

/// Closes the loop over the block's segments (after the epilogue).
pub(super) fn close(px: &mut Px, s: &Segment) {
    px.body.push_str(&format!("{}:\n", s.next));
    let (len, p) = (px.fresh("r"), px.fresh("p"));
    px.line(format!("sub.u32 {len}, {}, {};", s.ke, s.kb));
    px.line(format!("add.u32 {}, {}, {len};", s.u, s.u));
    px.line(format!("setp.lt.u32 {p}, {}, {};", s.u, s.end));
    // The next segment's first stage overwrites a shared stage this one read: the k
    // loop's last barrier already orders them, this one keeps it so if the epilogue or
    // the partial path ever use shared memory (one barrier a segment, 1 to 3 a block).
    px.line("bar.sync 0;");
    px.line(format!("@{p} bra.uni {};", s.head));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_tiles_that_fill_waves_badly() {
        // gpt's [4096, 768] products (192 tiles) and weight gradients (144, 108 and 36
        // tiles of 512 stages): one wave of blocks.
        assert_eq!(choose(192, 384), Some(MAX_CTAS));
        assert_eq!(choose(144, 512), Some(MAX_CTAS));
        assert_eq!(choose(36, 512), Some(MAX_CTAS));
        // [4096, 3072] (768 tiles, 97% of three waves) and [4096, 8192]: whole tiles.
        assert_eq!(choose(768, 96), None);
        assert_eq!(choose(2048, 96), None);
        // Too little work: a short k, or mlp's 16 tiles of 128 stages.
        assert_eq!(choose(192, 16), None);
        assert_eq!(choose(16, 128), None);
        // Enough for fewer blocks than the slots, but at least one an SM.
        assert_eq!(choose(15, 375), Some(175));
        assert_eq!(choose(0, 100), None);
        assert_eq!(choose(usize::MAX, 100), None);
        assert_eq!(choose(1 << 30, 64), None);
    }
}
