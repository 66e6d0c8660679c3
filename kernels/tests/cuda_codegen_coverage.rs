//! The CUDA code-generation check (`tests/cuda_codegen.rs`, behind the `cuda-codegen` feature)
//! covers every kernel: each `#[cube(launch_unchecked)]` function of the crate has a case in
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
            if line.trim() != "#[cube(launch_unchecked)]" {
                continue;
            }
            let signature = lines.next().unwrap_or_default();
            let name = signature
                .trim()
                .strip_prefix("pub fn ")
                .and_then(|rest| rest.split(['<', '(']).next())
                .unwrap_or_else(|| panic!("{}: a kernel that is not a `pub fn`", path.display()));
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
