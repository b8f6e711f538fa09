//! `tcc build`: what `--emit` asks for from the pipeline's product, and the compile line
//! (kernels, arena, time per stage).

use super::{Emit, Layout, SassMode, Target};
use crate::artifact::{self, CompileOptions};
use crate::kernel::fuse::FuseOptions;
use crate::kernel::print::print_kernels;
use crate::pipeline::{Product, Report};
use codespan_reporting::term::termcolor::StandardStream;
use std::io::Write;
use std::time::Instant;
use tcc_runtime::artifact::Sass;

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
    let (graph, kernels, plan, chain) = match p {
        Product::Planned(p) => (&p.graph, p.fused.kernels.len(), &p.plan, None),
        Product::Code(c) => (
            &c.graph,
            c.fused.kernels.len(),
            &c.plan,
            Some(crate::analysis::launch_deps::critical_path(&c.deps)),
        ),
        _ => return None,
    };
    Some(format!(
        "compiled `{}`{}: {kernels} kernels{}, arena {} (lower bound {}); {}",
        graph.name,
        graph
            .micro_batches
            .map(|k| format!(" in {k} micro-batches"))
            .or(graph
                .loss_chunks
                .map(|k| format!(" (loss head in {k} chunks)")))
            .unwrap_or_default(),
        chain
            .map(|c| format!(" (longest dependency chain {c})"))
            .unwrap_or_default(),
        super::run::bytes(plan.arena_bytes),
        super::run::bytes(plan.lower_bound),
        report.timing_line()
    ))
}

/// What `tcc build` writes.
#[derive(Clone, Copy, Debug)]
pub struct Request {
    pub emit: Emit,
    pub target: Target,
    /// Seed of the params' initial values (an artifact's recipes).
    pub seed: u64,
    /// Whether a `cuda` artifact carries SASS.
    pub sass: SassMode,
}

/// The SASS of `c`'s PTX as `mode` asks (`None`: PTX only); errors are printed. With
/// `auto` a missing `ptxas` means PTX only, and any other failure a warning and PTX only;
/// with `on` every failure is an error.
fn sass(
    c: &crate::artifact::Compiled,
    mode: SassMode,
    stderr: &mut StandardStream,
) -> Result<Option<(Sass, Vec<u8>)>, ()> {
    use crate::back::sass::{Ptxas, SassError};
    let mut fail = |e: &dyn std::fmt::Display| {
        if mode == SassMode::On {
            let _ = writeln!(stderr, "error: {e}");
            return Err(());
        }
        let _ = writeln!(
            stderr,
            "warning: {e}\nnote: the artifact carries PTX only (`--sass on` makes this an error)"
        );
        Ok(None)
    };
    if mode == SassMode::Off {
        return Ok(None);
    }
    let found = match Ptxas::find() {
        Ok(p) => p,
        Err(SassError::NotFound) if mode == SassMode::Auto => return Ok(None),
        Err(e) => return fail(&e),
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let t0 = Instant::now();
    let spinner = crate::progress::Spinner::start(
        &format!("assembling SASS with ptxas on {threads} threads"),
        super::quiet(),
    );
    let made = found.assemble(&c.code, threads);
    drop(spinner);
    let (s, bytes) = match made {
        Ok(m) => m,
        Err(e) => return fail(&e),
    };
    // What the reader will check, checked before it is written: an artifact whose SASS
    // its reader refuses would be refused whole.
    let kernels: Vec<&str> = c.fused.kernels.iter().map(|k| k.name.as_str()).collect();
    let code_sum = tcc_runtime::artifact::checksum_hex(c.code.as_bytes());
    if let Err(e) = s.check(bytes.len() as u64, &kernels, &code_sum) {
        return fail(&format!(
            "the SASS `ptxas` made does not fit the artifact: {e}"
        ));
    }
    super::info!(
        "sass: {} for {} ({} pieces; ptxas: {}) in {:.1} s on {} threads",
        super::run::bytes(bytes.len() as u64),
        s.arch,
        s.pieces.len(),
        found.version,
        t0.elapsed().as_secs_f64(),
        threads.min(16)
    );
    Ok(Some((s, bytes)))
}

/// The bytes `out.emit` asks for from the pipeline's product; errors are printed.
pub fn emit_bytes(
    p: &Product,
    out: Request,
    locations: Option<&crate::SourceMap>,
    given: &std::collections::BTreeMap<String, crate::eager::io::TensorBytes>,
    stderr: &mut StandardStream,
) -> Option<Vec<u8>> {
    match (out.emit, p) {
        (Emit::Artifact, Product::Code(c)) => {
            let img = match artifact::persistent_image(c, out.seed, given) {
                Ok(i) => i,
                Err(e) => {
                    let _ = writeln!(stderr, "error: {e}");
                    return None;
                }
            };
            let sass = match out.target {
                Target::Cuda => sass(c, out.sass, stderr).ok()?,
                Target::Cpu => None,
            };
            let t0 = Instant::now();
            let bytes = artifact::write_artifact_with_sass(
                c,
                target(out.target),
                &img,
                sass.as_ref().map(|(s, b)| (s, b.as_slice())),
            );
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
