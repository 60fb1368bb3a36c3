//! Copies doorbell's CUDA headers into the Python package (`py/doorbell/include/doorbell`), so
//! the wheel ships them for `doorbell.get_include()`. The tree is copied whole (the tier folders
//! `core/`, `ib/`, `channel/`, `coll/`, `detail/` and `doorbell.cuh` above them), and the copy is
//! made afresh each time, so a header moved or removed in `cuda/include` does not linger in it.

use std::path::Path;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let from = root.join("../cuda/include/doorbell");
    let to = root.join("py/doorbell/include/doorbell");
    println!("cargo:rerun-if-changed={}", from.display());
    if to.exists() {
        std::fs::remove_dir_all(&to).expect("remove the old py/doorbell/include/doorbell");
    }
    copy_headers(&from, &to);
}

/// Copies every `.cuh` under `from` to the same place under `to`.
fn copy_headers(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create a folder under py/doorbell/include/doorbell");
    for entry in std::fs::read_dir(from).expect("read a folder under cuda/include/doorbell") {
        let path = entry.expect("a directory entry").path();
        let dst = to.join(path.file_name().expect("a file name"));
        if path.is_dir() {
            copy_headers(&path, &dst);
        } else if path.extension().is_some_and(|e| e == "cuh") {
            std::fs::copy(&path, &dst).expect("copy a header");
        }
    }
}
