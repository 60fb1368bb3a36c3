//! Launcher tests on real processes. Output relaying is checked from outside: the test runs this
//! test binary as a launcher (`child_entry` with `DOORBELL_LAUNCH_TEST` set) and reads what that
//! launcher printed. Supervision (grace period, overall timeout) is checked directly with
//! `/bin/sh` ranks.

use doorbell::job::launch::{exit_code, rank_or_spawn, spawn_ranks, Launched, SpawnOptions};
use std::collections::HashSet;
use std::ffi::OsString;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const CASE: &str = "DOORBELL_LAUNCH_TEST";
const LINES: usize = 200;

fn child_args() -> Vec<OsString> {
    [
        "child_entry",
        "--exact",
        "--nocapture",
        "--test-threads=1",
        "-q",
    ]
    .iter()
    .map(OsString::from)
    .collect()
}

fn sh(script: &str) -> Vec<OsString> {
    vec!["-c".into(), script.into()]
}

/// Runs this test binary's `child_entry` with `case`, without launcher variables.
fn run_launcher(case: &str) -> Output {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(child_args()).env(CASE, case);
    for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"] {
        cmd.env_remove(var);
    }
    cmd.output().unwrap()
}

/// Each rank writes LINES long lines to stdout and to stderr, as fast as it can, then a last
/// line without a newline; rank 2 exits with 3.
const CHATTY: &str = r#"
pad=PAD
i=0
while [ $i -lt LINES ]; do
  echo "out $RANK/$WORLD_SIZE line $i $pad$pad$pad"
  echo "err $RANK line $i $pad" >&2
  i=$((i+1))
done
printf "tail $RANK"
[ "$RANK" = 2 ] && exit 3
exit 0
"#;

/// The launcher side of the relaying cases; does nothing unless `DOORBELL_LAUNCH_TEST` is set.
#[test]
fn child_entry() {
    let Ok(case) = std::env::var(CASE) else {
        return;
    };
    match case.as_str() {
        "relay" => {
            let script = CHATTY
                .replace("LINES", &LINES.to_string())
                .replace("PAD", &"x".repeat(96));
            let exits =
                spawn_ranks(Path::new("/bin/sh"), &sh(&script), &SpawnOptions::new(3)).unwrap();
            for e in &exits {
                eprintln!("EXIT {} {} {}", e.rank, e.code(), e.killed);
            }
            std::process::exit(exit_code(&exits));
        }
        "rank_or_spawn" | "rank_or_spawn_ok" => {
            let fail = case == "rank_or_spawn";
            match rank_or_spawn(None, || Ok(3)).unwrap() {
                Launched::Rank(cfg) => {
                    println!(
                        "rank {} of {} local {} of {} master {}:{}",
                        cfg.rank,
                        cfg.world_size,
                        cfg.local_rank,
                        cfg.local_world_size,
                        cfg.master_addr,
                        cfg.master_port
                    );
                    std::process::exit(if fail && cfg.rank == 1 { 7 } else { 0 });
                }
                Launched::Parent(code) => std::process::exit(code),
            }
        }
        other => panic!("unknown case {other}"),
    }
}

fn lines(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn output_is_prefixed_whole_lines_and_failure_is_the_exit_code() {
    let t0 = Instant::now();
    let out = run_launcher("relay");
    let (stdout, stderr) = (lines(&out.stdout), lines(&out.stderr));
    assert_eq!(out.status.code(), Some(3), "stderr: {stderr:?}");
    let pad = "x".repeat(96);
    let mut seen_out = HashSet::new();
    let mut seen_err = HashSet::new();
    for line in &stdout {
        if line.contains("out ") || line.contains("tail") {
            assert!(seen_out.insert(line.clone()), "duplicate line {line}");
        }
    }
    for line in &stderr {
        if line.contains("err ") {
            assert!(seen_err.insert(line.clone()), "duplicate line {line}");
        }
    }
    for rank in 0..3 {
        for i in 0..LINES {
            let want = format!("[rank {rank}] out {rank}/3 line {i} {pad}{pad}{pad}");
            assert!(seen_out.contains(&want), "missing or torn: {want}");
            let want = format!("[rank {rank}] err {rank} line {i} {pad}");
            assert!(seen_err.contains(&want), "missing or torn: {want}");
        }
        assert!(seen_out.contains(&format!("[rank {rank}] tail {rank}")));
    }
    // Nothing else carries rank output: every relayed line was accounted for above.
    assert_eq!(seen_out.len(), 3 * (LINES + 1));
    assert_eq!(seen_err.len(), 3 * LINES);
    for rank in [0, 1] {
        assert!(
            stderr.contains(&format!("EXIT {rank} 0 false")),
            "{stderr:?}"
        );
    }
    assert!(stderr.contains(&"EXIT 2 3 false".to_string()), "{stderr:?}");
    eprintln!("relay case took {:?}", t0.elapsed());
}

#[test]
fn rank_or_spawn_runs_this_program_as_each_rank() {
    let out = run_launcher("rank_or_spawn_ok");
    let stdout = lines(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout:?}");
    let ports: HashSet<String> = stdout
        .iter()
        .filter_map(|l| l.split("master 127.0.0.1:").nth(1).map(str::to_string))
        .collect();
    assert_eq!(ports.len(), 1, "one MASTER_PORT for all ranks: {stdout:?}");
    for rank in 0..3 {
        let want = format!("[rank {rank}] rank {rank} of 3 local {rank} of 3 master 127.0.0.1:");
        assert!(
            stdout.iter().any(|l| l.starts_with(&want)),
            "{want}: {stdout:?}"
        );
    }
}

#[test]
fn rank_or_spawn_exit_code_reports_a_failed_rank() {
    let out = run_launcher("rank_or_spawn");
    assert_eq!(out.status.code(), Some(7), "{:?}", lines(&out.stderr));
}

#[test]
fn a_failed_rank_gets_the_others_killed_after_the_grace_period() {
    let t0 = Instant::now();
    let opts = SpawnOptions {
        grace: Duration::from_millis(500),
        ..SpawnOptions::new(3)
    };
    let exits = spawn_ranks(
        Path::new("/bin/sh"),
        &sh(r#"[ "$RANK" = 1 ] && exit 4; exec sleep 60"#),
        &opts,
    )
    .unwrap();
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert_eq!(exits[1].code(), 4);
    assert!(!exits[1].killed);
    for r in [0, 2] {
        assert!(exits[r].killed && !exits[r].success(), "{:?}", exits[r]);
    }
    assert_eq!(exit_code(&exits), 4);
}

#[test]
fn the_overall_timeout_kills_a_hung_job() {
    let t0 = Instant::now();
    let opts = SpawnOptions {
        timeout: Some(Duration::from_millis(500)),
        ..SpawnOptions::new(2)
    };
    let exits = spawn_ranks(Path::new("/bin/sh"), &sh("exec sleep 60"), &opts).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(exits.iter().all(|e| e.killed), "{exits:?}");
    assert_ne!(exit_code(&exits), 0);
}

#[test]
fn variables_and_extra_env_reach_every_rank() {
    let opts = SpawnOptions {
        extra_env: vec![
            ("EXTRA".into(), "yes".into()),
            ("WORLD_SIZE".into(), "9".into()),
        ],
        ..SpawnOptions::new(2)
    };
    let script = r#"[ "$EXTRA" = yes ] && [ "$WORLD_SIZE" = 9 ] && [ "$LOCAL_RANK" = "$RANK" ] \
        && [ "$MASTER_ADDR" = 127.0.0.1 ] && [ -n "$MASTER_PORT" ] \
        && [ ${#DOORBELL_JOB_SECRET} -ge 32 ]"#;
    let exits = spawn_ranks(Path::new("/bin/sh"), &sh(script), &opts).unwrap();
    assert!(exits.iter().all(|e| e.success()), "{exits:?}");
}

#[test]
fn spawn_errors_are_errors() {
    let e = spawn_ranks(Path::new("/nonexistent/rank"), &[], &SpawnOptions::new(2)).unwrap_err();
    assert!(e.to_string().contains("rank 0"), "{e}");
    assert!(spawn_ranks(Path::new("/bin/sh"), &[], &SpawnOptions::new(0)).is_err());
}
