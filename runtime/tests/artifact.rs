//! The artifact format: writing, reading and every rejection `ARTIFACT.md` asks for.

mod common;

use common::*;
use tcc_runtime::artifact::{self, fnv1a64, DType, SECTION_ALIGN};
use tcc_runtime::{Error, Model};

#[test]
fn checksum_known_values() {
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    // Formats 3 and 4 use FNV-1a 64; format 5 XXH3-64 with seed 0 (reference value of the
    // empty input).
    assert_eq!(artifact::checksum(4, b"foobar"), fnv1a64(b"foobar"));
    assert_eq!(artifact::checksum(5, b""), 0x2d06_8005_38d3_94c2);
    assert_eq!(artifact::checksum_hex(b""), "2d06800538d394c2");
}

#[test]
fn write_then_read_round_trips() {
    let bytes = tiny_artifact();
    assert_eq!(&bytes[..8], b"TCCMODEL");
    assert_eq!(
        u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]),
        artifact::FORMAT_VERSION
    );
    let (m, sections) = artifact::read(&bytes).unwrap();
    let mut want = tiny_manifest();
    want.sections = m.sections.clone();
    assert_eq!(m, want);
    assert_eq!(sections.len(), 2);
    assert_eq!(sections[0].0, "code");
    let code = artifact::bounds_line(&m) + &tiny_code();
    assert!(
        code.starts_with("; tcc-bounds arena=256 align=64 checks= k0=4 k1=4p\n"),
        "{code}"
    );
    let mut par = m.clone();
    par.kernels[0].parallel = true;
    assert!(artifact::bounds_line(&par)
        .starts_with("; tcc-bounds arena=256 align=64 checks= k0=4p k1=4p\n"));
    assert_eq!(&bytes[sections[0].1.clone()], code.as_bytes());
    assert_eq!(sections[1].0, "persistent");
    assert_eq!(sections[1].1.len(), 64);
    for (s, (_, r)) in m.sections.iter().zip(&sections) {
        assert_eq!(s.offset % SECTION_ALIGN, 0);
        assert_eq!(s.offset as usize, r.start);
        assert_eq!(s.checksum, artifact::checksum_hex(&bytes[r.clone()]));
    }
    // The manifest length in the header matches the JSON, and the first section follows it.
    let mut l = [0u8; 8];
    l.copy_from_slice(&bytes[16..24]);
    let json_end = 24 + u64::from_le_bytes(l);
    assert!(m.sections[0].offset >= json_end);
    assert!(m.sections[0].offset < json_end + SECTION_ALIGN);
}

#[test]
fn write_is_deterministic_and_ignores_given_sections() {
    let a = tiny_artifact();
    let mut m = tiny_manifest();
    m.sections = vec![artifact::Section {
        name: "stale".into(),
        offset: 12345,
        len: 1,
        checksum: "0".into(),
    }];
    let b = build(
        &m,
        &tiny_code(),
        &persistent_init(&[1.0, 2.0, 3.0, 4.0], 64),
    );
    assert_eq!(a, b);
}

#[test]
fn write_handles_offsets_that_lengthen_the_manifest() {
    // Many sections whose offsets grow in digits as the manifest grows.
    let m = tiny_manifest();
    let blobs: Vec<Vec<u8>> = (0..40).map(|i| vec![i as u8; 1000 + i * 37]).collect();
    let names: Vec<String> = (0..40).map(|i| format!("s{i}")).collect();
    let sections: Vec<(&str, &[u8])> = names
        .iter()
        .map(String::as_str)
        .zip(blobs.iter().map(Vec::as_slice))
        .collect();
    let bytes = artifact::write(&m, &sections);
    let (_, ranges) = artifact::read(&bytes).unwrap();
    for ((name, r), blob) in ranges.iter().zip(&blobs) {
        assert!(name.starts_with('s'));
        assert_eq!(r.start % SECTION_ALIGN as usize, 0);
        assert_eq!(&bytes[r.clone()], blob.as_slice());
    }
}

#[test]
fn empty_sections_and_no_sections() {
    let bytes = artifact::write(&tiny_manifest(), &[]);
    let (m, ranges) = artifact::read(&bytes).unwrap();
    assert!(m.sections.is_empty() && ranges.is_empty());
    let bytes = artifact::write(&tiny_manifest(), &[("code", b""), ("persistent", b"")]);
    let (_, ranges) = artifact::read(&bytes).unwrap();
    assert!(ranges.iter().all(|(_, r)| r.is_empty()));
}

#[test]
fn short_file_or_bad_magic_is_not_an_artifact() {
    let bytes = tiny_artifact();
    assert!(matches!(
        artifact::read(&bytes[..10]),
        Err(Error::NotAnArtifact)
    ));
    assert!(matches!(artifact::read(b""), Err(Error::NotAnArtifact)));
    let mut bad = bytes.clone();
    bad[0] = b'X';
    assert!(matches!(Model::from_bytes(bad), Err(Error::NotAnArtifact)));
}

#[test]
fn newer_version_names_both_versions() {
    let mut bytes = tiny_artifact();
    bytes[8..12].copy_from_slice(&7u32.to_le_bytes());
    let err = Model::from_bytes(bytes).unwrap_err();
    assert!(matches!(
        err,
        Error::NewerVersion {
            found: 7,
            supported: 6
        }
    ));
    let msg = err.to_string();
    assert!(msg.contains('7') && msg.contains('6'), "{msg}");
    // Version 5 (XXH3 checksums, no GEMM helper) still loads: the same bytes stamped 5.
    let v5 = restamp(&tiny_artifact(), 5);
    let m = Model::from_bytes(v5).unwrap();
    assert_eq!(m.manifest().format_version, 5);
    // Versions 3 (before the finite check's kind) and 4 (FNV-1a checksums) still load: the
    // same bytes stamped 3 or 4, with FNV-1a checksums under their old keys.
    for v in [3u32, 4] {
        let old = downgrade(&tiny_artifact(), v);
        let m = Model::from_bytes(old.clone()).unwrap();
        assert_eq!(m.manifest().format_version, v);
        // An old file's sections are checked with FNV-1a: a flipped byte is still caught.
        let (man, _) = artifact::read(&old).unwrap();
        let mut bad = old;
        bad[man.sections[1].offset as usize] ^= 1;
        assert!(matches!(Model::from_bytes(bad), Err(Error::Corrupt { .. })));
    }
    // Older than the bounds line: refused, with the advice to rebuild.
    let mut bytes = tiny_artifact();
    bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
    let err = Model::from_bytes(bytes).unwrap_err();
    assert!(err.to_string().contains("rebuild"), "{err}");
}

#[test]
fn truncated_file_names_the_section() {
    let bytes = tiny_artifact();
    let cut = bytes[..bytes.len() - 1].to_vec();
    match Model::from_bytes(cut) {
        Err(Error::Truncated {
            section,
            needed,
            have,
        }) => {
            assert_eq!(section, "persistent");
            assert_eq!(needed, bytes.len() as u64);
            assert_eq!(have, bytes.len() as u64 - 1);
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
    // Cut inside the manifest.
    assert!(matches!(
        artifact::read(&bytes[..40]),
        Err(Error::Truncated { section, .. }) if section == "manifest"
    ));
}

#[test]
fn flipped_byte_in_a_section_is_corrupt() {
    let bytes = tiny_artifact();
    let (m, _) = artifact::read(&bytes).unwrap();
    for s in &m.sections {
        let mut bad = bytes.clone();
        bad[s.offset as usize + 1] ^= 0x40;
        match Model::from_bytes(bad) {
            Err(Error::Corrupt { section }) => assert_eq!(section, s.name),
            other => panic!("expected Corrupt, got {other:?}"),
        }
    }
}

#[test]
fn invalid_json_is_a_bad_manifest() {
    let mut bytes = tiny_artifact();
    bytes[24] = b'[';
    // The header's manifest checksum catches the edit first.
    let err = artifact::read(&bytes).unwrap_err();
    assert!(
        matches!(err, Error::Corrupt { ref section } if section == "manifest"),
        "{err}"
    );
    // With the checksum recomputed, the JSON itself is refused.
    let len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let check = artifact::manifest_check(artifact::FORMAT_VERSION, &bytes[24..24 + len]);
    bytes[12..16].copy_from_slice(&check.to_le_bytes());
    let err = artifact::read(&bytes).unwrap_err();
    assert!(matches!(err, Error::BadManifest(_)), "{err}");
}

#[test]
fn missing_field_is_a_bad_manifest() {
    let json = br#"{"format_version":3}"#;
    let mut bytes = b"TCCMODEL".to_vec();
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(&artifact::manifest_check(3, json).to_le_bytes());
    bytes.extend_from_slice(&(json.len() as u64).to_le_bytes());
    bytes.extend_from_slice(json);
    let err = artifact::read(&bytes).unwrap_err();
    assert!(
        matches!(err, Error::BadManifest(ref m) if m.contains("missing field")),
        "{err}"
    );
}

fn rejects(edit: impl FnOnce(&mut artifact::Manifest), needle: &str) {
    let mut m = tiny_manifest();
    edit(&mut m);
    let bytes = build(
        &m,
        &tiny_code(),
        &persistent_init(&[1.0, 2.0, 3.0, 4.0], 64),
    );
    match Model::from_bytes(bytes) {
        Err(Error::BadManifest(msg)) => assert!(msg.contains(needle), "{msg}"),
        other => panic!("expected BadManifest({needle}), got {other:?}"),
    }
}

#[test]
fn layouts_that_do_not_fit_are_rejected() {
    rejects(|m| m.outputs[1].offset = 256, "outside the arena");
    rejects(
        |m| m.inputs[0].offset = 65,
        "not a multiple of the alignment",
    );
    rejects(|m| m.inputs[0].bytes = 12, "needs 16 bytes");
    rejects(|m| m.inputs[0].dtype = DType::F16, "needs 8 bytes");
    rejects(
        |m| m.persistent[0].slot.offset = 64,
        "outside the persistent region",
    );
    rejects(|m| m.plan.buffers[1].offset = 250, "plan buffer of `x`");
    rejects(|m| m.alignment = 48, "not a power of two");
    rejects(|m| m.plan.persistent_bytes = 512, "larger than the arena");
    rejects(
        |m| m.outputs.push(m.outputs[0].clone()),
        "output `y` is listed twice",
    );
    rejects(|m| m.kernels[0].extent = u64::MAX, "does not fit an i64");
    rejects(|m| m.inputs[0].shape = vec![usize::MAX, 2], "overflows");
    rejects(
        |m| m.kernels[0].after = Some(vec![0]),
        "waits for kernel number 0, which is not an earlier one",
    );
    rejects(
        |m| m.kernels[0].after = Some(vec![1]),
        "kernel number 1, which is not an earlier one",
    );
    rejects(
        |m| {
            m.kernels.push(m.kernels[1].clone());
            m.kernels[2].after = Some(vec![1, 0]);
        },
        "is not strictly ascending",
    );
}

#[test]
fn kernel_dependencies_round_trip_and_are_optional() {
    let mut m = tiny_manifest();
    m.kernels[1].after = Some(vec![0]);
    let bytes = build(
        &m,
        &tiny_code(),
        &persistent_init(&[1.0, 2.0, 3.0, 4.0], 64),
    );
    let model = Model::from_bytes(bytes).unwrap();
    assert_eq!(model.manifest().kernels[1].after, Some(vec![0]));
    assert_eq!(model.manifest().kernels[0].after, None);
}

#[test]
fn missing_sections_and_wrong_persistent_size_are_rejected() {
    let m = tiny_manifest();
    let only_code = artifact::write(&m, &[("code", tiny_code().as_bytes())]);
    assert!(matches!(
        Model::from_bytes(only_code),
        Err(Error::BadManifest(msg)) if msg.contains("`persistent`")
    ));
    // Shorter than the region is fine (the rest starts at zero); longer is not.
    let short = build(&m, &tiny_code(), &[0u8; 32]);
    assert!(Model::from_bytes(short).is_ok());
    let long = build(&m, &tiny_code(), &[0u8; 128]);
    assert!(matches!(
        Model::from_bytes(long),
        Err(Error::BadManifest(msg)) if msg.contains("persistent section is 128 bytes")
    ));
    let not_utf8 = artifact::write(&m, &[("code", &[0xff, 0xfe]), ("persistent", &[0u8; 64])]);
    assert!(matches!(
        Model::from_bytes(not_utf8),
        Err(Error::BadManifest(msg)) if msg.contains("UTF-8")
    ));
}

#[test]
fn model_accessors() {
    let model = Model::from_bytes(tiny_artifact()).unwrap();
    assert_eq!(model.arena_bytes(), 256);
    assert_eq!(model.alignment(), 64);
    assert_eq!(model.target(), artifact::Target::Cpu);
    assert_eq!(model.inputs()[0].name, "x");
    assert_eq!(model.outputs().len(), 2);
    assert_eq!(model.persistent()[0].slot.name, "w");
    assert_eq!(model.code(), tiny_code());
    assert_eq!(model.manifest().model, "tiny");
    assert_eq!(model.persistent_init().len(), 64);
}

#[test]
fn load_reports_missing_file_with_its_path() {
    let err = Model::load("no/such/dir/model.tcc").unwrap_err();
    assert!(matches!(err, Error::Io { .. }));
    assert!(err.to_string().contains("model.tcc"), "{err}");
}

#[test]
fn load_from_a_file() {
    let dir = std::env::temp_dir().join(format!("tcc-runtime-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.tcc");
    std::fs::write(&path, tiny_artifact()).unwrap();
    let model = Model::load(&path).unwrap();
    assert_eq!(model.manifest().model, "tiny");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The manifest is held to the code section's bounds line: an arena, extent, launch shape
/// or kernel list edited after the code was written (checksums recomputed) is refused with
/// an error naming it, on both targets.
#[test]
fn the_manifest_is_checked_against_the_codes_bounds() {
    let loads = |m: &artifact::Manifest, code: String| {
        let init = persistent_init(&[1.0, 2.0, 3.0, 4.0], 64);
        Model::from_bytes(artifact::write(
            m,
            &[("code", code.as_bytes()), ("persistent", &init)],
        ))
    };
    let refused = |m: &artifact::Manifest, code: String, needle: &str| match loads(m, code) {
        Err(Error::BadManifest(msg)) => assert!(msg.contains(needle), "{needle}: {msg}"),
        other => panic!("expected BadManifest({needle}), got {other:?}"),
    };
    for (m, body) in [
        (tiny_manifest(), tiny_code()),
        (cuda_tiny_manifest(), cuda_tiny_ptx()),
    ] {
        let code = artifact::bounds_line(&m) + &body;
        assert!(loads(&m, code.clone()).is_ok());
        let mut e = m.clone();
        e.arena_bytes += 256;
        refused(&e, code.clone(), "the code addresses 256 bytes");
        let mut e = m.clone();
        e.kernels[1].extent += 1;
        refused(&e, code.clone(), "kernel `k1`");
        let mut e = m.clone();
        e.kernels[0].parallel = !e.kernels[0].parallel;
        refused(&e, code.clone(), "kernel `k0`");
        let mut e = m.clone();
        e.kernels[1].after = Some(vec![]);
        refused(&e, code.clone(), "kernel `k1`");
        let mut e = m.clone();
        e.kernels.pop();
        refused(
            &e,
            code.clone(),
            "launches 1 kernels, but the code was compiled for 2",
        );
        let mut e = m.clone();
        e.alignment = 32;
        refused(
            &e,
            code.clone(),
            "alignment is 32, but the code was compiled for 64",
        );
        // A check dropped from the manifest (its output kept) would turn it off.
        let mut with_check = m.clone();
        with_check
            .outputs
            .push(slot("tcc.check.0", DType::F32, &[], 0));
        with_check.checks.push(artifact::Check {
            output: "tcc.check.0".into(),
            what: "embedding".into(),
            bound: 8,
            kind: Default::default(),
        });
        let checked = artifact::bounds_line(&with_check) + &body;
        assert!(loads(&with_check, checked.clone()).is_ok());
        let mut e = with_check.clone();
        e.checks.clear();
        refused(
            &e,
            checked,
            "in-step checks `` are not the code's `tcc.check.0:8`",
        );
        refused(
            &m,
            code.replacen("  ", " ", 1).replacen(" k0=", "  k0=", 1),
            "not written as the manifest's would be",
        );
        let mut e = m.clone();
        e.kernels.swap(0, 1);
        refused(
            &e,
            code.clone(),
            "kernel 0 is `k1` in the manifest but `k0`",
        );
        refused(
            &m,
            body.clone(),
            "does not start with its `tcc-bounds` line",
        );
        if m.target == artifact::Target::Cuda {
            for edit in [
                |l: &mut artifact::Launch| l.grid[0] += 1,
                |l: &mut artifact::Launch| l.block[0] *= 2,
                |l: &mut artifact::Launch| l.shared_bytes = 1 << 20,
            ] {
                let mut e = m.clone();
                if let Some(l) = e.kernels[0].launch.as_mut() {
                    edit(l);
                }
                refused(
                    &e,
                    code.clone(),
                    "kernel `k0`: the manifest's extent and launch",
                );
            }
        }
    }
}

/// A file is read only as far as its header and manifest declare, plus one byte: trailing
/// bytes are still refused, a truncated file still names its section, and an endless file
/// (`/dev/zero`) or one that is not an artifact stops after its first bytes.
#[test]
fn load_reads_only_what_the_artifact_declares() {
    let dir = std::env::temp_dir().join(format!("tcc-runtime-declared-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.tcc");
    let whole = tiny_artifact();
    let load = |bytes: &[u8]| {
        std::fs::write(&path, bytes).unwrap();
        Model::load(&path)
    };
    assert!(load(&whole).is_ok());
    let mut longer = whole.clone();
    longer.extend([0u8; 4096]);
    let err = load(&longer).unwrap_err();
    assert_eq!(
        err.to_string(),
        Model::from_bytes(longer.clone()).unwrap_err().to_string()
    );
    let err = load(&whole[..whole.len() - 1]).unwrap_err();
    assert!(matches!(err, Error::Truncated { .. }), "{err}");
    let err = load(b"not an artifact, and longer than its header").unwrap_err();
    assert!(matches!(err, Error::NotAnArtifact), "{err}");
    // The bytes read of a file that declares less than it holds: the declared length + 1.
    std::fs::write(&path, &longer).unwrap();
    let read = tcc_runtime::fsutil::read_declared(
        &path,
        artifact::HEADER_BYTES as u64,
        artifact::declared_len,
    )
    .unwrap();
    assert_eq!(read.len(), whole.len() + 1);
    #[cfg(unix)]
    {
        let err = Model::load("/dev/zero").unwrap_err();
        assert!(matches!(err, Error::NotAnArtifact), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Format 2: a param with a recipe is drawn at load with `tcc_runtime::init`, over the
/// stored bytes; the recipe is checked like every other manifest field.
#[test]
fn params_with_a_recipe_are_drawn_at_load() {
    use tcc_runtime::init::{self, Dist, Recipe};
    let recipe = Recipe {
        dist: Dist::Normal {
            mean: 0.0,
            std: 0.5,
        },
        seed: 11,
    };
    let mut m = tiny_manifest();
    m.persistent[0].init = Some(recipe);
    // Nothing stored: the whole image is drawn.
    let model = Model::from_bytes(build(&m, &tiny_code(), &[])).unwrap();
    let mut want = vec![0u8; 16];
    assert!(init::fill_le("w", recipe, DType::F32, &mut want, 1));
    assert_eq!(model.persistent_init(), &want[..]);
    let mut s = tcc_runtime::Session::new(&model, tcc_runtime::Device::Cpu).unwrap();
    assert_eq!(s.param_bytes("w").unwrap(), &want[..]);
    s.run().unwrap();
    s.reset();
    assert_eq!(s.param_bytes("w").unwrap(), &want[..]);
    // The manifest round-trips with the recipe.
    let (back, _) = artifact::read(&build(&m, &tiny_code(), &[])).unwrap();
    assert_eq!(back.persistent[0].init, Some(recipe));

    let refused = |m: &artifact::Manifest, what: &str| {
        let err = artifact::validate(m).unwrap_err().to_string();
        assert!(err.contains(what), "{err}");
    };
    let mut v1 = m.clone();
    v1.format_version = 1;
    refused(&v1, "format version 1 does not have");
    let mut state = m.clone();
    state.persistent[0].kind = artifact::PersistentKind::State;
    refused(&state, "not a floating-point param");
    let mut int = m.clone();
    int.persistent[0].slot.dtype = DType::I32;
    refused(&int, "not a floating-point param");
    let mut nan = m.clone();
    nan.persistent[0].init = Some(Recipe {
        dist: Dist::Uniform {
            lo: f64::NAN,
            hi: 1.0,
        },
        seed: 0,
    });
    refused(&nan, "not finite");
}

/// A data-parallel step's collectives: sizes that do not fit the op and the ranks, inputs
/// that overlap their result or lie outside the arena, and a step of 0 ranks are bad
/// manifests, never a panic or a wild NCCL call.
#[test]
fn collectives_that_do_not_fit_are_rejected() {
    use artifact::{Collective, CollectiveOp, Region};
    let with = |op, offset, bytes, input: Option<Region>, ranks: u32| {
        move |m: &mut artifact::Manifest| {
            m.ranks = Some(ranks);
            m.kernels[0].collective = Some(Collective {
                op,
                offset,
                bytes,
                dtype: DType::F32,
                in_place: false,
                input,
            });
        }
    };
    let at = |offset, bytes| Some(Region { offset, bytes });
    // A reduce-scatter of 2 ranks takes twice its result.
    rejects(
        with(CollectiveOp::ReduceScatterSum, 128, 16, at(64, 16), 2),
        "does not fit 2 ranks",
    );
    // An all-gather of 2 ranks gives twice its input.
    rejects(
        with(CollectiveOp::AllGather, 128, 16, at(64, 16), 2),
        "does not fit 2 ranks",
    );
    // A shard of 3 floats over 2 ranks is 2 floats.
    rejects(
        with(CollectiveOp::Shard, 128, 4, at(64, 12), 2),
        "does not fit 2 ranks",
    );
    rejects(
        with(CollectiveOp::ReduceScatterSum, 64, 16, at(64, 32), 2),
        "overlaps its result",
    );
    rejects(
        with(CollectiveOp::AllGather, 128, 32, at(192, 128), 2),
        "inside the arena",
    );
    rejects(
        with(CollectiveOp::AllGather, 128, 32, at(68, 16), 2),
        "not a multiple of the alignment",
    );
    rejects(with(CollectiveOp::Shard, 128, 8, None, 2), "names no input");
    rejects(
        with(CollectiveOp::AllReduceSum, 128, 8, at(64, 8), 2),
        "an all-reduce with an input",
    );
    rejects(
        with(CollectiveOp::Shard, 128, 8, at(64, 12), 0),
        "names no ranks",
    );
    // In place with an input.
    rejects(
        |m| {
            with(CollectiveOp::AllGather, 128, 32, at(64, 16), 2)(m);
            if let Some(c) = &mut m.kernels[0].collective {
                c.in_place = true;
            }
        },
        "in place but has an input",
    );
}

/// The CUDA tiny model with a `sass` section of two stand-in cubins (`k0` in the first,
/// `k1` in the second), after `edit` changed the description, and `section` as its bytes.
fn with_sass(
    edit: impl FnOnce(&mut artifact::Manifest),
    section: Option<&[u8]>,
) -> Result<Model, Error> {
    use artifact::{Sass, SassPiece};
    let mut m = cuda_tiny_manifest();
    m.sass = Some(Sass {
        arch: "sm_90a".into(),
        assembler: "ptxas test".into(),
        code_checksum: artifact::checksum_hex(
            (artifact::bounds_line(&cuda_tiny_manifest()) + &cuda_tiny_ptx()).as_bytes(),
        ),
        pieces: vec![
            SassPiece {
                offset: 0,
                len: 100,
                entries: vec!["k0".into()],
            },
            SassPiece {
                offset: 128,
                len: 72,
                entries: vec!["k1".into()],
            },
        ],
    });
    edit(&mut m);
    let code = artifact::bounds_line(&m) + &cuda_tiny_ptx();
    let init = persistent_init(&[1.0, 2.0, 3.0, 4.0], 64);
    let mut sections = vec![("code", code.as_bytes()), ("persistent", init.as_slice())];
    if let Some(s) = section {
        sections.push(("sass", s));
    }
    Model::from_bytes(artifact::write(&m, &sections))
}

#[test]
fn sass_pieces_are_checked_against_the_section_and_the_kernels() {
    let section: Vec<u8> = (0..200u32).map(|i| i as u8).collect();
    let m = with_sass(|_| {}, Some(&section)).unwrap();
    let (sass, cubins) = m.sass().unwrap();
    assert_eq!(sass.arch, "sm_90a");
    assert_eq!(cubins, vec![&section[..100], &section[128..200]]);
    let bad =
        |edit: fn(&mut artifact::Manifest), section: Option<&[u8]>, needle: &str| match with_sass(
            edit, section,
        ) {
            Err(Error::BadManifest(msg)) => assert!(msg.contains(needle), "{needle}: {msg}"),
            other => panic!("expected BadManifest({needle}), got {other:?}"),
        };
    let s = Some(section.as_slice());
    bad(
        |m| m.sass.as_mut().unwrap().pieces[1].len = 73,
        s,
        "outside",
    );
    bad(
        |m| m.sass.as_mut().unwrap().pieces[1].offset = 64,
        s,
        "overlap",
    );
    bad(|m| m.sass.as_mut().unwrap().pieces[0].len = 0, s, "empty");
    bad(
        |m| m.sass.as_mut().unwrap().pieces[1].offset = u64::MAX,
        s,
        "outside",
    );
    bad(
        |m| m.sass.as_mut().unwrap().pieces[1].entries.clear(),
        s,
        "no piece holds kernel `k1`",
    );
    bad(
        |m| m.sass.as_mut().unwrap().pieces[1].entries = vec!["k0".into(), "k1".into()],
        s,
        "in two pieces",
    );
    bad(
        |m| m.sass.as_mut().unwrap().pieces[1].entries.push("k9".into()),
        s,
        "`k9` is no kernel",
    );
    bad(
        |m| m.sass.as_mut().unwrap().arch = "sm_9".into(),
        s,
        "not `sm_NN`",
    );
    bad(
        |m| m.sass.as_mut().unwrap().arch = "compute_90".into(),
        s,
        "not `sm_NN`",
    );
    bad(|_| {}, None, "no `sass` section");
    bad(|m| m.sass = None, s, "does not describe");
    bad(
        |m| m.target = artifact::Target::Cpu,
        s,
        "only `cuda` artifacts",
    );
}

#[test]
fn sass_runs_on_its_compute_capability() {
    let sass = |arch: &str| artifact::Sass {
        arch: arch.into(),
        assembler: String::new(),
        code_checksum: String::new(),
        pieces: Vec::new(),
    };
    // `a`: exactly that capability (Hopper's wgmma); without: that major, a minor as high.
    assert_eq!(sass("sm_90a").capability(), Some((9, 0, true)));
    assert!(sass("sm_90a").runs_on(9, 0));
    assert!(!sass("sm_90a").runs_on(10, 0));
    assert!(sass("sm_80").runs_on(8, 6));
    assert!(!sass("sm_86").runs_on(8, 0));
    assert!(!sass("sm_80").runs_on(9, 0));
    assert_eq!(sass("sm_120").capability(), Some((12, 0, false)));
    assert_eq!(sass("sm_x0").capability(), None);
    assert!(!sass("sm_").runs_on(9, 0));
}

#[test]
fn shards_must_be_one_of_ranks_blocks_of_a_param() {
    use artifact::{PersistentKind, PersistentSlot};
    // `w` is f32[4]; on 2 ranks its state's shard is f32[2].
    let shard = |shape: &[usize], of: &str, kind, ranks| {
        let shape = shape.to_vec();
        let of = of.to_string();
        move |m: &mut artifact::Manifest| {
            m.ranks = Some(ranks);
            m.plan.persistent_bytes = 128;
            m.persistent.push(PersistentSlot {
                slot: slot("w.m", DType::F32, &shape, 64),
                kind,
                init: None,
                shard_of: Some(of),
            });
        }
    };
    let ok = {
        let mut m = tiny_manifest();
        shard(&[2], "w", PersistentKind::State, 2)(&mut m);
        m
    };
    assert!(artifact::validate(&ok).is_ok());
    assert_eq!(
        ok.persistent[1].whole(&ok).map(|s| s.shape.clone()),
        Some(vec![4])
    );
    rejects(
        shard(&[2], "v", PersistentKind::State, 2),
        "which is no param",
    );
    rejects(
        shard(&[3], "w", PersistentKind::State, 2),
        "cannot be one of 2 shards",
    );
    rejects(
        shard(&[2], "w", PersistentKind::State, 1),
        "cannot be one of 1 shards",
    );
    rejects(
        shard(&[2], "w", PersistentKind::Param, 2),
        "cannot be one of 2 shards",
    );
    rejects(
        shard(&[1, 2], "w", PersistentKind::State, 2),
        "cannot be one of 2 shards",
    );
}

/// An in-step check names a scalar f32 output; a step that leaves its count above zero
/// fails with the op and the bound, and one that leaves it at zero runs.
#[test]
fn in_step_checks_name_a_scalar_output_and_fail_the_step() {
    let check = |output: &str| artifact::Check {
        output: output.into(),
        what: "embedding into `t`".into(),
        bound: 8,
        kind: Default::default(),
    };
    rejects(
        |m| m.checks.push(check("tcc.check.0")),
        "check `tcc.check.0` does not name a scalar f32 output",
    );
    rejects(
        |m| {
            m.outputs.push(slot("y2", DType::F32, &[], 0));
            m.checks.push(check("y2"));
        },
        "starting with `tcc.check.`",
    );
    // The count lives at the param's first element (1.0 here, 0.0 once zeroed).
    let mut m = tiny_manifest();
    m.outputs.push(slot("tcc.check.0", DType::F32, &[], 0));
    m.checks.push(check("tcc.check.0"));
    let model = Model::from_bytes(build(
        &m,
        &tiny_code(),
        &persistent_init(&[1.0, 2.0, 3.0, 4.0], 64),
    ))
    .unwrap();
    let mut s = tcc_runtime::Session::new(&model, tcc_runtime::Device::Cpu).unwrap();
    match s.run() {
        Err(Error::IndexOutOfRangeInStep { what, count, bound }) => {
            assert_eq!((what.as_str(), count, bound), ("embedding into `t`", 1, 8));
        }
        other => panic!("expected IndexOutOfRangeInStep, got {other:?}"),
    }
    s.set_param("w", &[0.0, 2.0, 3.0, 4.0]).unwrap();
    s.run().unwrap();
}

/// `bytes` (written by this crate) stamped with format `v` (same checksums: 5 or later),
/// in the header and the manifest.
fn restamp(bytes: &[u8], v: u32) -> Vec<u8> {
    let mut bytes = bytes.to_vec();
    bytes[8..12].copy_from_slice(&v.to_le_bytes());
    let len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let text = String::from_utf8(bytes[24..24 + len].to_vec()).unwrap();
    let new = format!("\"format_version\":{}", artifact::FORMAT_VERSION);
    assert!(text.contains(&new));
    let text = text.replacen(&new, &format!("\"format_version\":{v}"), 1);
    assert_eq!(text.len(), len);
    bytes[24..24 + len].copy_from_slice(text.as_bytes());
    bytes[12..16].copy_from_slice(&artifact::manifest_check(v, text.as_bytes()).to_le_bytes());
    bytes
}

/// `bytes` (written by this crate) as format `v` (3 or 4) would have written them: the
/// version in the header and the manifest, and each section's FNV-1a 64 under `fnv1a64`
/// (a digit for a digit, so no offset moves), with the manifest's checksum of that format.
fn downgrade(bytes: &[u8], v: u32) -> Vec<u8> {
    let mut bytes = bytes.to_vec();
    let (m, ranges) = artifact::read(&bytes).unwrap();
    bytes[8..12].copy_from_slice(&v.to_le_bytes());
    let len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let mut text = String::from_utf8(bytes[24..24 + len].to_vec()).unwrap();
    let new = format!("\"format_version\":{}", artifact::FORMAT_VERSION);
    assert!(text.contains(&new));
    text = text.replacen(&new, &format!("\"format_version\":{v}"), 1);
    for (s, (_, r)) in m.sections.iter().zip(&ranges) {
        let from = format!("\"xxh3_64\":\"{}\"", s.checksum);
        let to = format!("\"fnv1a64\":\"{:016x}\"", fnv1a64(&bytes[r.clone()]));
        assert!(text.contains(&from));
        text = text.replacen(&from, &to, 1);
    }
    assert_eq!(text.len(), len);
    bytes[24..24 + len].copy_from_slice(text.as_bytes());
    bytes[12..16].copy_from_slice(&artifact::manifest_check(v, text.as_bytes()).to_le_bytes());
    bytes
}
