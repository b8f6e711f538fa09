//! Build information for `tcc --version`: the commit the binary was built from (when built
//! from a git checkout) and whether the CUDA back end's executor is compiled in.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    // Rebuild the string when HEAD moves or the branch it names gets a new commit.
    for what in ["HEAD", "packed-refs"] {
        if let Some(p) = git(&["rev-parse", "--git-path", what]) {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
        if let Some(p) = git(&["rev-parse", "--git-path", &r]) {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_CUDA");
    let commit = match (
        git(&["rev-parse", "--short=12", "HEAD"]),
        git(&["show", "-s", "--format=%cs", "HEAD"]),
    ) {
        (Some(c), Some(d)) => format!("commit {c} {d}"),
        (Some(c), None) => format!("commit {c}"),
        _ => "commit unknown".to_string(),
    };
    let targets = if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        "builds for cpu and cuda, runs on cpu and cuda"
    } else {
        "builds for cpu and cuda, runs on cpu (running on cuda needs `--features cuda`)"
    };
    println!("cargo:rustc-env=TCC_BUILD_INFO={commit}; {targets}");
}
