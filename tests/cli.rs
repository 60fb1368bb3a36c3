//! The `doorbell-info` binary on any machine (CPU test): `--help` describes it, a bad argument is
//! refused, and a plain run reports every section, with reasons where something is missing (CI
//! has no GPU and no RDMA device).

use std::process::Command;

fn info(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_doorbell-info"))
        .args(args)
        .output()
        .expect("run doorbell-info");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn doorbell_info_help_errors_and_report() {
    let (code, out, _) = info(&["--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("usage: doorbell-info"), "{out}");
    let (code, _, err) = info(&["--frobnicate"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown argument"), "{err}");
    let (code, out, err) = info(&[]);
    assert_eq!(code, 0, "{err}");
    for section in [
        "GPU",
        "RDMA NICs:",
        "IBGDA prerequisites:",
        "Between ranks on this host",
    ] {
        assert!(out.contains(section), "missing {section:?} in:\n{out}");
    }
}
