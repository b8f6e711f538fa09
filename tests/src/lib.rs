//! Shared helpers for tcc's test suite: compiling files and cases, reading case headers,
//! and extracting the TDSL programs of LANGUAGE.md.

pub mod amp;

use std::path::{Path, PathBuf};
use tcc::front::{self, Lowered, ModelSelection, Options, Sources};
use tcc_grammar::diag::render_all;

/// Says, past the test harness's output capture, that a test did not do its work (libtest
/// captures `eprintln!`, so a skipped test would read as a plain `ok`).
pub fn skipped(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

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

/// The scheduled training step of a repository file (as `tcc remat` and `tcc build` make
/// it), with `sets` overriding its constants (`("B", "8")`).
pub fn scheduled_step(file: &str, sets: &[(&str, &str)]) -> tcc::ir::Graph {
    let p = root().join(file);
    let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{file}: {e}"));
    let sets: Vec<(String, String)> = sets
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    tcc::cli::remat_cmd::step_graph(
        &p,
        &bytes,
        &sets,
        &None,
        true,
        Default::default(),
        Default::default(),
    )
    .unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// Compiles a source and runs the pipeline from `lower` to `schedule` (the program stages
/// before `remat`) on its single model, verifying after every stage.
pub fn compile_pipeline(src: &str, opts: &Options) -> Result<tcc::ir::Graph, String> {
    compile_to(src, opts, "schedule")
}

/// Compiles a source and runs the pipeline from `lower` to `last` (a graph stage) on its
/// single model, verifying after every stage.
pub fn compile_to(src: &str, opts: &Options, last: &str) -> Result<tcc::ir::Graph, String> {
    let (sources, mut lowered) = compile_bytes("case.tdsl", src.as_bytes(), opts)?;
    let g = lowered.graphs.remove(0);
    let popts = tcc::pipeline::Options {
        verify: true,
        ..Default::default()
    };
    match tcc::pipeline::lowered(g, Default::default(), last, &popts, &mut |_, _| {}) {
        Ok((tcc::pipeline::Product::Graph(g), _)) => Ok(g),
        Ok((p, _)) => Err(format!("stage `{last}` gave {}, not a graph", p.form())),
        Err(e) => Err(render_all(&e.diagnostics(), &sources.map)),
    }
}

/// Runs the pipeline's stages `first..=last` on a graph, verifying after each.
pub fn run_stages(
    g: &tcc::ir::Graph,
    first: &str,
    last: &str,
    compile: tcc::artifact::CompileOptions,
) -> Result<tcc::pipeline::Product, String> {
    let popts = tcc::pipeline::Options {
        compile,
        verify: true,
        ..Default::default()
    };
    tcc::pipeline::run(
        tcc::pipeline::Product::Graph(g.clone()),
        first,
        last,
        &popts,
        &mut |_, _| {},
    )
    .map(|(p, _)| p)
    .map_err(|e| e.to_string())
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
    device_steps(g, inputs, steps, seed, fuse, tcc_runtime::Device::Cpu)
}

/// Like [`cpu_steps`] on any device (`Device::Cuda(i)` compiles PTX).
pub fn device_steps(
    g: &tcc::ir::Graph,
    inputs: &std::collections::BTreeMap<String, tcc::eager::Tensor>,
    steps: usize,
    seed: u64,
    fuse: bool,
    device: tcc_runtime::Device,
) -> Result<StepResult, String> {
    device_steps_with(g, inputs, steps, seed, fuse, device, false)
}

/// [`device_steps`], where f32 matmuls may use TF32 tensor cores when `allow_tf32`.
pub fn device_steps_with(
    g: &tcc::ir::Graph,
    inputs: &std::collections::BTreeMap<String, tcc::eager::Tensor>,
    steps: usize,
    seed: u64,
    fuse: bool,
    device: tcc_runtime::Device,
    allow_tf32: bool,
) -> Result<StepResult, String> {
    let opts = tcc::artifact::CompileOptions {
        allow_tf32,
        ..device_options(device, fuse)
    };
    steps_compiled(g, inputs, steps, seed, device, &opts)
}

/// The compile options [`device_steps`] uses for `device`.
pub fn device_options(device: tcc_runtime::Device, fuse: bool) -> tcc::artifact::CompileOptions {
    use tcc::artifact::{CompileOptions, Target};
    let target = match device {
        tcc_runtime::Device::Cpu => Target::Cpu,
        tcc_runtime::Device::Cuda(_) => Target::Cuda,
    };
    CompileOptions {
        target,
        fuse: tcc::kernel::fuse::FuseOptions {
            fuse,
            channels_last: target == Target::Cuda,
            ..Default::default()
        },
        ..CompileOptions::default()
    }
}

/// Compiles `g` with `opts` (stages `outputs` to `codegen`; `opts.target` must be
/// `device`'s), writes and reloads the artifact and runs `steps` steps as [`cpu_steps`].
pub fn steps_compiled(
    g: &tcc::ir::Graph,
    inputs: &std::collections::BTreeMap<String, tcc::eager::Tensor>,
    steps: usize,
    seed: u64,
    device: tcc_runtime::Device,
    opts: &tcc::artifact::CompileOptions,
) -> Result<StepResult, String> {
    use tcc::artifact;
    let target = opts.target;
    let c = artifact::compile(g, opts).map_err(|e| e.to_string())?;
    let img =
        artifact::persistent_image(&c, seed, &Default::default()).map_err(|e| e.to_string())?;
    let bytes = artifact::write_artifact(&c, target, &img);
    let model = tcc_runtime::Model::from_bytes(bytes).map_err(|e| e.to_string())?;
    model_steps(&model, g, inputs, steps, device).map(|(r, _)| r)
}

/// Runs `steps` steps of `model` (compiled from `g`) on `device` with `inputs`: the outputs
/// and persistent tensors after them, and where the session's code came from.
pub fn model_steps(
    model: &tcc_runtime::Model,
    g: &tcc::ir::Graph,
    inputs: &std::collections::BTreeMap<String, tcc::eager::Tensor>,
    steps: usize,
    device: tcc_runtime::Device,
) -> Result<(StepResult, tcc_runtime::CodeOrigin), String> {
    let mut s = tcc_runtime::Session::new(model, device).map_err(|e| e.to_string())?;
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
    for (_, name, ty) in g.persistent_tensors() {
        let b = s.param_bytes(&name).map_err(|e| e.to_string())?;
        let t = tcc::eager::Tensor::from_le_bytes(ty, b)
            .ok_or_else(|| format!("param `{name}` has the wrong size"))?;
        persistent.insert(name, t);
    }
    let result = StepResult {
        outputs,
        persistent,
        arena_bytes: s.arena_bytes(),
    };
    Ok((result, s.code_origin()))
}

/// `ptxas` matching the GPU machine's CUDA (13.0): `$TCC_PTXAS`, then the PyPI package
/// `nvidia-cuda-nvcc==13.0.88` of `python3`, then where `tcc build` looks
/// ([`tcc::back::sass::Ptxas::locate`]: `PATH`, `$CUDA_HOME/bin`, `/usr/local/cuda/bin`).
pub fn ptxas() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("TCC_PTXAS") {
        return Some(PathBuf::from(p));
    }
    let pip = std::process::Command::new("python3")
        .args([
            "-c",
            "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cu13', 'bin', 'ptxas'))",
        ])
        .output();
    if let Ok(out) = pip {
        let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && p.is_file() {
            return Some(p);
        }
    }
    tcc::back::sass::Ptxas::locate().ok()
}

/// The artifact of `c` (params drawn under seed 7) with the SASS `ptxas` makes of its PTX
/// on `threads` threads.
pub fn artifact_with_sass(
    c: &tcc::artifact::Compiled,
    ptxas: &Path,
    threads: usize,
) -> Result<Vec<u8>, String> {
    use tcc::artifact;
    let img = artifact::persistent_image(c, 7, &Default::default()).map_err(|e| e.to_string())?;
    let p = tcc::back::sass::Ptxas::at(ptxas).map_err(|e| e.to_string())?;
    let (sass, section) = p.assemble(&c.code, threads).map_err(|e| e.to_string())?;
    Ok(artifact::write_artifact_with_sass(
        c,
        artifact::Target::Cuda,
        &img,
        Some((&sass, &section)),
    ))
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

/// Inputs every builtin case may use.
pub const BUILTIN_DECLS: &str = "
    input a: f32[3, 4]
    input b: f32[4]
    input c: f32[3, 1]
    input v: f32[2, 3, 4]
    input m: f32[4, 5]
    input img: f32[2, 4, 6, 6]
    input k: f32[6, 2, 3, 3]
    input table: f32[7, 3]
    input ids: i32[2, 5]
    input labels: i32[3]
    input g4: f32[4]
    input q: f32[2, 5, 4]
    input kv: f32[2, 6, 4]
";

/// One builtin case: an expression over [`BUILTIN_DECLS`] and the inputs to differentiate.
pub type BuiltinCase = (&'static str, &'static [&'static str]);

/// Every builtin and primitive, grouped by kind.
pub const BUILTIN_CASES: &[(&str, &[BuiltinCase])] = &[
    (
        "unary",
        &[
            ("neg(a)", &["a"]),
            ("abs(a)", &["a"]),
            ("exp(a)", &["a"]),
            ("tanh(a)", &["a"]),
            ("sigmoid(a)", &["a"]),
            ("relu(a)", &["a"]),
            ("gelu(a)", &["a"]),
            ("silu(a)", &["a"]),
            ("sin(a)", &["a"]),
            ("cos(a)", &["a"]),
            ("erf(a)", &["a"]),
            ("log(abs(a) + 0.5)", &["a"]),
            ("sqrt(abs(a) + 0.5)", &["a"]),
            ("rsqrt(abs(a) + 0.5)", &["a"]),
            ("recip(abs(a) + 0.5)", &["a"]),
        ],
    ),
    (
        "binary",
        &[
            ("a + b", &["a", "b"]),
            ("a - c", &["a", "c"]),
            ("a * b * c", &["a", "b", "c"]),
            ("a / (abs(b) + 0.5)", &["a", "b"]),
            ("pow(abs(a) + 0.5, c)", &["a", "c"]),
            ("maximum(a, b)", &["a", "b"]),
            ("minimum(c, a)", &["a", "c"]),
            ("a * 3 - 2 / (abs(c) + 1)", &["a", "c"]),
            ("where(a > 0, b, c)", &["b", "c"]),
            ("v * a", &["v", "a"]),
            ("a % (abs(c) + 0.5)", &["a"]),
        ],
    ),
    (
        "reductions",
        &[
            ("sum(a, axis: 0)", &["a"]),
            ("mean(v, axis: [0, 2], keepdim: true)", &["v"]),
            ("max(a, axis: 1)", &["a"]),
            ("min(v, axis: -1, keepdim: true)", &["v"]),
            ("mean(a)", &["a"]),
            ("sum(v, axis: 1)", &["v"]),
        ],
    ),
    (
        "shapes",
        &[
            ("reshape(a, [2, 6])", &["a"]),
            ("transpose(a) @ a", &["a"]),
            ("permute(v, [2, 0, 1])", &["v"]),
            ("broadcast_to(b, [2, 3, 4])", &["b"]),
            ("concat([a, c, a], axis: 1)", &["a", "c"]),
            ("split(v, 2, axis: -1)[1] * 2", &["v"]),
            ("squeeze(c, axis: 1)", &["c"]),
            ("unsqueeze(b, axis: 0) + a", &["a", "b"]),
            ("v[1]", &["v"]),
            ("v[:, 1:3, ..]", &["v"]),
            ("v[.., -1]", &["v"]),
            ("a[1:3, 0:2] * a[0:2, 2:4]", &["a"]),
            ("tril(a)", &["a"]),
            ("triu(v, k: 1)", &["v"]),
            ("softmax(transpose(a))", &["a"]),
            ("relu(v[:, 1:3, :]) @ m", &["v", "m"]),
        ],
    ),
    (
        "matmul",
        &[
            ("a @ m", &["a", "m"]),
            ("v @ m", &["v", "m"]),
            ("b @ m", &["b", "m"]),
            ("a @ b", &["a", "b"]),
            ("b @ g4", &["b", "g4"]),
            ("v @ transpose(v)", &["v"]),
            ("relu(a @ m + m[0]) * 2", &["a", "m"]),
        ],
    ),
    (
        "conv",
        &[
            ("conv2d(img, k, padding: 1, groups: 2)", &["img", "k"]),
            ("conv2d(img[:, 0:2], k, stride: 2)", &["img", "k"]),
            ("max_pool2d(img, 2)", &["img"]),
            ("max_pool2d(img, 3, stride: 2, padding: 1)", &["img"]),
            ("avg_pool2d(img, 3, stride: 1, padding: 1)", &["img"]),
            ("embedding(table, ids)", &["table"]),
            ("dropout(a, 0.3)", &["a"]),
        ],
    ),
    (
        "composites",
        &[
            ("softmax(a)", &["a"]),
            ("softmax(v, axis: 1)", &["v"]),
            ("log_softmax(a)", &["a"]),
            ("layer_norm(a, b, g4)", &["a", "b", "g4"]),
            ("rms_norm(v, b)", &["v", "b"]),
            ("batch_norm(img, b, g4)", &["img", "b", "g4"]),
            ("cross_entropy(a, labels)", &["a"]),
            ("mse(a, c)", &["a", "c"]),
            ("linear(v, m, m[0])", &["v", "m"]),
            ("attention(q, kv, kv)", &["q", "kv"]),
            ("attention(q, kv, kv, causal: true)", &["q", "kv"]),
            ("checkpoint { let h = tanh(a @ m)\n h * h }", &["a", "m"]),
        ],
    ),
];

/// Integer and boolean cases over `input i: i32[3, 4]`, `input j: i32[4]`,
/// `input x: f32[3, 4]` (exact results).
pub const INTEGER_CASES: &[&str] = &[
    "i / (abs(j) + 1)",
    "i % (abs(j) + 1)",
    "i * j - j",
    "maximum(i, j)",
    "-i",
    "abs(i)",
    "relu(i)",
    "argmax(x, axis: 1)",
    "argmax(x)",
    "cast(x, i32)",
    "cast(i, f32) * x",
    "where(x > 0 && i > 0, x, 0.0)",
    "cast(!(x > 0) || i == 2, f32)",
    "arange(12)",
    "sum(i, axis: 0)",
    "max(i, axis: 1)",
    "full([2, 3], 1.5) + 1",
];

/// The program of an integer case.
pub fn integer_program(e: &str) -> String {
    format!("model m {{\n input i: i32[3, 4]\n input j: i32[4]\n input x: f32[3, 4]\n let out = {e}\n output out\n}}\n")
}

/// The program of a builtin case: `out = expr`, `y = sum(out * proj)` and the gradients of
/// `y` with respect to `wrt`, all outputs.
pub fn builtin_program(expr: &str, wrt: &[&str]) -> Result<String, String> {
    let probe = format!("model m {{ {BUILTIN_DECLS}\n let out = {expr}\n output out\n}}\n");
    let g = compile_pipeline(&probe, &Options::default())?;
    let ty = g.ty(g.outputs[0].1).to_string();
    let dims = ty.trim_start_matches("f32");
    let grads: String = wrt
        .iter()
        .map(|x| format!("    let d_{x} = grad(y, {x})\n"))
        .collect();
    let mut src = format!(
        "model m {{ {BUILTIN_DECLS}\n    input proj: f32{dims}\n    let out = {expr}\n    let y = sum(out * proj)\n{grads}    output out, y"
    );
    for x in wrt {
        src.push_str(&format!(", d_{x}"));
    }
    src.push_str("\n}\n");
    Ok(src)
}

/// Asserts that one fused CPU step of `g` gives the interpreter's outputs within `tol`, on
/// random inputs drawn with `seed`; `what` names the case in a failure.
pub fn assert_cpu_like_eager(g: &tcc::ir::Graph, seed: u64, tol: f64, what: &str) {
    let inputs = tcc::eager::random_inputs(g, seed);
    let want = eager_steps(g, &inputs, 1, 0).unwrap_or_else(|e| panic!("{what}: {e}"));
    let got = cpu_steps(g, &inputs, 1, 0, true).unwrap_or_else(|e| panic!("{what}: {e}"));
    for (name, t) in &want.outputs {
        let e = rel_err(&got.outputs[name], t);
        assert!(e <= tol, "{what}: output `{name}` differs by {e:e}");
    }
}

/// Asserts that `steps` fused CPU steps of `g` give the interpreter's outputs and params
/// within `tol`, on random inputs drawn with `seed`; `what` names the case in a failure.
pub fn assert_cpu_steps_like_eager(
    g: &tcc::ir::Graph,
    seed: u64,
    steps: usize,
    tol: f64,
    what: &str,
) {
    let inputs = tcc::eager::random_inputs(g, seed);
    let want = eager_steps(g, &inputs, steps, 0).unwrap_or_else(|e| panic!("{what}: {e}"));
    let got = cpu_steps(g, &inputs, steps, 0, true).unwrap_or_else(|e| panic!("{what}: {e}"));
    for (name, t) in &want.outputs {
        let e = rel_err(&got.outputs[name], t);
        assert!(e <= tol, "{what}: output `{name}` differs by {e:e}");
    }
    let e = params_rel_err(&got.persistent, &want.persistent)
        .unwrap_or_else(|| panic!("{what}: the params differ in names or sizes"));
    assert!(e <= tol, "{what}: params differ by {e:e}");
}

/// The kernels (by description) that only copy views: every node they compute is an op
/// whose name starts with one of `views`.
pub fn view_copy_kernels(
    g: &tcc::ir::Graph,
    kernels: &[tcc::kernel::Kernel],
    views: &[&str],
) -> Vec<String> {
    kernels
        .iter()
        .filter(|k| {
            k.nodes.iter().all(|&n| {
                let op = g.node(n).op.name();
                views.iter().any(|v| op.starts_with(v))
            })
        })
        .map(|k| k.describe.clone())
        .collect()
}

/// The longest one fuzz case may take (issue 32: no hang past 10 s). [`timed_case`]
/// fails a case that returns later; its watchdog aborts the process when one runs longer.
pub const CASE_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// When each thread's running fuzz case started ([`timed_case`]).
#[allow(clippy::type_complexity)]
static CASES: std::sync::Mutex<Vec<(std::thread::ThreadId, String, std::time::Instant)>> =
    std::sync::Mutex::new(Vec::new());

/// Runs one fuzz case and fails it when it took longer than [`CASE_LIMIT`]. A watchdog
/// thread (started by the first case) looks at the running cases every second and aborts
/// the process, naming the test, when one has run past the limit: a case that hangs fails
/// the campaign instead of stalling it.
pub fn timed_case(f: impl FnOnce()) -> Result<(), proptest::test_runner::TestCaseError> {
    static WATCHDOG: std::sync::Once = std::sync::Once::new();
    WATCHDOG.call_once(|| {
        std::thread::spawn(|| loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
            let cases = CASES.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((_, test, start)) = cases.iter().find(|(_, _, s)| s.elapsed() > CASE_LIMIT)
            {
                // Straight to the stream: the harness captures `eprintln!` of a test's threads.
                let _ = std::io::Write::write_fmt(
                    &mut std::io::stderr(),
                    format_args!(
                        "a fuzz case of {test} has run for {:.1} s, past the {} s limit: \
                         a hang\n",
                        start.elapsed().as_secs_f64(),
                        CASE_LIMIT.as_secs()
                    ),
                );
                // Not `exit`: its handlers could wait on the hung work.
                std::process::abort();
            }
        });
    });
    /// Takes the thread's case off the list when it ends, returning or panicking (proptest
    /// catches a failing case's panic and goes on shrinking on the same thread).
    struct Running(std::thread::ThreadId);
    impl Drop for Running {
        fn drop(&mut self) {
            CASES
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|(t, _, _)| *t != self.0);
        }
    }
    let thread = std::thread::current();
    let (id, test) = (thread.id(), thread.name().unwrap_or("a test").to_string());
    let start = std::time::Instant::now();
    CASES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((id, test, start));
    let running = Running(id);
    f();
    drop(running);
    let took = start.elapsed();
    if took > CASE_LIMIT {
        return Err(proptest::test_runner::TestCaseError::fail(format!(
            "the case took {:.1} s, past the {} s limit",
            took.as_secs_f64(),
            CASE_LIMIT.as_secs()
        )));
    }
    Ok(())
}

/// Configuration of the suite's property tests: `cases` cases from a fixed seed, so that a
/// run of the suite (CI's included) draws the same programs every time and a failure
/// reproduces. `PROPTEST_RNG_SEED=<u64>` explores other seeds, and `TCC_FUZZ_SCALE=N` runs
/// N times as many cases (`scripts/fuzz-campaign.sh`), `TCC_FUZZ_CASES=N` exactly N; a
/// failure's case is saved in the test's `.proptest-regressions` file, which is replayed
/// before the seeded cases.
pub fn proptest_config(cases: u32) -> proptest::test_runner::Config {
    use proptest::test_runner::{Config, RngSeed};
    let base = Config::default();
    let rng_seed = match base.rng_seed {
        RngSeed::Random => RngSeed::Fixed(0x7cc5_eed0),
        fixed => fixed,
    };
    let scale = std::env::var("TCC_FUZZ_SCALE")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .filter(|&s| s > 0)
        .unwrap_or(1);
    let exact = std::env::var("TCC_FUZZ_CASES")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .filter(|&n| n > 0);
    Config {
        cases: exact.unwrap_or(cases.saturating_mul(scale)),
        rng_seed,
        ..base
    }
}

/// `‖a − b‖ / ‖b‖` over all params and optimizer state taken as one vector (by name from
/// `b`). A param whose gradient is mathematically zero (a norm's shift followed by another
/// norm, a layer norm of two elements) holds only rounding noise, so its own relative
/// error means nothing; the whole vector's does. `None` if a name or size differs.
pub fn params_rel_err(
    a: &std::collections::BTreeMap<String, tcc::eager::Tensor>,
    b: &std::collections::BTreeMap<String, tcc::eager::Tensor>,
) -> Option<f64> {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (name, t) in b {
        let (x, y) = (a.get(name)?.to_f64(), t.to_f64());
        if x.len() != y.len() {
            return None;
        }
        for (p, q) in x.iter().zip(&y) {
            num += (p - q) * (p - q);
            den += q * q;
        }
    }
    Some(num.sqrt() / den.sqrt().max(1e-30))
}

/// Half-precision cases over `x, y: D[8, 16]` with their bound: fused kernels keep f32
/// between ops where the interpreter rounds every op, hence 2e-3 for f16 (10-bit mantissa)
/// and 1.6e-2 for bf16 (7-bit mantissa).
pub fn half_cases() -> Vec<(String, String, f64)> {
    let mut v = Vec::new();
    for (d, tol) in [("f16", 2e-3), ("bf16", 1.6e-2)] {
        for e in [
            "gelu(x * 2 + y)",
            "sum(x, axis: 1)",
            "x @ transpose(y)",
            "softmax(x)",
        ] {
            let src = format!(
                "model m {{\n input x: {d}[8, 16]\n input y: {d}[8, 16]\n let out = {e}\n output out\n}}\n"
            );
            v.push((format!("{d}: {e}"), src, tol));
        }
    }
    v
}

/// Convolutions in channels-last large enough for the CUDA back end's large-tile SGEMM to
/// run them as implicit GEMMs (gathered operands): 3×3 ones with padding (one with a ReLU,
/// one of 128 channels on stream-K's 128×128 tiles), a 1×1 one, the input gradients of
/// stride-1, stride-2 and 1×1 convolutions (with the ReLU's gradient in their epilogue),
/// and two weight gradients split along `k` (48 and 128 × 576 from 28672 pixels), most
/// reading runs of 4 channels as float4s. 28672 rows of 40 to 128 columns (not all whole
/// tiles); the stride-2 convolution itself and the other weight gradients are too small
/// for the SGEMM.
pub const IMPLICIT_GEMM_CONVS: &str = "model m {
    input x: f32[7, 16, 64, 64]
    param w1: f32[64, 16, 3, 3] = normal(0.0, 0.05)
    param w2: f32[48, 64, 3, 3] = normal(0.0, 0.05)
    param w3: f32[40, 64, 3, 3] = normal(0.0, 0.05)
    param w4: f32[40, 64, 1, 1] = normal(0.0, 0.1)
    param w5: f32[128, 64, 3, 3] = normal(0.0, 0.03)
    let h = relu(conv2d(x, w1, padding: 1))
    let y = conv2d(h, w2, padding: 1)
    let z = conv2d(h, w3, stride: 2, padding: 1)
    let u = conv2d(h, w4)
    let v = conv2d(h, w5, padding: 1)
    let loss = mean(y * y) + mean(z * z) + mean(u * u) + mean(v * v)
    output loss
    train sgd(lr: 0.1) minimize loss
}
";

/// Programs that exercise the CUDA back end's special paths, with the bound on their
/// relative error against the interpreter: vectorized pointwise kernels (vector loads of
/// f32, i32 and halves, scalar broadcasts, and shapes that fall back to the scalar path),
/// the tiled f32 matmul and the tensor-core f16/bf16 matmul with fused epilogues (edges
/// that are not multiples of the tiles, a transposed A, a batch).
pub fn gpu_path_cases() -> Vec<(String, String, f64)> {
    let mut v = Vec::new();
    let mut add = |what: &str, decls: &str, e: &str, tol: f64| {
        v.push((
            what.to_string(),
            format!("model m {{\n{decls}\n let out = {e}\n output out\n}}\n"),
            tol,
        ));
    };
    add(
        "vector f32 with row and column broadcasts",
        " input x: f32[64, 96]\n input b: f32[96]\n input c: f32[64, 1]",
        "gelu(x + b) * c",
        1e-5,
    );
    add(
        "vector i32",
        " input x: i32[16, 32]\n input y: i32[32]",
        "x * 3 + y",
        0.0,
    );
    add(
        "scalar fallback: odd extent",
        " input x: f32[33, 7]\n input y: f32[7]",
        "tanh(x) - y",
        1e-5,
    );
    add(
        "scalar fallback: transposed load",
        " input x: f32[64, 96]\n input y: f32[96, 64]",
        "x + transpose(y)",
        1e-5,
    );
    add(
        "concat along an outer axis: one vector load from the chosen piece",
        " input a: f32[1, 8, 64]\n input b: f32[1, 8, 64]\n input c: f32[2, 8, 64]",
        "concat([a, b, a, c], axis: 0) * 2.0 + concat([b, a, b, b, a, b], axis: 0)[1:6]",
        1e-6,
    );
    add(
        "concat along the innermost axis in whole vectors: one vector load from the chosen piece",
        " input a: f32[4, 8, 60]\n input b: f32[4, 8, 4]\n input c: f32[4, 8, 8]",
        "concat([a, b, c], axis: 2) * 2.0 + concat([c, a, b], axis: -1)",
        1e-6,
    );
    add(
        "concat along the innermost axis, pieces not whole vectors: scalar loads",
        " input a: f32[4, 8, 6]\n input b: f32[4, 8, 10]",
        "concat([a, b], axis: 2) - concat([b, a], axis: 2)",
        1e-6,
    );
    add(
        "concat along the innermost axis with a transposed piece: one scalar load",
        " input a: f32[4, 8, 60]\n input b: f32[4, 8, 4]\n input c: f32[4, 64, 8]",
        "concat([a, b, transpose(c)], axis: 2) - 1.0",
        1e-6,
    );
    for (d, tol) in [("f16", 2e-3), ("bf16", 1.6e-2)] {
        add(
            &format!("vector {d} with a broadcast"),
            &format!(" input x: {d}[32, 64]\n input b: {d}[64]"),
            "silu(x) + b",
            tol,
        );
    }
    add(
        "tiled f32 matmul, epilogue",
        " input x: f32[128, 96]\n input w: f32[96, 80]\n input b: f32[80]",
        "relu(x @ w + b)",
        1e-5,
    );
    add(
        "large-tile f32 matmul, ragged columns, epilogue",
        " input x: f32[1300, 72]\n input w: f32[72, 1700]\n input b: f32[1700]",
        "tanh(x @ w + b)",
        1e-5,
    );
    add(
        "large-tile f32 batched matmul, short k: vector stores of a bf16 cast, ragged m and n",
        " input x: f32[5, 500, 40]\n input w: f32[40, 1004]\n input b: f32[1004]",
        "cast(x @ w + b, bf16)",
        1.6e-2,
    );
    add(
        "large-tile f32 matmul, transposed A, ragged k and columns",
        " input x: f32[70, 1700]\n input w: f32[70, 1500]",
        "transpose(x) @ w",
        1e-5,
    );
    // A side of at most 64: 128×64 and 64×128 tiles (attention's shapes), ragged.
    add(
        "large-tile f32 batched matmul, 128x64 tiles",
        " input x: f32[50, 300, 96]\n input w: f32[50, 96, 60]",
        "x @ w",
        1e-5,
    );
    add(
        "large-tile f32 batched matmul, 64x128 tiles, transposed B",
        " input x: f32[50, 50, 80]\n input w: f32[50, 300, 80]",
        "x @ transpose(w)",
        1e-5,
    );
    add(
        "large-tile f32 batched matmul",
        " input x: f32[34, 256, 64]\n input w: f32[34, 64, 256]",
        "x @ w",
        1e-5,
    );
    // 128×128 tiles that fill their waves badly: stream-K (`back::ptx::stream_k`), blocks
    // whose ranges of k stages start and end inside tiles, the tile's first block adding
    // the others' partials before the epilogue. A weight gradient's shape (25 tiles of 512
    // stages, about 8 blocks a tile).
    add(
        "stream-K f32 matmul: a weight gradient's shape, epilogue",
        " input x: f32[4096, 640]\n input dy: f32[4096, 640]\n input b: f32[640]",
        "transpose(x) @ dy + b",
        1e-5,
    );
    add(
        "stream-K f32 matmul: batched A, ragged rows and columns",
        " input x: f32[4, 250, 2048]\n input w: f32[2048, 600]",
        "relu(x @ w)",
        1e-5,
    );
    // Tiles of a short k (gpt's output projection's shape, 88 stages, the last ragged): a
    // block's range spans a tile's end and the next one's start.
    add(
        "stream-K f32 matmul: a short ragged k, ragged, epilogue",
        " input x: f32[4000, 700]\n input w: f32[700, 760]\n input b: f32[760]",
        "tanh(x @ w + b)",
        1e-5,
    );
    // The same batched, with whole stages loaded by number (k a multiple of 8).
    add(
        "stream-K f32 matmul: batched, staged loads",
        " input x: f32[8, 500, 712]\n input w: f32[712, 760]",
        "x @ w",
        1e-5,
    );
    // Convolutions as implicit GEMMs: the avg_pool2d of size 1 copies every element of a
    // channels-last intermediate to the (channels-first) output.
    add(
        "implicit GEMM: conv2d 3x3, padding 1",
        " input x: f32[2, 16, 12, 12]\n input w: f32[24, 16, 3, 3]",
        "avg_pool2d(conv2d(x, w, padding: 1), 1)",
        1e-5,
    );
    add(
        "implicit GEMM: conv2d stride 2, odd side, fused relu on the input",
        " input x: f32[3, 16, 13, 13]\n input w: f32[40, 16, 3, 3]",
        "avg_pool2d(conv2d(relu(x), w, stride: 2, padding: 1), 1)",
        1e-5,
    );
    add(
        "implicit GEMM: conv2d 1x1, epilogue",
        " input x: f32[2, 24, 10, 10]\n input w: f32[32, 24, 1, 1]",
        "avg_pool2d(tanh(conv2d(x, w)), 1)",
        1e-5,
    );
    // Causal attention's structural zeros (`analysis::zeros`): the score tiles above the
    // diagonal are not computed and `p @ v` sums `k` only up to the diagonal (a `tril`
    // with `k = 44`: fewer queries than keys; 300 and 260 are whole tiles and a ragged
    // one, not whole stages of 8), and the same for an upper-triangular mask.
    add(
        "causal attention: skipped score tiles and k ranges, fewer queries than keys",
        " input q: f32[72, 256, 32]\n input k: f32[72, 300, 32]\n input v: f32[72, 300, 32]",
        "attention(q, k, v, causal: true)",
        1e-5,
    );
    add(
        "upper-triangular mask: skipped score tiles and k ranges from the diagonal",
        " input q: f32[72, 260, 32]\n input k: f32[72, 260, 32]\n input v: f32[72, 260, 32]",
        "softmax(where(triu(ones([260, 260], bool), k: -3), q @ transpose(k), -inf), axis: -1) @ v",
        1e-5,
    );
    add(
        "row blocks: softmax over long rows",
        " input x: f32[6, 40, 520]",
        "softmax(x, axis: -1)",
        1e-5,
    );
    add(
        "row blocks: layer norm, rows of 200",
        " input x: f32[300, 200]\n input g: f32[200]\n input b: f32[200]",
        "layer_norm(x, g, b)",
        1e-5,
    );
    // Many rows of one output each: a warp per row (rows of 70: the last lanes idle).
    add(
        "warp rows: statistics of many short rows",
        " input x: f32[17000, 70]",
        "max(x, axis: -1, keepdim: true) + sum(x, axis: -1, keepdim: true)",
        1e-5,
    );
    add(
        "warp rows: softmax of many rows",
        " input x: f32[40, 450, 96]",
        "softmax(x, axis: -1)",
        1e-5,
    );
    add(
        "row blocks: a kept reduced axis of extent 1",
        " input x: f32[100, 300]",
        "max(x, axis: -1, keepdim: true) + sum(x, axis: -1, keepdim: true)",
        1e-5,
    );
    for (d, tol) in [("f16", 2e-3), ("bf16", 1.6e-2)] {
        add(
            &format!("{d} matmul, epilogue"),
            &format!(" input x: {d}[128, 64]\n input w: {d}[64, 96]\n input b: {d}[96]"),
            "gelu(x @ w + b)",
            tol,
        );
        add(
            &format!("{d} matmul, ragged edges"),
            &format!(" input x: {d}[70, 40]\n input w: {d}[40, 50]"),
            "x @ w",
            tol,
        );
        add(
            &format!("{d} matmul, transposed A"),
            &format!(" input x: {d}[48, 128]\n input w: {d}[48, 64]"),
            "transpose(x) @ w",
            tol,
        );
        add(
            &format!("{d} batched matmul"),
            &format!(" input x: {d}[3, 64, 32]\n input w: {d}[3, 32, 72]"),
            "x @ w",
            tol,
        );
        // Hopper wgmma (128×128 tiles): A contiguous along k, B along n; ragged m, n
        // and k (the last stage is zero-filled).
        add(
            &format!("{d} wgmma, ragged edges, epilogue"),
            &format!(" input x: {d}[200, 72]\n input w: {d}[72, 136]\n input b: {d}[136]"),
            "gelu(x @ w + b)",
            tol,
        );
        // The operands the other way: A contiguous along m, B along k.
        add(
            &format!("{d} wgmma, transposed A"),
            &format!(" input x: {d}[96, 256]\n input w: {d}[96, 136]"),
            "transpose(x) @ w",
            tol,
        );
        add(
            &format!("{d} wgmma, transposed B"),
            &format!(" input x: {d}[256, 96]\n input w: {d}[136, 96]"),
            "x @ transpose(w)",
            tol,
        );
    }
    // 132 blocks of 128×256: the wide wgmma tile.
    add(
        "bf16 wgmma, 128x256 tiles, batched",
        " input x: bf16[66, 256, 64]\n input w: bf16[66, 64, 256]",
        "x @ w",
        1.6e-2,
    );
    v
}

/// The one-argument elementwise builtins as builtin cases (an expression over `a`, the
/// input to differentiate), enumerated rather than listed: every unary op of the op table
/// (`tcc::ir::UnaryOp`, on `abs(a) + 0.5` where it is defined on positive numbers only) and
/// every prelude function of the form `fn f(x: F[..]) -> F[..]` (on `a`: such a composite
/// must be defined on all reals). A new op or prelude activation is tested without editing
/// any list.
/// Every builtin case: [`unary_builtin_cases`], then every group of [`BUILTIN_CASES`].
pub fn all_builtin_cases() -> Vec<(String, &'static [&'static str])> {
    let mut cases = unary_builtin_cases();
    for (_, group) in BUILTIN_CASES {
        for (e, wrt) in group.iter() {
            cases.push((e.to_string(), *wrt));
        }
    }
    cases
}

/// Assembles PTX `code` for sm_90 (sm_90a where the module asks for it) with `ptxas`, in
/// `dir`; the error is ptxas's first lines.
pub fn assemble_ptx(ptxas: &Path, dir: &Path, code: &str) -> Result<(), String> {
    let path = dir.join("module.ptx");
    std::fs::write(&path, code).map_err(|e| e.to_string())?;
    let arch = if code.contains("\n.target sm_90a\n") {
        "-arch=sm_90a"
    } else {
        "-arch=sm_90"
    };
    let out = std::process::Command::new(ptxas)
        .arg(arch)
        .arg(&path)
        .arg("-o")
        .arg(dir.join("module.cubin"))
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        return Ok(());
    }
    Err(String::from_utf8_lossy(&out.stderr)
        .lines()
        .take(5)
        .collect::<Vec<_>>()
        .join("\n"))
}

pub fn unary_builtin_cases() -> Vec<(String, &'static [&'static str])> {
    use tcc_grammar::ast::{DimExpr, Item, TypeExpr};
    let mut cases = Vec::new();
    for op in tcc::ir::UnaryOp::ALL {
        if tcc::ir::UnaryOp::from_builtin(op.name()) != Some(op) {
            continue;
        }
        let arg = if op.on_all_reals() {
            "a"
        } else {
            "abs(a) + 0.5"
        };
        cases.push(format!("{}({arg})", op.name()));
    }
    let any_float =
        |t: &TypeExpr| t.dtype.name == "F" && matches!(t.dims.as_deref(), Some([DimExpr::Rest(_)]));
    let prelude = tcc_grammar::parse(tcc::front::PRELUDE, tcc_grammar::span::FileId(0))
        .unwrap_or_else(|e| panic!("the prelude does not parse: {e:?}"));
    for item in &prelude.items {
        if let Item::Fn(f) = item {
            if let [p] = f.params.as_slice() {
                if any_float(&p.ty) && any_float(&f.ret) {
                    cases.push(format!("{}(a)", f.name.name));
                }
            }
        }
    }
    const A: &[&str] = &["a"];
    cases.into_iter().map(|c| (c, A)).collect()
}

/// A random well-typed program (the proptests' generator) over values of shape `[r, c]` built from random ops on earlier values.
pub fn random_program(
    r: usize,
    c: usize,
    ops: &[(usize, usize, usize)],
    train: Option<bool>,
) -> String {
    let mut src = format!(
        "model m {{\n input x: f32[{r}, {c}]\n input row: f32[{c}]\n input col: f32[{r}, 1]\n param w: f32[{c}, {c}] = normal(0.0, 0.3)\n param g: f32[{c}] = ones\n let v0 = tanh(x @ w)\n"
    );
    for (k, &(op, a, b)) in ops.iter().enumerate() {
        let (a, b) = (a % (k + 1), b % (k + 1));
        let smooth = train.is_some();
        let e = match op % 14 {
            0 => format!("v{a} + v{b}"),
            1 => format!("tanh(v{a}) * v{b}"),
            2 => format!("v{a} @ w"),
            3 => format!("softmax(v{a})"),
            4 => format!("v{a} - mean(v{b}, axis: 0, keepdim: true)"),
            5 => format!("transpose(transpose(v{a})) * 0.5 + row"),
            // Over two columns a layer norm's output is ±1 whatever its input (up to its
            // eps): centering it leaves rounding noise, and its gradient is rounding noise
            // that Adam turns into full steps of either sign, so two correct programs differ
            // by 1e-4. It takes three columns or more.
            6 if c >= 3 => format!("layer_norm(v{a} + row, g, row)"),
            7 => format!("v{a} * col - sigmoid(v{b})"),
            8 => format!("concat([v{a}[:, 0:1], v{b}[:, 1:]], axis: 1)"),
            9 => format!("exp(-v{a} * v{a}) + sum(v{b}, axis: 1, keepdim: true) * 0.1"),
            10 if !smooth => format!("maximum(v{a}, v{b}) + relu(v{a})"),
            11 if !smooth => format!("where(v{a} > v{b}, v{a}, col)"),
            12 => format!("reshape(transpose(reshape(v{a}, [{c}, {r}])), [{r}, {c}])"),
            _ => format!("gelu(v{a}) / (1.0 + v{b} * v{b})"),
        };
        src.push_str(&format!(" let v{} = {e}\n", k + 1));
    }
    let last = ops.len();
    src.push_str(&format!(
        " let loss = mean(v{last} * v{last})\n output loss, v{}\n",
        last / 2
    ));
    match train {
        // Adam's first steps move a param by about lr·g/(|g| + eps): with the default eps of
        // 1e-8, a gradient of 1e-7 that f32 gets to 1e-4 relative (the softmax of a nearly
        // constant row cancels terms 1e4 times larger) moves the param 1e-5 away from the
        // interpreter's. eps = 1e-4 bounds that gain by lr/eps and still runs every part of
        // the update (moments, bias correction).
        Some(true) => src.push_str(" train adam(lr: 0.01, eps: 1e-4) minimize loss\n"),
        Some(false) => src.push_str(" train sgd(lr: 0.1, momentum: 0.9) minimize loss\n"),
        None => {}
    }
    src.push_str("}\n");
    src
}

/// A data-parallel step against the same step on the whole batch: `src` with `{B}` standing
/// for its batch is compiled once at `ranks * b` (one session) and once at `b` for `ranks`
/// ranks (`--gpus`), on `devices` (one per rank; the whole-batch session runs on the first).
/// Both run `steps` steps on the same random whole batch (the ranks each get their slice);
/// returns the params' and optimizer state's relative error ([`params_rel_err`]) and the
/// loss of each (the ranks' mean).
pub fn data_parallel_vs_whole(
    src: &str,
    b: usize,
    steps: usize,
    devices: &[tcc_runtime::Device],
    amp: tcc::passes::amp::Amp,
) -> Result<(f64, f64, f64), String> {
    let first = *devices.first().ok_or("no devices")?;
    let options = tcc::artifact::CompileOptions {
        amp,
        ..device_options(first, true)
    };
    data_parallel_vs_whole_with(src, b, steps, devices, options)
}

/// [`data_parallel_vs_whole`] with both steps compiled with `options` (its `ranks` set
/// for each).
pub fn data_parallel_vs_whole_with(
    src: &str,
    b: usize,
    steps: usize,
    devices: &[tcc_runtime::Device],
    options: tcc::artifact::CompileOptions,
) -> Result<(f64, f64, f64), String> {
    use std::collections::BTreeMap;
    let ranks = devices.len();
    let first = *devices.first().ok_or("no devices")?;
    let build = |batch: usize, ranks: usize| {
        let compile = tcc::artifact::CompileOptions { ranks, ..options };
        let text = src.replace("{B}", &batch.to_string());
        compile_step(&text, &Default::default(), &compile).map(|(g, _, model)| (g, model))
    };
    let (gw, whole) = build(ranks * b, 1)?;
    let (_, part) = build(b, ranks)?;
    let inputs = tcc::eager::random_inputs(&gw, 3);
    let mut s = tcc_runtime::Session::new(&whole, first).map_err(|e| e.to_string())?;
    let mut dp = tcc_runtime::DataParallel::new(&part, devices).map_err(|e| e.to_string())?;
    for _ in 0..steps {
        for (name, t) in &inputs {
            let bytes = t.to_le_bytes();
            s.set_input_bytes(name, &bytes).map_err(|e| e.to_string())?;
            dp.set_input_split(name, &bytes)
                .map_err(|e| e.to_string())?;
        }
        s.run().map_err(|e| e.to_string())?;
        dp.run().map_err(|e| e.to_string())?;
    }
    let read =
        |s: &tcc_runtime::Session<'_>| -> Result<BTreeMap<String, tcc::eager::Tensor>, String> {
            let mut out = BTreeMap::new();
            for p in s.model().persistent() {
                let b = s.param_bytes(&p.slot.name).map_err(|e| e.to_string())?;
                let ty = gw
                    .persistent_tensors()
                    .into_iter()
                    .find(|(_, name, _)| *name == p.slot.name)
                    .map(|(_, _, ty)| ty)
                    .ok_or_else(|| format!("no `{}` in the graph", p.slot.name))?;
                let t = tcc::eager::Tensor::from_le_bytes(ty, b).ok_or("wrong size")?;
                out.insert(p.slot.name.clone(), t);
            }
            Ok(out)
        };
    let want = read(&s)?;
    let mut worst = 0.0f64;
    for r in 0..ranks {
        let got = read(dp.session(r).ok_or("no rank")?)?;
        worst = worst.max(params_rel_err(&got, &want).ok_or("params differ in name or size")?);
    }
    let loss = s.output::<f32>("loss").map_err(|e| e.to_string())?[0] as f64;
    let mut mean = 0.0;
    for r in 0..ranks {
        let l = dp
            .session(r)
            .ok_or("no rank")?
            .output::<f32>("loss")
            .map_err(|e| e.to_string())?;
        mean += l[0] as f64 / ranks as f64;
    }
    Ok((worst, loss, mean))
}

/// ZeRO-1 against plain data parallelism: `src` (`{B}`: one rank's batch) built for
/// `devices.len()` ranks with and without `zero`, run `steps` steps on the same per-rank
/// inputs. Returns the relative errors of every rank's params, of the optimizer state
/// (each rank's ZeRO shards concatenated, padding dropped, against the plain state) and
/// the largest loss difference of any rank at any step.
pub fn zero_vs_plain(
    src: &str,
    b: usize,
    steps: usize,
    devices: &[tcc_runtime::Device],
    amp: tcc::passes::amp::Amp,
) -> Result<(f64, f64, f64), String> {
    use std::collections::BTreeMap;
    use tcc::eager::Tensor;
    let ranks = devices.len();
    let first = *devices.first().ok_or("no devices")?;
    let text = src.replace("{B}", &b.to_string());
    let build = |zero: bool| {
        let compile = tcc::artifact::CompileOptions {
            ranks,
            zero,
            amp,
            ..device_options(first, true)
        };
        compile_step(&text, &Default::default(), &compile).map(|(g, _, model)| (g, model))
    };
    let (gp, plain) = build(false)?;
    let (gz, zero) = build(true)?;
    let e = |e: tcc_runtime::Error| e.to_string();
    let mut dp = tcc_runtime::DataParallel::new(&plain, devices).map_err(e)?;
    let mut dz = tcc_runtime::DataParallel::new(&zero, devices).map_err(e)?;
    let mut loss_diff = 0.0f64;
    for step in 0..steps {
        for r in 0..ranks {
            for (name, t) in &tcc::eager::random_inputs(&gp, (step * ranks + r) as u64) {
                let bytes = t.to_le_bytes();
                for d in [&mut dp, &mut dz] {
                    let s = d.session_mut(r).ok_or("no rank")?;
                    s.set_input_bytes(name, &bytes).map_err(e)?;
                }
            }
        }
        dp.run().map_err(e)?;
        dz.run().map_err(e)?;
        for r in 0..ranks {
            let loss = |d: &tcc_runtime::DataParallel| -> Result<f64, String> {
                let s = d.session(r).ok_or("no rank")?;
                Ok(s.output::<f32>("loss").map_err(e)?[0] as f64)
            };
            loss_diff = loss_diff.max((loss(&dp)? - loss(&dz)?).abs());
        }
    }
    let named = |g: &tcc::ir::Graph, n: tcc::ir::NodeId| match &g.node(n).op {
        tcc::ir::Op::Param { name, .. } | tcc::ir::Op::State { name, .. } => Some(name.clone()),
        _ => None,
    };
    let mut param_err = 0.0f64;
    for r in 0..ranks {
        let (mut want, mut got) = (BTreeMap::new(), BTreeMap::new());
        for &p in &gp.params {
            let name = named(&gp, p).ok_or("unnamed param")?;
            for (d, map) in [(&dp, &mut want), (&dz, &mut got)] {
                let s = d.session(r).ok_or("no rank")?;
                let bytes = s.param_bytes(&name).map_err(e)?;
                let t = Tensor::from_le_bytes(gp.ty(p).clone(), bytes).ok_or("param size")?;
                map.insert(name.clone(), t);
            }
        }
        param_err = param_err.max(params_rel_err(&got, &want).ok_or("params differ")?);
    }
    let (mut want, mut got) = (BTreeMap::new(), BTreeMap::new());
    for &st in &gp.states {
        let name = named(&gp, st).ok_or("unnamed state")?;
        let ty = gp.ty(st).clone();
        let whole = dp
            .session(0)
            .ok_or("no rank")?
            .param_bytes(&name)
            .map_err(e)?;
        want.insert(
            name.clone(),
            Tensor::from_le_bytes(ty.clone(), whole).ok_or("size")?,
        );
        // The ZeRO step's state of this name: sharded (one block per rank) or whole.
        let sharded = gz
            .states
            .iter()
            .any(|&z| named(&gz, z).as_deref() == Some(&name) && gz.ty(z).shape != ty.shape);
        let mut cat = Vec::new();
        for r in 0..if sharded { ranks } else { 1 } {
            let s = dz.session(r).ok_or("no rank")?;
            cat.extend_from_slice(s.param_bytes(&name).map_err(e)?);
        }
        cat.truncate(ty.size_bytes());
        got.insert(name, Tensor::from_le_bytes(ty, &cat).ok_or("shard sizes")?);
    }
    let state_err = params_rel_err(&got, &want).ok_or("states differ")?;
    Ok((param_err, state_err, loss_diff))
}

/// The single model of `src` compiled with `compile` (stages `autodiff` to `codegen`,
/// verified; params drawn with seed 7): its scheduled graph, the compiled program and the
/// artifact loaded back.
pub fn compile_step(
    src: &str,
    front: &Options,
    compile: &tcc::artifact::CompileOptions,
) -> Result<(tcc::ir::Graph, tcc::artifact::Compiled, tcc_runtime::Model), String> {
    use tcc::artifact;
    let (sources, mut lowered) = compile_bytes("case.tdsl", src.as_bytes(), front)?;
    let g = lowered.graphs.remove(0);
    let popts = tcc::pipeline::Options {
        compile: *compile,
        verify: true,
        ..Default::default()
    };
    let g = match tcc::pipeline::lowered(g, Default::default(), "schedule", &popts, &mut |_, _| {})
    {
        Ok((tcc::pipeline::Product::Graph(g), _)) => g,
        Ok((p, _)) => return Err(format!("`schedule` gave {}", p.form())),
        Err(e) => return Err(render_all(&e.diagnostics(), &sources.map)),
    };
    let c = artifact::compile(&g, compile).map_err(|e| e.to_string())?;
    let img = artifact::persistent_image(&c, 7, &Default::default()).map_err(|e| e.to_string())?;
    let bytes = artifact::write_artifact(&c, compile.target, &img);
    let model = tcc_runtime::Model::from_bytes(bytes).map_err(|e| e.to_string())?;
    Ok((g, c, model))
}

/// A small MLP with Adam for the data-parallel tests (`{B}`: the batch).
pub const DATA_PARALLEL_MLP: &str = "
model dp {
    input  x: f32[{B}, 24]
    input  labels: i32[{B}]
    param  w1: f32[24, 32] = normal(0.0, 0.2)
    param  b1: f32[32] = zeros
    param  w2: f32[32, 5] = normal(0.0, 0.2)
    param  b2: f32[5] = zeros
    let h = gelu(linear(x, w1, b1))
    let loss = cross_entropy(linear(h, w2, b2), labels)
    output loss
    train adam(lr: 0.01) minimize loss
}
";

/// One step program at `--micro-batches k` against the same program on its whole batch.
pub struct MicroVsWhole {
    /// [`params_rel_err`] of params and optimizer state after the steps.
    pub params: f64,
    /// The largest [`rel_err`] of any output (those carrying the batch concatenated from
    /// the micro-batches).
    pub outputs: f64,
    /// The arenas: whole batch, micro-batched.
    pub arenas: (usize, usize),
}

/// The single model of `src` (`--set` values `sets`) lowered as the front end does with
/// `--micro-batches k` ([`tcc::front::micro_batch`]) and run through the pipeline to
/// `schedule` with `compile`, verified.
pub fn micro_batched_step(
    src: &str,
    sets: &[(&str, &str)],
    k: usize,
    compile: &tcc::artifact::CompileOptions,
) -> Result<tcc::ir::Graph, String> {
    split_step(src, sets, k, Some(1), compile)
}

/// [`micro_batched_step`] through [`tcc::front::micro_batch::compile_step`]: `k`
/// micro-batches, and the loss head in `loss_chunks` chunks (`None`: as the front end
/// chooses).
pub fn split_step(
    src: &str,
    sets: &[(&str, &str)],
    k: usize,
    loss_chunks: Option<usize>,
    compile: &tcc::artifact::CompileOptions,
) -> Result<tcc::ir::Graph, String> {
    split_step_through(src, sets, k, loss_chunks, compile, "schedule")
}

/// [`split_step`] run through the graph stage `last` (`schedule`, `remat`, …).
pub fn split_step_through(
    src: &str,
    sets: &[(&str, &str)],
    k: usize,
    loss_chunks: Option<usize>,
    compile: &tcc::artifact::CompileOptions,
    last: &str,
) -> Result<tcc::ir::Graph, String> {
    let opts = Options {
        sets: sets
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    let mut sources = Sources::new("case.tdsl", src.as_bytes());
    let mut lowered = tcc::front::micro_batch::compile_step(&mut sources, &opts, k, loss_chunks)
        .map_err(|d| render_all(&d, &sources.map))?;
    let g = lowered.graphs.remove(0);
    let popts = tcc::pipeline::Options {
        compile: *compile,
        verify: true,
        ..Default::default()
    };
    match tcc::pipeline::lowered(g, Default::default(), last, &popts, &mut |_, _| {}) {
        Ok((tcc::pipeline::Product::Graph(g), _)) => Ok(g),
        Ok((p, _)) => Err(format!("`{last}` gave {}", p.form())),
        Err(e) => Err(render_all(&e.diagnostics(), &sources.map)),
    }
}

/// Runs `src` for `steps` steps on `device` with `--micro-batches k` and on its whole
/// batch, from the same params (seed 7) and inputs (seed 3), and compares them. `amp`:
/// `--amp` (`off`, `bf16`, `f16`).
pub fn micro_vs_whole(
    src: &str,
    sets: &[(&str, &str)],
    k: usize,
    steps: usize,
    device: tcc_runtime::Device,
    amp: &str,
) -> Result<MicroVsWhole, String> {
    let compile = tcc::artifact::CompileOptions {
        amp: tcc::passes::amp::Amp::named(amp).ok_or(format!("no --amp {amp}"))?,
        ..device_options(device, true)
    };
    let whole = micro_batched_step(src, sets, 1, &compile)?;
    let micro = micro_batched_step(src, sets, k, &compile)?;
    if micro.micro_batches != Some(k) {
        return Err(format!("the step was not split: {:?}", micro.micro_batches));
    }
    steps_side_by_side(&whole, &micro, steps, device, &compile)
}

/// `whole` and `other` (the same step, split) run `steps` steps on `device` from the same
/// params (seed 7) and inputs (seed 3), compared.
fn steps_side_by_side(
    whole: &tcc::ir::Graph,
    other: &tcc::ir::Graph,
    steps: usize,
    device: tcc_runtime::Device,
    compile: &tcc::artifact::CompileOptions,
) -> Result<MicroVsWhole, String> {
    let inputs = tcc::eager::random_inputs(whole, 3);
    let a = steps_compiled(whole, &inputs, steps, 7, device, compile)?;
    let b = steps_compiled(other, &inputs, steps, 7, device, compile)?;
    let params = params_rel_err(&b.persistent, &a.persistent).ok_or("params differ in name")?;
    let mut outputs = 0.0f64;
    for (name, t) in &a.outputs {
        let u = b.outputs.get(name).ok_or(format!("no output `{name}`"))?;
        outputs = outputs.max(rel_err(u, t));
    }
    Ok(MicroVsWhole {
        params,
        outputs,
        arenas: (a.arena_bytes, b.arena_bytes),
    })
}

/// Runs `src` for `steps` f32 steps on `device` with its loss head as the front end
/// chooses to chunk it and whole, from the same params (seed 7) and inputs (seed 3), and
/// compares them; also gives the chunks chosen.
pub fn chunks_vs_whole(
    src: &str,
    sets: &[(&str, &str)],
    steps: usize,
    device: tcc_runtime::Device,
) -> Result<(MicroVsWhole, Option<usize>), String> {
    let compile = device_options(device, true);
    let whole = split_step(src, sets, 1, Some(1), &compile)?;
    let chunked = split_step(src, sets, 1, None, &compile)?;
    let r = steps_side_by_side(&whole, &chunked, steps, device, &compile)?;
    Ok((r, chunked.loss_chunks))
}

/// Asserts that `src` with `--micro-batches k` equals its whole-batch step after 3 steps on
/// `device` ([`micro_vs_whole`], f32): params and outputs to 1e-5 relative error (the
/// gradients add up in another order, nothing else differs).
pub fn assert_micro_equals_whole(
    what: &str,
    src: &str,
    sets: &[(&str, &str)],
    k: usize,
    device: tcc_runtime::Device,
) {
    let r = micro_vs_whole(src, sets, k, 3, device, "off")
        .unwrap_or_else(|e| panic!("{what}, K={k}: {e}"));
    eprintln!(
        "{what}, K={k}: params rel err {:e}, outputs {:e}, arena {} -> {} bytes",
        r.params, r.outputs, r.arenas.0, r.arenas.1
    );
    assert!(
        r.params < 1e-5,
        "{what}, K={k}: params differ by {:e}",
        r.params
    );
    assert!(
        r.outputs < 1e-5,
        "{what}, K={k}: outputs differ by {:e}",
        r.outputs
    );
}

/// Fused attention over 16-bit queries, keys and values (`back::ptx::attention_mma`): `t`
/// queries against `s` keys (2 × 3 heads), head dimension `d`, value width `e`.
pub fn tensor_core_attention(
    dtype: &str,
    (t, s): (usize, usize),
    (d, e): (usize, usize),
    causal: bool,
) -> String {
    format!(
        "model m {{
            input q: {dtype}[2, 3, {t}, {d}]
            input k: {dtype}[2, 3, {s}, {d}]
            input v: {dtype}[2, 3, {s}, {e}]
            let out = attention(cast(q, f32), cast(k, f32), cast(v, f32), causal: {causal})
            output out
        }}"
    )
}

/// gelu's gradient far from 0 on `device`: the compiled step (`gelu_grad` evaluated at x
/// clamped to [-9, 9]) agrees with the interpreter's f64 formula out to ±1e30, where an
/// unclamped `x u'` would outgrow the clamped exponential (about -3.9 at -1e12 before), and
/// a NaN stays NaN.
pub fn check_gelu_gradient_far_from_zero(device: tcc_runtime::Device) {
    use tcc::eager::{Precision, Tensor};
    let xs = [
        -1e30, -1e13, -1e4, -30.0, -9.5, -9.0, -3.0, -0.75, 0.0, 0.5, 3.0, 9.0, 9.5, 30.0, 1e4,
        1e13,
    ];
    let src = "model m {\n    input a: f32[17]\n    let y = sum(gelu(a))\n    let d = grad(y, a)\n    output d\n}\n";
    let g = compile_pipeline(src, &tcc::front::Options::default())
        .unwrap_or_else(|e| panic!("gelu far from 0:\n{e}"));
    let mut values: Vec<f64> = xs.to_vec();
    values.push(f64::NAN);
    let a = Tensor::from_f64(tcc::ir::DType::F32, vec![values.len()], values.clone());
    let inputs = std::collections::BTreeMap::from([("a".to_string(), a)]);
    let mut p = tcc::eager::init_persistent(&g, 0);
    let want = tcc::eager::run_step(&g, &mut p, &inputs, Precision::F64)
        .unwrap_or_else(|e| panic!("eager: {e}"));
    let got =
        device_steps(&g, &inputs, 1, 0, true, device).unwrap_or_else(|e| panic!("{device:?}: {e}"));
    let (want, got) = (want[0].1.to_f64(), got.outputs["d"].to_f64());
    for (i, x) in values.iter().enumerate() {
        if x.is_nan() {
            assert!(got[i].is_nan(), "{device:?}: gelu'(NaN) = {}", got[i]);
            continue;
        }
        assert!(
            (got[i] - want[i]).abs() <= 1e-6 * want[i].abs().max(1.0),
            "{device:?}: gelu'({x}) = {}, the interpreter's {}",
            got[i],
            want[i]
        );
    }
}
