//! Starting ranks the way launchers do: either this process already is a rank (torchrun, srun,
//! mpirun set its variables), or it becomes a small launcher that runs itself once per rank on
//! this host and relays each rank's output with a `[rank N] ` prefix.
//!
//! This module owns the child processes it spawns and the threads relaying their output. It must
//! never leave a child running after it returns (a failed rank's siblings are killed after a grace
//! period, everything is killed at the optional overall timeout, and children die with the thread
//! that spawned them), and it knows nothing about GPUs: ranks may outnumber them.

use crate::error::{Error, Result};
use crate::job::auth::{hex, random_bytes};
use crate::job::bootstrap::BootstrapConfig;
use crate::job::config::{LaunchEnv, Settings};
use crate::job::socket::fmt_duration;
use std::ffi::OsString;
use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// Grace period [`rank_or_spawn`] gives the other ranks after one fails.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);
/// How often the supervisor looks at its children.
const POLL: Duration = Duration::from_millis(10);
/// How long to wait for a killed child to be reaped before reporting it anyway.
const REAP_WAIT: Duration = Duration::from_secs(10);
/// How long to wait for output relays to drain after every child exited.
const DRAIN_WAIT: Duration = Duration::from_secs(2);
/// Longest line relayed in one piece; longer ones are split.
const MAX_LINE: u64 = 64 * 1024;

/// What [`rank_or_spawn`] made of this process.
#[derive(Debug)]
pub enum Launched {
    /// This process is a rank; run the job with this config.
    Rank(BootstrapConfig),
    /// This process spawned the ranks and they all finished; exit with this code (0 when every
    /// child succeeded).
    Parent(i32),
}

/// If launcher variables are present ([`LaunchEnv::from_env`]), returns [`Launched::Rank`].
/// Otherwise spawns `nranks` children (or `default_nranks()` when `None`) running the current
/// executable with the same arguments and the variables [`spawn_ranks`] sets, waits for them with
/// a [`DEFAULT_GRACE`] after a failure, and returns [`Launched::Parent`] with the exit code.
pub fn rank_or_spawn(
    nranks: Option<usize>,
    default_nranks: impl FnOnce() -> Result<usize>,
) -> Result<Launched> {
    if let Some(env) = LaunchEnv::from_env()? {
        let settings = Settings::from_env()?;
        return Ok(Launched::Rank(BootstrapConfig::from_launch(
            &env, &settings,
        )));
    }
    let nranks = match nranks {
        Some(n) => n,
        None => default_nranks()?,
    };
    let program =
        std::env::current_exe().map_err(|e| Error::io("finding the current executable", e))?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let exits = spawn_ranks(
        &program,
        &args,
        &SpawnOptions {
            nranks,
            extra_env: Vec::new(),
            timeout: None,
            grace: DEFAULT_GRACE,
        },
    )?;
    Ok(Launched::Parent(exit_code(&exits)))
}

/// How [`spawn_ranks`] runs a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpawnOptions {
    /// Number of ranks to start.
    pub nranks: usize,
    /// Variables set in every child after the launcher's own, so they can override them.
    pub extra_env: Vec<(String, String)>,
    /// Kill every rank still running this long after the start.
    pub timeout: Option<Duration>,
    /// After the first rank fails, how long the others may keep running before they are killed.
    pub grace: Duration,
}

impl SpawnOptions {
    /// `nranks` ranks, no extra variables, no overall timeout, [`DEFAULT_GRACE`].
    pub fn new(nranks: usize) -> Self {
        SpawnOptions {
            nranks,
            extra_env: Vec::new(),
            timeout: None,
            grace: DEFAULT_GRACE,
        }
    }
}

/// How one rank ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankExit {
    /// The rank.
    pub rank: usize,
    /// Its exit status (`SIGKILL` when it was killed and could not be reaped in time).
    pub status: ExitStatus,
    /// True when the launcher killed it (grace period or overall timeout ran out).
    pub killed: bool,
}

impl RankExit {
    /// True when the rank exited by itself with code 0.
    pub fn success(&self) -> bool {
        !self.killed && self.status.success()
    }

    /// The shell's view of the status: the exit code, or 128 + the signal number.
    pub fn code(&self) -> i32 {
        match (self.status.code(), self.status.signal()) {
            (Some(code), _) => code,
            (None, Some(signal)) => 128 + signal,
            (None, None) => 1,
        }
    }
}

impl fmt::Display for RankExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.status.code(), self.status.signal()) {
            (Some(code), _) => write!(f, "rank {} exited with code {code}", self.rank)?,
            (None, Some(signal)) => write!(f, "rank {} died of signal {signal}", self.rank)?,
            (None, None) => write!(f, "rank {} ended with {}", self.rank, self.status)?,
        }
        if self.killed {
            write!(f, " (killed by the launcher)")?;
        }
        Ok(())
    }
}

/// The job's exit code: 0 when every rank succeeded, else the code of the lowest rank that failed
/// by itself (the likely cause), else that of the lowest killed rank.
pub fn exit_code(exits: &[RankExit]) -> i32 {
    exits
        .iter()
        .find(|e| !e.success() && !e.killed)
        .or_else(|| exits.iter().find(|e| !e.success()))
        .map_or(0, |e| e.code().max(1))
}

/// The lowest port the kernel hands to outgoing connections (`ip_local_port_range`; Linux's
/// default 32768 where the file cannot be read).
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// Where [`free_port`] looks first: ports [10000, the ephemeral range's start), or none when
/// that range starts too low to leave a thousand.
fn quiet_ports(ephemeral_low: u16) -> Option<std::ops::Range<u16>> {
    (ephemeral_low >= 11_000).then_some(10_000..ephemeral_low)
}

/// A TCP port free a moment ago on every address: a random one below the kernel's ephemeral
/// range where there is room, else one the kernel picks (bind to port 0). Outgoing connections
/// take their local ports from the ephemeral range, so they cannot take a port below it before
/// rank 0 binds it (a port from bind(0) can be taken so, and once was: the GPU suite's ranks
/// failed with "Address already in use"); another listener still could (rank 0 then fails with a
/// clear "cannot listen" error).
pub fn free_port() -> Result<u16> {
    let free =
        |port: u16| TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).and_then(|l| l.local_addr());
    if let Some(range) = quiet_ports(ephemeral_low()) {
        let span = u64::from(range.end - range.start);
        for _ in 0..64 {
            let port = range.start + (u64::from_le_bytes(random_bytes::<8>()?) % span) as u16;
            if free(port).is_ok() {
                return Ok(port);
            }
        }
    }
    free(0)
        .map(|a| a.port())
        .map_err(|e| Error::io("finding a free TCP port", e))
}

/// Runs `program args` as `opts.nranks` ranks on this host, with `RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR=127.0.0.1`, `MASTER_PORT` (a [`free_port`]) and
/// a random `DOORBELL_JOB_SECRET` set, then `opts.extra_env`. Each line a child writes to stdout
/// or stderr is relayed whole to ours with a `[rank N] ` prefix. Returns every rank's exit, in
/// rank order. Children get no stdin, and are killed if the calling thread dies before them.
pub fn spawn_ranks(
    program: &Path,
    args: &[OsString],
    opts: &SpawnOptions,
) -> Result<Vec<RankExit>> {
    let n = opts.nranks;
    if n == 0 {
        return Err(Error::invalid("nranks", "a job needs at least one rank"));
    }
    let port = free_port()?;
    let secret = hex(&random_bytes::<32>()?);
    let (relay_done, relays_done) = mpsc::channel::<()>();
    let mut children: Vec<Child> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("DOORBELL_JOB_SECRET", &secret)
            .envs(opts.extra_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        die_with_parent(&mut cmd);
        let started = cmd
            .spawn()
            .map_err(|e| Error::io(format!("starting rank {rank} ({})", program.display()), e))
            .and_then(|mut child| {
                let relays = start_relay(rank, child.stdout.take(), false, &relay_done)
                    .and_then(|()| start_relay(rank, child.stderr.take(), true, &relay_done));
                match relays {
                    Ok(()) => Ok(child),
                    Err(e) => {
                        let _ = child.kill();
                        let _ = child.wait();
                        Err(e)
                    }
                }
            });
        match started {
            Ok(child) => children.push(child),
            Err(e) => {
                for child in &mut children {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(e);
            }
        }
    }
    drop(relay_done);
    let exits = supervise(children, opts);
    // The children are gone; their pipes close unless they left grandchildren holding them.
    let until = Instant::now() + DRAIN_WAIT;
    for _ in 0..2 * n {
        let left = until.saturating_duration_since(Instant::now());
        if relays_done.recv_timeout(left).is_err() {
            break;
        }
    }
    Ok(exits)
}

/// Makes the child get SIGKILL when the thread that spawned it exits, so a launcher that dies
/// (or is killed) never leaves ranks behind.
fn die_with_parent(cmd: &mut Command) {
    let parent = std::process::id();
    let hook = move || -> io::Result<()> {
        // SAFETY: runs in the forked child before exec; prctl and getppid are async-signal-safe
        // and touch no memory shared with the parent.
        let (rc, ppid) = unsafe {
            (
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong),
                libc::getppid(),
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // The launcher may have died before prctl took effect. (No allocation here: this runs
        // between fork and exec.)
        if u32::try_from(ppid).ok() != Some(parent) {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(())
    };
    // SAFETY: the hook only makes async-signal-safe calls (see above) and allocates nothing on
    // its success path.
    unsafe {
        cmd.pre_exec(hook);
    }
}

fn start_relay(
    rank: usize,
    pipe: Option<impl Read + Send + 'static>,
    to_stderr: bool,
    done: &mpsc::Sender<()>,
) -> Result<()> {
    let Some(pipe) = pipe else {
        return Ok(());
    };
    let done = done.clone();
    thread::Builder::new()
        .name(format!("doorbell-relay-{rank}"))
        .spawn(move || {
            let prefix = format!("[rank {rank}] ");
            let _ = if to_stderr {
                prefix_lines(&prefix, pipe, |line| {
                    let mut err = io::stderr().lock();
                    err.write_all(line).and_then(|()| err.flush())
                })
            } else {
                prefix_lines(&prefix, pipe, |line| {
                    let mut out = io::stdout().lock();
                    out.write_all(line).and_then(|()| out.flush())
                })
            };
            let _ = done.send(());
        })
        .map(drop)
        .map_err(|e| Error::io(format!("starting the output relay of rank {rank}"), e))
}

/// Reads `src` to its end and hands each line to `emit` as one buffer: `prefix`, the line, and a
/// newline (added when the last line lacks one). Lines longer than `MAX_LINE` are split. Once
/// `emit` fails, the rest is read and dropped, so the child never blocks on a full pipe.
fn prefix_lines(
    prefix: &str,
    src: impl Read,
    mut emit: impl FnMut(&[u8]) -> io::Result<()>,
) -> io::Result<()> {
    let mut src = BufReader::new(src);
    let mut line = Vec::new();
    let mut emitting = true;
    loop {
        line.clear();
        line.extend_from_slice(prefix.as_bytes());
        let read = (&mut src).take(MAX_LINE).read_until(b'\n', &mut line)?;
        if read == 0 {
            return Ok(());
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        if emitting && emit(&line).is_err() {
            emitting = false;
        }
    }
}

/// Waits for every child; enforces the grace period after the first failure and the overall
/// timeout. Never blocks longer than one poll interval at a time.
fn supervise(mut children: Vec<Child>, opts: &SpawnOptions) -> Vec<RankExit> {
    let start = Instant::now();
    let mut exits: Vec<Option<RankExit>> = vec![None; children.len()];
    let mut killed_at: Vec<Option<Instant>> = vec![None; children.len()];
    let mut first_failure: Option<Instant> = None;
    loop {
        let now = Instant::now();
        for (rank, child) in children.iter_mut().enumerate() {
            if exits[rank].is_some() {
                continue;
            }
            let status = match child.try_wait() {
                Ok(Some(status)) => Some(status),
                Ok(None) => None,
                Err(e) => {
                    announce(&format!("cannot wait for rank {rank}: {e}; killing it"));
                    let _ = child.kill();
                    killed_at[rank].get_or_insert(now);
                    None
                }
            };
            // A child stuck in the kernel may not die at once; report it after REAP_WAIT.
            let status = status.or_else(|| {
                killed_at[rank]
                    .filter(|t| now.duration_since(*t) >= REAP_WAIT)
                    .map(|_| ExitStatus::from_raw(libc::SIGKILL))
            });
            let Some(status) = status else { continue };
            let exit = RankExit {
                rank,
                status,
                killed: killed_at[rank].is_some(),
            };
            if !exit.success() && first_failure.is_none() {
                first_failure = Some(now);
                if !exit.killed && exits.iter().flatten().count() + 1 < exits.len() {
                    announce(&format!(
                        "{exit}; stopping the other ranks in {}",
                        fmt_duration(opts.grace)
                    ));
                }
            }
            exits[rank] = Some(exit);
        }
        if exits.iter().all(Option::is_some) {
            return exits.into_iter().flatten().collect();
        }
        let grace_over = first_failure.is_some_and(|t| now.duration_since(t) >= opts.grace);
        let timed_out = opts.timeout.is_some_and(|t| now.duration_since(start) >= t);
        if grace_over || timed_out {
            for (rank, child) in children.iter_mut().enumerate() {
                if exits[rank].is_none() && killed_at[rank].is_none() {
                    announce(&format!(
                        "killing rank {rank}: {}",
                        if timed_out {
                            "the job's timeout ran out"
                        } else {
                            "another rank failed and the grace period ran out"
                        }
                    ));
                    let _ = child.kill();
                    killed_at[rank] = Some(now);
                }
            }
        }
        thread::sleep(POLL);
    }
}

fn announce(message: &str) {
    let mut err = io::stderr().lock();
    let _ = writeln!(err, "[launch] {message}");
}

/// The `main` of a multi-rank program such as doorbell's examples. Under a launcher it runs `run`
/// as the rank it was given and exits with its code (1, after printing the error, if it failed);
/// started by hand it spawns `nranks` (or `default_nranks()`) ranks of this same program and
/// exits with their combined code. Never returns.
pub fn run_job(
    name: &str,
    nranks: Option<usize>,
    default_nranks: impl FnOnce() -> Result<usize>,
    run: impl FnOnce() -> Result<i32>,
) -> ! {
    let code = match rank_or_spawn(nranks, default_nranks) {
        Ok(Launched::Parent(code)) => code,
        Ok(Launched::Rank(_)) => match run() {
            Ok(code) => code,
            Err(e) => {
                eprintln!("{name} failed: {e}");
                1
            }
        },
        Err(e) => {
            eprintln!("{name}: {e}");
            1
        }
    };
    std::process::exit(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relay(input: &[u8]) -> Vec<Vec<u8>> {
        let mut lines = Vec::new();
        prefix_lines("[rank 3] ", input, |l| {
            lines.push(l.to_vec());
            Ok(())
        })
        .unwrap();
        lines
    }

    #[test]
    fn lines_get_the_prefix_and_a_final_newline() {
        assert_eq!(
            relay(b"a\nbc\n\npartial"),
            vec![
                b"[rank 3] a\n".to_vec(),
                b"[rank 3] bc\n".to_vec(),
                b"[rank 3] \n".to_vec(),
                b"[rank 3] partial\n".to_vec(),
            ]
        );
        assert!(relay(b"").is_empty());
        // Bytes that are not UTF-8 pass through untouched.
        assert_eq!(relay(b"\xff\xfe\n"), vec![b"[rank 3] \xff\xfe\n".to_vec()]);
    }

    #[test]
    fn long_lines_are_split_and_a_failed_sink_stops_emitting() {
        let long = vec![b'x'; MAX_LINE as usize + 10];
        let lines = relay(&long);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].len(), "[rank 3] ".len() + MAX_LINE as usize + 1);
        let mut calls = 0;
        prefix_lines("p", &b"1\n2\n3\n"[..], |_| {
            calls += 1;
            Err(io::Error::other("closed"))
        })
        .unwrap();
        assert_eq!(calls, 1);
    }

    #[test]
    fn exit_codes() {
        let exit = |rank, raw, killed| RankExit {
            rank,
            status: ExitStatus::from_raw(raw),
            killed,
        };
        // Raw wait statuses: code c is c << 8; a signal s is s.
        let ok = exit(0, 0, false);
        let failed = exit(1, 3 << 8, false);
        let killed = exit(2, libc::SIGKILL, true);
        assert_eq!(exit_code(&[ok, ok]), 0);
        assert_eq!(exit_code(&[ok, killed, failed]), 3);
        assert_eq!(exit_code(&[killed, ok]), 128 + libc::SIGKILL);
        assert_eq!(failed.to_string(), "rank 1 exited with code 3");
        assert!(killed.to_string().contains("killed by the launcher"));
        assert!(!exit(0, 0, true).success());
    }

    #[test]
    fn free_ports_are_nonzero_and_below_the_ephemeral_range() {
        let port = free_port().unwrap();
        assert_ne!(port, 0);
        if let Some(range) = quiet_ports(ephemeral_low()) {
            assert!(range.contains(&port), "{port} outside {range:?}");
        }
        assert_eq!(quiet_ports(32768), Some(10_000..32768));
        assert_eq!(quiet_ports(1024), None);
    }
}
