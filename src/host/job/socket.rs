//! Socket waits and the duration text of timeout errors, shared by the host's control-plane
//! modules (bootstrap, fd passing, launch).
//!
//! This module owns only stateless helpers: it holds no sockets and starts no threads. Its waits
//! must never block past the timeout they are given, and must never take ownership of (or close)
//! a descriptor they were lent.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

/// Waits up to `timeout` for `fd` to become readable (for a listener: a pending connection).
/// An interrupted wait counts as "not yet".
pub(crate) fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: `pfd` is a valid, exclusively borrowed pollfd for the whole call and nfds is 1;
    // `fd` is borrowed, so it stays open until poll returns.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(rc > 0)
}

/// "250 ms", "10 s", "2.5 s".
pub(crate) fn fmt_duration(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_naturally() {
        assert_eq!(fmt_duration(Duration::from_millis(250)), "250 ms");
        assert_eq!(fmt_duration(Duration::from_secs(10)), "10 s");
        assert_eq!(fmt_duration(Duration::from_millis(2500)), "2.5 s");
    }
}
