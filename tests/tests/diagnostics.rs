//! Every `tests/cases/errors/*.tdsl` must fail with located diagnostics; the rendered text
//! is snapshotted. A case's `// args:` header gives command-line options; `// expect-codes:`
//! lists the error codes that must appear, checked beside the snapshot.

use tcc_tests::*;

#[test]
fn error_cases() {
    let files = tdsl_files("tests/cases/errors");
    assert!(files.len() >= 30);
    for path in files {
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("?")
            .to_string();
        let rel = format!("tests/cases/errors/{stem}.tdsl");
        let bytes = std::fs::read(&path).unwrap();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let opts = options_from_args(&header(&text, "args").unwrap_or_default());
        let rendered = match compile_bytes(&rel, &bytes, &opts) {
            Ok(_) => panic!("{rel} should fail to compile"),
            Err(r) => r,
        };
        assert!(
            rendered.contains("error["),
            "{rel}: no error rendered:\n{rendered}"
        );
        if let Some(codes) = header(&text, "expect-codes") {
            for code in codes.split_whitespace() {
                assert!(
                    rendered.contains(&format!("error[{code}]")),
                    "{rel}: expected {code}:\n{rendered}"
                );
            }
        }
        // Every error is located, except those about the command line.
        let located = rendered.contains(&format!("{rel}:"))
            || rendered.contains("--set")
            || rendered.contains("model");
        assert!(located, "{rel}: diagnostic without location:\n{rendered}");
        insta::assert_snapshot!(format!("error_{stem}"), rendered);
    }
}
