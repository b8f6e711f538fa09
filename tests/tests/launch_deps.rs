//! The kernel dependencies a compiled step ships (`after`, from
//! `tcc::analysis::launch_deps`) are complete: running a CPU artifact's kernels in another
//! order that they allow gives the same bytes as the launch order, while an order they
//! forbid does not. (The CUDA executor builds its graph from the same edges; the GPU tests
//! check that path on a device.)

use tcc::artifact::{self, CompileOptions, Target};
use tcc_runtime::artifact::{self as fmt, KernelEntry, Manifest};
use tcc_tests::{compile_pipeline, options_from_args};

/// Outputs, then params and optimizer state, after `steps` steps of the artifact built from
/// `m` (kernels in its order) with the same inputs every step.
fn run(
    m: &Manifest,
    code: &str,
    persistent: &[u8],
    g: &tcc::ir::Graph,
    steps: usize,
) -> Vec<Vec<u8>> {
    // The kernels' order is the manifest's: the code's bounds line lists them in it.
    let code = fmt::bounds_line(m) + code;
    let bytes = fmt::write(m, &[("code", code.as_bytes()), ("persistent", persistent)]);
    let model = tcc_runtime::Model::from_bytes(bytes).unwrap();
    let mut s = tcc_runtime::Session::new(&model, tcc_runtime::Device::Cpu).unwrap();
    let inputs = tcc::eager::random_inputs(g, 3);
    for _ in 0..steps {
        for (name, t) in &inputs {
            s.set_input_bytes(name, &t.to_le_bytes()).unwrap();
        }
        s.run().unwrap();
    }
    let mut out: Vec<Vec<u8>> = g
        .outputs
        .iter()
        .map(|(name, _)| s.output_bytes(name).unwrap().to_vec())
        .collect();
    for (_, name, _) in g.persistent_tensors() {
        out.push(s.param_bytes(&name).unwrap().to_vec());
    }
    out
}

/// A launch order the dependencies allow: of the kernels whose dependencies have all run,
/// the one `pick` chooses (given their launch numbers, ascending).
fn allowed_order(kernels: &[KernelEntry], pick: &mut dyn FnMut(&[usize]) -> usize) -> Vec<usize> {
    let n = kernels.len();
    let mut done = vec![false; n];
    let mut order = Vec::with_capacity(n);
    while order.len() < n {
        let ready: Vec<usize> = (0..n)
            .filter(|&i| {
                !done[i]
                    && kernels[i]
                        .after
                        .as_ref()
                        .unwrap()
                        .iter()
                        .all(|&d| done[d as usize])
            })
            .collect();
        let i = ready[pick(&ready)];
        done[i] = true;
        order.push(i);
    }
    order
}

/// `m` with its kernels in `order`, each waiting for the one before.
fn reordered(m: &Manifest, order: &[usize]) -> Manifest {
    let mut r = m.clone();
    r.kernels = order
        .iter()
        .map(|&i| KernelEntry {
            after: None,
            ..m.kernels[i].clone()
        })
        .collect();
    r
}

fn check(file: &str, args: &str, steps: usize) {
    let src = std::fs::read_to_string(tcc_tests::root().join("examples").join(file)).unwrap();
    let g = compile_pipeline(&src, &options_from_args(args)).unwrap();
    let opts = CompileOptions {
        target: Target::Cpu,
        ..CompileOptions::default()
    };
    let c = artifact::compile(&g, &opts).unwrap();
    let img = artifact::persistent_image(&c, 0, &Default::default()).unwrap();
    let m = artifact::manifest(&c, Target::Cpu, &img);
    let n = m.kernels.len();
    assert!(m.kernels.iter().all(|k| k.after.is_some()), "{file}");
    let want = run(&m, &c.code, &img.image, &g, steps);

    // The latest-launched ready kernel first (pulls every kernel as early as its
    // dependencies let it), then pseudo-random picks.
    let mut orders = vec![allowed_order(&m.kernels, &mut |r| r.len() - 1)];
    for seed in 1..=3u64 {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        orders.push(allowed_order(&m.kernels, &mut |r| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % r.len() as u64) as usize
        }));
    }
    let moved = orders[0]
        .iter()
        .enumerate()
        .filter(|(i, &k)| *i != k)
        .count();
    assert!(
        moved * 4 >= n,
        "{file}: the eager order moves only {moved} of {n} kernels: too few to test"
    );
    for order in &orders {
        let got = run(&reordered(&m, order), &c.code, &img.image, &g, steps);
        assert!(
            got == want,
            "{file}: an order the dependencies allow gives other bytes"
        );
    }

    // Control: an order that breaks one read-after-write edge (the last kernel's
    // dependency runs after it) gives other bytes, so the comparison can fail.
    let last = n - 1;
    if let Some(&d) = m.kernels[last].after.as_ref().unwrap().last() {
        let mut order: Vec<usize> = (0..n).filter(|&i| i != d as usize).collect();
        order.push(d as usize);
        let got = run(&reordered(&m, &order), &c.code, &img.image, &g, steps);
        assert!(
            got != want,
            "{file}: running kernel {d} after the last kernel changed nothing"
        );
    }
}

#[test]
fn gpt_kernels_in_any_allowed_order_give_the_same_bytes() {
    check(
        "gpt.tdsl",
        "--set L=2 --set D=32 --set H=2 --set T=16 --set B=2 --set V=64",
        2,
    );
}

#[test]
fn cnn_kernels_in_any_allowed_order_give_the_same_bytes() {
    check("cnn.tdsl", "--set B=2 --set C=4 --set S=8", 2);
}

#[test]
fn mlp_kernels_in_any_allowed_order_give_the_same_bytes() {
    check("mlp.tdsl", "--set B=8 --set D=32", 2);
}

/// Stream-K matmuls (CUDA) share the scratch region after the plan's buffers, so they run
/// one after another even where their buffers are independent (params, two outputs).
#[test]
fn stream_k_matmuls_run_one_after_another() {
    let src = "model m {
        param x: f32[4096, 768] = normal(0.0, 1.0)
        param w: f32[768, 768] = normal(0.0, 1.0)
        param u: f32[4096, 768] = normal(0.0, 1.0)
        param v: f32[768, 768] = normal(0.0, 1.0)
        let y = x @ w
        let z = u @ v
        output y, z
    }";
    let g = compile_pipeline(src, &Default::default()).unwrap();
    let opts = CompileOptions {
        target: Target::Cuda,
        ..Default::default()
    };
    let c = artifact::compile(&g, &opts).unwrap();
    let scratch: Vec<bool> = c.launches.iter().map(|l| l.scratch_bytes > 0).collect();
    assert_eq!(scratch, [true, true]);
    assert_eq!(c.deps, [vec![], vec![0u32]]);
    let buffers_only = tcc::analysis::launch_deps::launch_deps(&c.fused.kernels, &c.plan, &[]);
    assert!(
        buffers_only.iter().all(|d| d.is_empty()),
        "{buffers_only:?}"
    );
}
