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

/// A file written before the manifest checksum existed (header bytes 12..16 zero) still
/// loads; its sections are still checked.
#[test]
fn artifacts_without_a_manifest_checksum_still_load() {
    let mut bytes = tiny_artifact(artifact::Target::Cpu);
    bytes[12..16].fill(0);
    assert!(tcc_runtime::Model::from_bytes(bytes).is_ok());
}
