//! The CPU executor on hand-written Cranelift kernels.

mod common;

use common::*;
use tcc_runtime::artifact::{self, DType, PersistentKind, PersistentSlot, Target};
use tcc_runtime::{Device, Error, Model, Session, CPU_HELPERS};

fn tiny() -> Model {
    Model::from_bytes(tiny_artifact()).unwrap()
}

fn expected_y(x: &[f32]) -> Vec<f32> {
    x.iter()
        .zip([1.0f32, 2.0, 3.0, 4.0])
        .map(|(x, w)| x * w + 1.0)
        .collect()
}

#[test]
fn helper_names_are_the_table_order() {
    assert_eq!(
        CPU_HELPERS,
        [
            "expf",
            "logf",
            "tanhf",
            "sinf",
            "cosf",
            "erff",
            "powf",
            "f16_to_f32",
            "f32_to_f16",
            "bf16_to_f32",
            "f32_to_bf16",
            "sgemm",
            "sgemm_gathered"
        ]
    );
    assert_eq!(tcc_runtime::cpu::GEMM_CONTEXT_SLOT, 13);
    assert_eq!(tcc_runtime::cpu::GATHER_A_SLOT, 14);
    assert_eq!(tcc_runtime::cpu::GATHER_B_SLOT, 15);
    assert_eq!(tcc_runtime::cpu::helper_slot("powf"), Some(6));
    assert_eq!(tcc_runtime::cpu::helper_slot("nope"), None);
}

#[test]
fn runs_the_tiny_model() {
    let model = tiny();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    assert_eq!(s.arena_bytes(), 256);
    assert_eq!(s.arena_bytes(), model.arena_bytes());
    assert_eq!(s.arena().as_ptr() as usize % 64, 0);
    // Device memory is a CUDA figure.
    assert!(matches!(
        s.session_device_bytes(),
        Err(Error::UnsupportedDevice { .. })
    ));
    let x = [0.5f32, -1.0, 2.0, 0.25];
    s.set_input("x", &x).unwrap();
    s.run().unwrap();
    let y: Vec<f32> = s.output("y").unwrap();
    assert_eq!(y, expected_y(&x));
    let z: Vec<f32> = s.output("z").unwrap();
    for (z, y) in z.iter().zip(&y) {
        assert_eq!(*z, libm::expf(*y));
    }
    // Raw bytes agree.
    let raw = s.output_bytes("y").unwrap();
    assert_eq!(raw.len(), 16);
    assert_eq!(&raw[..4], &y[0].to_le_bytes());

    // A second step with new inputs.
    let x2 = [1.0f32, 1.0, 1.0, 1.0];
    s.set_input("x", &x2).unwrap();
    s.run().unwrap();
    assert_eq!(s.output::<f32>("y").unwrap(), vec![2.0, 3.0, 4.0, 5.0]);
    // And again without touching inputs.
    s.run().unwrap();
    assert_eq!(s.output::<f32>("y").unwrap(), vec![2.0, 3.0, 4.0, 5.0]);
}

#[test]
fn set_input_bytes_checks_only_length() {
    let model = tiny();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    let x: Vec<u8> = [2.0f32, 2.0, 2.0, 2.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    s.set_input_bytes("x", &x).unwrap();
    s.run().unwrap();
    assert_eq!(s.output::<f32>("y").unwrap(), vec![3.0, 5.0, 7.0, 9.0]);
    assert!(matches!(
        s.set_input_bytes("x", &x[..15]),
        Err(Error::ByteLenMismatch {
            expected: 16,
            got: 15,
            ..
        })
    ));
}

#[test]
fn set_input_rejects_wrong_name_dtype_and_length() {
    let model = tiny();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    let err = s.set_input("q", &[0.0f32; 4]).unwrap_err();
    match &err {
        Error::UnknownTensor { kind, name, known } => {
            assert_eq!(*kind, "input");
            assert_eq!(name, "q");
            assert_eq!(known, &["x".to_string()]);
        }
        other => panic!("expected UnknownTensor, got {other:?}"),
    }
    assert!(err.to_string().contains("`q`") && err.to_string().contains('x'));
    assert!(matches!(
        s.set_input("x", &[0i32; 4]),
        Err(Error::DTypeMismatch {
            expected: DType::F32,
            got: DType::I32,
            ..
        })
    ));
    assert!(matches!(
        s.set_input("x", &[half::f16::ZERO; 4]),
        Err(Error::DTypeMismatch {
            got: DType::F16,
            ..
        })
    ));
    let err = s.set_input("x", &[0.0f32; 3]).unwrap_err();
    assert!(matches!(
        err,
        Error::LenMismatch {
            expected: 4,
            got: 3,
            ..
        }
    ));
    assert!(err.to_string().contains("4 elements"), "{err}");
    // Outputs are not inputs.
    assert!(matches!(
        s.set_input("y", &[0.0f32; 4]),
        Err(Error::UnknownTensor { .. })
    ));
    assert!(matches!(
        s.output::<f32>("x"),
        Err(Error::UnknownTensor { kind: "output", .. })
    ));
    assert!(matches!(
        s.output::<i32>("y"),
        Err(Error::DTypeMismatch { .. })
    ));
}

#[test]
fn params_read_write_and_persist_across_runs() {
    let model = tiny();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    assert_eq!(s.param::<f32>("w").unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    s.set_param("w", &[10.0f32, 0.0, 0.0, 1.0]).unwrap();
    s.set_input("x", &[1.0f32, 1.0, 1.0, 2.0]).unwrap();
    s.run().unwrap();
    assert_eq!(s.output::<f32>("y").unwrap(), vec![11.0, 1.0, 1.0, 3.0]);
    assert_eq!(s.param_bytes("w").unwrap().len(), 16);
    assert!(matches!(
        s.param::<f32>("v"),
        Err(Error::UnknownTensor {
            kind: "persistent tensor",
            ..
        })
    ));
    assert!(matches!(
        s.set_param("w", &[1.0f32]),
        Err(Error::LenMismatch { .. })
    ));
    // `reset` restores the artifact's initial params.
    s.reset();
    assert_eq!(s.param::<f32>("w").unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    // A fresh session starts from the artifact, not from another session's state.
    let s2 = Session::new(&model, Device::Cpu).unwrap();
    assert_eq!(s2.param::<f32>("w").unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn with_arena_uses_the_callers_buffer() {
    let model = tiny();
    // Over-allocate to find a 64-aligned start.
    let mut buf = vec![0xAAu8; 256 + 64 + 32];
    let off = buf.as_ptr().align_offset(64);
    let arena = &mut buf[off..];
    {
        let mut s = Session::with_arena(&model, arena).unwrap();
        assert_eq!(s.arena_bytes(), 256);
        let x = [1.0f32, 2.0, 3.0, 4.0];
        s.set_input("x", &x).unwrap();
        s.run().unwrap();
        assert_eq!(s.output::<f32>("y").unwrap(), expected_y(&x));
    }
    // The result lives in the caller's buffer; bytes past the arena are untouched.
    let y_bytes = &buf[off + 128..off + 132];
    assert_eq!(y_bytes, &2.0f32.to_le_bytes());
    assert!(buf[off + 256..].iter().all(|&b| b == 0xAA));
}

#[test]
fn with_arena_rejects_small_or_misaligned_buffers() {
    let model = tiny();
    let mut buf = vec![0u8; 512];
    let off = buf.as_ptr().align_offset(64);
    let err = Session::with_arena(&model, &mut buf[off..off + 100]).unwrap_err();
    assert!(matches!(
        err,
        Error::ArenaTooSmall {
            needed: 256,
            got: 100
        }
    ));
    assert!(err.to_string().contains("256"), "{err}");
    let err = Session::with_arena(&model, &mut buf[off + 1..off + 300]).unwrap_err();
    assert!(matches!(err, Error::ArenaMisaligned { align: 64 }));
    assert!(err.to_string().contains("64"), "{err}");
}

#[test]
fn cuda_device_and_target_mismatch() {
    let model = tiny();
    let err = Session::new(&model, Device::Cuda(0)).unwrap_err();
    if cfg!(feature = "cuda") {
        // A CPU artifact cannot run on a CUDA device.
        assert!(matches!(err, Error::TargetMismatch { .. }), "{err:?}");
    } else {
        assert!(matches!(err, Error::UnsupportedDevice { .. }));
        assert!(
            err.to_string().contains("built without CUDA support"),
            "{err}"
        );
    }

    let mut m = tiny_manifest();
    m.target = Target::Cuda;
    let ptx = Model::from_bytes(build(&m, ".version 8.0\n", &[0u8; 64])).unwrap();
    assert_eq!(ptx.target(), Target::Cuda);
    assert!(matches!(
        Session::new(&ptx, Device::Cpu),
        Err(Error::TargetMismatch { .. })
    ));
}

fn compile_err(code: &str) -> (String, String) {
    let m = tiny_manifest();
    let model = Model::from_bytes(build(&m, code, &[0u8; 64])).unwrap();
    match Session::new(&model, Device::Cpu) {
        Err(Error::Compile { kernel, message }) => (kernel, message),
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn compile_errors() {
    // A kernel in the manifest that the code lacks.
    let (kernel, message) = compile_err(&fma_kernel("k0", 64, 128));
    assert_eq!(kernel, "k1");
    assert!(message.contains("no function `%k1`"), "{message}");
    // Text that does not parse.
    let (_, message) = compile_err("function %k0(i64 {");
    assert!(message.contains("parse"), "{message}");
    // IR that does not verify (a use of an undefined value).
    let bad = "function %k0(i64, i64, i64, i64) system_v {
block0(v0: i64, v1: i64, v2: i64, v3: i64):
    v4 = iadd v0, v1
    v5 = iadd v4, v4
    return v5
}
";
    let (kernel, _) = compile_err(bad);
    assert_eq!(kernel, "k0");
    // A wrong kernel signature.
    let (kernel, message) = compile_err(
        "function %k0(i64, i64) system_v {
block0(v0: i64, v1: i64):
    return
}
",
    );
    assert_eq!(kernel, "k0");
    assert!(message.contains("signature"), "{message}");
    // External functions are refused (the JIT would need a symbol).
    let (_, message) = compile_err(
        "function %k0(i64, i64, i64, i64) system_v {
    sig0 = () system_v
    fn0 = %other sig0
block0(v0: i64, v1: i64, v2: i64, v3: i64):
    call fn0()
    return
}
",
    );
    assert!(message.contains("external"), "{message}");
}

#[test]
fn helpers_powf_and_half_conversions() {
    let mut m = tiny_manifest();
    // out = pow(x, 2) at 128, bf16 round trip at 192, f16 round trip at 256.
    m.arena_bytes = 320;
    m.outputs = vec![
        slot("y", DType::F32, &[4], 128),
        slot("z", DType::F32, &[4], 192),
        slot("h", DType::F32, &[4], 256),
    ];
    m.kernels = vec![kernel("k0", 4, false)];
    let code = multi_helper_kernel("k0", 64, 128, 192, 256);
    let model = Model::from_bytes(build(&m, &code, &persistent_init(&[], 64))).unwrap();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    let x = [1.5f32, -3.0, 0.1, 1.0e-3];
    s.set_input("x", &x).unwrap();
    s.run().unwrap();
    let y: Vec<f32> = s.output("y").unwrap();
    let z: Vec<f32> = s.output("z").unwrap();
    let h: Vec<f32> = s.output("h").unwrap();
    for i in 0..4 {
        assert_eq!(y[i], libm::powf(x[i], 2.0));
        assert_eq!(z[i], half::bf16::from_f32(x[i]).to_f32());
        assert_eq!(h[i], half::f16::from_f32(x[i]).to_f32());
    }
}

#[test]
fn every_unary_helper_matches_libm() {
    type Unary = fn(f32) -> f32;
    let fns: [(u32, Unary); 6] = [
        (0, libm::expf),
        (1, libm::logf),
        (2, libm::tanhf),
        (3, libm::sinf),
        (4, libm::cosf),
        (5, libm::erff),
    ];
    for (slot_no, f) in fns {
        let mut m = tiny_manifest();
        m.kernels = vec![kernel("k0", 4, false)];
        let code = unary_helper_kernel("k0", slot_no, 64, 128);
        let model = Model::from_bytes(build(&m, &code, &persistent_init(&[], 64))).unwrap();
        let mut s = Session::new(&model, Device::Cpu).unwrap();
        let x = [0.5f32, 1.25, 2.0, 0.1];
        s.set_input("x", &x).unwrap();
        s.run().unwrap();
        let y: Vec<f32> = s.output("y").unwrap();
        for (y, x) in y.iter().zip(x) {
            assert_eq!(y.to_bits(), f(x).to_bits(), "slot {slot_no} at {x}");
        }
    }
}

#[test]
fn other_element_types_round_trip_through_params() {
    let mut m = tiny_manifest();
    m.persistent = vec![
        PersistentSlot {
            slot: slot("w", DType::F32, &[4], 0),
            kind: PersistentKind::Param,
            init: None,
            shard_of: None,
        },
        PersistentSlot {
            slot: slot("h", DType::F16, &[3], 64),
            kind: PersistentKind::Param,
            init: None,
            shard_of: None,
        },
        PersistentSlot {
            slot: slot("b", DType::Bf16, &[2], 128),
            kind: PersistentKind::Param,
            init: None,
            shard_of: None,
        },
        PersistentSlot {
            slot: slot("n", DType::I32, &[], 192),
            kind: PersistentKind::State,
            init: None,
            shard_of: None,
        },
        PersistentSlot {
            slot: slot("mask", DType::Bool, &[5], 256),
            kind: PersistentKind::State,
            init: None,
            shard_of: None,
        },
    ];
    m.plan.persistent_bytes = 320;
    m.arena_bytes = 512;
    m.inputs[0].offset = 320;
    m.outputs[0].offset = 384;
    m.outputs[1].offset = 448;
    m.plan.buffers.clear();
    let code = fma_kernel("k0", 320, 384) + &unary_helper_kernel("k1", 0, 384, 448);
    let model = Model::from_bytes(build(
        &m,
        &code,
        &persistent_init(&[1.0, 2.0, 3.0, 4.0], 320),
    ))
    .unwrap();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    let h = [half::f16::from_f32(0.5), half::f16::ONE, half::f16::NEG_ONE];
    let b = [half::bf16::from_f32(-2.5), half::bf16::MAX];
    s.set_param("h", &h).unwrap();
    s.set_param("b", &b).unwrap();
    s.set_param("n", &[7i32]).unwrap();
    s.set_param("mask", &[true, false, true, true, false])
        .unwrap();
    assert_eq!(s.param::<half::f16>("h").unwrap(), h);
    assert_eq!(s.param::<half::bf16>("b").unwrap(), b);
    assert_eq!(s.param::<i32>("n").unwrap(), vec![7]);
    assert_eq!(
        s.param::<bool>("mask").unwrap(),
        vec![true, false, true, true, false]
    );
    assert_eq!(s.param_bytes("mask").unwrap(), &[1, 0, 1, 1, 0]);

    // safetensors round trip of every dtype.
    let saved = s.save_params_bytes().unwrap();
    let mut s2 = Session::new(&model, Device::Cpu).unwrap();
    let report = s2.load_params_bytes(&saved).unwrap();
    assert_eq!(report.loaded, ["w", "h", "b", "n", "mask"]);
    assert!(report.missing.is_empty());
    for name in ["w", "h", "b", "n", "mask"] {
        assert_eq!(s.param_bytes(name).unwrap(), s2.param_bytes(name).unwrap());
    }
}

fn safetensors_of(tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.to_string(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::tensor::serialize(views, None).unwrap()
}

#[test]
fn safetensors_save_then_load() {
    let model = tiny();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    s.set_param("w", &[5.0f32, 6.0, 7.0, 8.0]).unwrap();
    let dir = std::env::temp_dir().join(format!("tcc-runtime-st-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("w.safetensors");
    s.save_params(&path).unwrap();

    // The file is plain safetensors.
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let w = st.tensor("w").unwrap();
    assert_eq!(w.dtype(), safetensors::Dtype::F32);
    assert_eq!(w.shape(), &[4]);

    let mut s2 = Session::new(&model, Device::Cpu).unwrap();
    let report = s2.load_params(&path).unwrap();
    assert_eq!(report.loaded, ["w"]);
    assert_eq!(s2.param::<f32>("w").unwrap(), vec![5.0, 6.0, 7.0, 8.0]);
    s2.set_input("x", &[1.0f32; 4]).unwrap();
    s2.run().unwrap();
    assert_eq!(s2.output::<f32>("y").unwrap(), vec![6.0, 7.0, 8.0, 9.0]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(matches!(s2.load_params(&path), Err(Error::Io { .. })));
}

#[test]
fn load_params_checks_names_dtypes_and_shapes() {
    let model = tiny();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();

    // An empty file loads nothing and reports `w` missing.
    let empty = safetensors_of(&[]);
    let report = s.load_params_bytes(&empty).unwrap();
    assert!(report.loaded.is_empty());
    assert_eq!(report.missing, ["w"]);

    // Unknown names are an error, and nothing is written.
    let file = safetensors_of(&[
        ("w", safetensors::Dtype::F32, vec![4], f32s(&[9.0; 4])),
        ("bias", safetensors::Dtype::F32, vec![1], f32s(&[1.0])),
    ]);
    let err = s.load_params_bytes(&file).unwrap_err();
    match &err {
        Error::UnknownParams { unknown, known } => {
            assert_eq!(unknown, &["bias".to_string()]);
            assert_eq!(known, &["w".to_string()]);
        }
        other => panic!("expected UnknownParams, got {other:?}"),
    }
    assert_eq!(s.param::<f32>("w").unwrap(), vec![1.0, 2.0, 3.0, 4.0]);

    let file = safetensors_of(&[("w", safetensors::Dtype::I32, vec![4], vec![0; 16])]);
    assert!(matches!(
        s.load_params_bytes(&file),
        Err(Error::DTypeMismatch {
            got: DType::I32,
            ..
        })
    ));
    let file = safetensors_of(&[("w", safetensors::Dtype::F32, vec![2, 2], f32s(&[0.0; 4]))]);
    assert!(matches!(
        s.load_params_bytes(&file),
        Err(Error::ShapeMismatch { .. })
    ));
    let file = safetensors_of(&[("w", safetensors::Dtype::F64, vec![4], vec![0; 32])]);
    assert!(matches!(
        s.load_params_bytes(&file),
        Err(Error::Safetensors(_))
    ));
    assert!(matches!(
        s.load_params_bytes(b"not safetensors"),
        Err(Error::Safetensors(_))
    ));
}

#[test]
fn parallel_kernels_on_several_threads_match_one_thread() {
    for n in [1usize, 5, 1000, 4099] {
        let model = Model::from_bytes(big_artifact(n)).unwrap();
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut one = Session::new(&model, Device::Cpu).unwrap();
        // One thread per available core by default.
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        assert_eq!(one.threads(), cores);
        one.set_threads(1).unwrap();
        assert_eq!(one.threads(), 1);
        one.set_input("x", &x).unwrap();
        one.run().unwrap();
        let mut many = Session::new(&model, Device::Cpu).unwrap();
        many.set_threads(4).unwrap();
        assert_eq!(many.threads(), 4);
        for _ in 0..3 {
            many.set_input("x", &x).unwrap();
            many.run().unwrap();
        }
        assert_eq!(
            one.output::<f32>("y").unwrap(),
            many.output::<f32>("y").unwrap()
        );
        assert_eq!(
            one.output::<f32>("z").unwrap(),
            many.output::<f32>("z").unwrap()
        );
        many.set_threads(1).unwrap();
        assert_eq!(many.threads(), 1);
        many.set_threads(0).unwrap();
        assert!(many.threads() >= 1);
        many.run().unwrap();
    }
}

#[test]
fn repeated_parallel_runs_are_identical() {
    let n = 4099;
    let model = Model::from_bytes(big_artifact(n)).unwrap();
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 1e-3).collect();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    s.set_input("x", &x).unwrap();
    s.run().unwrap();
    let want: Vec<f32> = s.output("z").unwrap();
    for threads in [2, 3, 8] {
        s.set_threads(threads).unwrap();
        for _ in 0..50 {
            s.reset(); // zeros the outputs, so a missed chunk shows
            s.set_input("x", &x).unwrap();
            s.run().unwrap();
            assert_eq!(s.output::<f32>("z").unwrap(), want, "{threads} threads");
        }
    }
}

#[test]
fn zero_sized_arena() {
    let m = artifact::Manifest {
        arena_bytes: 0,
        inputs: vec![],
        outputs: vec![],
        persistent: vec![],
        kernels: vec![kernel("k0", 0, false)],
        plan: artifact::PlanInfo::default(),
        ..tiny_manifest()
    };
    let model = Model::from_bytes(build(&m, &fma_kernel("k0", 0, 0), &[])).unwrap();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    assert_eq!(s.arena_bytes(), 0);
    s.run().unwrap();
    let mut empty: [u8; 0] = [];
    let mut s = Session::with_arena(&model, &mut empty).unwrap();
    s.run().unwrap();
    assert!(s.save_params_bytes().is_ok());
}

#[test]
fn sessions_can_move_between_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<Session<'static>>();
    assert_send::<Model>();
    let model = tiny();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    s.set_threads(2).unwrap();
    let y = std::thread::spawn(move || {
        s.set_input("x", &[1.0f32; 4]).unwrap();
        s.run().unwrap();
        s.output::<f32>("y").unwrap()
    })
    .join()
    .unwrap();
    assert_eq!(y, vec![2.0, 3.0, 4.0, 5.0]);
}

#[test]
fn errors_display_clearly() {
    let e = Error::Truncated {
        section: "code".into(),
        needed: 100,
        have: 50,
    };
    assert!(e.to_string().contains("truncated") && e.to_string().contains("`code`"));
    let e = Error::Corrupt {
        section: "persistent".into(),
    };
    assert!(e.to_string().contains("corrupt"));
    let e = Error::UnknownTensor {
        kind: "input",
        name: "q".into(),
        known: vec![],
    };
    assert!(e.to_string().contains("none"), "{e}");
}

/// An index input (`index_bound`) takes values in `[0, bound)` only: a value outside is
/// `IndexOutOfRange` naming the first one, and the input is zeroed; a bound on a float
/// tensor is a bad manifest.
#[test]
fn index_inputs_are_checked_at_set_input() {
    let mut m = tiny_manifest();
    m.arena_bytes = 320;
    let mut ids = slot("ids", DType::I32, &[4], 256);
    ids.index_bound = Some(3);
    m.inputs.push(ids);
    let model = Model::from_bytes(build(
        &m,
        &tiny_code(),
        &persistent_init(&[1.0, 2.0, 3.0, 4.0], 64),
    ))
    .unwrap();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    s.set_input("ids", &[0i32, 1, 2, 2]).unwrap();
    let err = s.set_input("ids", &[0i32, 3, 2, -1]).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::IndexOutOfRange { name, position: 1, value: 3, bound: 3 } if name == "ids"
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("outside [0, 3)"), "{err}");
    let bytes: Vec<u8> = [1i32, 1, 1, -7]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert!(matches!(
        s.set_input_bytes("ids", &bytes),
        Err(Error::IndexOutOfRange {
            position: 3,
            value: -7,
            ..
        })
    ));
    // Zeroed, so the next step indexes in range; the float input is untouched.
    s.set_input("x", &[1.0f32; 4]).unwrap();
    s.run().unwrap();
    let mut bad = tiny_manifest();
    bad.inputs[0].index_bound = Some(3);
    assert!(matches!(
        artifact::validate(&bad),
        Err(Error::BadManifest(msg)) if msg.contains("index bound")
    ));
}

/// A kernel's product through the GEMM helper, on 1 and 3 threads (each computes its own
/// rows into its own scratch); a call naming an operand outside the arena fails the step
/// with `HelperRefused`, and the session runs again once the calls are good.
#[test]
fn the_gemm_helper_computes_blocks_and_refuses_calls_outside_the_arena() {
    let (m, n, k) = (7, 5, 300);
    let x: Vec<f32> = (0..m * k).map(|i| ((i % 11) as f32 - 5.0) * 0.25).collect();
    let want = gemm_expected(m, n, k, &x);
    let model = Model::from_bytes(gemm_artifact(m, n, k, None)).unwrap();
    for threads in [1, 3] {
        let mut s = Session::new(&model, Device::Cpu).unwrap();
        s.set_threads(threads).unwrap();
        s.set_input("x", &x).unwrap();
        s.run().unwrap();
        let y: Vec<f32> = s.output("y").unwrap();
        for (i, (g, w)) in y.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                "{threads} threads, y[{i}]: {g} vs {w}"
            );
        }
    }
    // B's last element one float past the arena.
    let arena = model.arena_bytes() as i64;
    let past = arena - 4 * ((k * n) as i64 - 1);
    let bad = Model::from_bytes(gemm_artifact(m, n, k, Some(past))).unwrap();
    let mut s = Session::new(&bad, Device::Cpu).unwrap();
    s.set_threads(1).unwrap();
    s.set_input("x", &x).unwrap();
    let err = s.run().unwrap_err();
    assert!(
        matches!(err, Error::HelperRefused { m: 7, n: 5, k: 300 }),
        "{err}"
    );
    assert!(err.to_string().contains("corrupt"), "{err}");
    // On 3 threads every call is refused, the workers' included (rows in chunks of 3).
    s.set_threads(3).unwrap();
    s.set_input("x", &x).unwrap();
    let err = s.run().unwrap_err();
    assert!(
        matches!(err, Error::HelperRefused { n: 5, k: 300, .. }),
        "{err}"
    );
    // One float earlier it is inside (reading other bytes of the arena, which is allowed).
    // One thread: this B overlaps `y`, which another thread's copy would write while it
    // is read.
    let edge = Model::from_bytes(gemm_artifact(m, n, k, Some(past - 4))).unwrap();
    let mut s = Session::new(&edge, Device::Cpu).unwrap();
    s.set_threads(1).unwrap();
    s.set_input("x", &x).unwrap();
    s.run().unwrap();
}
