//! `tcc import model.onnx` and the `.onnx` branch of the commands that read a program
//! (`build`, `run`, `mem`, `check`): the model is imported in memory, its TDSL compiled as
//! any program and its initializers given to the compiled step as the params' values.

use super::ProgramArgs;
use crate::eager::io::TensorBytes;
use crate::eager::Tensor;
use crate::onnx::{self, ImportOptions, Imported};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Whether a program file is an ONNX model (by its extension).
pub fn is_onnx(p: &Path) -> bool {
    p.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("onnx"))
}

/// `--dim NAME=N` pairs (or `--set NAME=N` on build/run/mem) as dimension sizes.
pub fn dims(pairs: &[(String, String)], flag: &str) -> Result<Vec<(String, usize)>, String> {
    pairs
        .iter()
        .map(|(n, v)| match v.trim().parse::<usize>() {
            Ok(d) if d > 0 => Ok((n.clone(), d)),
            _ => Err(format!(
                "{flag} {n}={v}: a dimension size must be a positive integer"
            )),
        })
        .collect()
}

/// Imports `file` with the named dimension sizes.
pub fn import_file(
    file: &Path,
    dims: Vec<(String, usize)>,
    f64_as_f32: bool,
) -> Result<Imported, String> {
    // A protobuf message starts with a field's tag, never a zero byte: refuse such a file
    // (`/dev/zero`) before reading up to the size limit.
    let bytes = tcc_runtime::fsutil::read_capped_checked(file, super::MAX_ONNX_BYTES, 1, |b| {
        if b.first() == Some(&0) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "not an ONNX model (a protobuf message cannot start with a zero byte)",
            ));
        }
        Ok(())
    })
    .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let stem = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let opts = ImportOptions {
        dims,
        name: Some(onnx_model_name(&stem)),
        f64_as_f32,
    };
    onnx::import_owned(bytes, &opts).map_err(|e| format!("{}: {e}", file.display()))
}

/// The note on the float64 values `--f64-as-f32` computed in f32 (printed once per command).
fn note_demoted(imp: &Imported) {
    if !imp.demoted.is_empty() {
        eprintln!(
            "note: --f64-as-f32: {} float64 value{} computed in f32 ({})",
            imp.demoted.len(),
            if imp.demoted.len() == 1 {
                " is"
            } else {
                "s are"
            },
            imp.demoted
                .iter()
                .take(5)
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
                + if imp.demoted.len() > 5 { ", …" } else { "" }
        );
    }
}

/// The TDSL model name for a file stem.
fn onnx_model_name(stem: &str) -> String {
    let s: String = stem
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if s.is_empty() || s == "model" {
        "imported".into()
    } else if s.starts_with(|c: char| c.is_ascii_digit()) {
        format!("m_{s}")
    } else {
        s
    }
}

/// The program of an `.onnx` file for the front end (with `--set` as dimension sizes).
pub fn program_source(program: &ProgramArgs) -> Result<Imported, String> {
    let imp = import_file(
        &program.file,
        dims(&program.sets, "--set")?,
        program.f64_as_f32,
    )?;
    note_demoted(&imp);
    // The names a command line uses (`--input`, `--save-outputs`) one by one; the others
    // (every intermediate value of a large model) as a count.
    let io: Vec<&str> = imp
        .inputs
        .iter()
        .chain(&imp.outputs)
        .map(|v| v.onnx.as_str())
        .collect();
    let mut others = 0;
    for (from, to) in &imp.renamed {
        if io.contains(&from.as_str()) {
            eprintln!("note: ONNX name `{from}` is `{to}` in the imported program");
        } else {
            others += 1;
        }
    }
    if others > 0 {
        eprintln!(
            "note: {others} other ONNX name{} renamed (`tcc import` lists them all)",
            if others == 1 { " is" } else { "s are" }
        );
    }
    Ok(imp)
}

/// The params' values of an `.onnx` program (empty for other files), as the bytes an
/// artifact stores.
pub fn given_params(program: &ProgramArgs) -> Result<BTreeMap<String, TensorBytes>, String> {
    if !is_onnx(&program.file) {
        return Ok(BTreeMap::new());
    }
    let imp = import_file(
        &program.file,
        dims(&program.sets, "--set")?,
        program.f64_as_f32,
    )?;
    Ok(imp.params.into_iter().collect())
}

/// [`given_params`] as the interpreter's tensors (`--eager`).
pub fn given_params_tensors(program: &ProgramArgs) -> Result<BTreeMap<String, Tensor>, String> {
    given_params(program)?
        .into_iter()
        .map(|(name, t)| match t.to_tensor() {
            Some(t) => Ok((name, t)),
            None => Err(format!(
                "internal error: the imported bytes of `{name}` do not match its type"
            )),
        })
        .collect()
}

/// `tcc import`: writes `STEM.tdsl` and `STEM.safetensors`.
pub fn run_import(
    file: &Path,
    out_dir: Option<&Path>,
    out_tdsl: Option<&Path>,
    dim_pairs: &[(String, String)],
    f64_as_f32: bool,
) -> Result<(), String> {
    let imp = import_file(file, dims(dim_pairs, "--dim")?, f64_as_f32)?;
    note_demoted(&imp);
    // The program must compile as it is written: check it before writing anything.
    let mut sources = crate::front::Sources::new("imported.tdsl", imp.tdsl.as_bytes());
    if let Err(diags) = crate::front::compile(&mut sources, &Default::default()) {
        let msgs: Vec<String> = diags.iter().map(|d| d.message.clone()).collect();
        return Err(format!(
            "internal error: the program imported from {} does not compile: {}",
            file.display(),
            msgs.join("; ")
        ));
    }
    let stem = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let tdsl_path: PathBuf = match (out_tdsl, out_dir) {
        (Some(p), _) => p.to_path_buf(),
        (None, Some(d)) => d.join(format!("{stem}.tdsl")),
        (None, None) => PathBuf::from(format!("{stem}.tdsl")),
    };
    let st_path = tdsl_path.with_extension("safetensors");
    if let Some(dir) = tdsl_path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    tcc_runtime::fsutil::write_atomic(&tdsl_path, imp.tdsl.as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", tdsl_path.display()))?;
    let st = crate::eager::io::write_safetensors_bytes(&imp.params)
        .map_err(|e| format!("cannot save params: {e}"))?;
    tcc_runtime::fsutil::write_atomic(&st_path, &st)
        .map_err(|e| format!("cannot write {}: {e}", st_path.display()))?;
    for (from, to) in &imp.renamed {
        println!("renamed: ONNX `{from}` -> `{to}`");
    }
    println!(
        "wrote {} (model `{}`, opset {}: {} inputs, {} params, {} outputs) and {} ({} tensors, {})",
        tdsl_path.display(),
        imp.model,
        imp.opset,
        imp.inputs.len(),
        imp.params.len(),
        imp.outputs.len(),
        st_path.display(),
        imp.params.len(),
        super::run::bytes(st.len() as u64)
    );
    Ok(())
}

/// Params read from `--param-file` for a program whose params have no initialiser, by the
/// graph's names and types (so the artifact can be built with them).
pub fn params_from_file(
    g: &crate::ir::Graph,
    path: &Path,
) -> Result<BTreeMap<String, TensorBytes>, String> {
    let wanted: Vec<(String, crate::ir::TensorType)> = g
        .persistent_tensors()
        .into_iter()
        .filter_map(|(p, name, ty)| match &g.node(p).op {
            crate::ir::Op::Param {
                init: crate::ir::Init::External,
                ..
            } => Some((name, ty)),
            _ => None,
        })
        .collect();
    if wanted.is_empty() {
        return Ok(BTreeMap::new());
    }
    Ok(crate::eager::io::read_safetensors_bytes(path, &wanted)
        .map_err(|e| e.to_string())?
        .into_iter()
        .collect())
}
