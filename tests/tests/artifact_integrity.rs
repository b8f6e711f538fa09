//! Every byte of an artifact is checked (issue 32, group 1): the header's manifest checksum,
//! the sections' checksums and the zero padding between them, so that no single-byte change
//! anywhere in a compiled artifact loads (a changed kernel extent gave SIGSEGV, a changed
//! number in the manifest silently changed the loss).

use tcc::artifact;
use tcc_tests::{compile_pipeline, root};

fn tiny_artifact(target: artifact::Target) -> Vec<u8> {
    let src = std::fs::read_to_string(root().join("examples/tiny.tdsl")).unwrap();
    let g = compile_pipeline(&src, &Default::default()).unwrap();
    let opts = artifact::CompileOptions {
        target,
        ..Default::default()
    };
    let c = artifact::compile(&g, &opts).unwrap();
    let img = artifact::persistent_image(&c, 0, &Default::default()).unwrap();
    artifact::write_artifact(&c, target, &img)
}

#[test]
fn every_single_byte_change_is_rejected_at_load() {
    for target in [artifact::Target::Cpu, artifact::Target::Cuda] {
        let bytes = tiny_artifact(target);
        assert!(tcc_runtime::Model::from_bytes(bytes.clone()).is_ok());
        let mut accepted = Vec::new();
        for i in 0..bytes.len() {
            for flip in [0x01u8, 0x80] {
                let mut b = bytes.clone();
                b[i] ^= flip;
                if tcc_runtime::Model::from_bytes(b).is_ok() {
                    accepted.push((i, flip));
                }
            }
        }
        assert!(
            accepted.is_empty(),
            "{target:?}: {} of {} one-bit changes load, first at {:?}",
            accepted.len(),
            2 * bytes.len(),
            &accepted[..accepted.len().min(8)]
        );
        // Appended bytes are refused too.
        let mut b = bytes.clone();
        b.push(0);
        assert!(tcc_runtime::Model::from_bytes(b).is_err());
    }
}

/// Every format a reader loads (3 and later) has the manifest checksum, and it is never 0:
/// a zeroed header word is a corrupt manifest, not one left unchecked (its kernel extents
/// reach the code).
#[test]
fn a_zeroed_manifest_checksum_is_refused() {
    let mut bytes = tiny_artifact(artifact::Target::Cpu);
    bytes[12..16].fill(0);
    assert!(matches!(
        tcc_runtime::Model::from_bytes(bytes),
        Err(tcc_runtime::Error::Corrupt { section }) if section == "manifest"
    ));
}

/// Artifacts whose manifest was edited and whose checksums were then recomputed (a hand
/// edit, a buggy writer, a crafted file): numbers set to edge values, strings changed, keys
/// and list entries dropped or doubled. Loading gives a typed error or a checked model,
/// never a panic or an abort (issue 32's fuzz target for the loader; the campaign's counts
/// come from `scripts/fuzz-campaign.sh`).
mod edited_manifests {
    use proptest::prelude::*;
    use serde_json::Value;
    use std::sync::OnceLock;
    use tcc::artifact;

    /// The artifacts edited: tiny for both targets, a small MLP's training step (`mlp.tdsl`
    /// at B=4, D=8) for both targets, and tiny for CUDA with SASS.
    fn originals() -> &'static Vec<Vec<u8>> {
        static A: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
        A.get_or_init(|| {
            let mlp = std::fs::read_to_string(tcc_tests::root().join("examples/mlp.tdsl")).unwrap();
            let g = tcc_tests::compile_pipeline(
                &mlp,
                &tcc_tests::options_from_args("--set B=4 --set D=8"),
            )
            .unwrap();
            let c = artifact::compile(&g, &Default::default()).unwrap();
            let img = artifact::persistent_image(&c, 0, &Default::default()).unwrap();
            let cuda = artifact::CompileOptions {
                target: artifact::Target::Cuda,
                ..Default::default()
            };
            let cc = artifact::compile(&g, &cuda).unwrap();
            let cimg = artifact::persistent_image(&cc, 0, &Default::default()).unwrap();
            vec![
                super::tiny_artifact(artifact::Target::Cpu),
                super::tiny_artifact(artifact::Target::Cuda),
                artifact::write_artifact(&c, artifact::Target::Cpu, &img),
                with_sass(),
                artifact::write_artifact(&cc, artifact::Target::Cuda, &cimg),
            ]
        })
    }

    /// The tiny CUDA artifact with a `sass` section of stand-in cubins, one per kernel.
    fn with_sass() -> Vec<u8> {
        let src = std::fs::read_to_string(tcc_tests::root().join("examples/tiny.tdsl")).unwrap();
        let g = tcc_tests::compile_pipeline(&src, &Default::default()).unwrap();
        let opts = artifact::CompileOptions {
            target: artifact::Target::Cuda,
            ..Default::default()
        };
        let c = artifact::compile(&g, &opts).unwrap();
        let img = artifact::persistent_image(&c, 0, &Default::default()).unwrap();
        let pieces: Vec<_> = c
            .fused
            .kernels
            .iter()
            .enumerate()
            .map(|(i, k)| tcc_runtime::artifact::SassPiece {
                offset: 64 * i as u64,
                len: 64,
                entries: vec![k.name.clone()],
            })
            .collect();
        let section = vec![0x7fu8; 64 * pieces.len()];
        let sass = tcc_runtime::artifact::Sass {
            arch: "sm_90".into(),
            assembler: "stand-in".into(),
            code_checksum: tcc_runtime::artifact::checksum_hex(c.code.as_bytes()),
            pieces,
        };
        let bytes = artifact::write_artifact_with_sass(
            &c,
            artifact::Target::Cuda,
            &img,
            Some((&sass, &section)),
        );
        assert!(tcc_runtime::Model::from_bytes(bytes.clone())
            .unwrap()
            .sass()
            .is_some());
        bytes
    }

    /// Whether CUDA models that load run a step (`TCC_FUZZ_CUDA=1`).
    fn cuda() -> bool {
        std::env::var_os("TCC_FUZZ_CUDA").is_some_and(|v| v == "1")
    }

    /// Numbers a corrupt manifest may hold.
    const NUMBERS: &[f64] = &[
        0.0,
        1.0,
        2.0,
        3.0,
        63.0,
        64.0,
        255.0,
        256.0,
        4096.0,
        65535.0,
        2147483647.0,
        2147483648.0,
        4294967296.0,
        9007199254740992.0,
        9223372036854775807.0,
        18446744073709551615.0,
        -1.0,
        -9223372036854775808.0,
        0.5,
        1e300,
    ];
    const STRINGS: &[&str] = &[
        "",
        "k0",
        "f32",
        "i32",
        "bf16",
        "cuda",
        "cpu",
        "x",
        "code",
        "sass",
        "persistent",
        "normal",
        "\u{0}",
        "k0\u{0}",
    ];

    #[derive(Clone, Debug)]
    enum Edit {
        /// The `i`-th number (mod their count) becomes `NUMBERS[v]`, or its value plus `v - 8`.
        Number(usize, usize, bool),
        /// The `i`-th string becomes `STRINGS[v]`.
        Text(usize, usize),
        /// The `i`-th object loses its `v`-th key.
        DropKey(usize, usize),
        /// The `i`-th list loses, or doubles, its `v`-th entry.
        List(usize, usize, bool),
    }

    fn edit() -> impl Strategy<Value = Edit> {
        prop_oneof![
            (any::<usize>(), 0..NUMBERS.len().max(17), any::<bool>())
                .prop_map(|(i, v, d)| Edit::Number(i, v, d)),
            (any::<usize>(), 0..STRINGS.len()).prop_map(|(i, v)| Edit::Text(i, v)),
            (any::<usize>(), any::<usize>()).prop_map(|(i, v)| Edit::DropKey(i, v)),
            (any::<usize>(), any::<usize>(), any::<bool>())
                .prop_map(|(i, v, d)| Edit::List(i, v, d)),
        ]
    }

    /// The JSON pointer of every value of `v` for which `want` holds, depth first.
    fn paths(v: &Value, at: String, want: fn(&Value) -> bool, out: &mut Vec<String>) {
        if want(v) {
            out.push(at.clone());
        }
        match v {
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    paths(x, format!("{at}/{i}"), want, out);
                }
            }
            Value::Object(o) => {
                for (k, x) in o {
                    let k = k.replace('~', "~0").replace('/', "~1");
                    paths(x, format!("{at}/{k}"), want, out);
                }
            }
            _ => {}
        }
    }

    /// The `i`-th value of `v` (mod their count) for which `want` holds.
    fn pick(v: &mut Value, want: fn(&Value) -> bool, i: usize) -> Option<&mut Value> {
        let mut all = Vec::new();
        paths(v, String::new(), want, &mut all);
        let path = all.get(i % all.len().max(1))?.clone();
        v.pointer_mut(&path)
    }

    /// Applies `e` to `v`; false where `v` has no value of the kind it edits.
    fn apply(v: &mut Value, e: &Edit) -> bool {
        match *e {
            Edit::Number(i, k, delta) => {
                let Some(p) = pick(v, Value::is_number, i) else {
                    return false;
                };
                let old = p.as_f64().unwrap_or(0.0);
                let new = if delta {
                    old + k as f64 - 8.0
                } else {
                    NUMBERS[k % NUMBERS.len()]
                };
                *p = if new.fract() == 0.0 && (0.0..=u64::MAX as f64).contains(&new) {
                    Value::from(new as u64)
                } else if new.fract() == 0.0 && (i64::MIN as f64..0.0).contains(&new) {
                    Value::from(new as i64)
                } else {
                    Value::from(new)
                };
            }
            Edit::Text(i, k) => {
                let Some(p) = pick(v, Value::is_string, i) else {
                    return false;
                };
                *p = Value::from(STRINGS[k]);
            }
            Edit::DropKey(i, k) => {
                let Some(Value::Object(o)) =
                    pick(v, |v| v.as_object().is_some_and(|o| !o.is_empty()), i)
                else {
                    return false;
                };
                let Some(key) = o.keys().nth(k % o.len()).cloned() else {
                    return false;
                };
                o.remove(&key);
            }
            Edit::List(i, k, double) => {
                let Some(Value::Array(a)) =
                    pick(v, |v| v.as_array().is_some_and(|a| !a.is_empty()), i)
                else {
                    return false;
                };
                let at = k % a.len();
                if double {
                    let x = a[at].clone();
                    a.insert(at, x);
                } else {
                    a.remove(at);
                }
            }
        }
        true
    }

    /// The artifact with manifest `json`, laid out by the writer when it still parses as a
    /// manifest (so the edit reaches the checks past the file's structure), else the header
    /// and `json` with a correct checksum in front of the original sections.
    fn rebuild(original: &[u8], json: &Value) -> Vec<u8> {
        let (m, ranges) = tcc_runtime::artifact::read(original).unwrap();
        let sections: Vec<(&str, &[u8])> = ranges
            .iter()
            .map(|(n, r)| (n.as_str(), &original[r.clone()]))
            .collect();
        let text = serde_json::to_vec(json).unwrap();
        if let Ok(edited) = serde_json::from_value::<tcc_runtime::Manifest>(json.clone()) {
            // The writer fills in the section table; an edit of it alone is the raw case.
            if edited.sections == m.sections {
                return tcc_runtime::artifact::write(&edited, &sections);
            }
        }
        let old_len = u64::from_le_bytes(original[16..24].try_into().unwrap()) as usize;
        let mut out = original[..12].to_vec();
        out.extend_from_slice(
            &tcc_runtime::artifact::manifest_check(tcc_runtime::artifact::FORMAT_VERSION, &text)
                .to_le_bytes(),
        );
        out.extend_from_slice(&(text.len() as u64).to_le_bytes());
        out.extend_from_slice(&text);
        out.extend_from_slice(&original[24 + old_len..]);
        out
    }

    proptest! {
        #![proptest_config(tcc_tests::proptest_config(3000))]

        #[test]
        fn edited_manifests_are_errors_or_checked_models(which in 0usize..5, edits in prop::collection::vec(edit(), 1..4)) {
            let original = &originals()[which];
            let len = u64::from_le_bytes(original[16..24].try_into().unwrap()) as usize;
            let mut json: Value = serde_json::from_slice(&original[24..24 + len]).unwrap();
            let mut changed = false;
            for e in &edits {
                changed |= apply(&mut json, e);
            }
            prop_assume!(changed);
            let bytes = rebuild(original, &json);
            // A typed error or a model; a panic fails the case, an abort the whole test. A
            // CPU model that loads also runs a step (a typed error is fine there too): what
            // the checks let through must not make the code touch memory it should not.
            // With `TCC_FUZZ_CUDA=1` (a `--features cuda` build on a GPU machine, under
            // compute-sanitizer in `scripts/gpu-check.sh device-fuzz`), CUDA models run a
            // step on GPU 0 likewise.
            tcc_tests::timed_case(|| {
                let Ok(model) = tcc_runtime::Model::from_bytes(bytes) else {
                    return;
                };
                let device = match model.target() {
                    tcc_runtime::artifact::Target::Cpu => tcc_runtime::Device::Cpu,
                    tcc_runtime::artifact::Target::Cuda if cuda() => tcc_runtime::Device::Cuda(0),
                    tcc_runtime::artifact::Target::Cuda => return,
                };
                let ran = match tcc_runtime::Session::new(&model, device) {
                    Ok(mut s) => match s.run() {
                        Ok(()) => "ran",
                        Err(_) => "step error",
                    },
                    Err(_) => "session error",
                };
                if cuda() {
                    // Counted by `device-fuzz` (straight to the stream, past the capture).
                    let _ = std::io::Write::write_fmt(
                        &mut std::io::stderr(),
                        format_args!("fuzz-step {:?}: {ran}\n", model.target()),
                    );
                    // A kernel that faulted poisons the process's CUDA context, after
                    // which every step fails: the unedited CUDA tiny must still run.
                    if device != tcc_runtime::Device::Cpu && ran != "ran" {
                        let good = tcc_runtime::Model::from_bytes(originals()[1].clone());
                        let ok = good.is_ok_and(|m| {
                            tcc_runtime::Session::new(&m, device).is_ok_and(|mut s| s.run().is_ok())
                        });
                        assert!(ok, "after a CUDA {ran}, an unedited model no longer runs");
                    }
                }
            })?;
        }
    }
}
