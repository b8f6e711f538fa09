//! `tcc build --emit kernels|clif|artifact`: fusion, plan and code generation with a
//! timing line per stage.

use super::{Emit, Layout, Target};
use crate::artifact::{self, CompileOptions};
use crate::ir::Graph;
use crate::kernel::fuse::FuseOptions;
use crate::kernel::print::print_kernels;
use codespan_reporting::term::termcolor::StandardStream;
use std::io::Write;
use std::time::Instant;

/// The target of the CLI as the compiler names it.
pub fn target(t: Target) -> artifact::Target {
    match t {
        Target::Cpu => artifact::Target::Cpu,
        Target::Cuda => artifact::Target::Cuda,
    }
}

/// Compile options of the CLI flags.
pub fn compile_options(t: Target, no_fuse: bool, layout: Layout) -> CompileOptions {
    CompileOptions {
        target: target(t),
        fuse: FuseOptions {
            fuse: !no_fuse,
            channels_last: match layout {
                Layout::Nhwc => true,
                Layout::Nchw => false,
                Layout::Auto => t == Target::Cuda,
            },
            ..FuseOptions::default()
        },
        ..CompileOptions::default()
    }
}

/// Compiles `g` and returns the bytes `emit` asks for; errors are printed.
#[allow(clippy::too_many_arguments)]
pub fn build(
    g: &Graph,
    emit: Emit,
    t: Target,
    no_fuse: bool,
    layout: Layout,
    allow_tf32: bool,
    seed: u64,
    front_ms: f64,
    stderr: &mut StandardStream,
) -> Option<Vec<u8>> {
    let opts = CompileOptions {
        allow_tf32,
        ..compile_options(t, no_fuse, layout)
    };
    let target_of_emit = match emit {
        Emit::Clif => Some(Target::Cpu),
        Emit::Ptx => Some(Target::Cuda),
        _ => None,
    };
    if let Some(want) = target_of_emit.filter(|&w| w != t) {
        let _ = writeln!(
            stderr,
            "error: `--emit {}` needs `--target {}`",
            if want == Target::Cpu { "clif" } else { "ptx" },
            if want == Target::Cpu { "cpu" } else { "cuda" }
        );
        return None;
    }
    let c = match artifact::compile(g, &opts) {
        Ok(c) => c,
        Err(e) => {
            let _ = writeln!(stderr, "error: {e}");
            return None;
        }
    };
    let stages: Vec<String> = c
        .timings
        .iter()
        .map(|(s, d)| format!("{s} {:.1} ms", d.as_secs_f64() * 1e3))
        .collect();
    let _ = writeln!(
        stderr,
        "compiled `{}`: {} kernels (longest dependency chain {}), arena {} (lower bound {}); front end + passes {front_ms:.1} ms, {}",
        g.name,
        c.fused.kernels.len(),
        crate::analysis::launch_deps::critical_path(&c.deps),
        super::run::bytes(c.plan.arena_bytes),
        super::run::bytes(c.plan.lower_bound),
        stages.join(", ")
    );
    match emit {
        Emit::Kernels => {
            Some(print_kernels(&c.fused.kernels, Some(&|n| c.offset_of(n))).into_bytes())
        }
        Emit::Clif | Emit::Ptx => Some(c.code.into_bytes()),
        Emit::Artifact => {
            let t0 = Instant::now();
            let img = match artifact::persistent_image(&c, seed, &Default::default()) {
                Ok(i) => i,
                Err(e) => {
                    let _ = writeln!(stderr, "error: {e}");
                    return None;
                }
            };
            let bytes = artifact::write_artifact(&c, target(t), &img);
            let _ = writeln!(
                stderr,
                "artifact: {} ({:.1} ms)",
                super::run::bytes(bytes.len() as u64),
                t0.elapsed().as_secs_f64() * 1e3
            );
            Some(bytes)
        }
        Emit::Ir => None,
    }
}
