//! Hand-built artifacts for the runtime tests.
#![allow(dead_code)]

use tcc_runtime::artifact::{
    self, DType, KernelEntry, Manifest, PersistentKind, PersistentSlot, PlanBuffer, PlanInfo,
    Target, TensorSlot,
};

pub const ALIGN: u64 = 64;

pub fn slot(name: &str, dtype: DType, shape: &[usize], offset: u64) -> TensorSlot {
    TensorSlot {
        name: name.to_string(),
        dtype,
        shape: shape.to_vec(),
        offset,
        bytes: (shape.iter().product::<usize>() * dtype.size_bytes()) as u64,
        index_bound: None,
    }
}

pub fn kernel(name: &str, extent: u64, parallel: bool) -> KernelEntry {
    KernelEntry {
        name: name.to_string(),
        extent,
        parallel,
        launch: None,
        after: None,
        describe: format!("test kernel {name}"),
        collective: None,
    }
}

/// `y[i] = x[i] * w[i] + 1.0` over `[lo, hi)`; `w` at 0, `x` at `xo`, `y` at `yo`.
pub fn fma_kernel(name: &str, xo: u64, yo: u64) -> String {
    format!(
        "function %{name}(i64, i64, i64, i64) system_v {{
block0(v0: i64, v1: i64, v2: i64, v3: i64):
    v4 = icmp sge v1, v2
    brif v4, block2, block1(v1)

block1(v5: i64):
    v30 = iconst.i64 2
    v6 = ishl v5, v30
    v7 = iadd v0, v6
    v8 = load.f32 notrap aligned v7+{xo}
    v9 = load.f32 notrap aligned v7
    v10 = fmul v8, v9
    v11 = f32const 0x1.0p0
    v12 = fadd v10, v11
    store notrap aligned v12, v7+{yo}
    v31 = iconst.i64 1
    v13 = iadd v5, v31
    v14 = icmp slt v13, v2
    brif v14, block1(v13), block2

block2:
    return
}}
"
    )
}

/// `out[i] = helper(src[i])` for a unary `f32 -> f32` helper in table slot `slot`.
pub fn unary_helper_kernel(name: &str, slot: u32, src: u64, out: u64) -> String {
    let at = slot * 8;
    format!(
        "function %{name}(i64, i64, i64, i64) system_v {{
    sig0 = (f32) -> f32 system_v

block0(v0: i64, v1: i64, v2: i64, v3: i64):
    v4 = icmp sge v1, v2
    brif v4, block2, block1(v1)

block1(v5: i64):
    v30 = iconst.i64 2
    v6 = ishl v5, v30
    v7 = iadd v0, v6
    v8 = load.f32 notrap aligned v7+{src}
    v9 = load.i64 notrap aligned v3+{at}
    v10 = call_indirect sig0, v9(v8)
    store notrap aligned v10, v7+{out}
    v31 = iconst.i64 1
    v11 = iadd v5, v31
    v12 = icmp slt v11, v2
    brif v12, block1(v11), block2

block2:
    return
}}
"
    )
}

/// `out[i] = powf(src[i], 2.0)` (slot 6), then `out2[i] = bf16_to_f32(f32_to_bf16(src[i]))`
/// (slots 10 and 9), and `out3[i] = f16_to_f32(f32_to_f16(src[i]))` (slots 8 and 7).
pub fn multi_helper_kernel(name: &str, src: u64, out: u64, out2: u64, out3: u64) -> String {
    format!(
        "function %{name}(i64, i64, i64, i64) system_v {{
    sig0 = (f32, f32) -> f32 system_v
    sig1 = (f32) -> i32 system_v
    sig2 = (i32) -> f32 system_v

block0(v0: i64, v1: i64, v2: i64, v3: i64):
    v4 = icmp sge v1, v2
    brif v4, block2, block1(v1)

block1(v5: i64):
    v30 = iconst.i64 2
    v6 = ishl v5, v30
    v7 = iadd v0, v6
    v8 = load.f32 notrap aligned v7+{src}
    v9 = load.i64 notrap aligned v3+48
    v20 = f32const 0x1.0p1
    v10 = call_indirect sig0, v9(v8, v20)
    store notrap aligned v10, v7+{out}
    v21 = load.i64 notrap aligned v3+80
    v22 = call_indirect sig1, v21(v8)
    v23 = load.i64 notrap aligned v3+72
    v24 = call_indirect sig2, v23(v22)
    store notrap aligned v24, v7+{out2}
    v25 = load.i64 notrap aligned v3+64
    v26 = call_indirect sig1, v25(v8)
    v27 = load.i64 notrap aligned v3+56
    v28 = call_indirect sig2, v27(v26)
    store notrap aligned v28, v7+{out3}
    v31 = iconst.i64 1
    v11 = iadd v5, v31
    v12 = icmp slt v11, v2
    brif v12, block1(v11), block2

block2:
    return
}}
"
    )
}

/// The small model of the tests: param `w: f32[4] = [1, 2, 3, 4]` at 0, input `x: f32[4]`
/// at 64, output `y: f32[4]` at 128 (`y = x * w + 1`, kernel `k0`) and output `z: f32[4]` at
/// 192 (`z = exp(y)`, kernel `k1` through helper slot 0). Arena: 256 bytes.
pub fn tiny_manifest() -> Manifest {
    Manifest {
        format_version: artifact::FORMAT_VERSION,
        producer: "tcc-runtime tests".into(),
        model: "tiny".into(),
        target: Target::Cpu,
        arena_bytes: 256,
        alignment: ALIGN,
        ranks: None,
        sass: None,
        checks: Vec::new(),
        inputs: vec![slot("x", DType::F32, &[4], 64)],
        outputs: vec![
            slot("y", DType::F32, &[4], 128),
            slot("z", DType::F32, &[4], 192),
        ],
        persistent: vec![PersistentSlot {
            slot: slot("w", DType::F32, &[4], 0),
            kind: PersistentKind::Param,
            init: None,
            shard_of: None,
        }],
        kernels: vec![kernel("k0", 4, false), kernel("k1", 4, true)],
        plan: PlanInfo {
            persistent_bytes: 64,
            lower_bound: 256,
            method: "by hand".into(),
            buffers: vec![
                PlanBuffer {
                    owner: "w".into(),
                    offset: 0,
                    bytes: 16,
                    start: 0,
                    end: 2,
                    kind: "persistent".into(),
                },
                PlanBuffer {
                    owner: "x".into(),
                    offset: 64,
                    bytes: 16,
                    start: 0,
                    end: 1,
                    kind: "input".into(),
                },
            ],
        },
        sections: vec![],
    }
}

pub fn tiny_code() -> String {
    fma_kernel("k0", 64, 128) + &unary_helper_kernel("k1", 0, 128, 192)
}

pub fn persistent_init(w: &[f32], bytes: usize) -> Vec<u8> {
    let mut init: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    init.resize(bytes, 0);
    init
}

/// Serialises `manifest` with a `code` section (`code` after the manifest's bounds line, as
/// the compiler writes it) and a `persistent` section.
pub fn build(manifest: &Manifest, code: &str, persistent: &[u8]) -> Vec<u8> {
    let code = artifact::bounds_line(manifest) + code;
    artifact::write(
        manifest,
        &[("code", code.as_bytes()), ("persistent", persistent)],
    )
}

/// `y = x · w` through the GEMM helper (slot 11): `x` is `[m, k]`, `w` (the param) `[k,
/// n]`, both row-major; kernel `k0` runs over rows, `parallel`, one helper call for its
/// rows `[lo, hi)`, then copies the block into `y`. `b_off` replaces `w`'s offset in the
/// call (a corrupt kernel); `None` keeps it.
pub fn gemm_artifact(m: usize, n: usize, k: usize, b_off: Option<i64>) -> Vec<u8> {
    let pad = |elems: usize| ((elems * 4) as u64).div_ceil(ALIGN) * ALIGN;
    let (w, x) = (0, pad(k * n));
    let y = x + pad(m * k);
    let mut man = tiny_manifest();
    man.model = "gemm".into();
    man.arena_bytes = y + pad(m * n);
    man.inputs = vec![slot("x", DType::F32, &[m, k], x)];
    man.outputs = vec![slot("y", DType::F32, &[m, n], y)];
    man.persistent[0].slot = slot("w", DType::F32, &[k, n], w);
    man.kernels = vec![kernel("k0", m as u64, true)];
    man.plan.persistent_bytes = pad(k * n);
    man.plan.lower_bound = man.arena_bytes;
    man.plan.buffers.clear();
    let b = b_off.unwrap_or(w as i64);
    let stride = 4 * tcc_runtime::cpu::SGEMM_BLOCK_N;
    let code = format!(
        "function %k0(i64, i64, i64, i64) system_v {{
    sig0 = (i64, i64, i64, i64, i64, i64, i64, i64, i64, i64) -> i64 system_v

block0(v0: i64, v1: i64, v2: i64, v3: i64):
    v4 = icmp sge v1, v2
    brif v4, block3, block1

block1:
    v5 = isub v2, v1
    v6 = iconst.i64 {n}
    v7 = iconst.i64 {k}
    v40 = iconst.i64 {row_bytes}
    v8 = imul v1, v40
    v41 = iconst.i64 {x}
    v9 = iadd v8, v41
    v11 = iconst.i64 1
    v12 = iconst.i64 {b}
    v15 = load.i64 notrap aligned v3+88
    v16 = call_indirect sig0, v15(v3, v5, v6, v7, v9, v7, v11, v12, v6, v11)
    v42 = imul v5, v6
    v17 = iconst.i64 0
    jump block2(v17)

block2(v18: i64):
    v19 = udiv v18, v6
    v20 = urem v18, v6
    v43 = iconst.i64 {stride}
    v21 = imul v19, v43
    v44 = iconst.i64 2
    v22 = ishl v20, v44
    v23 = iadd v21, v22
    v24 = iadd v16, v23
    v25 = load.f32 notrap aligned v24
    v26 = iadd v19, v1
    v45 = iconst.i64 {out_row}
    v27 = imul v26, v45
    v28 = iadd v27, v22
    v29 = iadd v0, v28
    store notrap aligned v25, v29+{y}
    v30 = iadd v18, v11
    v32 = icmp slt v30, v42
    brif v32, block2(v30), block3

block3:
    return
}}
",
        row_bytes = 4 * k,
        out_row = 4 * n,
    );
    let wv: Vec<f32> = (0..k * n)
        .map(|i| ((i * 3 % 7) as f32 - 3.0) * 0.5)
        .collect();
    build(&man, &code, &persistent_init(&wv, pad(k * n) as usize))
}

/// What `gemm_artifact`'s `y` holds for input `x`.
pub fn gemm_expected(m: usize, n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    let wv: Vec<f32> = (0..k * n)
        .map(|i| ((i * 3 % 7) as f32 - 3.0) * 0.5)
        .collect();
    (0..m * n)
        .map(|e| (0..k).map(|p| x[e / n * k + p] * wv[p * n + e % n]).sum())
        .collect()
}

pub fn tiny_artifact() -> Vec<u8> {
    build(
        &tiny_manifest(),
        &tiny_code(),
        &persistent_init(&[1.0, 2.0, 3.0, 4.0], 64),
    )
}

/// A larger model for parallel runs: `y = x * w + 1` over `n` elements, kernel `k0`
/// `parallel`, followed by `z = tanh(y)` (helper slot 2), also `parallel`.
pub fn big_artifact(n: usize) -> Vec<u8> {
    let bytes = (n * 4) as u64;
    let pad = bytes.div_ceil(ALIGN) * ALIGN;
    let (w, x, y, z) = (0, pad, 2 * pad, 3 * pad);
    let mut m = tiny_manifest();
    m.model = "big".into();
    m.arena_bytes = 4 * pad;
    m.inputs = vec![slot("x", DType::F32, &[n], x)];
    m.outputs = vec![
        slot("y", DType::F32, &[n], y),
        slot("z", DType::F32, &[n], z),
    ];
    m.persistent[0].slot = slot("w", DType::F32, &[n], w);
    m.kernels = vec![kernel("k0", n as u64, true), kernel("k1", n as u64, true)];
    m.plan.persistent_bytes = pad;
    m.plan.lower_bound = m.arena_bytes;
    m.plan.buffers.clear();
    let code = fma_kernel("k0", x, y) + &unary_helper_kernel("k1", 2, y, z);
    let w: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.25).collect();
    build(&m, &code, &persistent_init(&w, pad as usize))
}

/// The launch shape of the CUDA test kernels: `ceil(n / 256)` blocks of 256 threads (one
/// block of 32 for tiny sizes).
pub fn launch_for(n: u64) -> artifact::Launch {
    if n <= 32 {
        artifact::Launch {
            grid: [1, 1, 1],
            block: [32, 1, 1],
            shared_bytes: 0,
        }
    } else {
        artifact::Launch {
            grid: [n.div_ceil(256) as u32, 1, 1],
            block: [256, 1, 1],
            shared_bytes: 0,
        }
    }
}

/// The header of every PTX module of the tests.
pub const PTX_HEADER: &str = ".version 8.0\n.target sm_80\n.address_size 64\n";

/// PTX entry `name(.param .u64 arena)`: `y[i] = x[i] * w[i] + 1.0` for `i < n` (f32; `w` at
/// byte `wo`, `x` at `xo`, `y` at `yo` of the arena), one thread per element.
pub fn fma_ptx(name: &str, n: u64, wo: u64, xo: u64, yo: u64) -> String {
    format!(
        "
.visible .entry {name}(
	.param .u64 arena
)
{{
	.reg .pred 	%p<2>;
	.reg .b32 	%r<5>;
	.reg .f32 	%f<4>;
	.reg .b64 	%rd<6>;

	ld.param.u64 	%rd1, [arena];
	cvta.to.global.u64 	%rd2, %rd1;
	mov.u32 	%r1, %ctaid.x;
	mov.u32 	%r2, %ntid.x;
	mov.u32 	%r3, %tid.x;
	mad.lo.s32 	%r4, %r1, %r2, %r3;
	setp.ge.u32 	%p1, %r4, {n};
	@%p1 bra 	DONE;
	mul.wide.u32 	%rd3, %r4, 4;
	add.s64 	%rd4, %rd2, %rd3;
	ld.global.f32 	%f1, [%rd4+{xo}];
	ld.global.f32 	%f2, [%rd4+{wo}];
	fma.rn.f32 	%f3, %f1, %f2, 0f3F800000;
	st.global.f32 	[%rd4+{yo}], %f3;
DONE:
	ret;
}}
"
    )
}

/// PTX entry `name(.param .u64 arena)`: `z[i] = y[i] * y[i] + w[i]`, then `w[i] += 1.0`
/// (an in-place param update, as a training step does) for `i < n`.
pub fn square_update_ptx(name: &str, n: u64, wo: u64, yo: u64, zo: u64) -> String {
    format!(
        "
.visible .entry {name}(
	.param .u64 arena
)
{{
	.reg .pred 	%p<2>;
	.reg .b32 	%r<5>;
	.reg .f32 	%f<5>;
	.reg .b64 	%rd<6>;

	ld.param.u64 	%rd1, [arena];
	cvta.to.global.u64 	%rd2, %rd1;
	mov.u32 	%r1, %ctaid.x;
	mov.u32 	%r2, %ntid.x;
	mov.u32 	%r3, %tid.x;
	mad.lo.s32 	%r4, %r1, %r2, %r3;
	setp.ge.u32 	%p1, %r4, {n};
	@%p1 bra 	DONE;
	mul.wide.u32 	%rd3, %r4, 4;
	add.s64 	%rd4, %rd2, %rd3;
	ld.global.f32 	%f1, [%rd4+{yo}];
	ld.global.f32 	%f2, [%rd4+{wo}];
	fma.rn.f32 	%f3, %f1, %f1, %f2;
	st.global.f32 	[%rd4+{zo}], %f3;
	add.f32 	%f4, %f2, 0f3F800000;
	st.global.f32 	[%rd4+{wo}], %f4;
DONE:
	ret;
}}
"
    )
}

/// PTX entry `name(.param .u64 arena)` that stores to a null pointer: an illegal address.
pub fn faulting_ptx(name: &str) -> String {
    format!(
        "
.visible .entry {name}(
	.param .u64 arena
)
{{
	.reg .b32 	%r<2>;
	.reg .b64 	%rd<2>;

	mov.u64 	%rd1, 0;
	mov.u32 	%r1, 7;
	st.global.u32 	[%rd1], %r1;
	ret;
}}
"
    )
}

/// The PTX of [`cuda_tiny_manifest`].
pub fn cuda_tiny_ptx() -> String {
    format!(
        "{PTX_HEADER}{}{}",
        fma_ptx("k0", 4, 0, 64, 128),
        square_update_ptx("k1", 4, 0, 128, 192)
    )
}

/// The tiny model for the CUDA target: the layout of [`tiny_manifest`] (param `w = [1, 2, 3,
/// 4]` at 0, input `x` at 64, outputs `y` at 128 and `z` at 192, arena 256 bytes), kernel
/// `k0`: `y = x * w + 1`, kernel `k1`: `z = y * y + w; w += 1`, each one block of 32 threads.
pub fn cuda_tiny_manifest() -> Manifest {
    let mut m = tiny_manifest();
    m.target = Target::Cuda;
    m.model = "tiny-cuda".into();
    for k in &mut m.kernels {
        k.launch = Some(launch_for(4));
    }
    m
}

pub fn cuda_tiny_artifact() -> Vec<u8> {
    build(
        &cuda_tiny_manifest(),
        &cuda_tiny_ptx(),
        &persistent_init(&[1.0, 2.0, 3.0, 4.0], 64),
    )
}

/// The CUDA version of [`big_artifact`]: `y = x * w + 1`, then `z = y * y + w; w += 1` over
/// `n` elements, `ceil(n / 256)` blocks of 256 threads.
pub fn cuda_big_artifact(n: usize) -> Vec<u8> {
    let bytes = (n * 4) as u64;
    let pad = bytes.div_ceil(ALIGN) * ALIGN;
    let (w, x, y, z) = (0, pad, 2 * pad, 3 * pad);
    let mut m = cuda_tiny_manifest();
    m.model = "big-cuda".into();
    m.arena_bytes = 4 * pad;
    m.inputs = vec![slot("x", DType::F32, &[n], x)];
    m.outputs = vec![
        slot("y", DType::F32, &[n], y),
        slot("z", DType::F32, &[n], z),
    ];
    m.persistent[0].slot = slot("w", DType::F32, &[n], w);
    m.kernels = vec![kernel("k0", n as u64, true), kernel("k1", n as u64, true)];
    for k in &mut m.kernels {
        k.launch = Some(launch_for(n as u64));
    }
    m.plan.persistent_bytes = pad;
    m.plan.lower_bound = m.arena_bytes;
    m.plan.buffers.clear();
    let code = format!(
        "{PTX_HEADER}{}{}",
        fma_ptx("k0", n as u64, w, x, y),
        square_update_ptx("k1", n as u64, w, y, z)
    );
    let init: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.25).collect();
    build(&m, &code, &persistent_init(&init, pad as usize))
}

/// Whether the CUDA tests can run here: the `cuda` feature is on and the driver reports a
/// device. Otherwise prints a notice (straight to stderr, so `cargo test` shows it even for a
/// passing test) and returns false, unless `TCC_REQUIRE_CUDA` is set, which makes a missing
/// device a failure (for runs on a GPU machine that must not skip).
pub fn cuda_or_skip(test: &str) -> bool {
    use std::io::Write;
    let why = match tcc_runtime::cuda_device_count() {
        Ok(n) if n > 0 => return true,
        Ok(_) => "the driver reports no CUDA device".to_string(),
        Err(e) => e.to_string(),
    };
    if std::env::var_os("TCC_REQUIRE_CUDA").is_some() {
        panic!("TCC_REQUIRE_CUDA is set, but {test} cannot run: {why}");
    }
    let _ = writeln!(
        std::io::stderr(),
        "note: skipping {test} (needs a CUDA device): {why}"
    );
    false
}
