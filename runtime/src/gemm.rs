//! The CPU kernels' f32 GEMM helpers (helper slots `sgemm` and `sgemm_gathered`,
//! `ARTIFACT.md`): one block of a product, at most [`BLOCK_M`] × [`BLOCK_N`], computed into
//! the calling thread's own scratch, which the kernel then reads through its fused
//! epilogue.
//!
//! Cranelift lowers 128-bit vectors only, so a GEMM written in CLIF runs on `f32x4` and
//! reaches about a quarter of what a host with AVX-512 can do. The helper is compiled into
//! the runtime instead, with the widest vectors the host has (checked at run time): an 8 ×
//! 32 register tile of AVX-512 fused multiply-adds, a 4 × 16 tile on AVX2 with FMA, and
//! elsewhere a portable 4 × 8 tile of multiplies and adds, which the compiler vectorizes
//! for the baseline (SSE2, NEON). `k` runs in slices of [`KC`]: each slice's rows of B are
//! packed into panels of the tile's width and A's rows into panels of its height, both
//! zero-padded, in buffers allocated with the session (so a step allocates nothing), and
//! every tile sums its slice in registers. Where A's rows are contiguous along `k` and a
//! block is at most [`ROWS_IN_PLACE_PANELS`] tiles wide, the AVX-512 tile reads them in
//! place instead of from a packed panel (same sums, bit for bit).
//!
//! The summation order of an element depends only on `k` and [`KC`]: the same on any
//! number of threads and for any split of the rows into blocks.

/// Rows of a block at most.
pub const BLOCK_M: usize = 256;
/// Columns of a block at most; also the row stride, in elements, of the result the helper
/// returns.
pub const BLOCK_N: usize = 512;
/// `k` is summed in slices of this many steps, each over packed panels (A's rows in place
/// for narrow blocks, `run`).
const KC: usize = 256;
/// The tallest and widest register tile (AVX-512's), which sizes the packing buffers.
const MR_MAX: usize = 8;
const NR_MAX: usize = 32;
/// Rows of the AVX-512 tile.
const AVX512_MR: usize = 8;
// Every tile fits the packing buffers (`Scratch::new`), so no panel slice is out of range.
const _: () = assert!(AVX512_MR <= MR_MAX && 4 <= MR_MAX && 32 <= NR_MAX);

/// The register tile a host runs, chosen once when a session is created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tile {
    /// 8 × 32, `zmm` registers (x86-64 with AVX-512F).
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// 4 × 16, `ymm` registers (x86-64 with AVX2 and FMA).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// 4 × 8 in plain Rust (any host).
    Portable,
}

impl Tile {
    /// The widest tile this host runs.
    pub(crate) fn detect() -> Tile {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Tile::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Tile::Avx2;
            }
        }
        Tile::Portable
    }
}

/// One thread's scratch: the block's result and the packed panels of one `k` slice.
pub(crate) struct Scratch {
    /// `BLOCK_M` rows of `BLOCK_N`.
    c: Box<[f32]>,
    /// A's rows of the block, in panels of `MR` rows (rounded up) × `KC` steps.
    pa: Box<[f32]>,
    /// B's columns of the block, in panels of `NR` columns × `KC` steps.
    pb: Box<[f32]>,
}

impl Scratch {
    /// Zeroed buffers (`calloc`: pages are touched only by a session that multiplies).
    pub(crate) fn new() -> Scratch {
        Scratch {
            c: vec![0.0; BLOCK_M * BLOCK_N].into_boxed_slice(),
            pa: vec![0.0; (BLOCK_M + MR_MAX - 1) * KC].into_boxed_slice(),
            pb: vec![0.0; (BLOCK_N + NR_MAX - 1) * KC].into_boxed_slice(),
        }
    }

    /// The block's result, `BLOCK_M` rows of `BLOCK_N` floats.
    pub(crate) fn c_ptr(&mut self) -> *mut f32 {
        self.c.as_mut_ptr()
    }
}

/// Floats of a thread's gather buffer for A: `BLOCK_M` rows of 512 steps.
pub const GATHER_A_FLOATS: usize = BLOCK_M * 512;
/// Floats of a thread's gather buffer for B: `BLOCK_N` columns of 512 steps.
pub const GATHER_B_FLOATS: usize = BLOCK_N * 512;

/// A thread's gather buffers: kernels pack an implicit GEMM's operands there (through the
/// addresses in their helper table) and `block` reads them. Held as raw allocations
/// so that no Rust reference to their contents exists while a kernel writes them.
pub(crate) struct Gathered {
    a: *mut f32,
    b: *mut f32,
}

impl Gathered {
    /// Zeroed buffers (`calloc`: pages are touched only by a session that gathers).
    pub(crate) fn new() -> Gathered {
        let a = Box::into_raw(vec![0.0f32; GATHER_A_FLOATS].into_boxed_slice());
        let b = Box::into_raw(vec![0.0f32; GATHER_B_FLOATS].into_boxed_slice());
        Gathered {
            a: a.cast::<f32>(),
            b: b.cast::<f32>(),
        }
    }

    pub(crate) fn a_ptr(&self) -> *mut f32 {
        self.a
    }

    pub(crate) fn b_ptr(&self) -> *mut f32 {
        self.b
    }

    /// Both buffers as operand sources.
    pub(crate) fn views(&self) -> (Arena, Arena) {
        // SAFETY: each pointer addresses its live allocation of that many floats
        // (`new`), which only the owning thread's kernels write, before the call that
        // reads it.
        unsafe {
            (
                Arena::new(self.a.cast_const().cast::<u8>(), GATHER_A_FLOATS * 4),
                Arena::new(self.b.cast_const().cast::<u8>(), GATHER_B_FLOATS * 4),
            )
        }
    }
}

impl Drop for Gathered {
    fn drop(&mut self) {
        // SAFETY: both pointers came from `Box::into_raw` of boxed slices of exactly these
        // lengths (`new`) and are freed only here, once.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.a,
                GATHER_A_FLOATS,
            )));
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.b,
                GATHER_B_FLOATS,
            )));
        }
    }
}

/// An operand of a block: element `(r, q)` is `arena[off + 4 * (r * rs + q * cs)]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operand {
    pub off: i64,
    pub rs: i64,
    pub cs: i64,
}

impl Operand {
    /// The element offset of `(r, q)` from the operand's base, for `r < rows`, `q < cols`:
    /// `None` when a stride is negative or the last element's byte end overflows or passes
    /// `arena_bytes`, or the base is not 4-byte aligned.
    fn check(&self, rows: usize, cols: usize, arena_bytes: usize) -> Option<()> {
        if self.off < 0 || self.rs < 0 || self.cs < 0 || self.off % 4 != 0 {
            return None;
        }
        if rows == 0 || cols == 0 {
            return Some(());
        }
        let last = (rows as i64 - 1)
            .checked_mul(self.rs)?
            .checked_add((cols as i64 - 1).checked_mul(self.cs)?)?;
        let end = last.checked_mul(4)?.checked_add(self.off)?.checked_add(4)?;
        (usize::try_from(end).ok()? <= arena_bytes).then_some(())
    }
}

/// Why a call was refused (the kernel reads zeros and the step fails after it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Refused {
    pub m: i64,
    pub n: i64,
    pub k: i64,
}

/// The bytes the operands are read from: `len` readable bytes at `base`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Arena {
    base: *const u8,
    len: usize,
}

impl Arena {
    /// # Safety
    /// `len` bytes from `base` must be readable, and not written by anyone, while a
    /// [`block`] call reads them.
    pub(crate) unsafe fn new(base: *const u8, len: usize) -> Arena {
        Arena { base, len }
    }

    /// The f32 at byte `i`, or 0 where `i + 4` passes the end.
    fn f32_at(&self, i: usize) -> f32 {
        match i.checked_add(4) {
            // SAFETY: `i + 4 <= len`, and `len` bytes from `base` are readable (`new`).
            Some(end) if end <= self.len => unsafe {
                self.base.add(i).cast::<f32>().read_unaligned()
            },
            _ => 0.0,
        }
    }

    /// Copies `out.len()` f32s from byte `i` into `out`; false (nothing copied) unless
    /// they all lie in the arena.
    fn read_into(&self, i: usize, out: &mut [f32]) -> bool {
        let end = out.len().checked_mul(4).and_then(|b| i.checked_add(b));
        if end.is_none_or(|e| e > self.len) {
            return false;
        }
        // SAFETY: `i + 4 * out.len() <= len`, and `len` bytes from `base` are readable and
        // not written during the call (`new`); `out` is a distinct, writable Rust slice
        // (the thread's scratch), so the ranges do not overlap. A byte copy needs no
        // alignment.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.add(i),
                out.as_mut_ptr().cast::<u8>(),
                4 * out.len(),
            );
        }
        true
    }

    /// The `N` f32s from byte `i`, if they lie in the arena.
    fn run_at<const N: usize>(&self, i: usize) -> Option<[f32; N]> {
        let mut out = [0.0; N];
        self.read_into(i, &mut out).then_some(out)
    }
}

/// `C = A · B` for an `m × n` block (`m <= BLOCK_M`, `n <= BLOCK_N`) over `k` steps, into
/// `scratch.c` (row stride `BLOCK_N`), A read from `sources.0` and B from `sources.1`;
/// with `accumulate`, the block is added to what `scratch` holds (the last call's result)
/// instead of replacing it. Every element of both operands is checked to lie in its
/// source before any is read; a call that fails a check leaves the block zero and is
/// refused.
pub(crate) fn block(
    tile: Tile,
    scratch: &mut Scratch,
    (a_src, b_src): (Arena, Arena),
    (m, n, k): (i64, i64, i64),
    a: Operand,
    b: Operand,
    accumulate: bool,
) -> Result<(), Refused> {
    let dims = (
        usize::try_from(m).ok().filter(|&m| m <= BLOCK_M),
        usize::try_from(n).ok().filter(|&n| n <= BLOCK_N),
        usize::try_from(k).ok(),
    );
    let (Some(mu), Some(nu), Some(ku)) = dims else {
        scratch.c.fill(0.0);
        return Err(Refused { m, n, k });
    };
    if a.check(mu, ku, a_src.len).is_none() || b.check(ku, nu, b_src.len).is_none() {
        scratch.c.fill(0.0);
        return Err(Refused { m, n, k });
    }
    // The first slice of `k` sets the block (`run`); with no slice, it is zero.
    if !accumulate && ku == 0 {
        for row in scratch.c.chunks_exact_mut(BLOCK_N).take(mu) {
            row[..nu].fill(0.0);
        }
    }
    let view = (
        Sides::new(a_src, &a, a.rs, a.cs),
        Sides::new(b_src, &b, b.cs, b.rs),
    );
    let dims = (mu, nu, ku, accumulate);
    match tile {
        #[cfg(target_arch = "x86_64")]
        Tile::Avx512 => run::<AVX512_MR, 32>(
            &view,
            scratch,
            dims,
            &|kc, pa, pb, t| {
                // SAFETY: `Tile::Avx512` is only chosen where `is_x86_feature_detected!`
                // found AVX-512F (`Tile::detect`).
                unsafe { x86::tile_avx512(kc, pa, pb, t) }
            },
            Some(&|rows, pb, t| {
                // SAFETY: as above for AVX-512F; each row of `rows` is readable for
                // `rows.steps()` floats (`Rows::new`).
                unsafe { x86::tile_avx512_rows(rows, pb, t) }
            }),
        ),
        #[cfg(target_arch = "x86_64")]
        Tile::Avx2 => run::<4, 16>(
            &view,
            scratch,
            dims,
            &|kc, pa, pb, t| {
                // SAFETY: `Tile::Avx2` is only chosen where `is_x86_feature_detected!`
                // found AVX2 and FMA (`Tile::detect`).
                unsafe { x86::tile_avx2(kc, pa, pb, t) }
            },
            None,
        ),
        Tile::Portable => run::<4, 8>(&view, scratch, dims, &tile_portable, None),
    }
    Ok(())
}

/// A's rows of one register tile read where they lie (A contiguous along `k`), instead of
/// from a packed panel: `MR` row addresses, each readable for `steps` floats.
pub(crate) struct Rows<const MR: usize> {
    at: [*const f32; MR],
    steps: usize,
}

impl<const MR: usize> Rows<MR> {
    /// # Safety
    /// Each of `at` must be readable for `steps` f32s (unaligned), none written while the
    /// tile reads them.
    unsafe fn new(at: [*const f32; MR], steps: usize) -> Rows<MR> {
        Rows { at, steps }
    }

    fn steps(&self) -> usize {
        self.steps
    }
}

/// A checked operand as the packing reads it: element `(s, q)` at byte `off + 4 (s ·
/// side + q · step)` of `src`, `s` its side (A's row, B's column) and `q` its step along
/// `k`.
struct Sides {
    src: Arena,
    off: usize,
    side: usize,
    step: usize,
}

impl Sides {
    /// `o`, checked (`Operand::check`: no negative offset or stride, every element in
    /// `src`), with its side along `side` and its steps along `step` (A: rows and
    /// columns; B: columns and rows).
    fn new(src: Arena, o: &Operand, side: i64, step: i64) -> Sides {
        Sides {
            src,
            off: o.off as usize,
            side: side as usize,
            step: step as usize,
        }
    }

    /// The address of element `(s, q)`; readable where `(s, q)` lies in the extents that
    /// `Operand::check` passed, for which the offset cannot overflow (the check bounds
    /// it); only the final pointer step wraps, so forming it is always defined.
    fn ptr(&self, s: usize, q: usize) -> *const f32 {
        let i = self.off + 4 * (s * self.side + q * self.step);
        self.src.base.wrapping_add(i).cast::<f32>()
    }

    /// Element `(s, q)`: in `src` for every `(s, q)` the packing asks for (the check
    /// passed for the block's extents, so nothing overflows); `Arena::f32_at` still reads
    /// nothing outside it.
    fn at(&self, s: usize, q: usize) -> f32 {
        self.src
            .f32_at(self.off + 4 * (s * self.side + q * self.step))
    }
}

/// A is read in place (when contiguous along `k`) where a block has at most this many
/// panels of B: then each of A's values is read by that many tiles, so packing it would
/// cost a pass over A for little reuse. With more, the packed panel's contiguous reads win
/// (A's rows of a large product lie a power-of-two stride apart and collide in the cache).
const ROWS_IN_PLACE_PANELS: usize = 2;

/// A register tile: `(kc, packed A panel, packed B panel, result)`.
type TileFn<const MR: usize, const NR: usize> = dyn Fn(usize, &[f32], &[f32], &mut [[f32; NR]; MR]);
/// A register tile reading A's rows in place: `(A's rows, packed B panel, result)`.
type RowsFn<const MR: usize, const NR: usize> = dyn Fn(&Rows<MR>, &[f32], &mut [[f32; NR]; MR]);

/// The product through tile `tile_fn` of `MR × NR`, `k` slice by slice, the first slice
/// setting the block unless `accumulate` (then every slice adds to it); where A is
/// contiguous along `k` and the tile has a form that reads A in place (`rows_fn`), A is not
/// packed.
fn run<const MR: usize, const NR: usize>(
    (a, b): &(Sides, Sides),
    s: &mut Scratch,
    (m, n, k, accumulate): (usize, usize, usize, bool),
    tile_fn: &TileFn<MR, NR>,
    rows_fn: Option<&RowsFn<MR, NR>>,
) {
    let (mp, np) = (m.div_ceil(MR), n.div_ceil(NR));
    let in_place = rows_fn.filter(|_| a.step == 1 && m > 0 && np <= ROWS_IN_PLACE_PANELS);
    let mut p0 = 0;
    while p0 < k {
        let kc = KC.min(k - p0);
        if in_place.is_none() {
            pack::<MR>(a, &mut s.pa, m, p0, kc);
        }
        pack::<NR>(b, &mut s.pb, n, p0, kc);
        for jp in 0..np {
            let pb = &s.pb[jp * NR * kc..(jp + 1) * NR * kc];
            for ip in 0..mp {
                let mut t = [[0.0f32; NR]; MR];
                match in_place {
                    Some(rows_fn) => {
                        // Rows past `m` repeat the last row; their sums are not stored.
                        let at = std::array::from_fn(|r| a.ptr((ip * MR + r).min(m - 1), p0));
                        // SAFETY: `block` checked every element `(s, q)` of A, `s < m`,
                        // `q < k`, to lie in its source (`Operand::check`), and A's steps
                        // are contiguous (`a.step == 1`), so each row is readable from step
                        // `p0` for `kc <= k - p0` floats; sources are not written during a
                        // call (`Arena::new`).
                        let rows = unsafe { Rows::new(at, kc) };
                        rows_fn(&rows, pb, &mut t);
                    }
                    None => {
                        let pa = &s.pa[ip * MR * kc..(ip + 1) * MR * kc];
                        tile_fn(kc, pa, pb, &mut t);
                    }
                }
                let (i0, j0) = (ip * MR, jp * NR);
                let cols = NR.min(n - j0);
                for (r, tr) in t.iter().enumerate().take(MR.min(m - i0)) {
                    let c0 = (i0 + r) * BLOCK_N + j0;
                    let row = &mut s.c[c0..c0 + cols];
                    if p0 == 0 && !accumulate {
                        row.copy_from_slice(&tr[..cols]);
                    } else {
                        for (c, x) in row.iter_mut().zip(tr) {
                            *c += x;
                        }
                    }
                }
            }
        }
        p0 += kc;
    }
}

/// An operand's sides `[0, extent)` (A's rows, B's columns), steps `[p0, p0 + kc)`, as
/// panels of `W` sides: step `q` of panel `p` holds its `W` sides' values at `p * W * kc +
/// q * W` (sides past `extent` are 0). A step of a panel whose sides are contiguous is one
/// run (B's row, or A's column in a transposed view); otherwise a side contiguous along
/// `k` (A's row, or B's column in a transposed weight) is read in runs of 16 steps.
fn pack<const W: usize>(o: &Sides, out: &mut [f32], extent: usize, p0: usize, kc: usize) {
    /// Steps of a side read at once where the side is contiguous along `k`.
    const RUN: usize = 16;
    for (p, panel) in out
        .chunks_exact_mut(W * kc)
        .take(extent.div_ceil(W))
        .enumerate()
    {
        let s0 = p * W;
        if o.side == 1 {
            // The last panel may have fewer sides: copy those, zero the rest.
            let w = (extent - s0).min(W);
            for (q, step) in panel.chunks_exact_mut(W).enumerate() {
                let at = o.off + 4 * (s0 + (p0 + q) * o.step);
                let (have, pad) = step.split_at_mut(w);
                if w == W {
                    if let Some(run) = o.src.run_at::<W>(at) {
                        have.copy_from_slice(&run);
                        continue;
                    }
                } else if o.src.read_into(at, have) {
                    pad.fill(0.0);
                    continue;
                }
                for (c, x) in have.iter_mut().enumerate() {
                    *x = o.at(s0 + c, p0 + q);
                }
                pad.fill(0.0);
            }
            continue;
        }
        for c in 0..W {
            let s = s0 + c;
            let mut q = 0;
            if s < extent && o.step == 1 {
                let base = o.off + 4 * (s * o.side + p0);
                while q + RUN <= kc {
                    let Some(run) = o.src.run_at::<RUN>(base + 4 * q) else {
                        break;
                    };
                    for (u, x) in run.into_iter().enumerate() {
                        panel[(q + u) * W + c] = x;
                    }
                    q += RUN;
                }
            }
            for q in q..kc {
                panel[q * W + c] = if s < extent { o.at(s, p0 + q) } else { 0.0 };
            }
        }
    }
}

/// The portable tile: `t[r][c] = Σ_q pa[q * MR + r] * pb[q * NR + c]`.
fn tile_portable<const MR: usize, const NR: usize>(
    kc: usize,
    pa: &[f32],
    pb: &[f32],
    t: &mut [[f32; NR]; MR],
) {
    for (a, b) in pa.chunks_exact(MR).zip(pb.chunks_exact(NR)).take(kc) {
        for (tr, &ar) in t.iter_mut().zip(a) {
            for (x, &bc) in tr.iter_mut().zip(b) {
                *x += ar * bc;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The 8 × 32 tile on AVX-512: 16 `zmm` accumulators, per step two loads of B and a
    /// broadcast of each of A's 8 values.
    ///
    /// # Safety
    /// The host must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile_avx512<const MR: usize>(
        kc: usize,
        pa: &[f32],
        pb: &[f32],
        t: &mut [[f32; 32]; MR],
    ) {
        let mut c = [[_mm512_setzero_ps(); 2]; MR];
        for (a, b) in pa.chunks_exact(MR).zip(pb.chunks_exact(32)).take(kc) {
            // SAFETY: `b` holds 32 floats (`chunks_exact(32)`), so both 16-float loads
            // are in bounds; `loadu` needs no alignment.
            let (b0, b1) = unsafe {
                (
                    _mm512_loadu_ps(b.as_ptr()),
                    _mm512_loadu_ps(b.as_ptr().add(16)),
                )
            };
            for (cr, &ar) in c.iter_mut().zip(a) {
                let av = _mm512_set1_ps(ar);
                cr[0] = _mm512_fmadd_ps(av, b0, cr[0]);
                cr[1] = _mm512_fmadd_ps(av, b1, cr[1]);
            }
        }
        store_avx512(&c, t);
    }

    /// The accumulators of an AVX-512 tile into `t`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn store_avx512<const MR: usize>(c: &[[__m512; 2]; MR], t: &mut [[f32; 32]; MR]) {
        for (tr, cr) in t.iter_mut().zip(c) {
            // SAFETY: a row of `t` holds 32 floats, so both 16-float stores are in bounds.
            unsafe {
                _mm512_storeu_ps(tr.as_mut_ptr(), cr[0]);
                _mm512_storeu_ps(tr.as_mut_ptr().add(16), cr[1]);
            }
        }
    }

    /// The 8 × 32 tile on AVX-512 with A's rows read in place: per step, two loads of B
    /// and a broadcast from each row.
    ///
    /// # Safety
    /// The host must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile_avx512_rows<const MR: usize>(
        rows: &super::Rows<MR>,
        pb: &[f32],
        t: &mut [[f32; 32]; MR],
    ) {
        let mut c = [[_mm512_setzero_ps(); 2]; MR];
        for (q, b) in pb.chunks_exact(32).take(rows.steps()).enumerate() {
            // SAFETY: `b` holds 32 floats (`chunks_exact(32)`).
            let (b0, b1) = unsafe {
                (
                    _mm512_loadu_ps(b.as_ptr()),
                    _mm512_loadu_ps(b.as_ptr().add(16)),
                )
            };
            for (cr, &row) in c.iter_mut().zip(&rows.at) {
                // SAFETY: `q < rows.steps()` (`take`), and each row is readable for that
                // many floats (`Rows::new`).
                let av = _mm512_set1_ps(unsafe { row.add(q).read_unaligned() });
                cr[0] = _mm512_fmadd_ps(av, b0, cr[0]);
                cr[1] = _mm512_fmadd_ps(av, b1, cr[1]);
            }
        }
        store_avx512(&c, t);
    }

    /// The 4 × 16 tile on AVX2 with FMA: 8 `ymm` accumulators.
    ///
    /// # Safety
    /// The host must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_avx2(kc: usize, pa: &[f32], pb: &[f32], t: &mut [[f32; 16]; 4]) {
        let mut c = [[_mm256_setzero_ps(); 2]; 4];
        for (a, b) in pa.chunks_exact(4).zip(pb.chunks_exact(16)).take(kc) {
            // SAFETY: `b` holds 16 floats, so both 8-float loads are in bounds.
            let (b0, b1) = unsafe {
                (
                    _mm256_loadu_ps(b.as_ptr()),
                    _mm256_loadu_ps(b.as_ptr().add(8)),
                )
            };
            for (cr, &ar) in c.iter_mut().zip(a) {
                let av = _mm256_set1_ps(ar);
                cr[0] = _mm256_fmadd_ps(av, b0, cr[0]);
                cr[1] = _mm256_fmadd_ps(av, b1, cr[1]);
            }
        }
        for (tr, cr) in t.iter_mut().zip(&c) {
            // SAFETY: a row of `t` holds 16 floats, so both 8-float stores are in bounds.
            unsafe {
                _mm256_storeu_ps(tr.as_mut_ptr(), cr[0]);
                _mm256_storeu_ps(tr.as_mut_ptr().add(8), cr[1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(xs: &[f32]) -> Vec<u8> {
        xs.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    /// Every tile this host runs agrees with a plain triple loop, on ragged shapes, strided
    /// (transposed) operands and a `k` longer than one slice.
    #[test]
    fn blocks_match_a_plain_product_on_every_tile() {
        let mut tiles = vec![Tile::Portable, Tile::detect()];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            tiles.push(Tile::Avx2);
        }
        tiles.dedup();
        for &(m, n, k, a_t, b_t) in &[
            (1usize, 1usize, 1usize, false, false),
            (5, 7, 3, false, false),
            (128, 256, 300, false, false),
            (17, 33, 513, true, false),
            (9, 40, 64, false, true),
            (40, 64, 700, false, false),
            (3, 2, 0, false, false),
        ] {
            let av: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
                .collect();
            let bv: Vec<f32> = (0..k * n)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0)
                .collect();
            let mut arena = vec![0u8; 8];
            arena.extend(bytes(&av));
            let b_off = arena.len() as i64;
            arena.extend(bytes(&bv));
            // A transposed: stored k × m, read with rs = 1, cs = m.
            let a = if a_t {
                let mut t = vec![0.0; m * k];
                for i in 0..m {
                    for q in 0..k {
                        t[q * m + i] = av[i * k + q];
                    }
                }
                arena[8..8 + 4 * m * k].copy_from_slice(&bytes(&t));
                Operand {
                    off: 8,
                    rs: 1,
                    cs: m as i64,
                }
            } else {
                Operand {
                    off: 8,
                    rs: k as i64,
                    cs: 1,
                }
            };
            let b = if b_t {
                let mut t = vec![0.0; k * n];
                for q in 0..k {
                    for j in 0..n {
                        t[j * k + q] = bv[q * n + j];
                    }
                }
                let s = b_off as usize;
                arena[s..s + 4 * k * n].copy_from_slice(&bytes(&t));
                Operand {
                    off: b_off,
                    rs: 1,
                    cs: k as i64,
                }
            } else {
                Operand {
                    off: b_off,
                    rs: n as i64,
                    cs: 1,
                }
            };
            for &tile in &tiles {
                let mut s = Scratch::new();
                s.c.fill(f32::NAN);
                // SAFETY: `arena` is a live vector no one writes during the call.
                let view = unsafe { Arena::new(arena.as_ptr(), arena.len()) };
                block(
                    tile,
                    &mut s,
                    (view, view),
                    (m as i64, n as i64, k as i64),
                    a,
                    b,
                    false,
                )
                .unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let want: f32 = (0..k).map(|q| av[i * k + q] * bv[q * n + j]).sum();
                        let got = s.c[i * BLOCK_N + j];
                        assert!(
                            (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                            "{tile:?} {m}x{n}x{k} ({i}, {j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// A's rows read in place give the packed panels' sums, bit for bit (so the choice,
    /// made per block from its width alone, never changes a result).
    #[test]
    fn rows_read_in_place_sum_as_packed_panels_do() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // m = 13: the last panel's rows past m repeat row 12; k = 600: three slices.
            let (m, n, k) = (13usize, 40usize, 600usize);
            let av: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
                .collect();
            let bv: Vec<f32> = (0..k * n)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0)
                .collect();
            let mut arena = bytes(&av);
            arena.extend(bytes(&bv));
            // SAFETY: `arena` is a live vector no one writes during the calls.
            let src = unsafe { Arena::new(arena.as_ptr(), arena.len()) };
            let a = Operand {
                off: 0,
                rs: k as i64,
                cs: 1,
            };
            let b = Operand {
                off: 4 * (m * k) as i64,
                rs: n as i64,
                cs: 1,
            };
            let view = (
                Sides::new(src, &a, a.rs, a.cs),
                Sides::new(src, &b, b.cs, b.rs),
            );
            let packed = |kc: usize, pa: &[f32], pb: &[f32], t: &mut [[f32; 32]; 8]| {
                // SAFETY: this host has AVX-512F (checked above).
                unsafe { x86::tile_avx512(kc, pa, pb, t) }
            };
            let rows = |r: &Rows<8>, pb: &[f32], t: &mut [[f32; 32]; 8]| {
                // SAFETY: as above; `Rows` rows are readable (`run` made them).
                unsafe { x86::tile_avx512_rows(r, pb, t) }
            };
            let mut out = Vec::new();
            for in_place in [false, true] {
                let mut s = Scratch::new();
                let rows_fn: Option<&RowsFn<8, 32>> = if in_place { Some(&rows) } else { None };
                run::<8, 32>(&view, &mut s, (m, n, k, false), &packed, rows_fn);
                out.push(
                    s.c[..BLOCK_N * m]
                        .iter()
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>(),
                );
            }
            assert_eq!(out[0], out[1]);
            let want: f32 = (0..k).map(|q| av[12 * k + q] * bv[q * n + 39]).sum();
            let got = f32::from_bits(out[1][12 * BLOCK_N + 39]);
            assert!(
                (got - want).abs() <= 1e-3 * want.abs().max(1.0),
                "{got} vs {want}"
            );
        }
    }

    /// Reading A and B from separate sources (a thread's gather buffers), and adding a
    /// second slice of `k` to the first's block.
    #[test]
    fn gathered_blocks_accumulate_over_slices_of_k() {
        let (m, n, k) = (6usize, 9usize, 40usize);
        let av: Vec<f32> = (0..m * k).map(|i| (i % 5) as f32 - 2.0).collect();
        let bv: Vec<f32> = (0..k * n).map(|i| (i % 3) as f32 * 0.5).collect();
        let (ab, bb) = (bytes(&av), bytes(&bv));
        // SAFETY: both are live vectors no one writes during the calls.
        let srcs = unsafe {
            (
                Arena::new(ab.as_ptr(), ab.len()),
                Arena::new(bb.as_ptr(), bb.len()),
            )
        };
        let mut s = Scratch::new();
        // k in two slices: steps [0, 25) then [25, 40).
        let a0 = Operand {
            off: 0,
            rs: k as i64,
            cs: 1,
        };
        let b0 = Operand {
            off: 0,
            rs: n as i64,
            cs: 1,
        };
        let dims = |kk: usize| (m as i64, n as i64, kk as i64);
        block(Tile::detect(), &mut s, srcs, dims(25), a0, b0, false).unwrap();
        let a1 = Operand { off: 4 * 25, ..a0 };
        let b1 = Operand {
            off: 4 * 25 * n as i64,
            ..b0
        };
        block(Tile::detect(), &mut s, srcs, dims(15), a1, b1, true).unwrap();
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|q| av[i * k + q] * bv[q * n + j]).sum();
                assert!((s.c[i * BLOCK_N + j] - want).abs() <= 1e-4 * want.abs().max(1.0));
            }
        }
        // B is checked against its own source: a 40 × 40 B does not fit its 40 × 9.
        let big_b = Operand {
            off: 0,
            rs: k as i64,
            cs: 1,
        };
        let dims = (m as i64, k as i64, k as i64);
        assert!(block(Tile::detect(), &mut s, srcs, dims, a0, big_b, false).is_err());
    }

    /// Operands outside the arena, negative strides and oversized blocks are refused
    /// before anything is read, and the block reads as zeros.
    #[test]
    fn calls_outside_the_arena_are_refused() {
        let arena = [0u8; 64];
        let ok = Operand {
            off: 0,
            rs: 4,
            cs: 1,
        };
        let cases = [
            ((4, 4, 4), ok, ok, true),
            ((4, 4, 5), ok, ok, false),
            ((4, 4, 4), Operand { off: 4, ..ok }, ok, false),
            ((4, 4, 4), ok, Operand { rs: -1, ..ok }, false),
            ((4, 4, 4), Operand { off: 2, ..ok }, ok, false),
            ((BLOCK_M as i64 + 1, 1, 0), ok, ok, false),
            ((1, BLOCK_N as i64 + 1, 0), ok, ok, false),
            ((-1, 1, 1), ok, ok, false),
            ((1, 1, i64::MAX), ok, ok, false),
            (
                (1, 1, 2),
                Operand {
                    off: 0,
                    rs: 0,
                    cs: i64::MAX,
                },
                ok,
                false,
            ),
        ];
        for (dims, a, b, fine) in cases {
            let mut s = Scratch::new();
            s.c.fill(1.0);
            // SAFETY: `arena` is a live vector no one writes during the call.
            let view = unsafe { Arena::new(arena.as_ptr(), arena.len()) };
            let r = block(Tile::detect(), &mut s, (view, view), dims, a, b, false);
            assert_eq!(r.is_ok(), fine, "{dims:?} {a:?} {b:?}");
            if !fine {
                assert!(s.c.iter().all(|&x| x == 0.0));
            }
        }
    }
}
