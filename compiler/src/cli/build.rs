//! `tcc build`: what `--emit` asks for from the pipeline's product, and the compile line
//! (kernels, arena, time per stage).

use super::{Emit, Layout, Target};
use crate::artifact::{self, CompileOptions};
use crate::kernel::fuse::FuseOptions;
use crate::kernel::print::print_kernels;
use crate::pipeline::{Product, Report};
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
                Layout::Auto => true,
            },
            ..FuseOptions::default()
        },
        ..CompileOptions::default()
    }
}

/// The last stage `--emit` needs: the IR is the program after `remat`, or under `--amp`
/// after `amp`, so that its casts show.
pub fn last_stage(emit: Emit, amp: bool) -> &'static str {
    match emit {
        Emit::Ir if amp => "amp",
        Emit::Ir => "remat",
        Emit::Kernels => "plan",
        Emit::Clif | Emit::Ptx | Emit::Artifact => "codegen",
    }
}

/// Whether `--emit` fits `--target`; prints the error when not.
pub fn check_emit(emit: Emit, t: Target, stderr: &mut StandardStream) -> bool {
    let want = match emit {
        Emit::Clif => Target::Cpu,
        Emit::Ptx => Target::Cuda,
        _ => return true,
    };
    if want != t {
        let _ = writeln!(
            stderr,
            "error: `--emit {}` needs `--target {}`",
            if want == Target::Cpu { "clif" } else { "ptx" },
            if want == Target::Cpu { "cpu" } else { "cuda" }
        );
        return false;
    }
    true
}

/// The line a compile ends with: kernels, arena and every stage's time.
pub fn compile_line(p: &Product, report: &Report) -> Option<String> {
    let (name, kernels, plan, chain) = match p {
        Product::Planned(p) => (&p.graph.name, p.fused.kernels.len(), &p.plan, None),
        Product::Code(c) => (
            &c.graph.name,
            c.fused.kernels.len(),
            &c.plan,
            Some(crate::analysis::launch_deps::critical_path(&c.deps)),
        ),
        _ => return None,
    };
    Some(format!(
        "compiled `{name}`: {kernels} kernels{}, arena {} (lower bound {}); {}",
        chain
            .map(|c| format!(" (longest dependency chain {c})"))
            .unwrap_or_default(),
        super::run::bytes(plan.arena_bytes),
        super::run::bytes(plan.lower_bound),
        report.timing_line()
    ))
}

/// The bytes `emit` asks for from the pipeline's product; errors are printed.
pub fn emit_bytes(
    p: &Product,
    emit: Emit,
    t: Target,
    seed: u64,
    locations: Option<&crate::SourceMap>,
    given: &std::collections::BTreeMap<String, crate::eager::Tensor>,
    stderr: &mut StandardStream,
) -> Option<Vec<u8>> {
    match (emit, p) {
        (Emit::Artifact, Product::Code(c)) => {
            let t0 = Instant::now();
            let img = match artifact::persistent_image(c, seed, given) {
                Ok(i) => i,
                Err(e) => {
                    let _ = writeln!(stderr, "error: {e}");
                    return None;
                }
            };
            let bytes = artifact::write_artifact(c, target(t), &img);
            super::info!(
                "artifact: {} ({:.1} ms)",
                super::run::bytes(bytes.len() as u64),
                t0.elapsed().as_secs_f64() * 1e3
            );
            Some(bytes)
        }
        (Emit::Artifact, other) => {
            let _ = writeln!(
                stderr,
                "error: an artifact needs code; the pipeline stopped at {}",
                other.form()
            );
            None
        }
        (Emit::Kernels, Product::Code(c)) => {
            Some(print_kernels(&c.fused.kernels, Some(&c.offsets)).into_bytes())
        }
        (Emit::Kernels, Product::Planned(p)) => {
            Some(print_kernels(&p.fused.kernels, Some(&p.offsets)).into_bytes())
        }
        _ => Some(p.render(locations).into_bytes()),
    }
}
