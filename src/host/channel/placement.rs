//! Where a proxy thread runs (`DOORBELL_PROXY_CPU`): a core near its GPU, spread so proxies of
//! different GPUs, and several of one GPU, do not spin on one core.

use crate::error::Result;
use crate::gpu::cuda::Gpu;
use std::sync::atomic::Ordering;

/// Proxies started by this process so far (spreads `auto` placement over cores).
static PROXIES_STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The CPU a new proxy of `gpu` should run on (`DOORBELL_PROXY_CPU`): for `auto`, a core of the
/// GPU's NUMA node, counted from the end of its list (away from core 0, where the OS and the
/// ranks' main threads tend to run), offset by the GPU's ordinal and this process's proxy count
/// so proxies of different GPUs and of one GPU do not spin on one core. `None` when unknown.
/// `placement`: the builder's choice, else the setting read now.
pub(crate) fn proxy_cpu(
    gpu: &Gpu,
    placement: Option<crate::job::config::ProxyCpu>,
) -> Result<Option<usize>> {
    use crate::job::config::{ProxyCpu, Settings};
    let nth = PROXIES_STARTED.fetch_add(1, Ordering::Relaxed);
    let placement = match placement {
        Some(p) => p,
        None => Settings::from_env()?.proxy_cpu,
    };
    match placement {
        ProxyCpu::Off => Ok(None),
        ProxyCpu::Cpu(c) => Ok(Some(c)),
        ProxyCpu::Auto => {
            let cpus = gpu
                .pci_bus_id()
                .ok()
                .and_then(|id| {
                    std::fs::read_to_string(format!("/sys/bus/pci/devices/{id}/local_cpulist")).ok()
                })
                .and_then(|list| parse_cpu_list(&list));
            Ok(cpus.filter(|c| !c.is_empty()).map(|c| {
                let k = (gpu.ordinal() * 4 + nth) % c.len();
                c[c.len() - 1 - k]
            }))
        }
    }
}

/// Parses a kernel CPU list (`0-63,128-191`).
pub(crate) fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut v = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (
                    a.trim().parse::<usize>().ok()?,
                    b.trim().parse::<usize>().ok()?,
                );
                if b < a {
                    return None;
                }
                v.extend(a..=b);
            }
            None => v.push(part.trim().parse().ok()?),
        }
    }
    Some(v)
}

/// Pins the calling thread to `cpu`; a refusal (the CPU is outside the process's cpuset) only
/// costs placement, so it is logged and ignored.
pub(crate) fn pin_to(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; CPU_SET stays inside it for cpu < CPU_SETSIZE (checked);
    // sched_setaffinity(0, ...) affects only this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu >= libc::CPU_SETSIZE as usize {
            tracing::debug!("proxy CPU {cpu} is beyond CPU_SETSIZE; not pinned");
            return;
        }
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::debug!(
                "proxy not pinned to CPU {cpu}: {}",
                std::io::Error::last_os_error()
            );
        } else {
            tracing::debug!("proxy pinned to CPU {cpu}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,8\n"), Some(vec![0, 1, 2, 3, 8]));
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list("4-2"), None);
        assert_eq!(parse_cpu_list("x"), None);
    }
}
