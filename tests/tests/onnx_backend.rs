//! The ONNX backend test cases shipped in the `onnx` Python package
//! (`onnx/backend/test/data/{pytorch-converted,pytorch-operator,simple}`): each `model.onnx` is
//! imported, compiled for the CPU (the GPU with `TCC_ONNX_DEVICE=cuda`) and run on every
//! `test_data_set_*`, and its outputs are compared with the stored ones: floats within
//! `|got - want| <= ATOL + RTOL * |want|`, integers and booleans exactly.
//!
//! `tests/cases/onnx/ops` (written by `scripts/onnx_op_cases.py`: the ops and opsets exporters
//! emit today, expected outputs from onnx's reference evaluator) runs the same way, with or
//! without the package.
//!
//! Every case is reported as passed, failed (with the first mismatch or the error) or
//! unsupported (the importer's reason). The cases listed in `tests/cases/onnx/expected_pass.txt`
//! must pass: one that no longer does fails the test. The data is found through
//! `$TCC_ONNX_DATA` or the `onnx` package of `python3` (`.ci/run` installs it); without it the
//! test prints that it skipped, and fails under `CI=true`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tcc::eager::{Data, Tensor};

const RTOL: f64 = 1e-3;
const ATOL: f64 = 1e-5;
const FOLDERS: [&str; 3] = ["pytorch-converted", "pytorch-operator", "simple"];

fn data_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("TCC_ONNX_DATA") {
        return Some(PathBuf::from(d));
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import onnx, os; print(os.path.dirname(onnx.__file__))",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let root = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let d = root.join("backend").join("test").join("data");
    d.is_dir().then_some(d)
}

enum Outcome {
    Pass,
    /// Passed with `--f64-as-f32`: the model's float64 tensors computed in f32.
    PassAsF32,
    Fail(String),
    Unsupported(String),
}

fn sorted_files(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|r| {
            r.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(prefix))
                })
                .collect()
        })
        .unwrap_or_default();
    // input_10 after input_9.
    v.sort_by_key(|p| {
        let n = p
            .file_stem()
            .and_then(|n| n.to_str())
            .and_then(|n| n.rsplit('_').next())
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(0);
        (n, p.clone())
    });
    v
}

/// The first element where `got` and `want` differ beyond the tolerance.
fn compare(name: &str, got: &Tensor, want: &Tensor) -> Result<(), String> {
    if got.dims() != want.dims() {
        return Err(format!(
            "output `{name}`: shape {:?}, expected {:?}",
            got.dims(),
            want.dims()
        ));
    }
    match (&got.data, &want.data) {
        (Data::F(g), Data::F(w)) => {
            for (i, (a, b)) in g.iter().zip(w).enumerate() {
                let ok = (a - b).abs() <= ATOL + RTOL * b.abs()
                    || (a.is_nan() && b.is_nan())
                    || (a == b);
                if !ok {
                    return Err(format!("output `{name}`[{i}] = {a}, expected {b}"));
                }
            }
            Ok(())
        }
        _ => {
            let (g, w) = (got.to_f64(), want.to_f64());
            match g.iter().zip(&w).position(|(a, b)| a != b) {
                None => Ok(()),
                Some(i) => Err(format!(
                    "output `{name}`[{i}] = {}, expected {}",
                    g[i], w[i]
                )),
            }
        }
    }
}

/// Where the cases run: the CPU, or with `TCC_ONNX_DEVICE=cuda` (a binary built with the
/// `cuda` feature, as `scripts/gpu-check.sh device-onnx` runs it) the first GPU.
fn device() -> tcc_runtime::Device {
    match std::env::var("TCC_ONNX_DEVICE").as_deref() {
        Ok("cuda") => tcc_runtime::Device::Cuda(0),
        _ => tcc_runtime::Device::Cpu,
    }
}

fn run_case(dir: &Path) -> Outcome {
    let bytes = match std::fs::read(dir.join("model.onnx")) {
        Ok(b) => b,
        Err(e) => return Outcome::Fail(format!("cannot read model.onnx: {e}")),
    };
    // A float64 model is refused by default; it is run again as `--f64-as-f32` runs it.
    let (imp, as_f32) = match tcc::onnx::import(&bytes, &Default::default()) {
        Ok(i) => (i, false),
        Err(tcc::onnx::ImportError::DType { dtype, .. }) if dtype == "double" => {
            let opts = tcc::onnx::ImportOptions {
                f64_as_f32: true,
                ..Default::default()
            };
            match tcc::onnx::import(&bytes, &opts) {
                Ok(i) => (i, true),
                Err(e) => return Outcome::Unsupported(e.to_string()),
            }
        }
        Err(e) => return Outcome::Unsupported(e.to_string()),
    };
    let mut sources = tcc::front::Sources::new("imported.tdsl", imp.tdsl.as_bytes());
    let g = match tcc::front::compile(&mut sources, &Default::default()) {
        Ok(mut l) if l.graphs.len() == 1 => l.graphs.remove(0),
        Ok(_) => return Outcome::Fail("the import has no single model".into()),
        Err(d) => {
            let msgs: Vec<String> = d
                .iter()
                .map(|d| {
                    let labels: Vec<&str> = d.labels.iter().map(|l| l.message.as_str()).collect();
                    format!("{} ({})", d.message, labels.join("; "))
                })
                .collect();
            return Outcome::Fail(format!(
                "the imported program does not compile: {}\n{}",
                msgs.join(" | "),
                imp.tdsl
            ));
        }
    };
    let popts = tcc::pipeline::Options {
        verify: true,
        ..Default::default()
    };
    let g = match tcc::pipeline::lowered(g, Default::default(), "schedule", &popts, &mut |_, _| {})
    {
        Ok((tcc::pipeline::Product::Graph(g), _)) => g,
        Ok(_) => return Outcome::Fail("the pipeline gave no graph".into()),
        Err(e) => return Outcome::Fail(format!("pipeline: {e}")),
    };
    let opts = tcc_tests::device_options(device(), true);
    let c = match tcc::artifact::compile(&g, &opts) {
        Ok(c) => c,
        Err(e) => return Outcome::Fail(format!("compile: {e}")),
    };
    let given: BTreeMap<String, tcc::eager::io::TensorBytes> = imp
        .params
        .iter()
        .map(|(n, t)| (n.clone(), t.clone()))
        .collect();
    let img = match tcc::artifact::persistent_image(&c, 0, &given) {
        Ok(i) => i,
        Err(e) => return Outcome::Fail(format!("params: {e}")),
    };
    let art = tcc::artifact::write_artifact(&c, opts.target, &img);
    let model = match tcc_runtime::Model::from_bytes(art) {
        Ok(m) => m,
        Err(e) => return Outcome::Fail(format!("load: {e}")),
    };
    let mut s = match tcc_runtime::Session::new(&model, device()) {
        Ok(s) => s,
        Err(e) => return Outcome::Fail(format!("session: {e}")),
    };
    let sets = sorted_files(dir, "test_data_set_");
    if sets.is_empty() {
        return Outcome::Fail("no test_data_set_*".into());
    }
    for set in sets {
        let read = |p: &Path| -> Result<Tensor, String> {
            let b = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
            tcc::onnx::read_tensor_file_as(&b, as_f32)
                .map(|(_, t)| t)
                .map_err(|e| format!("{}: {e}", p.display()))
        };
        let ins = sorted_files(&set, "input_");
        if ins.len() != imp.inputs.len() {
            return Outcome::Fail(format!(
                "{} input files for {} inputs",
                ins.len(),
                imp.inputs.len()
            ));
        }
        for (p, io) in ins.iter().zip(&imp.inputs) {
            let t = match read(p) {
                Ok(t) => t,
                Err(e) => return Outcome::Unsupported(format!("input data: {e}")),
            };
            if t.dims() != io.dims.as_slice() || t.ty.dtype != io.dtype {
                return Outcome::Fail(format!(
                    "input `{}` is {} in the data, {}{:?} in the model",
                    io.onnx, t.ty, io.dtype, io.dims
                ));
            }
            if let Err(e) = s.set_input_bytes(&io.tdsl, &t.to_le_bytes()) {
                return Outcome::Fail(format!("input `{}`: {e}", io.onnx));
            }
        }
        if let Err(e) = s.run() {
            return Outcome::Fail(format!("run: {e}"));
        }
        let outs = sorted_files(&set, "output_");
        if outs.len() != imp.outputs.len() {
            return Outcome::Fail(format!(
                "{} output files for {} outputs",
                outs.len(),
                imp.outputs.len()
            ));
        }
        for (p, io) in outs.iter().zip(&imp.outputs) {
            let want = match read(p) {
                Ok(t) => t,
                Err(e) => return Outcome::Unsupported(format!("output data: {e}")),
            };
            let got = match s.output_bytes(&io.tdsl).map(|b| {
                Tensor::from_le_bytes(
                    tcc::ir::TensorType::new(io.dtype, tcc::ir::Shape(io.dims.clone())),
                    b,
                )
            }) {
                Ok(Some(t)) => t,
                Ok(None) => return Outcome::Fail(format!("output `{}`: wrong size", io.onnx)),
                Err(e) => return Outcome::Fail(format!("output `{}`: {e}", io.onnx)),
            };
            if let Err(e) = compare(&io.onnx, &got, &want) {
                return Outcome::Fail(e);
            }
        }
    }
    if as_f32 {
        Outcome::PassAsF32
    } else {
        Outcome::Pass
    }
}

fn expected_pass() -> Vec<String> {
    let p = tcc_tests::root().join("tests/cases/onnx/expected_pass.txt");
    std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect()
}

#[test]
fn onnx_backend_cases() {
    // The op cases written by scripts/onnx_op_cases.py live in the repository.
    let mut roots = vec![(
        "ops".to_string(),
        tcc_tests::root().join("tests/cases/onnx/ops"),
    )];
    match data_dir() {
        Some(root) => {
            for f in FOLDERS {
                roots.push((f.to_string(), root.join(f)));
            }
        }
        None => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "the onnx package's backend test data is missing (pip install onnx; or set TCC_ONNX_DATA)"
            );
            eprintln!(
                "onnx_backend: the onnx package's cases skipped (no onnx package: `pip install onnx`, or set TCC_ONNX_DATA); only tests/cases/onnx/ops runs"
            );
        }
    }
    let only = std::env::var("TCC_ONNX_CASE").ok();
    let mut passed = Vec::new();
    let mut report = String::new();
    let mut totals = Vec::new();
    let have_package = roots.len() > 1;
    for (folder, dir) in &roots {
        let mut cases: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|r| r.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        cases.retain(|p| p.join("model.onnx").is_file());
        cases.sort();
        let (mut p, mut f, mut u, mut as_f32) = (0, 0, 0, 0);
        for case in cases {
            let name = format!(
                "{folder}/{}",
                case.file_name().and_then(|n| n.to_str()).unwrap_or("?")
            );
            if only.as_ref().is_some_and(|o| !name.contains(o.as_str())) {
                continue;
            }
            let outcome = std::panic::catch_unwind(|| run_case(&case))
                .unwrap_or_else(|_| Outcome::Fail("panic (a bug)".into()));
            let line = match outcome {
                Outcome::Pass => {
                    p += 1;
                    passed.push(name.clone());
                    format!("pass         {name}")
                }
                Outcome::PassAsF32 => {
                    p += 1;
                    as_f32 += 1;
                    passed.push(name.clone());
                    format!("pass         {name} (float64 computed in f32: --f64-as-f32)")
                }
                Outcome::Fail(why) => {
                    f += 1;
                    format!("FAIL         {name}: {why}")
                }
                Outcome::Unsupported(why) => {
                    u += 1;
                    format!("unsupported  {name}: {why}")
                }
            };
            report.push_str(&line);
            report.push('\n');
        }
        let note = if as_f32 > 0 {
            format!(" ({as_f32} of them with float64 computed in f32)")
        } else {
            String::new()
        };
        totals.push(format!(
            "{folder}: {p} passed{note}, {f} failed, {u} unsupported"
        ));
    }
    eprint!("{report}");
    let on = match device() {
        tcc_runtime::Device::Cpu => "",
        tcc_runtime::Device::Cuda(_) => " (cuda)",
    };
    for t in &totals {
        eprintln!("onnx_backend{on}: {t}");
    }
    if only.is_some() {
        return;
    }
    let expected: Vec<String> = expected_pass()
        .into_iter()
        .filter(|e| have_package || e.starts_with("ops/"))
        .collect();
    let lost: Vec<&String> = expected.iter().filter(|e| !passed.contains(e)).collect();
    let new: Vec<&String> = passed.iter().filter(|p| !expected.contains(p)).collect();
    if !new.is_empty() {
        eprintln!(
            "onnx_backend: {} cases pass that tests/cases/onnx/expected_pass.txt does not list (add them):",
            new.len()
        );
        for n in &new {
            eprintln!("{n}");
        }
    }
    assert!(
        lost.is_empty(),
        "cases listed in tests/cases/onnx/expected_pass.txt no longer pass: {lost:?}"
    );
}
