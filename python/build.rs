//! Copies doorbell's CUDA headers into the Python package (`py/doorbell/include/doorbell`), so
//! the wheel ships them for `doorbell.get_include()`.

use std::path::Path;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let from = root.join("../cuda/include/doorbell");
    let to = root.join("py/doorbell/include/doorbell");
    println!("cargo:rerun-if-changed={}", from.display());
    std::fs::create_dir_all(&to).expect("create py/doorbell/include/doorbell");
    for entry in std::fs::read_dir(&from).expect("read cuda/include/doorbell") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|e| e == "cuh") {
            let dst = to.join(path.file_name().expect("a file name"));
            std::fs::copy(&path, &dst).expect("copy a header");
        }
    }
}
