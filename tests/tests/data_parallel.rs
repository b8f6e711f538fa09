//! Data parallelism (`--gpus N`) on CPU ranks: a step on N ranks, each on its slice of the
//! batch with the gradients summed across them, equals the step on the whole batch in one
//! session (the same compiled kernels per rank; NCCL on GPUs is checked in `gpu.rs`).

use tcc_runtime::Device;
use tcc_tests::{data_parallel_vs_whole, DATA_PARALLEL_MLP};

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
    let (err, loss, mean) =
        data_parallel_vs_whole(src, 3, 5, &[Device::Cpu; 2], Default::default())
            .unwrap_or_else(|e| panic!("{e}"));
    assert!(err < 1e-5, "params differ by {err:e}");
    assert!(
        (loss - mean).abs() < 1e-5 * loss.abs().max(1.0),
        "loss {loss} vs {mean}"
    );
}

/// `tcc fit --gpus 2`: the largest per-GPU batch whose 2-rank arena fits the budget (the
/// arena of the next one does not).
#[test]
fn fit_with_gpus_answers_per_gpu_with_the_data_parallel_arena() {
    let file = tcc_tests::root().join("examples/mlp.tdsl");
    let arena = |b: usize| -> u64 {
        let src = std::fs::read_to_string(&file).expect("reads");
        let front = tcc::front::Options {
            sets: vec![("D".into(), "64".into()), ("B".into(), b.to_string())],
            ..Default::default()
        };
        let compile = tcc::artifact::CompileOptions {
            ranks: 2,
            ..Default::default()
        };
        let (_, c, _) = tcc_tests::compile_step(&src, &front, &compile).expect("compiles");
        c.plan.arena_bytes
    };
    let budget = arena(40);
    let sets = vec![("D".to_string(), "64".to_string())];
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
        2,
    )
    .expect("fits");
    assert!(b >= 40, "{b}");
    assert!(
        arena(b as usize) <= budget && arena(b as usize + 1) > budget,
        "{b}"
    );
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
