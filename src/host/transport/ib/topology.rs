//! Which RDMA NIC each GPU uses: the nearest one in the PCIe tree, as NCCL chooses, read from
//! sysfs (`/sys`, or a fixture tree in tests). Owns the PCIe distance classes (`PIX` .. `SYS`,
//! nvidia-smi's and NCCL's names), the `DOORBELL_IB_HCA` filter (NCCL_IB_HCA's syntax) and the
//! balancing of GPUs over equally near NICs. It reads files and symlinks only: it never loads
//! libibverbs (callers pass the ports they found, with their state) and never opens a device.
//!
//! How sysfs shows the tree: `/sys/bus/pci/devices/<bus id>` links to the device's directory,
//! whose canonical path names every bridge from the root complex down, e.g.
//! `/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:03.0/0000:1b:00.0` (root complex
//! `pci0000:15`, root port `15:01.0`, a switch's upstream port `16:00.0` and downstream port
//! `17:03.0`, the GPU `1b:00.0`). `/sys/class/infiniband/<nic>/device` links to the NIC's PCI
//! directory. Two devices' common prefix is where their traffic turns around.

use crate::error::{Error, Result};
use std::cmp::Ordering;
use std::fmt;
use std::path::Path;

/// How far apart two PCI devices are, nearest first (the order NCCL prefers paths in).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Distance {
    /// `PIX`: one PCIe switch between them (down, up and down one switch's ports).
    SamePciSwitch,
    /// `PXB`: several PCIe switches between them, without going up to the root complex.
    MultiSwitch,
    /// `PHB`: they meet at the root complex (the CPU's PCIe host bridge), no switch in common.
    HostBridge,
    /// `NODE`: different root complexes of one NUMA node; traffic crosses the CPU's mesh.
    SameNuma,
    /// `SYS`: different NUMA nodes, usually different sockets; traffic crosses the CPU
    /// interconnect (UPI, Infinity Fabric). NUMA nodes of one socket (AMD NPS2/4, Intel SNC)
    /// count as this too, as in NCCL.
    CrossNuma,
}

impl Distance {
    /// 0 (nearest, `PIX`) to 4 (`SYS`).
    pub fn rank(self) -> u8 {
        self as u8
    }

    /// Where one device sits seen from another, for the reasons given to users.
    fn relation(self) -> &'static str {
        match self {
            Distance::SamePciSwitch => "under the same PCIe switch as",
            Distance::MultiSwitch => "two or more PCIe switches away, below one root port, from",
            Distance::HostBridge => "at the same PCIe host bridge (no switch in common) as",
            Distance::SameNuma => "on another PCIe root complex of the NUMA node of",
            Distance::CrossNuma => "across the CPU interconnect (another NUMA node) from",
        }
    }
}

impl fmt::Display for Distance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Distance::SamePciSwitch => "PIX",
            Distance::MultiSwitch => "PXB",
            Distance::HostBridge => "PHB",
            Distance::SameNuma => "NODE",
            Distance::CrossNuma => "SYS",
        })
    }
}

/// A PCI device's place in the tree: its root complex, the bridges from the root port down, and
/// its NUMA node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciPath {
    /// The root complex (`pci0000:15`), as sysfs names its directory.
    pub root: String,
    /// Bus ids from the root port down to the device itself (the last entry), lower case.
    pub chain: Vec<String>,
    /// The device's `numa_node`; `None` where the kernel reports -1 (no NUMA information).
    pub numa_node: Option<u32>,
}

impl PciPath {
    /// The device with PCI bus id `bus_id` (any form [`normalize_bus_id`] accepts), found
    /// through `<sysfs>/bus/pci/devices/<bus id>`.
    pub fn of_device(sysfs: &Path, bus_id: &str) -> Result<PciPath> {
        let id = normalize_bus_id(bus_id)?;
        let link = sysfs.join("bus/pci/devices").join(&id);
        let dir = std::fs::canonicalize(&link).map_err(|e| {
            Error::io(
                format!("PCI device {id} (from {bus_id:?}): {}", link.display()),
                e,
            )
        })?;
        PciPath::from_dir(&dir)
    }

    /// The PCI device of RDMA device `nic` (`mlx5_0`), through
    /// `<sysfs>/class/infiniband/<nic>/device`. Software devices (rxe, siw) have none.
    pub fn of_ib_device(sysfs: &Path, nic: &str) -> Result<PciPath> {
        let link = sysfs.join("class/infiniband").join(nic).join("device");
        let dir = std::fs::canonicalize(&link).map_err(|e| {
            Error::io(
                format!("PCI device of RDMA device {nic}: {}", link.display()),
                e,
            )
        })?;
        PciPath::from_dir(&dir)
    }

    /// Parses a device's canonical sysfs directory (`.../devices/pci0000:15/0000:15:01.0/...`)
    /// and reads its `numa_node`.
    pub fn from_dir(dir: &Path) -> Result<PciPath> {
        let parts: Vec<String> = dir
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let root_at = parts
            .iter()
            .rposition(|p| is_root_complex(p))
            .ok_or_else(|| {
                Error::invalid(
                    "PCI device path",
                    format!("{} has no root complex (pciDDDD:BB) in it", dir.display()),
                )
            })?;
        let chain: Vec<String> = parts[root_at + 1..]
            .iter()
            .map(|p| normalize_bus_id(p))
            .collect::<Result<_>>()
            .map_err(|_| {
                Error::invalid(
                    "PCI device path",
                    format!(
                        "{} is not a chain of PCI bus ids below its root complex",
                        dir.display()
                    ),
                )
            })?;
        if chain.is_empty() {
            return Err(Error::invalid(
                "PCI device path",
                format!("{} is a root complex, not a device", dir.display()),
            ));
        }
        let numa_node = std::fs::read_to_string(dir.join("numa_node"))
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok());
        Ok(PciPath {
            root: parts[root_at].to_ascii_lowercase(),
            chain,
            numa_node,
        })
    }

    /// The device's own bus id (`0000:1b:00.0`).
    pub fn bus_id(&self) -> &str {
        self.chain.last().map_or("", String::as_str)
    }

    /// How far `other` is from this device. Below one root complex, the bridges between the two
    /// decide: a PCIe switch is an upstream port with downstream ports, so a path through one
    /// switch passes three bridges (downstream, upstream, downstream) and anything longer passes
    /// several switches. Across root complexes, the NUMA nodes decide (unknown nodes on both
    /// sides count as one node: machines without NUMA information have one).
    pub fn distance_to(&self, other: &PciPath) -> Distance {
        if self.root != other.root {
            return if self.numa_node == other.numa_node {
                Distance::SameNuma
            } else {
                Distance::CrossNuma
            };
        }
        let common = self
            .chain
            .iter()
            .zip(&other.chain)
            .take_while(|(a, b)| a == b)
            .count();
        if common == 0 {
            return Distance::HostBridge;
        }
        // The last common entry is the turning point; below it each side passes its own
        // bridges (every entry of its tail but the device itself).
        let bridges = 1 + (self.chain.len() - common - 1) + (other.chain.len() - common - 1);
        if bridges <= 3 {
            Distance::SamePciSwitch
        } else {
            Distance::MultiSwitch
        }
    }
}

/// `pci0000:15`, `pci10000:e0` (VMD): a root complex's directory in `/sys/devices`.
fn is_root_complex(part: &str) -> bool {
    part.strip_prefix("pci")
        .and_then(|r| r.split_once(':'))
        .is_some_and(|(d, b)| {
            !d.is_empty()
                && !b.is_empty()
                && d.chars().all(|c| c.is_ascii_hexdigit())
                && b.chars().all(|c| c.is_ascii_hexdigit())
        })
}

/// A PCI bus id as sysfs names devices: `0000:1b:00.0`. Accepts CUDA's forms (`0000:1B:00.0`,
/// `00000000:1B:00.0`) and a bare `1b:00.0` (domain 0).
pub fn normalize_bus_id(id: &str) -> Result<String> {
    let bad = || {
        Error::invalid(
            "PCI bus id",
            format!("{id:?} is not of the form [domain:]bus:device.function, like 0000:1b:00.0"),
        )
    };
    let hex = |s: &str, max_len: usize| -> Option<u32> {
        if s.is_empty() || s.len() > max_len || !s.chars().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        u32::from_str_radix(s, 16).ok()
    };
    let t = id.trim();
    let (rest, function) = t.rsplit_once('.').ok_or_else(bad)?;
    let fields: Vec<&str> = rest.split(':').collect();
    let (domain, bus, device) = match fields.as_slice() {
        [d, b, s] => (hex(d, 8).ok_or_else(bad)?, *b, *s),
        [b, s] => (0, *b, *s),
        _ => return Err(bad()),
    };
    let bus = hex(bus, 2).ok_or_else(bad)?;
    let device = hex(device, 2).filter(|d| *d < 32).ok_or_else(bad)?;
    let function = hex(function, 1).filter(|f| *f < 8).ok_or_else(bad)?;
    Ok(format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}

/// One port of an RDMA NIC that could carry a GPU's traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicCandidate {
    /// The RDMA device's name (`mlx5_0`).
    pub name: String,
    /// The port number (from 1).
    pub port: u8,
    /// Whether the port is ACTIVE; others are skipped.
    pub active: bool,
}

/// The RDMA devices `<sysfs>/class/infiniband` lists, one candidate per port, with the state each
/// `ports/<n>/state` reports (`4: ACTIVE`; `5: ACTIVE_DEFER` counts as active, as in
/// [`crate::transport::ib::boundary::verbs::Port::active`]). No directory means no devices. For
/// when libibverbs is not at hand; it lists the same devices.
pub fn nics_in_sysfs(sysfs: &Path) -> Result<Vec<NicCandidate>> {
    let class = sysfs.join("class/infiniband");
    let entries = match std::fs::read_dir(&class) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(format!("reading {}", class.display()), e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(format!("reading {}", class.display()), e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let ports = entry.path().join("ports");
        let Ok(ports) = std::fs::read_dir(&ports) else {
            continue;
        };
        for port in ports.flatten() {
            let Ok(num) = port.file_name().to_string_lossy().parse::<u8>() else {
                continue;
            };
            let state = std::fs::read_to_string(port.path().join("state")).unwrap_or_default();
            out.push(NicCandidate {
                name: name.clone(),
                port: num,
                active: matches!(
                    state.split_once(':').map(|(_, s)| s.trim()),
                    Some("ACTIVE" | "ACTIVE_DEFER")
                ),
            });
        }
    }
    out.sort_by(|a, b| natural_order(&a.name, &b.name).then(a.port.cmp(&b.port)));
    Ok(out)
}

/// A parsed `DOORBELL_IB_HCA`: NCCL_IB_HCA's syntax. A comma-separated list of `name[:port]`;
/// a name matches every device it is a prefix of (`mlx5` matches `mlx5_0` .. `mlx5_11`), or
/// only itself after a leading `=`; a leading `^` (before any `=`) keeps every port the list
/// does not match instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HcaFilter {
    given: String,
    exclude: bool,
    exact: bool,
    entries: Vec<(String, Option<u8>)>,
}

impl HcaFilter {
    /// Parses the setting's value; a port that is not a number from 1 to 255 is refused.
    pub fn parse(value: &str) -> Result<HcaFilter> {
        let given = value.trim().to_string();
        let mut rest = given.as_str();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = &rest[1..];
        }
        let exact = rest.starts_with('=');
        if exact {
            rest = &rest[1..];
        }
        let mut entries = Vec::new();
        for item in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, port) = match item.split_once(':') {
                None => (item, None),
                Some((name, port)) => match port.trim().parse::<u8>() {
                    Ok(p) if p > 0 && !name.trim().is_empty() => (name.trim(), Some(p)),
                    _ => {
                        return Err(Error::invalid(
                            "DOORBELL_IB_HCA",
                            format!(
                                "{item:?} in {given:?}: expected name or name:port, the port a \
                                 number from 1 (like mlx5_0:1)"
                            ),
                        ))
                    }
                },
            };
            entries.push((name.to_string(), port));
        }
        Ok(HcaFilter {
            given,
            exclude,
            exact,
            entries,
        })
    }

    /// Whether port `port` of device `name` may be used.
    pub fn allows(&self, name: &str, port: u8) -> bool {
        let listed = self.entries.iter().any(|(n, p)| {
            let name_matches = if self.exact {
                name == n
            } else {
                name.starts_with(n.as_str())
            };
            name_matches && p.is_none_or(|p| p == port)
        });
        listed != self.exclude
    }

    /// The value as given.
    pub fn as_str(&self) -> &str {
        &self.given
    }
}

/// The NIC port chosen for a GPU, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicChoice {
    /// The RDMA device (`mlx5_3`).
    pub name: String,
    /// Its port.
    pub port: u8,
    /// How far it is from the GPU.
    pub distance: Distance,
    /// The reason, for logs and `doorbell-info`.
    pub why: String,
}

/// The NIC port for the GPU with bus id `gpu_bus_id` (CUDA's form is fine): the nearest active
/// port that `hca` (a `DOORBELL_IB_HCA` value) allows, ties going to the first by name. To
/// spread several GPUs over equally near NICs, use [`assign_nics`].
pub fn choose_nic(
    sysfs: &Path,
    gpu_bus_id: &str,
    nics: &[NicCandidate],
    hca: Option<&str>,
) -> Result<NicChoice> {
    assign_nics(sysfs, &[gpu_bus_id], nics, hca)?
        .into_iter()
        .next()
        .ok_or_else(|| Error::TransportUnavailable {
            transport: "ib",
            why: "no RDMA NIC port to choose from".into(),
        })
}

/// A NIC port for each GPU, in order: its nearest active port that `hca` allows; among equally
/// near ports, the one the fewest earlier GPUs got, then the first by name. So GPUs sharing a
/// switch with as many NICs get one each, and GPUs outnumbering their NICs share them evenly
/// (NCCL spreads the GPUs of a switch over its NICs the same way).
pub fn assign_nics(
    sysfs: &Path,
    gpu_bus_ids: &[&str],
    nics: &[NicCandidate],
    hca: Option<&str>,
) -> Result<Vec<NicChoice>> {
    let filter = hca
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(HcaFilter::parse)
        .transpose()?;
    if gpu_bus_ids.is_empty() {
        return Ok(Vec::new());
    }
    let ports = usable_ports(sysfs, nics, filter.as_ref())?;
    let mut served = vec![0usize; ports.usable.len()];
    let mut out = Vec::with_capacity(gpu_bus_ids.len());
    for &id in gpu_bus_ids {
        let gpu = PciPath::of_device(sysfs, id)?;
        let dist = |path: &Option<PciPath>| {
            path.as_ref()
                .map_or(Distance::CrossNuma, |p| gpu.distance_to(p))
        };
        let distances: Vec<Distance> = ports.usable.iter().map(|p| dist(&p.path)).collect();
        // `usable` is in name order, so the index settles the last tie.
        let pick = (0..distances.len())
            .min_by_key(|&i| (distances[i], served[i], i))
            .ok_or_else(|| Error::TransportUnavailable {
                transport: "ib",
                why: "no RDMA NIC port to choose from".into(),
            })?;
        let nearest = distances[pick];
        let tied = distances.iter().filter(|&&d| d == nearest).count();
        let port = &ports.usable[pick];
        let mut why = format!(
            "{} port {}: {} GPU {} ({nearest})",
            port.nic.name,
            port.nic.port,
            nearest.relation(),
            gpu.bus_id()
        );
        if port.path.is_none() {
            why.push_str(" [no PCI device in sysfs: distance unknown, counted as SYS]");
        }
        if tied > 1 {
            why.push_str(&format!(
                "; the least used of {tied} equally near ports (it served {} GPU(s) before)",
                served[pick]
            ));
        }
        for down in &ports.down {
            let d = dist(&down.path);
            if d < nearest {
                why.push_str(&format!(
                    "; {} port {} is nearer ({d}) but down",
                    down.nic.name, down.nic.port
                ));
            }
        }
        if let Some(f) = &filter {
            if ports.usable.len() == 1 {
                why.push_str(&format!("; DOORBELL_IB_HCA={} picks it", f.as_str()));
            } else {
                why.push_str(&format!(
                    "; chosen among the {} ports DOORBELL_IB_HCA={} allows",
                    ports.usable.len(),
                    f.as_str()
                ));
            }
        }
        served[pick] += 1;
        out.push(NicChoice {
            name: port.nic.name.clone(),
            port: port.nic.port,
            distance: nearest,
            why,
        });
    }
    Ok(out)
}

struct Located<'a> {
    nic: &'a NicCandidate,
    /// `None` for devices without a PCI function (software RDMA).
    path: Option<PciPath>,
}

struct Ports<'a> {
    /// Active ports the filter allows, in name order.
    usable: Vec<Located<'a>>,
    /// Ports the filter allows that are down.
    down: Vec<Located<'a>>,
}

/// Splits the ports the filter allows into active and down ones, located in the PCI tree, or
/// says why none is left.
fn usable_ports<'a>(
    sysfs: &Path,
    nics: &'a [NicCandidate],
    filter: Option<&HcaFilter>,
) -> Result<Ports<'a>> {
    let mut sorted: Vec<&NicCandidate> = nics.iter().collect();
    sorted.sort_by(|a, b| natural_order(&a.name, &b.name).then(a.port.cmp(&b.port)));
    let allowed: Vec<&NicCandidate> = sorted
        .iter()
        .copied()
        .filter(|n| filter.is_none_or(|f| f.allows(&n.name, n.port)))
        .collect();
    let locate = |nic: &'a NicCandidate| Located {
        nic,
        path: PciPath::of_ib_device(sysfs, &nic.name).ok(),
    };
    let (usable, down): (Vec<_>, Vec<_>) = allowed.iter().partition(|n| n.active);
    if !usable.is_empty() {
        return Ok(Ports {
            usable: usable.into_iter().map(locate).collect(),
            down: down.into_iter().map(locate).collect(),
        });
    }
    let listing = |list: &[&NicCandidate]| {
        list.iter()
            .map(|n| {
                format!(
                    "{} port {} ({})",
                    n.name,
                    n.port,
                    if n.active { "active" } else { "down" }
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    if nics.is_empty() {
        return Err(Error::TransportUnavailable {
            transport: "ib",
            why: "no RDMA NIC on this host (none listed by libibverbs or in \
                  /sys/class/infiniband)"
                .into(),
        });
    }
    match filter {
        Some(f) if allowed.is_empty() => Err(Error::invalid(
            "DOORBELL_IB_HCA",
            format!(
                "{:?} allows none of this host's NIC ports: {}; name some of them, or unset it",
                f.as_str(),
                listing(&sorted)
            ),
        )),
        Some(f) => Err(Error::TransportUnavailable {
            transport: "ib",
            why: format!(
                "every NIC port DOORBELL_IB_HCA={} allows is down: {}; bring a link up, or \
                 allow another port (this host has: {})",
                f.as_str(),
                listing(&allowed),
                listing(&sorted)
            ),
        }),
        None => Err(Error::TransportUnavailable {
            transport: "ib",
            why: format!(
                "every RDMA NIC port is down: {}; check the cables and the subnet manager \
                 (ibstat)",
                listing(&sorted)
            ),
        }),
    }
}

/// Name order with numbers compared as numbers: `mlx5_2` before `mlx5_10`.
fn natural_order(a: &str, b: &str) -> Ordering {
    let split = |s: &str| {
        let digits = s.len() - s.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        let (stem, num) = s.split_at(s.len() - digits);
        (stem.to_string(), num.parse::<u64>().ok())
    };
    split(a).cmp(&split(b)).then_with(|| a.cmp(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(root: &str, chain: &[&str], numa: Option<u32>) -> PciPath {
        PciPath {
            root: root.into(),
            chain: chain.iter().map(|s| s.to_string()).collect(),
            numa_node: numa,
        }
    }

    #[test]
    fn distances_follow_the_bridges_between() {
        let gpu = path(
            "pci0000:15",
            &[
                "0000:15:01.0",
                "0000:16:00.0",
                "0000:17:03.0",
                "0000:1b:00.0",
            ],
            Some(0),
        );
        let mate = path(
            "pci0000:15",
            &[
                "0000:15:01.0",
                "0000:16:00.0",
                "0000:17:00.0",
                "0000:18:00.0",
            ],
            Some(0),
        );
        let two_up = path(
            "pci0000:15",
            &[
                "0000:15:01.0",
                "0000:16:00.0",
                "0000:17:01.0",
                "0000:19:00.0",
                "0000:1a:00.0",
                "0000:1c:00.0",
            ],
            Some(0),
        );
        let other_port = path("pci0000:15", &["0000:15:02.0", "0000:30:00.0"], Some(0));
        let other_root = path("pci0000:37", &["0000:37:01.0", "0000:38:00.0"], Some(0));
        let other_socket = path("pci0000:97", &["0000:97:01.0", "0000:98:00.0"], Some(1));
        assert_eq!(gpu.distance_to(&mate), Distance::SamePciSwitch);
        assert_eq!(gpu.distance_to(&two_up), Distance::MultiSwitch);
        assert_eq!(two_up.distance_to(&gpu), Distance::MultiSwitch);
        assert_eq!(gpu.distance_to(&other_port), Distance::HostBridge);
        assert_eq!(gpu.distance_to(&other_root), Distance::SameNuma);
        assert_eq!(gpu.distance_to(&other_socket), Distance::CrossNuma);
        let functions = path("pci0000:15", &["0000:15:02.0", "0000:30:00.1"], Some(0));
        assert_eq!(other_port.distance_to(&functions), Distance::SamePciSwitch);
        assert!(Distance::SamePciSwitch < Distance::CrossNuma);
        let all = [
            Distance::SamePciSwitch,
            Distance::MultiSwitch,
            Distance::HostBridge,
            Distance::SameNuma,
            Distance::CrossNuma,
        ];
        let names: Vec<String> = all.iter().map(|d| d.to_string()).collect();
        assert_eq!(names, ["PIX", "PXB", "PHB", "NODE", "SYS"]);
        assert_eq!(all.map(Distance::rank), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn canonical_paths_parse() {
        let p = PciPath::from_dir(Path::new(
            "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:03.0/0000:1b:00.0",
        ))
        .unwrap();
        assert_eq!(p.root, "pci0000:15");
        assert_eq!(p.bus_id(), "0000:1b:00.0");
        assert_eq!(p.chain.len(), 4);
        assert!(PciPath::from_dir(Path::new("/sys/devices/pci0000:15")).is_err());
        assert!(PciPath::from_dir(Path::new("/sys/devices/virtual/infiniband/rxe0")).is_err());
    }

    #[test]
    fn hca_filters_parse_like_nccl_ib_hca() {
        let f = HcaFilter::parse("mlx5_1").unwrap();
        assert!(f.allows("mlx5_1", 1) && f.allows("mlx5_10", 1) && !f.allows("mlx5_2", 1));
        let f = HcaFilter::parse("=mlx5_1").unwrap();
        assert!(f.allows("mlx5_1", 1) && !f.allows("mlx5_10", 1));
        let f = HcaFilter::parse("^mlx5_0, mlx5_1:2").unwrap();
        assert!(!f.allows("mlx5_0", 1) && !f.allows("mlx5_1", 2) && f.allows("mlx5_1", 1));
        let f = HcaFilter::parse("^=mlx5_1").unwrap();
        assert!(!f.allows("mlx5_1", 1) && f.allows("mlx5_10", 1));
        for bad in ["mlx5_0:x", "mlx5_0:0", ":1", "mlx5_0:300"] {
            let e = HcaFilter::parse(bad).unwrap_err().to_string();
            assert!(e.contains("DOORBELL_IB_HCA"), "{e}");
        }
    }

    #[test]
    fn bus_ids_normalize() {
        for (given, want) in [
            ("0000:1B:00.0", "0000:1b:00.0"),
            ("00000000:1B:00.0", "0000:1b:00.0"),
            ("1b:00.0", "0000:1b:00.0"),
            ("00010000:E1:1f.7", "10000:e1:1f.7"),
        ] {
            assert_eq!(normalize_bus_id(given).unwrap(), want);
        }
        for bad in [
            "",
            "1B:00",
            "GPU-0",
            "0000:1b:00.8",
            "0000:1b:20.0",
            "0:0:0:0.0",
        ] {
            assert!(normalize_bus_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_order_naturally() {
        let mut v = vec!["mlx5_10", "mlx5_2", "mlx5_1", "bnxt_re0"];
        v.sort_by(|a, b| natural_order(a, b));
        assert_eq!(v, ["bnxt_re0", "mlx5_1", "mlx5_2", "mlx5_10"]);
    }
}
