//! Shared harness of the multi-process GPU tests: each test spawns its ranks as processes of its
//! own test binary, running the binary's `gpu_rank` test with the case in `DOORBELL_GPU_CASE`,
//! as a launcher would (one process per rank; `LOCAL_RANK % GPUs` picks the GPU, so more ranks
//! than GPUs share them).

use doorbell::host::launch::{spawn_ranks, SpawnOptions};
use std::ffi::OsString;
use std::time::Duration;

/// The variable that tells a spawned rank which case to run.
pub const CASE_VAR: &str = "DOORBELL_GPU_CASE";

/// Rank counts every multi-rank test runs with: `DOORBELL_TEST_RANKS` (e.g. "8") lists them
/// explicitly; otherwise 2, 3 and 4, and `DOORBELL_TEST_MAX_RANKS=8` adds 8 (an 8-GPU machine, or
/// ranks sharing fewer GPUs).
pub fn rank_counts() -> Vec<usize> {
    if let Ok(list) = std::env::var("DOORBELL_TEST_RANKS") {
        let v: Vec<usize> = list
            .split([' ', ','])
            .filter_map(|s| s.trim().parse().ok())
            .filter(|&n| n >= 2)
            .collect();
        if !v.is_empty() {
            return v;
        }
    }
    let max: usize = std::env::var("DOORBELL_TEST_MAX_RANKS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    [2, 3, 4, 8].into_iter().filter(|&n| n <= max).collect()
}

/// Runs `case` as `nranks` processes and asserts every one succeeded.
pub fn run_case(case: &str, nranks: usize, extra: &[(&str, &str)]) {
    let exe = std::env::current_exe().expect("test binary path");
    let args: Vec<OsString> = [
        "gpu_rank",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    let mut extra_env = vec![(CASE_VAR.to_string(), case.to_string())];
    extra_env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let exits = spawn_ranks(
        &exe,
        &args,
        &SpawnOptions {
            nranks,
            extra_env,
            timeout: Some(Duration::from_secs(300)),
            grace: Duration::from_secs(20),
        },
    )
    .expect("spawn ranks");
    let failed: Vec<_> = exits.iter().filter(|e| !e.success()).collect();
    assert!(
        failed.is_empty(),
        "case {case} with {nranks} ranks: {failed:?}"
    );
}

/// The case this process should run as a rank, if it was spawned by `run_case`.
pub fn spawned_case() -> Option<String> {
    std::env::var(CASE_VAR).ok()
}
