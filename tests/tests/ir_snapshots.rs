//! Snapshots of the graph IR of every example and every LANGUAGE.md program.

use tcc::front::Options;
use tcc::ir::verify::verify;
use tcc_tests::*;

#[test]
fn examples_ir() {
    let files = tdsl_files("examples");
    assert!(files.len() >= 4, "expected mlp, cnn, gpt and tiny examples");
    for path in files {
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("?")
            .to_string();
        let rel = format!("examples/{stem}.tdsl");
        let (sources, lowered) =
            compile_repo_file(&rel, &Options::default()).unwrap_or_else(|e| panic!("{rel}:\n{e}"));
        assert!(lowered.warnings.is_empty(), "{rel} has warnings");
        for g in &lowered.graphs {
            verify(g).unwrap_or_else(|e| panic!("{rel}: {e:?}"));
        }
        insta::assert_snapshot!(format!("example_{stem}"), ir_text(&sources, &lowered));
    }
}

#[test]
fn language_md_programs_ir() {
    let examples = language_examples();
    assert!(
        examples.len() >= 2,
        "LANGUAGE.md should hold at least two programs"
    );
    for (i, src) in examples.iter().enumerate() {
        let name = format!("LANGUAGE.md#{i}");
        let (sources, lowered) = compile_bytes(&name, src.as_bytes(), &Options::default())
            .unwrap_or_else(|e| panic!("{name} must check:\n{e}"));
        for g in &lowered.graphs {
            verify(g).unwrap_or_else(|e| panic!("{name}: {e:?}"));
        }
        insta::assert_snapshot!(format!("language_md_{i}"), ir_text(&sources, &lowered));
    }
}

#[test]
fn set_shrinks_gpt() {
    let full = compile_repo_file("examples/gpt.tdsl", &Options::default()).unwrap();
    let small = compile_repo_file("examples/gpt.tdsl", &options_from_args("--set L=2")).unwrap();
    let (nf, ns) = (
        full.1.graphs[0].node_count(),
        small.1.graphs[0].node_count(),
    );
    // Each block adds the same number of nodes.
    let one = compile_repo_file("examples/gpt.tdsl", &options_from_args("--set L=1")).unwrap();
    let n1 = one.1.graphs[0].node_count();
    let per_block = ns - n1;
    assert!(
        per_block > 20,
        "a transformer block is more than 20 nodes, got {per_block}"
    );
    assert_eq!(nf, n1 + 11 * per_block, "12 blocks unrolled");
    let text = ir_text(&small.0, &small.1);
    assert!(text.contains("param wqkv init=normal(0.0, 0.02) : f32[2, 768, 2304]"));
}

#[test]
fn ir_is_deterministic() {
    let a = compile_repo_file("examples/cnn.tdsl", &Options::default()).unwrap();
    let b = compile_repo_file("examples/cnn.tdsl", &Options::default()).unwrap();
    assert_eq!(ir_text(&a.0, &a.1), ir_text(&b.0, &b.1));
}
