//! Compiles a C program against rdma-core's headers and runs it (the golden WQE and verbs layout
//! tests): needs a C compiler and `apt install libibverbs-dev` (`.ci/run` installs them).

use std::path::PathBuf;
use std::process::Command;

/// Builds `source` as `name` (with optimization `opt`, e.g. "-O1") and returns what it printed;
/// `against` names the header for the failure message.
pub fn run(name: &str, source: &str, opt: &str, against: &str) -> String {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (src, exe) = (dir.join(format!("{name}.c")), dir.join(name));
    std::fs::write(&src, source).expect("write the C program");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args([opt, "-std=gnu11", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("running {cc}: {e} (a C compiler is needed)"));
    assert!(
        out.status.success(),
        "compiling against rdma-core's {against} failed (install rdma-core's headers: apt install \
         libibverbs-dev):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().expect("run the C program");
    assert!(run.status.success(), "the C program {name} failed");
    String::from_utf8(run.stdout).expect("utf-8")
}
