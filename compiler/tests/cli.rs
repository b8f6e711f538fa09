//! The `tcc` binary end to end: exit codes, messages, emitted IR.

use std::path::PathBuf;
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn tcc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tcc"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("tcc runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn version_and_help() {
    let o = tcc(&["--version"]);
    assert!(o.status.success());
    let v = stdout(&o);
    assert!(v.starts_with("tcc 0."), "{v}");
    // The commit (a hex hash, or `unknown` outside a git checkout) and what it runs on.
    let commit = v
        .split("commit ")
        .nth(1)
        .and_then(|r| r.split([' ', ';']).next())
        .unwrap_or("");
    assert!(
        commit == "unknown" || (commit.len() >= 7 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
        "{v}"
    );
    assert!(v.contains("runs on cpu"), "{v}");
    assert_eq!(tcc(&["-V"]).stdout, o.stdout);
    // `-q` leaves results and errors only.
    let o = tcc(&["check", "examples/tiny.tdsl", "-q"]);
    assert!(o.status.success());
    assert!(!stderr(&o).contains("checked"), "{}", stderr(&o));
    let o = tcc(&["-q", "run", "examples/tiny.tdsl", "--steps", "1"]);
    assert!(o.status.success());
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    assert!(stdout(&o).contains("step    1"), "{}", stdout(&o));
    let o = tcc(&["-q", "run", "examples/none.tdsl"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("error"), "{}", stderr(&o));
    let o = tcc(&["help"]);
    assert!(o.status.success());
    for cmd in ["check", "build"] {
        assert!(stdout(&o).contains(cmd));
    }
}

#[test]
fn check_examples_exit_zero() {
    for ex in ["tiny", "mlp", "cnn", "gpt"] {
        let o = tcc(&["check", &format!("examples/{ex}.tdsl")]);
        assert!(o.status.success(), "{ex}: {}", stderr(&o));
        assert!(stderr(&o).contains("ok: model"), "{}", stderr(&o));
    }
}

#[test]
fn user_errors_exit_one() {
    let o = tcc(&[
        "check",
        "tests/cases/errors/matmul_mismatch.tdsl",
        "--color",
        "never",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("error[E0301]: matmul inner dimensions differ"),
        "{err}"
    );
    assert!(err.contains("matmul_mismatch.tdsl:7:18"), "{err}");
    assert!(
        err.contains("f32[256, 1024] @ f32[784, 1024]: 1024 ≠ 784"),
        "{err}"
    );
}

#[test]
fn missing_file_is_a_clear_error() {
    let o = tcc(&["check", "no/such/file.tdsl"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("cannot read no/such/file.tdsl"));
}

#[test]
fn bad_command_lines_are_rejected() {
    let o = tcc(&["check", "examples/tiny.tdsl", "--frobnicate"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--frobnicate"));
    let o = tcc(&["build", "examples/tiny.tdsl", "--emit", "llvm"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("llvm") && stderr(&o).contains("ir"),
        "{}",
        stderr(&o)
    );
    let o = tcc(&["build", "examples/tiny.tdsl", "--target", "tpu"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("tpu") && stderr(&o).contains("cuda"),
        "{}",
        stderr(&o)
    );
    let o = tcc(&["check", "examples/tiny.tdsl", "--set", "B"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("NAME=VALUE"));
    let o = tcc(&["check", "examples/tiny.tdsl", "--set", "Q=3"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("no constant named `Q`"));
}

#[test]
fn build_emits_ir_and_set_shrinks_it() {
    let full = tcc(&["build", "examples/gpt.tdsl", "--emit", "ir"]);
    assert!(full.status.success(), "{}", stderr(&full));
    let text = stdout(&full);
    assert!(text.starts_with("model gpt {"));
    // 12 unrolled blocks: one select of each stacked per-layer param per block.
    assert_eq!(text.matches("select %4 axis=0").count(), 12);
    let small = tcc(&["build", "examples/gpt.tdsl", "--emit", "ir", "--set", "L=2"]);
    assert!(small.status.success());
    assert_eq!(stdout(&small).matches("select %4 axis=0").count(), 2);
    assert!(stdout(&small).lines().count() < text.lines().count() / 3);
}

#[test]
fn build_writes_output_file() {
    let dir = std::env::temp_dir().join(format!("tcc-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("mlp.ir");
    let o = tcc(&[
        "build",
        "examples/mlp.tdsl",
        "--emit",
        "ir",
        "-o",
        out.to_str().unwrap(),
        "--locations",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.contains("output loss"));
    assert!(text.contains("  @"), "locations requested");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn several_models_need_a_choice_for_build() {
    let dir = std::env::temp_dir().join(format!("tcc-cli-two-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("two.tdsl");
    std::fs::write(
        &f,
        "model a { input x: f32[2]\n output x }\nmodel b { input y: f32[3]\n output y }\n",
    )
    .unwrap();
    let path = f.to_str().unwrap();
    assert!(
        tcc(&["check", path]).status.success(),
        "check takes every model"
    );
    let o = tcc(&["build", path]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--model"));
    let o = tcc(&["build", path, "--model", "b", "--emit", "ir"]);
    assert!(o.status.success());
    assert!(stdout(&o).contains("model b {"));
    std::fs::remove_dir_all(&dir).ok();
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tcc-cli-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write_npy_f32(path: &std::path::Path, shape: &[u64], data: &[f32]) {
    use npyz::WriterBuilder;
    let mut buf = std::io::Cursor::new(Vec::new());
    {
        let mut w = npyz::WriteOptions::new()
            .default_dtype()
            .shape(shape)
            .writer(&mut buf)
            .begin_nd()
            .unwrap();
        w.extend(data.iter().copied()).unwrap();
        w.finish().unwrap();
    }
    std::fs::write(path, buf.into_inner()).unwrap();
}

#[test]
fn run_eager_trains_and_reports_memory() {
    let o = tcc(&[
        "run",
        "examples/tiny.tdsl",
        "--eager",
        "--steps",
        "5",
        "--every",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert_eq!(
        out.matches("step ").count(),
        3 + 1,
        "steps 2, 4 and 5, then the timing line:\n{out}"
    );
    assert!(out.contains("loss: f32[] = "));
    assert!(out.contains("eager memory peak: "));
    assert!(out.contains("step time: median"));
    let o = tcc(&["run", "examples/gpt.tdsl", "--eager", "--steps", "0"]);
    assert!(o.status.success());
    assert!(
        stdout(&o).contains("optimizer state 696.15 MiB"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn run_compiles_for_the_cpu_and_trains() {
    let o = tcc(&[
        "run",
        "examples/tiny.tdsl",
        "--steps",
        "30",
        "--every",
        "10",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("arena: "), "{out}");
    assert!(out.contains("step time: median"), "{out}");
    let losses: Vec<f64> = out
        .lines()
        .filter_map(|l| l.split("loss: f32[] = ").nth(1))
        .filter_map(|v| v.split_whitespace().next()?.parse().ok())
        .collect();
    assert_eq!(losses.len(), 3, "{out}");
    assert!(losses[2] < losses[0], "{out}");
    assert!(stderr(&o).contains("kernels"), "{}", stderr(&o));
}

/// `TCC_PERF_MAP=1` names every JIT kernel in perf's map file for the process, at its
/// address, so `perf report` can attribute samples to kernels.
#[test]
fn perf_map_names_the_jit_kernels() {
    let child = Command::new(env!("CARGO_BIN_EXE_tcc"))
        .args(["run", "examples/tiny.tdsl", "--steps", "1", "-q"])
        .current_dir(root())
        .env("TCC_PERF_MAP", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("tcc runs");
    let map = PathBuf::from(format!("/tmp/perf-{}.map", child.id()));
    let o = child.wait_with_output().expect("tcc runs");
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&map).unwrap_or_default();
    let _ = std::fs::remove_file(&map);
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines.iter().any(|l| l.ends_with(" tcc_kernel_k0")),
        "{text}"
    );
    for l in lines {
        let f: Vec<&str> = l.split(' ').collect();
        assert_eq!(f.len(), 3, "{l}");
        let at = u64::from_str_radix(f[0], 16).unwrap_or(0);
        let size = u64::from_str_radix(f[1], 16).unwrap_or(0);
        assert!(at > 0 && size > 0, "{l}");
    }
}

#[test]
fn build_artifact_then_run_it_and_reject_a_corrupt_one() {
    let d = tmpdir("artifact");
    let path = d.join("tiny.tcc");
    let p = path.display().to_string();
    let o = tcc(&[
        "build",
        "examples/tiny.tdsl",
        "--emit",
        "artifact",
        "-o",
        &p,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = tcc(&["run", &p, "--steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("step    2"), "{}", stdout(&o));
    // Flip a byte in the middle of the file: a section checksum fails.
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() - 8;
    bytes[mid] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let o = tcc(&["run", &p]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("corrupt"), "{}", stderr(&o));
    // Truncated.
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let o = tcc(&["run", &p]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("truncated"), "{}", stderr(&o));
    // Kernels and CLIF print.
    let o = tcc(&["build", "examples/tiny.tdsl", "--emit", "kernels"]);
    assert!(stdout(&o).contains("matmul batch=[]"), "{}", stdout(&o));
    let o = tcc(&["build", "examples/tiny.tdsl", "--emit", "clif"]);
    assert!(
        stdout(&o).contains("function %k0(i64, i64, i64, i64) system_v"),
        "{}",
        stdout(&o)
    );
    let o = tcc(&["run", "examples/tiny.tdsl", "--target", "cuda"]);
    assert_eq!(o.status.code(), Some(1));
}

/// An endless file (`/dev/zero`) named where tcc reads a source, an input, params or an
/// artifact is refused after its first bytes or at a stated size limit, never read until
/// memory runs out (issue 32, g7).
#[cfg(unix)]
#[test]
fn endless_files_are_refused_not_read() {
    let cases: [(&[&str], &str); 4] = [
        (&["check", "/dev/zero"], "longer than the 268435456 bytes"),
        (
            &["run", "examples/tiny.tdsl", "--input", "x=/dev/zero"],
            "not a valid .npy file",
        ),
        (
            &["run", "examples/tiny.tdsl", "--param-file", "/dev/zero"],
            "safetensors",
        ),
        (
            &[
                "run",
                "examples/tiny.tdsl",
                "--eager",
                "--input",
                "y=/dev/zero",
            ],
            "not a valid .npy file",
        ),
    ];
    for (args, needle) in cases {
        let o = tcc(args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn run_reads_npy_inputs_and_reports_bad_ones() {
    let d = tmpdir("npy");
    let x = d.join("x.npy");
    write_npy_f32(&x, &[4, 3], &[0.0; 12]);
    let y = d.join("y.npy");
    write_npy_f32(&y, &[4, 2], &[1.0; 8]);
    let (xs, ys) = (format!("x={}", x.display()), format!("y={}", y.display()));
    // With x = 0 the prediction is b = 0 at the first step: loss = mean((0 - 1)^2) = 1.
    let o = tcc(&[
        "run",
        "examples/tiny.tdsl",
        "--eager",
        "--input",
        &xs,
        "--input",
        &ys,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("loss: f32[] = 1.000000"),
        "{}",
        stdout(&o)
    );
    let o = tcc(&[
        "run",
        "examples/tiny.tdsl",
        "--eager",
        "--input",
        &format!("y={}", x.display()),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("`y` is shape [4, 3], but the model declares f32[4, 2]"),
        "{}",
        stderr(&o)
    );
    let o = tcc(&[
        "run",
        "examples/tiny.tdsl",
        "--eager",
        "--input",
        &format!("z={}", x.display()),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("no input `z`"));
    let bad = d.join("bad.npy");
    std::fs::write(&bad, b"not an npy file").unwrap();
    let o = tcc(&[
        "run",
        "examples/tiny.tdsl",
        "--eager",
        "--input",
        &format!("x={}", bad.display()),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("not a valid .npy file"),
        "{}",
        stderr(&o)
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn run_saves_and_loads_params() {
    let d = tmpdir("st");
    let saved = d.join("w.safetensors");
    let o = tcc(&[
        "run",
        "examples/tiny.tdsl",
        "--eager",
        "--steps",
        "3",
        "--save-params",
        saved.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = tcc(&[
        "run",
        "examples/tiny.tdsl",
        "--eager",
        "--param-file",
        saved.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("loaded 2 tensors"), "{}", stderr(&o));
    // Loading the trained params continues from step 3: the loss is lower than a fresh start.
    let loss = |o: &Output| {
        let s = stdout(o);
        let at = s.find("loss: f32[] = ").unwrap() + 14;
        s[at..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    let fresh = tcc(&["run", "examples/tiny.tdsl", "--eager"]);
    assert!(loss(&o) < loss(&fresh));
    let bad = d.join("bad.safetensors");
    std::fs::write(&bad, [1u8, 2, 3]).unwrap();
    let o = tcc(&[
        "run",
        "examples/tiny.tdsl",
        "--eager",
        "--param-file",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("not a valid .safetensors file"),
        "{}",
        stderr(&o)
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn print_after_and_stop_after() {
    let o = tcc(&[
        "build",
        "examples/tiny.tdsl",
        "--print-after",
        "lower",
        "--stop-after",
        "lower",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("// ----- IR after lower -----"));
    assert!(!stdout(&o).contains("update"), "stopped before autodiff");
    let o = tcc(&["build", "examples/tiny.tdsl", "--emit", "ir"]);
    assert!(stdout(&o).contains("update %2 <- "), "{}", stdout(&o));
    let o = tcc(&[
        "build",
        "examples/tiny.tdsl",
        "--stop-after",
        "fuse-everything",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("invalid value 'fuse-everything'"));
    assert!(stderr(&o).contains("split_reductions"), "{}", stderr(&o));
}

#[test]
fn micro_batches_split_the_step_and_fit_finds_the_fewest_that_fit() {
    let gpt = [
        "--set", "L=2", "--set", "T=128", "--set", "D=64", "--set", "V=128", "--set", "H=2",
    ];
    // `mem` says the step is split and plans less than the whole batch's arena.
    let arena = |k: &str| {
        let mut args = vec!["mem", "examples/gpt.tdsl", "--json", "--micro-batches", k];
        args.extend(gpt);
        let o = tcc(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        v
    };
    let (whole, split) = (arena("1"), arena("4"));
    assert!(whole.get("micro_batches").is_none(), "{whole}");
    assert_eq!(split["micro_batches"], 4, "{split}");
    let bytes = |v: &serde_json::Value| v["fused_arena_bytes"].as_u64().expect("arena");
    assert!(bytes(&split) < bytes(&whole), "{split} vs {whole}");
    // `fit` grows the batch past what fits whole, with the fewest micro-batches that fit.
    let fit = |k: &str| {
        let mut args = vec![
            "fit",
            "examples/gpt.tdsl",
            "--mem-budget",
            "12MiB",
            "--grow",
            "B",
            "--micro-batches",
            k,
        ];
        args.extend(gpt);
        let o = tcc(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = stdout(&o);
        let last = out.lines().last().unwrap_or("").to_string();
        let b: u64 = last
            .split(": ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{out}"));
        (b, last)
    };
    let (b1, _) = fit("1");
    let (b8, line) = fit("8");
    assert!(b8 > b1, "{b8} <= {b1}: {line}");
    assert!(line.contains("with --micro-batches"), "{line}");
    // A count that does not divide the batch is an error that says so.
    let mut args = vec![
        "build",
        "examples/gpt.tdsl",
        "--micro-batches",
        "3",
        "-o",
        "/dev/null",
    ];
    args.extend(gpt);
    let o = tcc(&args);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("E0541"), "{}", stderr(&o));
    // The build line says so; an artifact keeps the split it was built with.
    let dir = std::env::temp_dir().join(format!("tcc-cli-micro-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let art = dir.join("gpt.tcc");
    let art = art.to_str().unwrap();
    let mut args = vec![
        "build",
        "examples/gpt.tdsl",
        "--micro-batches",
        "2",
        "-o",
        art,
    ];
    args.extend(gpt);
    let o = tcc(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("in 2 micro-batches"), "{}", stderr(&o));
    let o = tcc(&["run", art, "--micro-batches", "4"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("an artifact runs the step it was built as"),
        "{}",
        stderr(&o)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fit_finds_the_largest_batch_under_a_budget() {
    let o = tcc(&[
        "fit",
        "examples/gpt.tdsl",
        "--mem-budget",
        "4GiB",
        "--grow",
        "B",
        "--set",
        "L=2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let line = out.lines().last().unwrap();
    assert!(line.starts_with("largest B that fits 4.00 GiB: "), "{out}");
    let b: u64 = line
        .split(": ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    // The answer fits and the next value does not (both were tried).
    assert!(out.contains(&format!("B = {b:>8}")));
    let next = out
        .lines()
        .find(|l| l.contains(&format!("B = {:>8}:", b + 1)))
        .unwrap();
    assert!(next.contains("GiB") || next.contains("MiB"));
    let o = tcc(&[
        "fit",
        "examples/gpt.tdsl",
        "--mem-budget",
        "1MiB",
        "--grow",
        "B",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("even B = 1 needs"), "{}", stderr(&o));
    let o = tcc(&[
        "fit",
        "examples/gpt.tdsl",
        "--mem-budget",
        "lots",
        "--grow",
        "B",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("not a size"));
}

#[test]
fn byte_sizes_parse() {
    use tcc::cli::fit::parse_bytes;
    assert_eq!(parse_bytes("16GiB"), Ok(16 << 30));
    assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
    assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
    assert_eq!(parse_bytes("4096"), Ok(4096));
    assert!(parse_bytes("12 parsecs").is_err());
}

#[test]
fn mixed_precision_flags() {
    // The IR shows the casts and the loss scaler's state; run reports the scale.
    let o = tcc(&[
        "build",
        "examples/tiny.tdsl",
        "--amp",
        "f16",
        "--emit",
        "ir",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ir = stdout(&o);
    assert!(
        ir.contains("cast") && ir.contains("f16[") && ir.contains("amp.loss_scale"),
        "{ir}"
    );
    let o = tcc(&["run", "examples/tiny.tdsl", "--amp", "f16", "--steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("loss scale: 65536"), "{}", stdout(&o));
    let o = tcc(&[
        "run",
        "examples/tiny.tdsl",
        "--amp",
        "bf16",
        "--eager",
        "--steps",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = tcc(&["mem", "examples/tiny.tdsl", "--amp", "bf16"]);
    assert!(stdout(&o).contains("by dtype"), "{}", stdout(&o));
    // Bad settings are errors that say what is accepted.
    let o = tcc(&["run", "examples/tiny.tdsl", "--loss-scale", "init=0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("out of range"), "{}", stderr(&o));
    let o = tcc(&["run", "examples/tiny.tdsl", "--loss-scale", "fast"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("expected `none`, `dynamic`"),
        "{}",
        stderr(&o)
    );
    // An artifact keeps the precision it was built with.
    let dir = std::env::temp_dir().join(format!("tcc-cli-amp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let art = dir.join("tiny.tcc");
    let art = art.to_str().unwrap();
    let o = tcc(&[
        "build",
        "examples/tiny.tdsl",
        "--amp",
        "bf16",
        "--emit",
        "artifact",
        "-o",
        art,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = tcc(&["run", art, "--amp", "f16"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("keeps the numerics it was built with"),
        "{}",
        stderr(&o)
    );
    let o = tcc(&["run", art, "--steps", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mem_reports_the_plan_of_the_target() {
    // The CUDA plan fuses attention: smaller than the CPU one, and the JSON says which.
    let json = |target: &str| {
        let o = tcc(&[
            "mem",
            "examples/gpt.tdsl",
            "--set",
            "L=2",
            "--target",
            target,
            "--json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str::<serde_json::Value>(&stdout(&o)).unwrap()
    };
    let (cpu, cuda) = (json("cpu"), json("cuda"));
    assert_eq!(cpu["target"], "cpu");
    assert_eq!(cuda["target"], "cuda");
    let bytes = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k}"));
    assert!(bytes(&cuda, "fused_arena_bytes") < bytes(&cpu, "fused_arena_bytes"));
    for r in [&cpu, &cuda] {
        // Fusion never raises the arena above one op per kernel (`--no-fuse`).
        assert!(
            bytes(r, "fused_arena_bytes") <= bytes(r, "arena_bytes"),
            "{r}"
        );
        assert!(
            bytes(r, "unfused_kernels") > bytes(r, "fused_kernels"),
            "{r}"
        );
        for k in [
            "gradient_peak_bytes",
            "fused_peak_transient_bytes",
            "eager_peak_bytes",
        ] {
            bytes(r, k);
        }
    }
    // The recurrent chain's report says what weighing the peak did.
    let o = tcc(&["mem", "bench/rnn_chain.tdsl", "--set", "T=16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("fusion lowered its transient peak"), "{text}");
    assert!(text.contains("eager, op by op (tcc --eager)"), "{text}");
}

/// `tcc check --color never` on `src`, written to `dir/name.tdsl`.
fn check_source(dir: &std::path::Path, name: &str, src: &str) -> Output {
    let f = dir.join(format!("{name}.tdsl"));
    std::fs::write(&f, src).unwrap();
    tcc(&["check", f.to_str().unwrap(), "--color", "never"])
}

/// A model whose one output is `y = e` over an input `x: f32[4]`.
fn model_of(e: &str) -> String {
    format!("model m {{\n input x: f32[4]\n let y = {e}\n output y\n}}\n")
}

#[test]
fn deeply_nested_programs_are_compiled_or_refused_without_crashing() {
    // Each crashed the compiler with a stack overflow on the main thread's 8 MiB.
    let d = tmpdir("deep");
    let cases = [
        ("minus", format!("{}x", "-".repeat(10_000))),
        (
            "relu",
            format!("{}x{}", "relu(".repeat(5_000), ")".repeat(5_000)),
        ),
        ("sum", format!("x{}", " + x".repeat(10_000))),
    ];
    for (name, e) in &cases {
        let o = check_source(&d, name, &model_of(e));
        assert!(o.status.success(), "{name}: {}", stderr(&o));
    }
    // Brackets nested 10,000 deep in a type: an error, not a crash.
    let ty = format!("f32{}4{}", "[".repeat(10_000), "]".repeat(10_000));
    let o = check_source(
        &d,
        "type",
        &format!("model m {{\n input x: {ty}\n output x\n}}\n"),
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    // Past the nesting limit: E0221, with the way out.
    let e = format!("x{}", " + x".repeat(tcc::front::MAX_EXPR_DEPTH + 10));
    let o = check_source(&d, "limit", &model_of(&e));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("E0221") && stderr(&o).contains("`let` bindings"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_deep_sum_in_a_long_program_builds() {
    // A 10,000-term sum fused into one kernel, among 200 more: the CPU code of so many
    // kernels is translated on worker threads, whose stacks must hold the sum's recursion
    // as the compiler thread's does.
    let d = tmpdir("deep_build");
    let src = format!(
        "model m {{\n input x: f32[8, 8]\n input w: f32[8, 8]\n let h = x{}\n for i in 0..200 {{\n h = relu(h @ w)\n }}\n output h\n}}\n",
        " + x".repeat(10_000)
    );
    let f = d.join("deep.tdsl");
    std::fs::write(&f, src).unwrap();
    let out = d.join("deep.tcc");
    let o = tcc(&[
        "build",
        f.to_str().unwrap(),
        "-q",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn a_line_of_stray_characters_is_one_error_and_long_lists_are_cut() {
    let d = tmpdir("garbage");
    // 5,000 stray characters in one run: one error (it was 5,000, each rendering the line:
    // 23 s and 22 MB of output).
    let o = check_source(&d, "run", &model_of(&format!("x {}", "$#`?".repeat(1250))));
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("5000 unexpected characters"), "{e}");
    assert_eq!(e.matches("error[E0101]").count(), 1, "{e}");
    // 2,000 separate stray characters: 50 shown, the rest counted.
    let o = check_source(&d, "many", &model_of(&format!("x {}", "$ ".repeat(2000))));
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert_eq!(e.matches("error[E0101]").count(), 50, "{e}");
    assert!(e.contains("more diagnostics not shown"), "{e}");
    // Each shown error renders its 4 KB line: 50 of them, not 2,000.
    assert!(e.len() < 400_000, "{} bytes of diagnostics", e.len());
}

fn write_npy_i32(path: &std::path::Path, data: &[i32]) {
    use npyz::WriterBuilder;
    let mut buf = std::io::Cursor::new(Vec::new());
    {
        let mut w = npyz::WriteOptions::new()
            .default_dtype()
            .shape(&[data.len() as u64])
            .writer(&mut buf)
            .begin_nd()
            .unwrap();
        w.extend(data.iter().copied()).unwrap();
        w.finish().unwrap();
    }
    std::fs::write(path, buf.into_inner()).unwrap();
}

/// The `step    N  loss: ...` lines of a run.
fn loss_lines(o: &Output) -> Vec<String> {
    stdout(o)
        .lines()
        .filter(|l| l.starts_with("step ") && l.contains("loss"))
        .map(|l| l.split("  logits").next().unwrap_or(l).to_string())
        .collect()
}

/// Labels outside `0..C` are the same typed error on the interpreter, on a step compiled
/// from source and on an artifact (whose manifest records the bound); inputs not given are
/// the same seeded values from the source as from the artifact, so both train alike (issue
/// 32 group 5, issue 29 item 3: integer inputs of an artifact used to be zeros).
#[test]
fn index_inputs_are_checked_and_seeded_alike_on_every_path() {
    let d = tmpdir("index");
    let art = d.join("mlp.tcc").display().to_string();
    let small = ["--set", "B=8", "--set", "D=32"];
    let mut args = vec![
        "build",
        "examples/mlp.tdsl",
        "--emit",
        "artifact",
        "-o",
        &art,
    ];
    args.extend(small);
    let o = tcc(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let bad = d.join("bad.npy");
    write_npy_i32(&bad, &[0, 1, 2, 3, 4, 5, 6, 10]);
    let bad_arg = format!("labels={}", bad.display());
    let eager = [
        "run",
        "examples/mlp.tdsl",
        "--eager",
        "--set",
        "B=8",
        "--set",
        "D=32",
    ];
    let compiled = ["run", "examples/mlp.tdsl", "--set", "B=8", "--set", "D=32"];
    let artifact = ["run", &art[..]];
    for how in [&eager[..], &compiled[..], &artifact[..]] {
        let mut args = how.to_vec();
        args.extend(["--steps", "1", "--input", &bad_arg]);
        let o = tcc(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(
                "input `labels`: element 7 is 10, outside [0, 10) (the range the model indexes with it)"
            ),
            "{args:?}: {}",
            stderr(&o)
        );
    }
    let mut from_source = vec!["run", "examples/mlp.tdsl", "--steps", "3", "--every", "1"];
    from_source.extend(small);
    let a = tcc(&from_source);
    let b = tcc(&["run", &art, "--steps", "3", "--every", "1"]);
    assert!(
        a.status.success() && b.status.success(),
        "{}{}",
        stderr(&a),
        stderr(&b)
    );
    let (la, lb) = (loss_lines(&a), loss_lines(&b));
    assert_eq!(la.len(), 3, "{}", stdout(&a));
    assert_eq!(la, lb);
    // Not all zero labels: the loss does not collapse to 0 at once.
    assert!(
        !lb[1].contains("= 0.000000") && !lb[1].contains("= -0.000000"),
        "{lb:?}"
    );
}

/// Files are written atomically (issue 32 group 4): a `build -o` that fails partway (here a
/// file-size limit, with SIGXFSZ ignored so the write returns an error) reports it, leaves
/// the previous artifact whole and loadable, and leaves no temporary file; `/dev/null` is
/// still written in place.
#[test]
fn a_failed_write_keeps_the_previous_file() {
    let d = tmpdir("atomic");
    let path = d.join("mlp.tcc");
    let p = path.display().to_string();
    let o = tcc(&[
        "build",
        "examples/tiny.tdsl",
        "--emit",
        "artifact",
        "-o",
        &p,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = std::fs::read(&path).unwrap();
    // 64 KiB at most per file: the mlp's artifact (12 MB) cannot be written.
    let script = format!(
        "trap '' XFSZ; ulimit -f 64; exec {} build examples/mlp.tdsl --emit artifact -o {p}",
        env!("CARGO_BIN_EXE_tcc")
    );
    let o = Command::new("bash")
        .args(["-c", &script])
        .current_dir(root())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot write"), "{}", stderr(&o));
    let after = std::fs::read(&path).unwrap();
    assert!(
        after == before,
        "the previous artifact changed: {} -> {} bytes",
        before.len(),
        after.len()
    );
    let left: Vec<String> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["mlp.tcc".to_string()]);
    let o = tcc(&["run", &p, "--steps", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = tcc(&[
        "build",
        "examples/tiny.tdsl",
        "--emit",
        "artifact",
        "-o",
        "/dev/null",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// A non-finite loss stops `tcc run` at that step with exit code 1, on the interpreter and
/// compiled, unless `--allow-nonfinite`; `--save-params` refuses non-finite params likewise
/// (issue 32, group 9: NaN losses printed with exit 0 and NaN weights were saved).
#[test]
fn non_finite_losses_stop_the_run_and_params_are_not_saved() {
    let d = tmpdir("nonfinite");
    let blowup = d.join("blowup.tdsl");
    std::fs::write(
        &blowup,
        "model m {
            input x: f32[4, 8]
            param w: f32[8, 8] = normal(0.0, 1.0)
            let loss = mean(exp(x @ w) * 1e30)
            output loss
            train sgd(lr: 1.0) minimize loss
        }",
    )
    .unwrap();
    let b = blowup.display().to_string();
    for eager in [false, true] {
        let mut args = vec!["run", &b[..], "--steps", "5", "--every", "10"];
        if eager {
            args.push("--eager");
        }
        let o = tcc(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("output `loss` is inf; the run stops at the first non-finite step"),
            "{}",
            stderr(&o)
        );
        assert!(stdout(&o).contains("loss: f32[] = inf"), "{}", stdout(&o));
        args.push("--allow-nonfinite");
        let o = tcc(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    }
    // One step: the loss is finite, the update is not. The step's finite check stops the
    // run; without it (`--no-finite-check`), `--save-params` still refuses the params.
    let huge = d.join("huge.tdsl");
    std::fs::write(
        &huge,
        "model m {
            input x: f32[4, 8]
            param w: f32[8, 8] = normal(0.0, 1.0)
            let loss = mean(x @ w) * 0.001
            output loss
            train sgd(lr: 1e39) minimize loss
        }",
    )
    .unwrap();
    let h = huge.display().to_string();
    let saved = d.join("p.safetensors");
    let sp = saved.display().to_string();
    for eager in [false, true] {
        let mut args = vec!["run", &h[..], "--steps", "1", "--save-params", &sp];
        if eager {
            args.push("--eager");
        }
        let o = tcc(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(
                "step 1: the params `train` updates are not finite after the step (the sum of \
                 their magnitudes is inf)"
            ),
            "{}",
            stderr(&o)
        );
        assert!(!saved.exists());
        args.push("--no-finite-check");
        let o = tcc(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("not saving params: `w` holds inf"),
            "{}",
            stderr(&o)
        );
        assert!(!saved.exists());
        args.push("--allow-nonfinite");
        let o = tcc(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        assert!(saved.exists());
        std::fs::remove_file(&saved).unwrap();
    }
}

/// A gradient that is NaN while the loss is finite (the derivative of `sqrt(w * w)` at 0)
/// stops the run at that step on every path, and on 2 data-parallel ranks with and without
/// ZeRO-1: the step's finite check sums the params its updates wrote (issue 32, group 9).
/// Loss scaling keeps its own check (the step is skipped), and `--no-finite-check` builds
/// the step without one, so the NaN shows in the next step's loss.
#[test]
fn a_non_finite_gradient_stops_the_run_at_its_step() {
    let d = tmpdir("nan-grad");
    let src = d.join("nan.tdsl");
    std::fs::write(
        &src,
        "model m {
            input x: f32[4, 8]
            param w: f32[8] = zeros
            param v: f32[8, 8] = normal(0.0, 1.0)
            let loss = mean(x @ v) + sum(sqrt(w * w))
            output loss
            train adam(lr: 0.01) minimize loss
        }",
    )
    .unwrap();
    let s = src.display().to_string();
    let want = "error: step 1: the params `train` updates are not finite after the step (the \
                sum of their magnitudes is NaN): a gradient held NaN or infinity";
    for extra in [
        &[][..],
        &["--eager"],
        &["--gpus", "2"],
        &["--gpus", "2", "--zero", "1"],
        &["--amp", "bf16"],
    ] {
        let mut args = vec!["run", &s[..], "--steps", "3"];
        args.extend_from_slice(extra);
        let o = tcc(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{args:?}: {}", stderr(&o));
        assert!(stdout(&o).contains("step    1  loss"), "{}", stdout(&o));
        args.push("--allow-nonfinite");
        let o = tcc(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    }
    // f16 loss scaling skips the non-finite step instead (and every later one here).
    let o = tcc(&["run", &s, "--steps", "3", "--amp", "f16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("3 steps skipped"), "{}", stdout(&o));
    // Without the check, the NaN reaches the loss one step later.
    let o = tcc(&["run", &s, "--steps", "3", "--no-finite-check"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("step 2: output `loss` is NaN"),
        "{}",
        stderr(&o)
    );
    // The artifact records the check; the runtime fails the step itself unless allowed.
    let art = d.join("nan.tcc");
    let o = tcc(&["build", &s, "-o", &art.display().to_string()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let model = tcc_runtime::Model::load(&art).unwrap();
    let mut session = tcc_runtime::Session::new(&model, tcc_runtime::Device::Cpu).unwrap();
    session.set_input_bytes("x", &[0u8; 4 * 8 * 4]).unwrap();
    match session.run() {
        Err(tcc_runtime::Error::NonFiniteUpdate { what, sum }) => {
            assert_eq!(what, "the params `train` updates");
            assert!(sum.is_nan());
        }
        other => panic!("expected NonFiniteUpdate, got {other:?}"),
    }
    session.set_allow_nonfinite(true);
    session.set_input_bytes("x", &[0u8; 4 * 8 * 4]).unwrap();
    session.run().unwrap();
    assert!(session.updated_params_l1().unwrap().unwrap().is_nan());
}

/// Sizes are checked at `check` time (issue 32, group 6): a declared type or an op's result
/// whose bytes overflow or pass 1 TiB is E0317 at its span, on `check` and on `run --eager`
/// (which used to panic with `capacity overflow`).
#[test]
fn tensors_too_large_are_located_errors() {
    let d = tmpdir("sizes");
    for (name, src, span) in [
        (
            "declared",
            "model m {\n    input x: f32[1000000000000, 1000000000000]\n    let y = x * 2.0\n    output y\n}\n",
            "declared.tdsl:2:",
        ),
        (
            "conv",
            "model m {\n    input x: f32[1, 1, 8, 8]\n    param w: f32[1, 1, 3, 3] = ones\n    let y = conv2d(x, w, padding: 4611686018427387904)\n    let s = sum(y)\n    output s\n}\n",
            "conv.tdsl:4:",
        ),
        (
            "broadcast",
            "model m {\n    input x: f32[1048576, 1]\n    input z: f32[1, 1048576]\n    let y = x + z\n    output y\n}\n",
            "broadcast.tdsl:4:",
        ),
    ] {
        let path = d.join(format!("{name}.tdsl"));
        std::fs::write(&path, src).unwrap();
        let p = path.display().to_string();
        for args in [
            vec!["check", &p[..], "--color", "never"],
            vec!["run", &p[..], "--eager", "--color", "never"],
        ] {
            let o = tcc(&args);
            assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
            let err = stderr(&o);
            assert!(err.contains("error[E0317]") && err.contains("is too large"), "{err}");
            assert!(err.contains(span), "{err}");
        }
    }
}

/// `tcc build FILE` writes the artifact `STEM.tcc` in the current directory (rustc's
/// convention), `-o` elsewhere; `--emit ir` prints text (issue 29, items 1 and 2).
#[test]
fn build_writes_the_artifact_in_the_current_directory() {
    let d = tmpdir("default-out");
    let tiny = root().join("examples/tiny.tdsl");
    let o = Command::new(env!("CARGO_BIN_EXE_tcc"))
        .args(["build", &tiny.display().to_string(), "--target", "cuda"])
        .current_dir(&d)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).is_empty(), "{}", stdout(&o));
    let art = d.join("tiny.tcc");
    let m = tcc_runtime::Model::load(&art).unwrap();
    assert_eq!(m.manifest().target, tcc_runtime::Target::Cuda);
    assert!(stderr(&o).contains("wrote tiny.tcc"), "{}", stderr(&o));
    // Nothing next to the source.
    assert!(!root().join("examples/tiny.tcc").exists());
    let o = tcc(&["build", "examples/tiny.tdsl", "--emit", "ir"]);
    assert!(stdout(&o).contains("model tiny"), "{}", stdout(&o));
    // `-o -` is standard output, for the artifact and for a stage's text, and no file `-`.
    let o = Command::new(env!("CARGO_BIN_EXE_tcc"))
        .args(["build", &tiny.display().to_string(), "-o", "-"])
        .current_dir(&d)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(o.stdout.starts_with(b"TCCMODEL"), "{}", stderr(&o));
    let o = Command::new(env!("CARGO_BIN_EXE_tcc"))
        .args([
            "build",
            &tiny.display().to_string(),
            "--stop-after",
            "schedule",
            "-o",
            "-",
        ])
        .current_dir(&d)
        .output()
        .unwrap();
    assert!(stdout(&o).contains("model tiny"), "{}", stdout(&o));
    assert!(!d.join("-").exists());
}

#[test]
fn options_that_do_not_apply_to_an_artifact_are_errors() {
    let d = tmpdir("artifact-options");
    let art = d.join("tiny.tcc").display().to_string();
    let o = tcc(&["build", "examples/tiny.tdsl", "-o", &art]);
    assert!(o.status.success(), "{}", stderr(&o));
    // `--eager` needs the source, and says so in plain text (no binary bytes).
    let o = tcc(&["run", &art, "--eager"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("`--eager` interprets a program's source"), "{e}");
    assert!(e.lines().count() == 1 && e.is_ascii(), "{e}");
    // Compile-time options name themselves.
    let o = tcc(&[
        "run",
        &art,
        "--set",
        "B=2",
        "--mem-budget",
        "1MiB",
        "--allow-tf32",
        "--f64-as-f32",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains(
            "`--set`, `--f64-as-f32`, `--mem-budget`, `--allow-tf32` apply when a program is compiled"
        ),
        "{e}"
    );
    // `--f64-as-f32` reads ONNX models only.
    let o = tcc(&["run", "examples/tiny.tdsl", "--f64-as-f32"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("--f64-as-f32 applies to .onnx models"),
        "{}",
        stderr(&o)
    );
    // The target is the artifact's; naming another one is an error, naming its own is fine.
    let o = tcc(&["run", &art, "--target", "cuda"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("built for `cpu`, so `--target cuda` does not apply"),
        "{}",
        stderr(&o)
    );
    let o = tcc(&["run", &art, "--target", "cpu", "--steps", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn small_output_fixes() {
    // `--budgets` help shows the comma form it parses.
    let o = tcc(&["remat", "--help"]);
    assert!(stdout(&o).contains("0.9,0.7,0.5"), "{}", stdout(&o));
    // `--param-file` says what it loaded in words, not as a Rust struct.
    let d = tmpdir("param-file-msg");
    let p = d.join("p.safetensors").display().to_string();
    let o = tcc(&[
        "run",
        "examples/tiny.tdsl",
        "--steps",
        "1",
        "--save-params",
        &p,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let art = d.join("tiny.tcc").display().to_string();
    assert!(tcc(&["build", "examples/tiny.tdsl", "-o", &art])
        .status
        .success());
    let o = tcc(&["run", &art, "--steps", "1", "--param-file", &p]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("loaded 2 of 2 persistent tensors from"), "{e}");
    assert!(!e.contains("ParamsLoaded"), "{e}");
    // An artifact is read, not compiled.
    assert!(e.contains("read and checked in"), "{e}");
    // `mem --mem-budget` states its remat line once.
    let o = tcc(&["mem", "examples/mlp.tdsl", "--mem-budget", "22MiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let all = stdout(&o) + &stderr(&o);
    assert_eq!(all.matches("remat: ").count(), 1, "{all}");
    // The remat table's columns stay aligned whether or not a row carries `!`.
    let g = root().join("../shared/bench/remat/checkmate_graphs/vgg16_bs256_224x224_test.json");
    let o = tcc(&[
        "remat",
        &g.display().to_string(),
        "--budgets",
        "1.5,0.3",
        "--time-ms",
        "100",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let bars = |l: &str| l.match_indices('|').map(|(i, _)| i).collect::<Vec<_>>();
    let lines: Vec<&str> = out.lines().filter(|l| l.contains('|')).collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines.iter().any(|l| l.contains('!')), "{out}");
    assert!(lines.iter().all(|l| bars(l) == bars(lines[0])), "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn outputs_may_be_expressions_and_concat_takes_a_tuple() {
    let d = tmpdir("output-exprs");
    let src = "model m {\n input x: f32[4, 6]\n let h = x * 2\n let t = concat(split(h, 2, axis: 1), axis: 0)\n output h, pred = argmax(h, axis: -1), relu(h), t, h + 1, relu(x)\n}\n";
    let o = check_source(&d, "outs", src);
    assert!(o.status.success(), "{}", stderr(&o));
    let f = d.join("outs.tdsl").display().to_string();
    let o = tcc(&["run", &f, "--eager", "--steps", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    // Names: given, the called function's (twice: `_2`), and by position.
    for want in [
        "h: f32[4, 6]",
        "pred: i32[4]",
        "relu: f32[4, 6]",
        "t: f32[8, 3]",
        "output5: f32[4, 6]",
        "relu_2: f32[4, 6]",
    ] {
        assert!(out.contains(want), "{want} in\n{out}");
    }
    // Compiled, the same outputs.
    let o = tcc(&["run", &f, "--steps", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("relu_2: f32[4, 6]"), "{}", stdout(&o));
    // A name given twice is an error naming both places.
    let o = check_source(
        &d,
        "dup",
        "model m {\n input x: f32[4]\n output a = x, a = x * 2\n}\n",
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("E0219"), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&d);
}

/// `--sass`: with `auto` a missing `ptxas` means a PTX-only artifact and one that does not
/// run a warning; with `on` both are errors; `on` needs a `cuda` artifact. Where `ptxas` is
/// there (`$TCC_PTXAS`, set under CI), `auto` puts SASS in the artifact, twice the same bytes,
/// and `off` leaves the same PTX without it.
#[test]
fn sass_in_cuda_artifacts() {
    let d = tmpdir("sass");
    let build = |ptxas: Option<&str>, extra: &[&str], out: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tcc"));
        cmd.args(["build", "examples/mlp.tdsl", "--target", "cuda", "-o"])
            .arg(d.join(out))
            .args(extra)
            .current_dir(root());
        // `ptxas` only where the test says: not on PATH or under CUDA_HOME.
        cmd.env("PATH", "")
            .env_remove("CUDA_HOME")
            .env_remove("CUDA_PATH");
        match ptxas {
            Some(p) => cmd.env("TCC_PTXAS", p),
            None => cmd.env_remove("TCC_PTXAS"),
        };
        cmd.output().unwrap()
    };
    let load = |out: &str| tcc_runtime::Model::load(d.join(out)).unwrap();
    // (Where CUDA is installed, /usr/local/cuda/bin/ptxas is found whatever PATH says.)
    if !std::path::Path::new("/usr/local/cuda/bin/ptxas").exists() {
        let o = build(None, &[], "auto.tcc");
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(load("auto.tcc").sass().is_none());
        assert!(!stderr(&o).contains("sass:"), "{}", stderr(&o));
        let o = build(None, &["--sass", "on"], "on.tcc");
        assert_eq!(o.status.code(), Some(1));
        assert!(stderr(&o).contains("no `ptxas` found"), "{}", stderr(&o));
        assert!(!d.join("on.tcc").exists());
    }
    // `$TCC_PTXAS` naming no executable file is said, not ignored.
    let o = build(Some("/"), &[], "dir.tcc");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("is not an executable file"),
        "{}",
        stderr(&o)
    );
    assert!(load("dir.tcc").sass().is_none());
    let o = build(Some("/"), &["--sass", "on"], "dir-on.tcc");
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("is not an executable file"),
        "{}",
        stderr(&o)
    );
    // A `ptxas` that does not answer `--version`.
    let o = build(Some("/bin/false"), &[], "false.tcc");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("warning: cannot run `/bin/false`"),
        "{}",
        stderr(&o)
    );
    assert!(load("false.tcc").sass().is_none());
    let o = build(Some("/bin/false"), &["--sass", "on"], "false-on.tcc");
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("error: cannot run `/bin/false`"),
        "{}",
        stderr(&o)
    );
    for args in [
        &["build", "examples/mlp.tdsl", "--sass", "on"][..],
        &[
            "build",
            "examples/mlp.tdsl",
            "--target",
            "cuda",
            "--emit",
            "ptx",
            "--sass",
            "on",
        ],
    ] {
        let o = tcc(args);
        assert_eq!(o.status.code(), Some(1));
        assert!(
            stderr(&o).contains("`--sass on` needs a `cuda` artifact"),
            "{}",
            stderr(&o)
        );
    }
    let Some(ptxas) = std::env::var_os("TCC_PTXAS") else {
        assert!(std::env::var_os("CI").is_none(), "CI sets TCC_PTXAS");
        eprintln!("SKIPPED sass_in_cuda_artifacts with ptxas: TCC_PTXAS is not set");
        let _ = std::fs::remove_dir_all(&d);
        return;
    };
    let ptxas = ptxas.to_string_lossy().into_owned();
    let o = build(Some(&ptxas), &[], "sass1.tcc");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("sass: "), "{}", stderr(&o));
    let o = build(Some(&ptxas), &[], "sass2.tcc");
    assert!(o.status.success(), "{}", stderr(&o));
    let (a, b) = (
        std::fs::read(d.join("sass1.tcc")).unwrap(),
        std::fs::read(d.join("sass2.tcc")).unwrap(),
    );
    assert!(a == b, "two builds with SASS differ");
    let with = load("sass1.tcc");
    let (sass, _) = with.sass().expect("SASS in the artifact");
    assert_eq!(sass.arch, "sm_90");
    let o = build(Some(&ptxas), &["--sass", "off"], "off.tcc");
    assert!(o.status.success(), "{}", stderr(&o));
    let off = load("off.tcc");
    assert!(off.sass().is_none());
    assert_eq!(off.code(), with.code());
    let _ = std::fs::remove_dir_all(&d);
}

/// `--zero 1` without `--gpus N` is an error on every command that takes it.
#[test]
fn zero_needs_gpus_on_every_command() {
    for cmd in [
        &["mem"][..],
        &["build"],
        &["run"],
        &["fit", "--mem-budget", "1GiB", "--grow", "B"],
    ] {
        let mut args = cmd.to_vec();
        args.extend(["--zero", "1", "examples/mlp.tdsl"]);
        let o = tcc(&args);
        assert_eq!(o.status.code(), Some(1), "{cmd:?}");
        let e = stderr(&o);
        assert!(
            e.contains("`--zero 1`") && e.contains("`--gpus N`"),
            "{cmd:?}: {e}"
        );
    }
}

/// Ids the step computes (`ids + 6`, not an input the runtime checks at `set_input`) that
/// fall outside the table stop the compiled step with an error naming the embedding, as
/// the interpreter stops at the op; in range, the step runs and the check's count is
/// neither printed nor saved (issue 32, g5).
#[test]
fn ids_computed_in_the_step_are_checked_on_every_path() {
    let d = tmpdir("in-step-ids");
    let src = d.join("emb.tdsl");
    std::fs::write(
        &src,
        "model m {\n    input ids: i32[4]\n    param table: f32[8, 2] = normal(0.0, 1.0)\n    \
         let e = embedding(table, ids + 6)\n    output e\n}\n",
    )
    .unwrap();
    let src = src.display().to_string();
    let low = d.join("low.npy");
    write_npy_i32(&low, &[0, 1, 0, 1]);
    let high = d.join("high.npy");
    write_npy_i32(&high, &[0, 1, 2, 1]);
    let (low, high) = (
        format!("ids={}", low.display()),
        format!("ids={}", high.display()),
    );
    for target in ["cpu", "eager"] {
        let run = |input: &str, extra: &[&str]| {
            let mut args = vec!["run", src.as_str(), "--steps", "2", "--input", input];
            if target == "eager" {
                args.push("--eager");
            }
            args.extend_from_slice(extra);
            tcc(&args)
        };
        let o = run(&high, &[]);
        assert_eq!(o.status.code(), Some(1), "{target}: {}", stdout(&o));
        let want = if target == "eager" {
            "embedding id 8 out of range 0..8"
        } else {
            "embedding into `table`: 1 index value(s) computed in the step lie outside [0, 8)"
        };
        assert!(stderr(&o).contains(want), "{target}: {}", stderr(&o));
        let outs = d.join(format!("outs-{target}"));
        let outs_arg = outs.display().to_string();
        let o = run(&low, &["--save-outputs", &outs_arg]);
        assert!(o.status.success(), "{target}: {}", stderr(&o));
        assert!(!stdout(&o).contains("tcc.check"), "{}", stdout(&o));
        let saved: Vec<String> = std::fs::read_dir(&outs)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(saved, vec!["e.npy".to_string()]);
    }
    // The artifact records the check; an index input's embedding gets none.
    let art = d.join("emb.tcc");
    let o = tcc(&["build", &src, "-o", &art.display().to_string()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = tcc_runtime::Model::load(&art).unwrap();
    assert_eq!(m.manifest().checks.len(), 1);
    assert_eq!(m.manifest().checks[0].bound, 8);
    let o = tcc(&[
        "build",
        "examples/gpt.tdsl",
        "--set",
        "L=1",
        "--set",
        "D=64",
        "--set",
        "H=2",
        "--set",
        "T=16",
        "--set",
        "B=2",
        "--set",
        "V=64",
        "-o",
        &art.display().to_string(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // gpt's ids are an input: its only check is the training step's finite check.
    let kinds: Vec<_> = tcc_runtime::Model::load(&art)
        .unwrap()
        .manifest()
        .checks
        .iter()
        .map(|c| c.kind)
        .collect();
    assert_eq!(kinds, vec![tcc_runtime::artifact::CheckKind::FiniteUpdates]);
}

/// A reader that stops early (`tcc run … | head -1`) ends tcc quietly with the status a
/// shell gives a tool stopped by SIGPIPE (141), not a panic report.
#[cfg(unix)]
#[test]
fn a_closed_stdout_stops_tcc_quietly() {
    use std::io::Read;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tcc"))
        .args([
            "run",
            "examples/tiny.tdsl",
            "--steps",
            "100000",
            "--every",
            "1",
            "-q",
        ])
        .current_dir(root())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("tcc runs");
    let mut first = [0u8; 64];
    let mut out = child.stdout.take().unwrap();
    out.read_exact(&mut first).unwrap();
    drop(out);
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(141), "{}", stderr(&o));
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
}
