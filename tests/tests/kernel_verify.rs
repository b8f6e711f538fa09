//! The kernel-IR verifiers (`kernel::verify`): they accept what the compiler produces for
//! every example and bench model, and report each kind of corruption of a real program.

use std::time::Duration;
use tcc::artifact::{plan_step, CompileOptions, Planned, Target};
use tcc::kernel::fuse::FuseOptions;
use tcc::kernel::verify::{verify_kernels, verify_planned, KernelError};
use tcc_tests::{compile_pipeline, options_from_args, root};

/// Small sizes of the examples (the verifiers are symbolic, but planning is not free).
fn small(file: &str) -> &'static str {
    match file {
        "gpt" => "--set L=2 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128",
        "cnn" => "--set B=4 --set C=16 --set S=16",
        "mlp" => "--set B=8 --set D=32",
        "add" | "gelu" => "--set N=256 --set M=64",
        "gemm_f32" | "gemm_bf16" => "--set N=128",
        _ => "",
    }
}

fn planned(dir: &str, file: &str, target: Target, fuse: bool) -> Planned {
    let src = std::fs::read_to_string(root().join(format!("{dir}/{file}.tdsl")))
        .unwrap_or_else(|e| panic!("{dir}/{file}: {e}"));
    let g = compile_pipeline(&src, &options_from_args(small(file)))
        .unwrap_or_else(|e| panic!("{file}: {e}"));
    let opts = CompileOptions {
        target,
        fuse: FuseOptions {
            fuse,
            ..Default::default()
        },
        plan_budget: Duration::from_millis(20),
        ..Default::default()
    };
    plan_step(&g, &opts).unwrap_or_else(|e| panic!("{file}: {e}"))
}

fn files(dir: &str) -> Vec<String> {
    tcc_tests::tdsl_files(dir)
        .iter()
        .filter_map(|p| Some(p.file_stem()?.to_str()?.to_string()))
        .collect()
}

#[test]
fn every_example_and_bench_model_verifies() {
    let mut checked = 0;
    for dir in ["examples", "bench"] {
        for file in files(dir) {
            for target in [Target::Cpu, Target::Cuda] {
                for fuse in [true, false] {
                    let p = planned(dir, &file, target, fuse);
                    let what = format!("{dir}/{file} {target:?} fuse={fuse}");
                    assert!(!p.fused.kernels.is_empty(), "{what}: no kernels");
                    if let Err(e) = verify_kernels(&p.graph, &p.fused) {
                        panic!("{what}: {}", lines(&e));
                    }
                    if let Err(e) = verify_planned(&p.graph, &p.fused, &p.plan) {
                        panic!("{what}: {}", lines(&e));
                    }
                    checked += 1;
                }
            }
        }
    }
    // 4 examples and 6 bench models, 4 ways each.
    assert!(checked >= 40, "{checked}");
}

fn lines(e: &[KernelError]) -> String {
    e.iter()
        .map(|x| format!("\n  {x}"))
        .collect::<Vec<_>>()
        .join("")
}
