//! The embedding example trains a small mlp artifact and the loss falls.

use std::process::Command;
use tcc::artifact::{self, CompileOptions, Target};
use tcc_tests::{compile_pipeline, options_from_args, root};

#[test]
fn embed_trains_the_mlp_artifact() {
    let src = std::fs::read_to_string(root().join("examples/mlp.tdsl")).unwrap();
    let g = compile_pipeline(&src, &options_from_args("--set B=32 --set D=64")).unwrap();
    let c = artifact::compile(&g, &CompileOptions::default()).unwrap();
    let img = artifact::persistent_image(&c, 0, &Default::default()).unwrap();
    let bytes = artifact::write_artifact(&c, Target::Cpu, &img);
    let dir = std::env::temp_dir().join(format!("tcc-embed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("mlp.tcc");
    std::fs::write(&path, bytes).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_embed"))
        .arg(&path)
        .arg("300")
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let losses: Vec<f64> = text
        .lines()
        .filter_map(|l| l.split("loss ").nth(1))
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    assert!(losses.len() >= 3, "{text}");
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(last < first / 3.0, "loss {first} -> {last}\n{text}");
}
