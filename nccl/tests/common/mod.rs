//! What the integration tests share: the C compiler (`cc`, or `CC`).

use std::process::Command;

/// Runs the C compiler with `args`; panics with its message when it fails or is missing.
pub fn compile(args: &[&std::ffi::OsStr]) {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&cc)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {cc}: {e} (a C compiler is needed)"));
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
}
