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
