//! `tcc import` and the `.onnx` paths of `tcc run/build`, end to end on a small MLP built
//! here: the imported program runs the same on `.onnx`, `.tcc`, `.tdsl --param-file` and
//! `--eager`, `--save-outputs` writes what a reference computation gives, and the imported
//! program trains once a loss and a `train` line are added (as README.md shows).

use prost::Message;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tcc::onnx::proto::*;

fn tcc(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tcc"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("tcc runs")
}

fn ok(o: &Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{what}:\n{err}\n{out}");
    format!("{out}{err}")
}

fn tensor(name: &str, dims: &[i64], v: Vec<f32>) -> TensorProto {
    TensorProto {
        dims: dims.to_vec(),
        data_type: data_type::FLOAT,
        raw_data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        name: name.into(),
        ..Default::default()
    }
}

fn value(name: &str, dims: &[i64]) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            tensor_type: Some(TypeProtoTensor {
                elem_type: data_type::FLOAT,
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|&d| Dimension {
                            value: Some(DimValue::DimValue(d)),
                        })
                        .collect(),
                }),
            }),
        }),
    }
}

fn gemm(name: &str, ins: &[&str], out: &str) -> NodeProto {
    NodeProto {
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: vec![out.into()],
        name: name.into(),
        op_type: "Gemm".into(),
        attribute: vec![AttributeProto {
            name: "transB".into(),
            i: 1,
            r#type: 2,
            ..Default::default()
        }],
        domain: String::new(),
    }
}

/// Deterministic weights in [-0.5, 0.5).
fn weights(n: usize, salt: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            ((i.wrapping_mul(2654435761).wrapping_add(salt * 97)) % 1000) as f32 / 1000.0 - 0.5
        })
        .collect()
}

/// x[8, 4] → Gemm(w1 [16, 4], b1) → Relu → Gemm(w2 [3, 16], b2) → y[8, 3], as PyTorch's
/// `nn.Linear` exports (weights [out, in], `transB = 1`).
fn mlp() -> (Vec<u8>, [Vec<f32>; 4]) {
    let w = [
        weights(64, 1),
        weights(16, 2),
        weights(48, 3),
        weights(3, 4),
    ];
    let m = ModelProto {
        ir_version: 8,
        producer_name: "test".into(),
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(GraphProto {
            node: vec![
                gemm("fc1", &["x", "w1", "b1"], "h"),
                NodeProto {
                    input: vec!["h".into()],
                    output: vec!["h_relu".into()],
                    name: "act".into(),
                    op_type: "Relu".into(),
                    ..Default::default()
                },
                gemm("fc2", &["h_relu", "w2", "b2"], "y"),
            ],
            name: "mlp".into(),
            initializer: vec![
                tensor("w1", &[16, 4], w[0].clone()),
                tensor("b1", &[16], w[1].clone()),
                tensor("w2", &[3, 16], w[2].clone()),
                tensor("b2", &[3], w[3].clone()),
            ],
            input: vec![value("x", &[8, 4])],
            output: vec![value("y", &[8, 3])],
            value_info: vec![],
        }),
        ..Default::default()
    };
    (m.encode_to_vec(), w)
}

fn reference(x: &[f32], w: &[Vec<f32>; 4]) -> Vec<f32> {
    let mut y = vec![0.0f32; 24];
    for n in 0..8 {
        let mut h = [0.0f32; 16];
        for (o, hv) in h.iter_mut().enumerate() {
            let mut s = w[1][o];
            for i in 0..4 {
                s += x[n * 4 + i] * w[0][o * 4 + i];
            }
            *hv = s.max(0.0);
        }
        for o in 0..3 {
            let mut s = w[3][o];
            for (i, hv) in h.iter().enumerate() {
                s += hv * w[2][o * 16 + i];
            }
            y[n * 3 + o] = s;
        }
    }
    y
}

fn read_npy(p: &Path) -> Vec<f32> {
    let b = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    npyz::NpyFile::new(&b[..])
        .unwrap()
        .into_vec::<f32>()
        .unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tcc-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn import_run_save_outputs_and_train() {
    let dir = scratch("onnx-cli");
    let (bytes, w) = mlp();
    std::fs::write(dir.join("mlp.onnx"), &bytes).unwrap();
    let x: Vec<f32> = weights(32, 9).iter().map(|v| v * 4.0).collect();
    let xt = tcc::eager::Tensor::from_f64(
        tcc::ir::DType::F32,
        tcc::ir::Shape(vec![8, 4]),
        x.iter().map(|&v| v as f64).collect(),
    );
    std::fs::write(dir.join("x.npy"), tcc::eager::io::write_npy(&xt).unwrap()).unwrap();
    let want = reference(&x, &w);

    let out = ok(
        &tcc(&dir, &["import", "mlp.onnx", "-o", "imported"]),
        "import",
    );
    assert!(
        out.contains("2 params") || out.contains("4 params"),
        "{out}"
    );
    let tdsl = std::fs::read_to_string(dir.join("imported/mlp.tdsl")).unwrap();
    for line in [
        "input  x: f32[8, 4]",
        "param  w1: f32[16, 4]",
        "param  b2: f32[3]",
        "output y",
    ] {
        assert!(tdsl.contains(line), "{line}:\n{tdsl}");
    }
    assert!(dir.join("imported/mlp.safetensors").is_file());

    // The same outputs on every path.
    ok(
        &tcc(
            &dir,
            &[
                "run",
                "mlp.onnx",
                "--input",
                "x=x.npy",
                "--save-outputs",
                "o1",
            ],
        ),
        "run .onnx",
    );
    ok(
        &tcc(&dir, &["build", "mlp.onnx", "-o", "mlp.tcc"]),
        "build .onnx",
    );
    ok(
        &tcc(
            &dir,
            &[
                "run",
                "mlp.tcc",
                "--input",
                "x=x.npy",
                "--save-outputs",
                "o2",
            ],
        ),
        "run .tcc",
    );
    ok(
        &tcc(
            &dir,
            &[
                "run",
                "imported/mlp.tdsl",
                "--param-file",
                "imported/mlp.safetensors",
                "--input",
                "x=x.npy",
                "--save-outputs",
                "o3",
            ],
        ),
        "run .tdsl --param-file",
    );
    ok(
        &tcc(
            &dir,
            &[
                "run",
                "mlp.onnx",
                "--eager",
                "--input",
                "x=x.npy",
                "--save-outputs",
                "o4",
            ],
        ),
        "run .onnx --eager",
    );
    for o in ["o1", "o2", "o3", "o4"] {
        let got = read_npy(&dir.join(o).join("y.npy"));
        assert_eq!(got.len(), want.len(), "{o}");
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 + 1e-5 * b.abs(),
                "{o}[{i}]: {a} vs {b}"
            );
        }
    }

    // Training the imported model: a target input, a loss and a `train` line.
    let train = tdsl
        .replace(
            "    input  x: f32[8, 4]\n",
            "    input  x: f32[8, 4]\n    input  target: f32[8, 3]\n",
        )
        .replace(
            "    output y\n",
            "    let loss = mse(y, target)\n    output loss\n    train sgd(lr: 0.1) minimize loss\n",
        );
    assert_ne!(train, tdsl);
    std::fs::write(dir.join("imported/train.tdsl"), &train).unwrap();
    let out = ok(
        &tcc(
            &dir,
            &[
                "run",
                "imported/train.tdsl",
                "--param-file",
                "imported/mlp.safetensors",
                "--input",
                "x=x.npy",
                "--steps",
                "30",
                "--every",
                "1",
                "--save-params",
                "trained.safetensors",
            ],
        ),
        "train",
    );
    let losses: Vec<f64> = out
        .lines()
        .filter_map(|l| l.split("loss: f32[] = ").nth(1))
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    assert_eq!(losses.len(), 30, "{out}");
    assert!(
        losses[29] < 0.5 * losses[0],
        "the loss should fall: {losses:?}"
    );
    assert!(dir.join("trained.safetensors").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_models_are_clear_errors() {
    let dir = scratch("onnx-bad");
    let (bytes, _) = mlp();
    std::fs::write(dir.join("cut.onnx"), &bytes[..bytes.len() / 3]).unwrap();
    for cmd in [
        &["import", "cut.onnx"][..],
        &["run", "cut.onnx"],
        &["build", "cut.onnx"],
    ] {
        let o = tcc(&dir, cmd);
        assert_eq!(o.status.code(), Some(1), "{cmd:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("not a readable ONNX model"), "{cmd:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
