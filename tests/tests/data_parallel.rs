//! Data parallelism (`--gpus N`) on CPU ranks: a step on N ranks, each on its slice of the
//! batch with the gradients summed across them, equals the step on the whole batch in one
//! session (the same compiled kernels per rank; NCCL on GPUs is checked in `gpu.rs`).

use tcc_runtime::Device;
use tcc_tests::{data_parallel_vs_whole, DATA_PARALLEL_MLP};

/// What `data_parallel_vs_whole` compiles CPU ranks with.
fn cpu_options() -> tcc::artifact::CompileOptions {
    tcc_tests::device_options(Device::Cpu, true)
}

/// Asserts that `src` on 2 CPU ranks (`b` examples each) equals one session on the whole
/// batch after `steps` steps, both compiled with `options`: params and optimizer state to
/// 1e-5 relative error, the loss likewise.
fn assert_two_ranks_equal_the_whole_batch(
    src: &str,
    b: usize,
    steps: usize,
    options: tcc::artifact::CompileOptions,
) {
    let (err, loss, mean) =
        tcc_tests::data_parallel_vs_whole_with(src, b, steps, &[Device::Cpu; 2], options)
            .unwrap_or_else(|e| panic!("{e}"));
    assert!(err < 1e-5, "params differ by {err:e}");
    assert!(
        (loss - mean).abs() < 1e-5 * loss.abs().max(1.0),
        "loss {loss} vs {mean}"
    );
}

#[test]
fn two_and_four_cpu_ranks_equal_one_session_on_the_whole_batch() {
    for ranks in [2usize, 4] {
        let devices = vec![Device::Cpu; ranks];
        let (err, loss, mean) =
            data_parallel_vs_whole(DATA_PARALLEL_MLP, 4, 10, &devices, Default::default())
                .unwrap_or_else(|e| panic!("{ranks} ranks: {e}"));
        eprintln!("{ranks} ranks: params rel err {err:e}, loss {loss} (whole) vs {mean} (ranks)");
        // 10 Adam steps: f32 rounding only (sums in another order).
        assert!(err < 1e-5, "{ranks} ranks: params differ by {err:e}");
        assert!(
            (loss - mean).abs() < 1e-5 * loss.abs().max(1.0),
            "{ranks} ranks: loss {loss} vs {mean}"
        );
    }
}

#[test]
fn a_data_parallel_step_alone_or_on_the_wrong_count_is_an_error() {
    let src = DATA_PARALLEL_MLP.replace("{B}", "4");
    let compile = tcc::artifact::CompileOptions {
        ranks: 2,
        ..Default::default()
    };
    let (g, c, model) =
        tcc_tests::compile_step(&src, &Default::default(), &compile).expect("compiles");
    assert_eq!(g.ranks, Some(2));
    assert_eq!(
        c.fused
            .kernels
            .iter()
            .filter(|k| k.collective.is_some())
            .count(),
        4
    );
    assert_eq!(model.manifest().ranks, Some(2));
    // Every gradient is reduced in place: the ranks skip the copy kernels.
    assert!(model
        .manifest()
        .kernels
        .iter()
        .filter_map(|k| k.collective.as_ref())
        .all(|c| c.in_place));
    let alone = tcc_runtime::Session::new(&model, Device::Cpu).unwrap_err();
    assert!(
        matches!(alone, tcc_runtime::Error::Ranks { built: 2, given: 1 }),
        "{alone}"
    );
    let three = tcc_runtime::DataParallel::new(&model, &[Device::Cpu; 3]).unwrap_err();
    assert!(
        three
            .to_string()
            .contains("built for 2 data-parallel rank(s) and is run with 3"),
        "{three}"
    );
}

#[test]
fn gpus_needs_a_training_step() {
    let src = "model m {\n input x: f32[4]\n output y = relu(x)\n}\n";
    let (_s, mut lowered) =
        tcc_tests::compile_bytes("case.tdsl", src.as_bytes(), &Default::default())
            .expect("compiles");
    let g = lowered.graphs.remove(0);
    let popts = tcc::pipeline::Options {
        compile: tcc::artifact::CompileOptions {
            ranks: 2,
            ..Default::default()
        },
        ..Default::default()
    };
    let e = tcc::pipeline::lowered(g, Default::default(), "schedule", &popts, &mut |_, _| {})
        .expect_err("an error");
    assert!(e.to_string().contains("needs a training step"), "{e}");
}

/// Two weights added before use get one gradient node: its sum across the ranks is taken
/// once.
#[test]
fn params_that_share_a_gradient_are_reduced_once() {
    let src = "
model dp {
    input  x: f32[{B}, 6]
    input  labels: i32[{B}]
    param  w1: f32[6, 3] = normal(0.0, 0.3)
    param  w2: f32[6, 3] = normal(0.0, 0.3)
    let loss = cross_entropy(x @ (w1 + w2), labels)
    output loss
    train sgd(lr: 0.1, momentum: 0.9) minimize loss
}
";
    assert_two_ranks_equal_the_whole_batch(src, 3, 5, cpu_options());
}

/// `tcc fit --gpus 2` (and `--zero 1`): the largest per-GPU batch whose 2-rank arena fits
/// the budget (the arena of the next one does not); with Adam's state sharded, a batch at
/// least as large fits the same budget.
#[test]
fn fit_with_gpus_answers_per_gpu_with_the_data_parallel_arena() {
    let mlp = std::fs::read_to_string(tcc_tests::root().join("examples/mlp.tdsl")).expect("reads");
    let src = mlp.replace("train sgd(lr: 0.05)", "train adam(lr: 0.001)");
    assert_ne!(src, mlp, "examples/mlp.tdsl changed its optimizer line");
    let dir = std::env::temp_dir().join(format!("tcc-fit-dp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("mlp_adam.tdsl");
    std::fs::write(&file, &src).expect("writes");
    let arena = |b: usize, zero: bool| -> u64 {
        let front = tcc::front::Options {
            sets: vec![("D".into(), "64".into()), ("B".into(), b.to_string())],
            ..Default::default()
        };
        let compile = tcc::artifact::CompileOptions {
            ranks: 2,
            zero,
            ..Default::default()
        };
        let (_, c, _) = tcc_tests::compile_step(&src, &front, &compile).expect("compiles");
        c.plan.arena_bytes
    };
    let budget = arena(40, false);
    let sets = vec![("D".to_string(), "64".to_string())];
    let mut fits = Vec::new();
    for zero in [false, true] {
        let b = tcc::cli::fit::run(
            &file,
            &sets,
            &None,
            budget,
            "B",
            4096,
            tcc::cli::remat_cmd::RematMode::None,
            200,
            Default::default(),
            tcc::cli::Parallel {
                ranks: 2,
                zero,
                ..Default::default()
            },
        )
        .expect("fits");
        assert!(b >= 40, "{b}");
        assert!(
            arena(b as usize, zero) <= budget && arena(b as usize + 1, zero) > budget,
            "zero {zero}: {b}"
        );
        fits.push(b);
    }
    assert!(
        fits[1] > fits[0],
        "ZeRO-1 fits {} against {}",
        fits[1],
        fits[0]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A gradient that one param takes whole and that flows on into others (`w1 + a @ b`, as
/// LoRA): its sum across the ranks must not reach the backward pass of `a @ b`, whatever
/// the order the schedule gives them.
#[test]
fn a_reduced_gradient_that_other_params_read_stays_local_for_them() {
    let src = "
model dp {
    input  x: f32[{B}, 6]
    input  labels: i32[{B}]
    param  w1: f32[6, 4] = normal(0.0, 0.3)
    param  a: f32[6, 2] = normal(0.0, 0.3)
    param  b: f32[2, 4] = normal(0.0, 0.3)
    let loss = cross_entropy(x @ (w1 + a @ b), labels)
    output loss
    train adam(lr: 0.01) minimize loss
}
";
    for ranks in [2usize, 3] {
        let (err, loss, mean) =
            data_parallel_vs_whole(src, 3, 5, &vec![Device::Cpu; ranks], Default::default())
                .unwrap_or_else(|e| panic!("{e}"));
        assert!(err < 1e-5, "{ranks} ranks: params differ by {err:e}");
        assert!(
            (loss - mean).abs() < 1e-5 * loss.abs().max(1.0),
            "loss {loss} vs {mean}"
        );
    }
}

/// ZeRO-1 (`--zero 1`): each rank updates a shard of every param and keeps only that
/// shard's Adam state, so the step equals plain data parallelism: params on every rank,
/// the sharded state put back together, and the losses of 10 Adam steps, to f32 rounding.
/// Three ranks pad params whose sizes do not split (`b2: f32[5]`, `w2: f32[32, 5]`).
#[test]
fn zero_one_equals_plain_data_parallelism_over_ten_adam_steps() {
    for ranks in [2usize, 3] {
        let (params, state, loss) = tcc_tests::zero_vs_plain(
            DATA_PARALLEL_MLP,
            4,
            10,
            &vec![Device::Cpu; ranks],
            Default::default(),
        )
        .unwrap_or_else(|e| panic!("{ranks} ranks: {e}"));
        eprintln!("{ranks} ranks: params {params:e}, state {state:e}, loss {loss:e}");
        assert!(params < 1e-6, "{ranks} ranks: params differ by {params:e}");
        assert!(
            state < 1e-6,
            "{ranks} ranks: optimizer state differs by {state:e}"
        );
        assert!(loss < 1e-6, "{ranks} ranks: losses differ by {loss:e}");
    }
}

/// ZeRO-1 with SGD momentum, weight decay and a gradient shared by two params, and with
/// f16 loss scaling (the ranks must agree on skipping a step: the overflow test sums the
/// shards' magnitudes over the ranks).
#[test]
fn zero_one_with_momentum_shared_gradients_and_f16_loss_scaling() {
    let src = "
model dp {
    input  x: f32[{B}, 6]
    input  labels: i32[{B}]
    param  w1: f32[6, 4] = normal(0.0, 0.3)
    param  w2: f32[6, 4] = normal(0.0, 0.3)
    param  c: f32[3] = normal(0.0, 0.3)
    let loss = cross_entropy(x @ (w1 + w2), labels) + sum(c * c)
    output loss
    train sgd(lr: 0.05, momentum: 0.9, weight_decay: 0.01) minimize loss
}
";
    let f16 = tcc::passes::amp::Amp {
        dtype: Some(tcc::ir::DType::F16),
        ..Default::default()
    };
    for (ranks, amp) in [
        (2usize, Default::default()),
        (4, Default::default()),
        (2, f16),
    ] {
        let (params, state, loss) =
            tcc_tests::zero_vs_plain(src, 3, 6, &vec![Device::Cpu; ranks], amp)
                .unwrap_or_else(|e| panic!("{ranks} ranks: {e}"));
        assert_eq!(params, 0.0, "{ranks} ranks: params differ by {params:e}");
        assert_eq!(state, 0.0, "{ranks} ranks: momentum differs by {state:e}");
        assert_eq!(loss, 0.0, "{ranks} ranks: losses differ by {loss:e}");
    }
}

/// What `--zero 1` builds: a reduce-scatter per gradient, a shard and an all-gather per
/// param, state of one shard, and a manifest the runtime checks; `tcc mem` prints the
/// formula next to the plan's persistent bytes.
#[test]
fn zero_one_shards_the_state_and_reports_the_formula() {
    let src = DATA_PARALLEL_MLP.replace("{B}", "4");
    let compile = tcc::artifact::CompileOptions {
        ranks: 2,
        zero: true,
        ..Default::default()
    };
    let (g, c, model) =
        tcc_tests::compile_step(&src, &Default::default(), &compile).expect("compiles");
    let count = |f: fn(&tcc::ir::Op) -> bool| g.node_ids().filter(|&n| f(&g.node(n).op)).count();
    assert_eq!(count(|o| matches!(o, tcc::ir::Op::ReduceScatter { .. })), 4);
    assert_eq!(count(|o| matches!(o, tcc::ir::Op::Shard { .. })), 4);
    assert_eq!(count(|o| matches!(o, tcc::ir::Op::AllGather { .. })), 4);
    // w1 [24, 32]: its moments are [384] on each of 2 ranks.
    let m = g
        .states
        .iter()
        .find(
            |&&s| matches!(&g.node(s).op, tcc::ir::Op::State { name, .. } if name == "w1.exp_avg"),
        )
        .expect("w1.exp_avg");
    assert_eq!(g.ty(*m).dims(), &[384]);
    use tcc_runtime::artifact::CollectiveOp;
    let ops: Vec<CollectiveOp> = model
        .manifest()
        .kernels
        .iter()
        .filter_map(|k| k.collective.as_ref().map(|c| c.op))
        .collect();
    for op in [
        CollectiveOp::ReduceScatterSum,
        CollectiveOp::Shard,
        CollectiveOp::AllGather,
    ] {
        assert_eq!(ops.iter().filter(|&&o| o == op).count(), 4, "{op:?}");
    }
    // (The finite check's sums over the 4 gathered params take a few kernels of their own.)
    assert!(
        c.fused.kernels.len() < 46,
        "{} kernels",
        c.fused.kernels.len()
    );
    let states = tcc::cli::mem::model_states(&g, c.plan.persistent_bytes).expect("ranks");
    // params 24·32 + 32 + 32·5 + 5 = 965 floats, Adam: 2 moments, whole 2·965 floats.
    assert!(states.zero);
    assert_eq!(states.param_bytes, 965 * 4);
    assert_eq!(states.gradient_bytes, 965 * 4);
    assert_eq!(states.state_bytes, 2 * 965 * 4 + 4);
    assert_eq!(states.formula_bytes, 965 * 4 * 2 + (2 * 965 * 4 + 4) / 2);
    // Planned: params + one shard of each moment + the step counter, each buffer aligned
    // (4 params, 8 moment shards, 1 counter).
    let share = states.param_bytes + states.state_bytes / 2;
    let align = tcc::plan::align_up(1);
    let planned = states.planned_persistent_bytes;
    assert!(
        planned >= share && planned <= share + 13 * align,
        "persistent {planned} vs {share}"
    );
}

#[test]
fn zero_without_gpus_is_an_error() {
    let mut err = Vec::new();
    assert!(!tcc::cli::zero_with_gpus(1, None, &mut err));
    let err = String::from_utf8(err).expect("utf-8");
    assert!(
        err.contains("`--zero 1`") && err.contains("`--gpus N`"),
        "{err}"
    );
    assert!(tcc::cli::zero_with_gpus(1, Some(2), &mut Vec::new()));
    assert!(tcc::cli::zero_with_gpus(0, None, &mut Vec::new()));
    // Every command that takes `--zero` checks it: compiler/tests/cli.rs
    // (`zero_needs_gpus_on_every_command`), where its message is captured.
}

/// Under ZeRO-1 with f16 loss scaling each rank tests only its gradient shards for
/// overflow, so the sum of their magnitudes is all-reduced before the test: one scalar
/// `all_reduce`, read by the finiteness comparison (without it a rank whose shard overflowed
/// would skip a step the others take; the equality tests above need an overflow in one
/// shard to see that).
#[test]
fn zero_one_with_f16_sums_the_overflow_test_over_the_ranks() {
    let src = DATA_PARALLEL_MLP.replace("{B}", "4");
    let compile = tcc::artifact::CompileOptions {
        ranks: 2,
        zero: true,
        amp: tcc::passes::amp::Amp::named("f16").expect("f16"),
        ..Default::default()
    };
    let (g, _, _) = tcc_tests::compile_step(&src, &Default::default(), &compile).expect("compiles");
    let reduced: Vec<_> = g
        .node_ids()
        .filter(|&n| matches!(g.node(n).op, tcc::ir::Op::AllReduce))
        .collect();
    assert_eq!(reduced.len(), 1, "one all_reduce: the overflow test's sum");
    let r = reduced[0];
    assert_eq!(g.ty(r).rank(), 0, "a scalar");
    assert!(
        g.users(r)
            .iter()
            .any(|&u| matches!(g.node(u).op, tcc::ir::Op::Binary(tcc::ir::BinaryOp::Lt))),
        "read by the finiteness test"
    );
}

/// ZeRO-1 checkpoints (`--save-params`, `--param-file` with `--zero 1`): saving puts each
/// state back together from the ranks' shards, so the file is byte for byte the one the
/// same step saves without ZeRO-1 (2 ranks, and 3 ranks whose shards are padded); loaded
/// into either step, training goes on alike: a plain checkpoint into ZeRO-1, and a ZeRO-1
/// checkpoint into a plain step, both end 3 steps later where the plain run does.
#[test]
fn zero_one_checkpoints_are_whole_and_load_into_either_step() {
    use tcc_runtime::DataParallel;
    let text = DATA_PARALLEL_MLP.replace("{B}", "4");
    for ranks in [2usize, 3] {
        let build = |zero| {
            let compile = tcc::artifact::CompileOptions {
                ranks,
                zero,
                ..tcc_tests::device_options(Device::Cpu, true)
            };
            tcc_tests::compile_step(&text, &Default::default(), &compile).unwrap()
        };
        let (g, _, plain) = build(false);
        let (_, _, zero) = build(true);
        let shards = zero
            .persistent()
            .iter()
            .filter(|p| p.shard_of.is_some())
            .count();
        assert!(shards > 0, "{ranks} ranks: no sharded state");
        let devices = vec![Device::Cpu; ranks];
        let steps = |d: &mut DataParallel, from: usize, n: usize| {
            for step in from..from + n {
                for r in 0..ranks {
                    for (name, t) in &tcc::eager::random_inputs(&g, (step * ranks + r) as u64) {
                        let s = d.session_mut(r).unwrap();
                        s.set_input_bytes(name, &t.to_le_bytes()).unwrap();
                    }
                }
                d.run().unwrap();
            }
        };
        let (mut dp, mut dz) = (
            DataParallel::new(&plain, &devices).unwrap(),
            DataParallel::new(&zero, &devices).unwrap(),
        );
        steps(&mut dp, 0, 3);
        steps(&mut dz, 0, 3);
        let (p3, z3) = (
            dp.save_params_bytes().unwrap(),
            dz.save_params_bytes().unwrap(),
        );
        assert!(
            p3 == z3,
            "{ranks} ranks: the ZeRO-1 checkpoint differs from the plain one"
        );
        let mut into_zero = DataParallel::new(&zero, &devices).unwrap();
        let loaded = into_zero.load_params_bytes(&p3).unwrap();
        assert!(loaded.missing.is_empty(), "{:?}", loaded.missing);
        let mut into_plain = DataParallel::new(&plain, &devices).unwrap();
        into_plain.load_params_bytes(&z3).unwrap();
        steps(&mut dp, 3, 3);
        steps(&mut into_zero, 3, 3);
        steps(&mut into_plain, 3, 3);
        let want = dp.save_params_bytes().unwrap();
        assert!(
            into_zero.save_params_bytes().unwrap() == want,
            "{ranks} ranks: ZeRO-1 from a plain checkpoint went elsewhere"
        );
        assert!(
            into_plain.save_params_bytes().unwrap() == want,
            "{ranks} ranks: a plain step from a ZeRO-1 checkpoint went elsewhere"
        );
        eprintln!("{ranks} ranks: {shards} sharded states; checkpoints identical");
    }
}

/// A stacked param (`w: f32[L, ..]` read as `w[l]` in a loop) has one gradient per layer,
/// ready one after another through the backward pass: each layer's is summed over the ranks
/// on its own, in place, as soon as it is ready (not the whole stack after the first
/// layer's, at the end of the backward pass), and the step still equals the whole batch's.
#[test]
fn a_stacked_params_layers_are_summed_as_each_is_ready() {
    let src = "
model stacked {
    input  x: f32[{B}, 512]
    input  labels: i32[{B}]
    param  w: f32[3, 512, 512] = normal(0.0, 0.03)
    param  head: f32[512, 5] = normal(0.0, 0.05)
    let h = x
    for l in 0..3 {
        h = h + gelu(h @ w[l])
    }
    let loss = cross_entropy(h @ head, labels)
    output loss
    train adam(lr: 0.001) minimize loss
}
";
    let compile = tcc::artifact::CompileOptions {
        ranks: 2,
        ..Default::default()
    };
    let (_, c, model) =
        tcc_tests::compile_step(&src.replace("{B}", "2"), &Default::default(), &compile)
            .expect("compiles");
    let kernels = &c.fused.kernels;
    let sums: Vec<usize> = (0..kernels.len())
        .filter(|&i| kernels[i].collective.is_some())
        .collect();
    // One sum per layer of `w` (1 MiB each) and one for `head`, all in place.
    assert_eq!(sums.len(), 4, "{:?}", sums);
    let manifest = model.manifest();
    let collectives: Vec<_> = manifest
        .kernels
        .iter()
        .filter_map(|k| k.collective.as_ref())
        .collect();
    assert!(collectives.iter().all(|c| c.in_place));
    assert_eq!(
        collectives
            .iter()
            .filter(|c| c.bytes == 512 * 512 * 4)
            .count(),
        3
    );
    // The first layer's gradient is the backward pass's last product: the other two
    // layers' sums are launched before it.
    let last_product = (0..kernels.len())
        .rev()
        .find(|&i| kernels[i].matmul.is_some() && kernels[i].collective.is_none())
        .expect("a product");
    let layer = |i: usize| {
        kernels[i]
            .collective
            .is_some_and(|x| c.graph.ty(x).size_bytes() == 512 * 512 * 4)
    };
    let early = sums
        .iter()
        .filter(|&&i| i < last_product && layer(i))
        .count();
    assert_eq!(early, 2, "sums at {sums:?}, last product at {last_product}");
    assert_two_ranks_equal_the_whole_batch(src, 2, 5, cpu_options());
}

/// A convolution's weight gradient is stored channels-last on CUDA; its sum over the ranks
/// takes that layout and runs in place (no permuting copy into the param's layout); a stack
/// of convolution weights is summed whole; and on
/// CPU ranks, channels-last too, the step equals the whole batch's.
#[test]
fn convolution_weight_gradients_are_summed_in_place_in_their_layout() {
    let src = "
model convs {
    input  x: f32[{B}, 8, 12, 12]
    input  labels: i32[{B}]
    param  w0: f32[64, 8, 3, 3] = normal(0.0, 0.2)
    param  ws: f32[2, 64, 64, 9, 9] = normal(0.0, 0.01)
    param  head: f32[64, 5] = normal(0.0, 0.1)
    let h = relu(conv2d(x, w0, padding: 1))
    for l in 0..2 {
        h = h + relu(conv2d(h, ws[l], padding: 4))
    }
    let pooled = reshape(avg_pool2d(h, 12), [{B}, 64])
    let loss = cross_entropy(pooled @ head, labels)
    output loss
    train sgd(lr: 0.05, momentum: 0.9) minimize loss
}
";
    let compile = tcc::artifact::CompileOptions {
        ranks: 2,
        ..tcc_tests::device_options(Device::Cuda(0), true)
    };
    let (_, _, model) =
        tcc_tests::compile_step(&src.replace("{B}", "2"), &Default::default(), &compile)
            .expect("compiles");
    let collectives: Vec<_> = model
        .manifest()
        .kernels
        .iter()
        .filter_map(|k| k.collective.as_ref())
        .collect();
    // w0, ws whole (a stack of convolution weights is not split: its gradient kernels store
    // into the stack in the param's layout), head.
    assert_eq!(collectives.len(), 3, "{collectives:?}");
    let w0 = collectives.iter().find(|c| c.bytes == 64 * 8 * 9 * 4);
    assert!(w0.is_some_and(|c| c.in_place), "{collectives:?}");
    assert!(
        collectives.iter().any(|c| c.bytes == 2 * 64 * 64 * 81 * 4),
        "{collectives:?}"
    );
    // Channels-last on the CPU too, as `tcc build` compiles it there.
    let mut cpu = cpu_options();
    cpu.fuse.channels_last = true;
    assert_two_ranks_equal_the_whole_batch(src, 2, 3, cpu);
}

/// `DataParallel::run` fails a step whose in-step checks fail on any rank, after every
/// rank's step: ids the step computes out of range (an index check), and params a NaN
/// gradient made NaN (the finite check, with and without ZeRO-1), which
/// `set_allow_nonfinite` lets through.
#[test]
fn in_step_checks_fail_a_data_parallel_step() {
    use tcc_runtime::{DataParallel, Error};
    let ids = "model m {
        input ids: i32[2]
        input x: f32[2, 2]
        param table: f32[8, 2] = normal(0.0, 1.0)
        let loss = mean(embedding(table, ids + 6) * x)
        output loss
        train sgd(lr: 0.1) minimize loss
    }";
    let compile = tcc::artifact::CompileOptions {
        ranks: 2,
        ..Default::default()
    };
    let (_, _, model) =
        tcc_tests::compile_step(ids, &Default::default(), &compile).expect("compiles");
    let ones: Vec<u8> = [1.0f32; 8].iter().flat_map(|v| v.to_le_bytes()).collect();
    let run = |id: i32| {
        let mut dp = DataParallel::new(&model, &[Device::Cpu; 2]).unwrap();
        // Rank 1 gets `id`; rank 0 stays in range.
        let ids: Vec<u8> = [0i32, 1, 0, id]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        dp.set_input_split("ids", &ids).unwrap();
        dp.set_input_split("x", &ones).unwrap();
        dp.run()
    };
    run(1).unwrap();
    match run(2) {
        Err(Error::IndexOutOfRangeInStep { what, count, bound }) => {
            assert_eq!(
                (what.as_str(), count, bound),
                ("embedding into `table`", 1, 8)
            );
        }
        other => panic!("expected IndexOutOfRangeInStep, got {other:?}"),
    }
    let nan = "model m {
        input x: f32[2, 4]
        param w: f32[4] = zeros
        param v: f32[4, 4] = normal(0.0, 1.0)
        let loss = mean(x @ v) + sum(sqrt(w * w))
        output loss
        train adam(lr: 0.01) minimize loss
    }";
    for zero in [false, true] {
        let compile = tcc::artifact::CompileOptions {
            ranks: 2,
            zero,
            ..Default::default()
        };
        let (_, _, model) =
            tcc_tests::compile_step(nan, &Default::default(), &compile).expect("compiles");
        let mut dp = DataParallel::new(&model, &[Device::Cpu; 2]).unwrap();
        let x: Vec<u8> = [0.5f32; 16].iter().flat_map(|v| v.to_le_bytes()).collect();
        dp.set_input_split("x", &x).unwrap();
        match dp.run() {
            Err(Error::NonFiniteUpdate { what, sum }) => {
                assert_eq!(what, "the params `train` updates");
                assert!(sum.is_nan(), "zero {zero}: {sum}");
            }
            other => panic!("zero {zero}: expected NonFiniteUpdate, got {other:?}"),
        }
        dp.set_allow_nonfinite(true);
        dp.set_input_split("x", &x).unwrap();
        dp.run().unwrap();
        for r in 0..2 {
            let s = dp.session(r).unwrap();
            assert!(s.updated_params_l1().unwrap().unwrap().is_nan());
        }
    }
}
