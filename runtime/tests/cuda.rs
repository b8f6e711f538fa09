//! The CUDA executor (feature `cuda`).
//!
//! The tests that need a GPU call `common::cuda_or_skip` first: without the feature, the
//! driver or a device they print a notice and pass (set `TCC_REQUIRE_CUDA=1` to make that a
//! failure instead). The others run everywhere: a CUDA session on a machine without CUDA, or
//! in a build without the feature, is a typed error, never a panic.

mod common;

use common::*;
use tcc_runtime::artifact::Target;
use tcc_runtime::{Device, Error, Model, Session};

fn cuda_tiny() -> Model {
    Model::from_bytes(cuda_tiny_artifact()).unwrap()
}

#[test]
fn no_cuda_is_a_typed_error() {
    let model = cuda_tiny();
    assert_eq!(model.target(), Target::Cuda);
    let gpu = matches!(tcc_runtime::cuda_device_count(), Ok(n) if n > 0);
    // An ordinal no machine has fails everywhere, with or without a GPU.
    for device in [Device::Cuda(4096), Device::Cuda(usize::MAX)] {
        let err = Session::new(&model, device).unwrap_err();
        if cfg!(feature = "cuda") {
            assert!(matches!(err, Error::Cuda { .. }), "{err:?}");
        } else {
            assert!(matches!(err, Error::UnsupportedDevice { .. }), "{err:?}");
        }
    }
    if gpu {
        return;
    }
    let err = Session::new(&model, Device::Cuda(0)).unwrap_err();
    if cfg!(feature = "cuda") {
        match &err {
            Error::Cuda { context, message } => {
                assert!(!context.is_empty() && !message.is_empty(), "{err:?}");
            }
            other => panic!("expected Error::Cuda, got {other:?}"),
        }
        assert!(err.to_string().starts_with("CUDA error while "), "{err}");
    } else {
        assert!(matches!(err, Error::UnsupportedDevice { .. }), "{err:?}");
        assert!(
            err.to_string().contains("built without CUDA support"),
            "{err}"
        );
    }
}

#[test]
fn cuda_device_count_is_typed() {
    let count = tcc_runtime::cuda_device_count();
    let expected = match &count {
        Ok(_) | Err(Error::Cuda { .. }) => cfg!(feature = "cuda"),
        Err(Error::UnsupportedDevice { .. }) => !cfg!(feature = "cuda"),
        Err(_) => false,
    };
    assert!(expected, "{count:?}");
}

#[test]
fn targets_must_match_devices() {
    let model = cuda_tiny();
    assert!(matches!(
        Session::new(&model, Device::Cpu),
        Err(Error::TargetMismatch { .. })
    ));
    let mut cpu_model = cuda_tiny_manifest();
    cpu_model.target = Target::Cpu;
    let cpu_model = Model::from_bytes(build(&cpu_model, &tiny_code(), &[0u8; 64])).unwrap();
    let err = Session::new(&cpu_model, Device::Cuda(0)).unwrap_err();
    if cfg!(feature = "cuda") {
        assert!(matches!(err, Error::TargetMismatch { .. }), "{err:?}");
    } else {
        assert!(matches!(err, Error::UnsupportedDevice { .. }), "{err:?}");
    }
}

/// The manifest is checked before the driver is touched, so these hold on any machine.
#[cfg(feature = "cuda")]
#[test]
fn manifest_errors_come_first() {
    let mut m = cuda_tiny_manifest();
    m.kernels[1].launch = None;
    let model = Model::from_bytes(build(&m, &cuda_tiny_ptx(), &[0u8; 64])).unwrap();
    match Session::new(&model, Device::Cuda(0)) {
        Err(Error::BadManifest(msg)) => {
            assert!(msg.contains("`k1`") && msg.contains("launch"), "{msg}")
        }
        other => panic!("expected a manifest error, got {other:?}"),
    }

    let mut m = cuda_tiny_manifest();
    m.kernels[0].launch.as_mut().unwrap().block = [0, 1, 1];
    let model = Model::from_bytes(build(&m, &cuda_tiny_ptx(), &[0u8; 64])).unwrap();
    assert!(matches!(
        Session::new(&model, Device::Cuda(0)),
        Err(Error::BadManifest(_))
    ));

    let mut m = cuda_tiny_manifest();
    m.alignment = 512;
    m.inputs[0].offset = 512;
    m.outputs[0].offset = 1024;
    m.outputs[1].offset = 1536;
    m.arena_bytes = 2048;
    m.plan.buffers.clear();
    let model = Model::from_bytes(build(&m, &cuda_tiny_ptx(), &[0u8; 64])).unwrap();
    match Session::new(&model, Device::Cuda(0)) {
        Err(Error::Cuda { message, .. }) => {
            assert!(
                message.contains("512") && message.contains("256"),
                "{message}"
            )
        }
        other => panic!("expected a CUDA error, got {other:?}"),
    }
}

/// Assembles every PTX module of these tests with `ptxas -arch=sm_90` (`$TCC_PTXAS`, as
/// `.ci/run` sets it, else `$PTXAS`, else `ptxas` on the path). Without one the test is
/// skipped with a notice, except under CI (`CI` set), where that is a failure.
#[test]
fn test_ptx_assembles() {
    use std::io::Write;
    let ptxas = std::env::var_os("TCC_PTXAS")
        .or_else(|| std::env::var_os("PTXAS"))
        .unwrap_or_else(|| "ptxas".into());
    let dir = std::env::temp_dir().join(format!("tcc-runtime-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let modules = [
        ("tiny", cuda_tiny_ptx()),
        (
            "big",
            format!(
                "{PTX_HEADER}{}{}",
                fma_ptx("k0", 1 << 20, 0, 4 << 20, 8 << 20),
                square_update_ptx("k1", 1 << 20, 0, 8 << 20, 12 << 20)
            ),
        ),
        ("fault", format!("{PTX_HEADER}{}", faulting_ptx("k0"))),
    ];
    for (name, ptx) in modules {
        let path = dir.join(format!("{name}.ptx"));
        std::fs::write(&path, ptx).unwrap();
        let out = match std::process::Command::new(&ptxas)
            .arg("-arch=sm_90")
            .arg(&path)
            .arg("-o")
            .arg(dir.join(format!("{name}.cubin")))
            .output()
        {
            Ok(out) => out,
            Err(e) => {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "ptxas is missing under CI ({ptxas:?}: {e}): `pip install nvidia-cuda-nvcc==13.0.88`"
                );
                let _ = writeln!(
                    std::io::stderr(),
                    "SKIPPED test_ptx_assembles: cannot run {ptxas:?} ({e}); set PTXAS"
                );
                let _ = std::fs::remove_dir_all(&dir);
                return;
            }
        };
        assert!(
            out.status.success(),
            "ptxas rejected {name}.ptx:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use tcc_runtime::artifact::DType;

    fn session(model: &Model) -> Session<'static> {
        Session::new(model, Device::Cuda(0)).unwrap()
    }

    /// One step of the tiny model from `w` with input `x`: (y, z, w after the step).
    fn reference(w: [f32; 4], x: [f32; 4]) -> ([f32; 4], [f32; 4], [f32; 4]) {
        let y: [f32; 4] = std::array::from_fn(|i| x[i] * w[i] + 1.0);
        let z: [f32; 4] = std::array::from_fn(|i| y[i] * y[i] + w[i]);
        (y, z, w.map(|v| v + 1.0))
    }

    #[test]
    fn tiny_step_and_graph_replay() {
        if !cuda_or_skip("tiny_step_and_graph_replay") {
            return;
        }
        let model = cuda_tiny();
        let mut s = session(&model);
        assert_eq!(s.device(), Device::Cuda(0));
        assert_eq!(s.arena_bytes(), 256);
        assert!(s.cuda_graph());
        assert_eq!(s.threads(), 1);
        // Outputs read as zeros before the first step.
        assert_eq!(s.output::<f32>("y").unwrap(), vec![0.0; 4]);
        let x = [1.0f32, 2.0, 3.0, 4.0];
        let mut w = [1.0f32, 2.0, 3.0, 4.0];
        for step in 0..3 {
            s.set_input("x", &x).unwrap();
            s.run().unwrap();
            let (y, z, w_next) = reference(w, x);
            assert_eq!(s.output::<f32>("y").unwrap(), y, "step {step}");
            assert_eq!(s.output::<f32>("z").unwrap(), z, "step {step}");
            assert_eq!(s.param::<f32>("w").unwrap(), w_next, "step {step}");
            let bytes: Vec<u8> = z.iter().flat_map(|v| v.to_le_bytes()).collect();
            assert_eq!(s.output_bytes("z").unwrap(), bytes.as_slice());
            w = w_next;
        }
        // Steps continue from the device state even without setting the input again.
        s.run().unwrap();
        let (_, z, _) = reference(w, x);
        assert_eq!(s.output::<f32>("z").unwrap(), z);
    }

    #[test]
    fn graph_off_matches_graph_on() {
        if !cuda_or_skip("graph_off_matches_graph_on") {
            return;
        }
        let model = cuda_tiny();
        let mut on = session(&model);
        let mut off = session(&model);
        off.set_cuda_graph(false);
        assert!(!off.cuda_graph());
        for step in 0..4 {
            let x = [step as f32, 0.5, -1.0, 2.0];
            for s in [&mut on, &mut off] {
                s.set_input("x", &x).unwrap();
                s.run().unwrap();
            }
            assert_eq!(
                on.output::<f32>("z").unwrap(),
                off.output::<f32>("z").unwrap(),
                "step {step}"
            );
            // Toggle the graph of `on` off and on again: the next step captures it anew.
            on.set_cuda_graph(step % 2 == 1);
        }
        on.set_cuda_graph(true);
        on.run().unwrap();
        off.run().unwrap();
        assert_eq!(
            on.param::<f32>("w").unwrap(),
            off.param::<f32>("w").unwrap()
        );
    }

    #[test]
    fn params_and_reset() {
        if !cuda_or_skip("params_and_reset") {
            return;
        }
        let model = cuda_tiny();
        let mut s = session(&model);
        assert_eq!(s.param::<f32>("w").unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        s.set_param("w", &[2.0f32, 2.0, 2.0, 2.0]).unwrap();
        assert_eq!(s.param::<f32>("w").unwrap(), vec![2.0; 4]);
        let two: Vec<u8> = [2.0f32; 4].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(s.param_bytes("w").unwrap(), two.as_slice());
        s.set_input("x", &[1.0f32; 4]).unwrap();
        s.run().unwrap();
        assert_eq!(s.output::<f32>("y").unwrap(), vec![3.0; 4]);
        // The cached host copy follows the step.
        assert_eq!(s.param::<f32>("w").unwrap(), vec![3.0; 4]);
        let three: Vec<u8> = [3.0f32; 4].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(s.param_bytes("w").unwrap(), three.as_slice());

        // The whole arena, copied to the host.
        let arena = s.arena().to_vec();
        assert_eq!(arena.len(), 256);
        assert_eq!(&arena[..16], three.as_slice());

        // Save, change, load back.
        let saved = s.save_params_bytes().unwrap();
        s.set_param_bytes("w", &two).unwrap();
        assert_eq!(s.param::<f32>("w").unwrap(), vec![2.0; 4]);
        let report = s.load_params_bytes(&saved).unwrap();
        assert_eq!(report.loaded, vec!["w".to_string()]);
        assert_eq!(s.param::<f32>("w").unwrap(), vec![3.0; 4]);

        // A CPU session of the same layout reads the same file.
        let mut m = cuda_tiny_manifest();
        m.target = Target::Cpu;
        for k in &mut m.kernels {
            k.launch = None;
        }
        let cpu = Model::from_bytes(build(&m, &tiny_code(), &[0u8; 64])).unwrap();
        let mut c = Session::new(&cpu, Device::Cpu).unwrap();
        c.load_params_bytes(&saved).unwrap();
        assert_eq!(c.param::<f32>("w").unwrap(), vec![3.0; 4]);

        s.reset();
        assert_eq!(s.param::<f32>("w").unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(s.output::<f32>("y").unwrap(), vec![0.0; 4]);
        assert!(s.arena()[64..].iter().all(|&b| b == 0));
        s.set_input("x", &[1.0f32; 4]).unwrap();
        s.run().unwrap();
        assert_eq!(s.output::<f32>("y").unwrap(), vec![2.0, 3.0, 4.0, 5.0]);
    }

    #[test]
    fn api_errors_match_the_cpu() {
        if !cuda_or_skip("api_errors_match_the_cpu") {
            return;
        }
        let model = cuda_tiny();
        let mut s = session(&model);
        assert!(matches!(
            s.set_input("nope", &[1.0f32; 4]),
            Err(Error::UnknownTensor { kind: "input", .. })
        ));
        assert!(matches!(
            s.set_input("x", &[1i32; 4]),
            Err(Error::DTypeMismatch {
                expected: DType::F32,
                got: DType::I32,
                ..
            })
        ));
        assert!(matches!(
            s.set_input("x", &[1.0f32; 3]),
            Err(Error::LenMismatch {
                expected: 4,
                got: 3,
                ..
            })
        ));
        assert!(matches!(
            s.set_input_bytes("x", &[0u8; 15]),
            Err(Error::ByteLenMismatch { .. })
        ));
        assert!(matches!(
            s.output::<f32>("nope"),
            Err(Error::UnknownTensor { kind: "output", .. })
        ));
        assert!(matches!(
            s.output::<half::f16>("y"),
            Err(Error::DTypeMismatch { .. })
        ));
        assert!(matches!(
            s.param::<f32>("nope"),
            Err(Error::UnknownTensor { .. })
        ));
        assert!(matches!(
            s.set_param("w", &[0.0f32; 5]),
            Err(Error::LenMismatch { .. })
        ));
        assert!(matches!(
            s.set_param_bytes("w", &[0u8; 3]),
            Err(Error::ByteLenMismatch { .. })
        ));
        assert!(matches!(
            s.load_params_bytes(b"not safetensors"),
            Err(Error::Safetensors(_))
        ));
        // Set raw bytes, then run: same result as typed data.
        let x: Vec<u8> = [1.0f32; 4].iter().flat_map(|v| v.to_le_bytes()).collect();
        s.set_input_bytes("x", &x).unwrap();
        s.run().unwrap();
        assert_eq!(s.output::<f32>("y").unwrap(), vec![2.0, 3.0, 4.0, 5.0]);
        assert!(s.set_threads(8).is_ok());
        let (free, total) = s.device_memory().unwrap();
        assert!(total > 0 && free <= total, "{free} / {total}");
        // The session's own bytes hold at least its arena, and far less than the device.
        let own = s.session_device_bytes().unwrap();
        assert!(own >= s.arena_bytes() && own < total, "{own} of {total}");
    }

    #[test]
    fn code_errors_name_the_kernel() {
        if !cuda_or_skip("code_errors_name_the_kernel") {
            return;
        }
        // A kernel in the manifest that the PTX lacks.
        let mut m = cuda_tiny_manifest();
        let mut k2 = m.kernels[0].clone();
        k2.name = "k2".into();
        m.kernels.push(k2);
        let model = Model::from_bytes(build(&m, &cuda_tiny_ptx(), &[0u8; 64])).unwrap();
        match Session::new(&model, Device::Cuda(0)) {
            Err(Error::Compile { kernel, message }) => {
                assert_eq!(kernel, "k2");
                assert!(message.contains("has no kernel `k2`"), "{message}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
        // PTX the driver cannot load: the error carries the JIT log.
        let bad = format!("{PTX_HEADER}.visible .entry k0(.param .u64 arena) {{ bogus; }}");
        let model = Model::from_bytes(build(&cuda_tiny_manifest(), &bad, &[0u8; 64])).unwrap();
        match Session::new(&model, Device::Cuda(0)) {
            Err(Error::Compile { kernel, message }) => {
                assert_eq!(kernel, "(code section)");
                assert!(message.contains("PTX"), "{message}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
        // A launch shape the device refuses (more than 1024 threads per block): the capture
        // at creation fails and names the kernel.
        let mut m = cuda_tiny_manifest();
        m.kernels[1].launch.as_mut().unwrap().block = [2048, 1, 1];
        let model = Model::from_bytes(build(&m, &cuda_tiny_ptx(), &[0u8; 64])).unwrap();
        match Session::new(&model, Device::Cuda(0)) {
            Err(Error::Cuda { context, .. }) => assert!(context.contains("`k1`"), "{context}"),
            other => panic!("expected a CUDA error, got {other:?}"),
        }
    }

    #[test]
    fn many_blocks() {
        if !cuda_or_skip("many_blocks") {
            return;
        }
        let n = (1 << 20) + 3;
        let model = Model::from_bytes(cuda_big_artifact(n)).unwrap();
        let mut s = session(&model);
        assert_eq!(s.arena_bytes(), model.arena_bytes());
        let x: Vec<f32> = (0..n).map(|i| (i % 11) as f32 - 5.0).collect();
        let w0: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.25).collect();
        s.set_input("x", &x).unwrap();
        s.run().unwrap();
        s.set_input("x", &x).unwrap();
        s.run().unwrap();
        // Second step: w = w0 + 1.
        let y = s.output::<f32>("y").unwrap();
        let z = s.output::<f32>("z").unwrap();
        for i in (0..n).step_by(997).chain([n - 1]) {
            let w = w0[i] + 1.0;
            let yi = x[i].mul_add(w, 1.0);
            assert_eq!(y[i], yi, "y[{i}]");
            assert_eq!(z[i], yi.mul_add(yi, w), "z[{i}]");
        }
        assert_eq!(s.param::<f32>("w").unwrap()[n - 1], w0[n - 1] + 2.0);
    }

    /// A step whose graph has two independent kernels: `k0` and `u0` both compute
    /// `x * w + 1` (into `y` and `u`), and `k1` (`z = y * y + w; w += 1`) waits for both (it
    /// reads `y` and overwrites the `w` they read).
    #[test]
    fn dependency_edges_build_the_graph() {
        if !cuda_or_skip("dependency_edges_build_the_graph") {
            return;
        }
        let n = (1 << 20) + 3;
        let bytes = (n * 4) as u64;
        let pad = bytes.div_ceil(ALIGN) * ALIGN;
        let mut m = Model::from_bytes(cuda_big_artifact(n))
            .unwrap()
            .manifest()
            .clone();
        let (w, x, y, z, u) = (0, pad, 2 * pad, 3 * pad, 4 * pad);
        m.arena_bytes = 5 * pad;
        m.outputs.push(slot("u", DType::F32, &[n], u));
        m.plan.lower_bound = m.arena_bytes;
        m.kernels.insert(1, m.kernels[0].clone());
        m.kernels[1].name = "u0".into();
        m.kernels[0].after = Some(vec![]);
        m.kernels[1].after = Some(vec![]);
        m.kernels[2].after = Some(vec![0, 1]);
        let code = format!(
            "{PTX_HEADER}{}{}{}",
            fma_ptx("k0", n as u64, w, x, y),
            fma_ptx("u0", n as u64, w, x, u),
            square_update_ptx("k1", n as u64, w, y, z)
        );
        let w0: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.25).collect();
        let model =
            Model::from_bytes(build(&m, &code, &persistent_init(&w0, pad as usize))).unwrap();
        let mut s = session(&model);
        assert!(s.cuda_graph());
        let x: Vec<f32> = (0..n).map(|i| (i % 11) as f32 - 5.0).collect();
        for step in 0..3 {
            s.set_input("x", &x).unwrap();
            s.run().unwrap();
            let (y, u, z) = (
                s.output::<f32>("y").unwrap(),
                s.output::<f32>("u").unwrap(),
                s.output::<f32>("z").unwrap(),
            );
            for i in (0..n).step_by(997).chain([n - 1]) {
                let w = w0[i] + step as f32;
                let yi = x[i].mul_add(w, 1.0);
                assert_eq!((y[i], u[i]), (yi, yi), "y[{i}], u[{i}], step {step}");
                assert_eq!(z[i], yi.mul_add(yi, w), "z[{i}], step {step}");
            }
        }
        assert_eq!(s.param::<f32>("w").unwrap()[n - 1], w0[n - 1] + 3.0);
    }

    #[test]
    fn empty_arena() {
        if !cuda_or_skip("empty_arena") {
            return;
        }
        let m = tcc_runtime::artifact::Manifest {
            arena_bytes: 0,
            inputs: vec![],
            outputs: vec![],
            persistent: vec![],
            kernels: vec![{
                let mut k = kernel("k0", 0, false);
                k.launch = Some(launch_for(0));
                k
            }],
            plan: tcc_runtime::artifact::PlanInfo::default(),
            ..cuda_tiny_manifest()
        };
        let code = format!("{PTX_HEADER}{}", fma_ptx("k0", 0, 0, 0, 0));
        let model = Model::from_bytes(build(&m, &code, &[])).unwrap();
        let mut s = session(&model);
        assert_eq!(s.arena_bytes(), 0);
        s.run().unwrap();
        s.run().unwrap();
        assert!(s.arena().is_empty());
        assert!(s.save_params_bytes().is_ok());
    }

    #[test]
    fn sessions_move_between_threads() {
        if !cuda_or_skip("sessions_move_between_threads") {
            return;
        }
        let model = cuda_tiny();
        let mut s = session(&model);
        s.set_input("x", &[1.0f32; 4]).unwrap();
        let y = std::thread::spawn(move || {
            s.run().unwrap();
            s.output::<f32>("y").unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(y, vec![2.0, 3.0, 4.0, 5.0]);
    }
}
