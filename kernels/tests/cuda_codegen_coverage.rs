//! The CUDA code-generation check (`tests/cuda_codegen.rs`, behind the `cuda-codegen` feature)
//! covers every kernel: each `#[cube(launch…)]` function of the crate has a case in
//! `tests/cuda_codegen/cases.rs`. Runs everywhere (it reads the sources), so a new kernel
//! without a case fails the ordinary test suite.

use std::path::Path;

/// `(file, name)` of every launchable kernel under `dir`, files relative to `root`.
fn kernels(root: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read the kernel sources")
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            kernels(root, &path, out);
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read a kernel source");
        let mut lines = text.lines();
        while let Some(line) = lines.next() {
            // `#[cube(launch)]` or `#[cube(launch_unchecked)]`, with or without other options.
            if !line.trim().starts_with("#[cube(launch") {
                continue;
            }
            // Further attributes may stand between the macro and the function.
            let signature = lines
                .by_ref()
                .map(str::trim)
                .find(|l| !l.starts_with("#[") && !l.starts_with("//"))
                .unwrap_or_default();
            let name = signature
                .strip_prefix("pub fn ")
                .and_then(|rest| rest.split(['<', '(']).next())
                .unwrap_or_else(|| {
                    panic!(
                        "{}: a kernel that is not a `pub fn`: {signature:?}",
                        path.display()
                    )
                });
            let file = path.strip_prefix(root).unwrap_or(&path);
            out.push((file.display().to_string(), name.to_string()));
        }
    }
}

#[test]
fn every_kernel_has_a_cuda_codegen_case() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    kernels(root, &root.join("src"), &mut found);
    assert!(
        found.len() >= 40,
        "the scan found only {} kernels",
        found.len()
    );
    let cases = std::fs::read_to_string(root.join("tests/cuda_codegen/cases.rs"))
        .expect("read tests/cuda_codegen/cases.rs");
    let missing: Vec<_> = found
        .iter()
        .filter(|(_, name)| !cases.contains(&format!("::{name}::")))
        .map(|(file, name)| format!("{name} ({file})"))
        .collect();
    assert!(
        missing.is_empty(),
        "kernels without a case in tests/cuda_codegen/cases.rs: {missing:?}"
    );
}
