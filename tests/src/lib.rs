//! Shared helpers for tcc's test suite: compiling files and cases, reading case headers,
//! and extracting the TDSL programs of LANGUAGE.md.

use std::path::{Path, PathBuf};
use tcc::front::{self, Lowered, ModelSelection, Options, Sources};
use tcc_grammar::diag::render_all;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

/// `../shared/LANGUAGE.md` beside the repository, as CI has it.
pub fn language_md() -> PathBuf {
    root().join("..").join("shared").join("LANGUAGE.md")
}

/// Every ```tdsl block of LANGUAGE.md, in order.
pub fn language_examples() -> Vec<String> {
    let path = language_md();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("LANGUAGE.md must sit at {}: {e}", path.display()));
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    for line in text.lines() {
        match (&mut cur, line.trim_start()) {
            (None, l) if l.starts_with("```tdsl") => cur = Some(String::new()),
            (Some(_), l) if l.starts_with("```") => out.extend(cur.take()),
            (Some(buf), _) => {
                buf.push_str(line);
                buf.push('\n');
            }
            (None, _) => {}
        }
    }
    out
}

/// Header lines of a case file: `// key: value`.
pub fn header(src: &str, key: &str) -> Option<String> {
    let prefix = format!("// {key}:");
    src.lines()
        .take_while(|l| l.starts_with("//") || l.trim().is_empty())
        .find_map(|l| l.strip_prefix(&prefix).map(|v| v.trim().to_string()))
}

/// Command-line-like options from a case's `// args:` header (`--set N=V`, `--model M`).
pub fn options_from_args(args: &str) -> Options {
    let mut opts = Options::default();
    let mut it = args.split_whitespace();
    while let Some(a) = it.next() {
        match a {
            "--set" => {
                if let Some((n, v)) = it.next().and_then(|kv| kv.split_once('=')) {
                    opts.sets.push((n.to_string(), v.to_string()));
                }
            }
            "--model" => opts.models = ModelSelection::One(it.next().map(str::to_string)),
            _ => {}
        }
    }
    opts
}

/// Compiles source bytes; on failure returns the rendered diagnostics.
pub fn compile_bytes(
    name: &str,
    bytes: &[u8],
    opts: &Options,
) -> Result<(Sources, Lowered), String> {
    let mut sources = Sources::new(name, bytes);
    match front::compile(&mut sources, opts) {
        Ok(l) => Ok((sources, l)),
        Err(d) => Err(render_all(&d, &sources.map)),
    }
}

/// Compiles a file of the repository (path relative to the root), naming it by that path.
pub fn compile_repo_file(rel: &str, opts: &Options) -> Result<(Sources, Lowered), String> {
    let bytes = std::fs::read(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
    compile_bytes(rel, &bytes, opts)
}

/// The IR text of every graph, with source locations.
pub fn ir_text(sources: &Sources, lowered: &Lowered) -> String {
    lowered
        .graphs
        .iter()
        .map(|g| tcc::ir::printer::print(g, Some(&sources.map)))
        .collect()
}

/// Sorted `.tdsl` files of a folder under the root.
pub fn tdsl_files(rel_dir: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join(rel_dir))
        .unwrap_or_else(|e| panic!("{rel_dir}: {e}"))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "tdsl"))
        .collect();
    v.sort();
    v
}

/// Compiles a source and runs the pass pipeline (autodiff) on its single model.
pub fn compile_pipeline(src: &str, opts: &Options) -> Result<tcc::ir::Graph, String> {
    let (sources, mut lowered) = compile_bytes("case.tdsl", src.as_bytes(), opts)?;
    let mut g = lowered.graphs.remove(0);
    let popts = tcc::passes::PipelineOptions {
        verify: true,
        ..Default::default()
    };
    tcc::passes::run(&mut g, &popts, |_, _| {}).map_err(|d| render_all(&d, &sources.map))?;
    Ok(g)
}

/// Result of running a compiled (or eager) program for some steps.
#[derive(Clone, Debug)]
pub struct StepResult {
    /// Outputs of the last step, by name.
    pub outputs: std::collections::BTreeMap<String, tcc::eager::Tensor>,
    /// Params and optimizer state after the last step, by name.
    pub persistent: std::collections::BTreeMap<String, tcc::eager::Tensor>,
    /// Arena bytes (compiled runs).
    pub arena_bytes: usize,
}

/// Compiles `g` for the CPU, writes and reloads the artifact, and runs `steps` steps with
/// the same inputs every step. Params start from their initialisers (`seed`).
pub fn cpu_steps(
    g: &tcc::ir::Graph,
    inputs: &std::collections::BTreeMap<String, tcc::eager::Tensor>,
    steps: usize,
    seed: u64,
    fuse: bool,
) -> Result<StepResult, String> {
    use tcc::artifact::{self, CompileOptions, Target};
    let opts = CompileOptions {
        fuse: tcc::kernel::fuse::FuseOptions {
            fuse,
            channels_last: false,
        },
        ..CompileOptions::default()
    };
    let c = artifact::compile(g, &opts).map_err(|e| e.to_string())?;
    let img =
        artifact::persistent_image(&c, seed, &Default::default()).map_err(|e| e.to_string())?;
    let bytes = artifact::write_artifact(&c, Target::Cpu, &img);
    let model = tcc_runtime::Model::from_bytes(bytes).map_err(|e| e.to_string())?;
    let mut s =
        tcc_runtime::Session::new(&model, tcc_runtime::Device::Cpu).map_err(|e| e.to_string())?;
    for _ in 0..steps {
        for (name, t) in inputs {
            s.set_input_bytes(name, &t.to_le_bytes())
                .map_err(|e| e.to_string())?;
        }
        s.run().map_err(|e| e.to_string())?;
    }
    let mut outputs = std::collections::BTreeMap::new();
    for (name, n) in &g.outputs {
        let b = s.output_bytes(name).map_err(|e| e.to_string())?;
        let t = tcc::eager::Tensor::from_le_bytes(g.ty(*n).clone(), b)
            .ok_or_else(|| format!("output `{name}` has the wrong size"))?;
        outputs.insert(name.clone(), t);
    }
    let mut persistent = std::collections::BTreeMap::new();
    for &p in g.params.iter().chain(&g.states) {
        let name = match &g.node(p).op {
            tcc::ir::Op::Param { name, .. } | tcc::ir::Op::State { name, .. } => name.clone(),
            _ => continue,
        };
        let b = s.param_bytes(&name).map_err(|e| e.to_string())?;
        let t = tcc::eager::Tensor::from_le_bytes(g.ty(p).clone(), b)
            .ok_or_else(|| format!("param `{name}` has the wrong size"))?;
        persistent.insert(name, t);
    }
    Ok(StepResult {
        outputs,
        persistent,
        arena_bytes: s.arena_bytes(),
    })
}

/// The same steps with the eager interpreter.
pub fn eager_steps(
    g: &tcc::ir::Graph,
    inputs: &std::collections::BTreeMap<String, tcc::eager::Tensor>,
    steps: usize,
    seed: u64,
) -> Result<StepResult, String> {
    let mut p = tcc::eager::init_persistent(g, seed);
    let mut outs = Vec::new();
    for _ in 0..steps {
        outs = tcc::eager::run_step(g, &mut p, inputs, tcc::eager::Precision::Native)
            .map_err(|e| e.to_string())?;
    }
    Ok(StepResult {
        outputs: outs.into_iter().collect(),
        persistent: p.values,
        arena_bytes: 0,
    })
}

/// `‖a − b‖ / max(‖b‖, tiny)` over all elements (NaNs and infinities compare equal only
/// to themselves; any mismatch there gives infinity).
pub fn rel_err(a: &tcc::eager::Tensor, b: &tcc::eager::Tensor) -> f64 {
    let (x, y) = (a.to_f64(), b.to_f64());
    if x.len() != y.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&p, &q) in x.iter().zip(&y) {
        if !p.is_finite() || !q.is_finite() {
            if p.is_nan() && q.is_nan() || p == q {
                continue;
            }
            return f64::INFINITY;
        }
        num += (p - q) * (p - q);
        den += q * q;
    }
    num.sqrt() / den.sqrt().max(1e-30)
}
