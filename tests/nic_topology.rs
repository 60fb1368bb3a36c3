//! The NIC each GPU uses (`transport::ib::topology`), on the CPU, against sysfs trees of real
//! 8-GPU servers. Each tree is described in `tests/fixtures/topology/*.txt` (one line per PCI
//! device: kind, sysfs path, NUMA node, and for NICs the RDMA name, port and its state; the
//! header of each file says which parts are as published and which are reconstructed) and
//! built here in a temporary directory the way the kernel lays it out: real directories for the
//! PCI hierarchy under `devices/`, `numa_node` files, `bus/pci/devices/<bus id>` symlinks,
//! `devices/.../<bus id>/infiniband/<nic>` with `ports/<n>/state` and a `device` link back, and
//! `class/infiniband/<nic>` linking to it.

use doorbell::transport::ib::topology::{
    assign_nics, choose_nic, nics_in_sysfs, normalize_bus_id, Distance, NicCandidate, PciPath,
};
use doorbell::Error;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A sysfs tree built from a description; removed when dropped.
struct Tree {
    root: PathBuf,
    /// GPU bus ids in the description's order.
    gpus: Vec<String>,
    /// (name, port, active), in the description's order.
    nics: Vec<(String, u8, bool)>,
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

impl Tree {
    fn load(file: &str) -> Tree {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/topology")
            .join(file);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        Tree::build(file.trim_end_matches(".txt"), &text)
    }

    fn build(name: &str, description: &str) -> Tree {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let root = std::env::temp_dir().join(format!(
            "doorbell-topology-{name}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&root);
        let mut tree = Tree {
            root,
            gpus: Vec::new(),
            nics: Vec::new(),
        };
        let mut bridges: HashSet<String> = HashSet::new();
        for (n, line) in description.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let at = format!("{name}.txt line {}", n + 1);
            let f: Vec<&str> = line.split_whitespace().collect();
            let (kind, sys_path, numa) = (f[0], f[1], f[2]);
            let rel = sys_path
                .strip_prefix("/sys/")
                .unwrap_or_else(|| panic!("{at}: {sys_path} is not under /sys"));
            let parts: Vec<&str> = rel.split('/').collect();
            assert!(
                parts.len() >= 3 && parts[0] == "devices" && parts[1].starts_with("pci"),
                "{at}: expected /sys/devices/pciDDDD:BB/..."
            );
            // Every bridge above the device must be declared: catches typos in the paths.
            for i in 3..parts.len() {
                let parent = parts[..i].join("/");
                assert!(
                    bridges.contains(&parent),
                    "{at}: /sys/{parent} is not declared as a bridge"
                );
            }
            let bdf = *parts.last().unwrap();
            let dir = tree.root.join(rel);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
            let by_id = tree.root.join("bus/pci/devices");
            std::fs::create_dir_all(&by_id).unwrap();
            std::os::unix::fs::symlink(format!("../../../{rel}"), by_id.join(bdf)).unwrap();
            match kind {
                "bridge" => {
                    bridges.insert(rel.to_string());
                }
                "gpu" => tree.gpus.push(bdf.to_string()),
                "nic" => {
                    let (ib, port, state) = (f[3], f[4], f[5]);
                    let port: u8 = port.parse().unwrap();
                    let active = match state {
                        "ACTIVE" => true,
                        "DOWN" => false,
                        other => panic!("{at}: port state {other}: expected ACTIVE or DOWN"),
                    };
                    let ib_dir = dir.join("infiniband").join(ib);
                    let port_dir = ib_dir.join("ports").join(port.to_string());
                    std::fs::create_dir_all(&port_dir).unwrap();
                    let state = if active { "4: ACTIVE\n" } else { "1: DOWN\n" };
                    std::fs::write(port_dir.join("state"), state).unwrap();
                    std::os::unix::fs::symlink(format!("../../../{bdf}"), ib_dir.join("device"))
                        .unwrap();
                    let class = tree.root.join("class/infiniband");
                    std::fs::create_dir_all(&class).unwrap();
                    std::os::unix::fs::symlink(
                        format!("../../{rel}/infiniband/{ib}"),
                        class.join(ib),
                    )
                    .unwrap();
                    tree.nics.push((ib.to_string(), port, active));
                }
                other => panic!("{at}: kind {other}: expected gpu, nic or bridge"),
            }
        }
        tree
    }

    /// The ports as `doorbell-info` would pass them, read back from the tree.
    fn candidates(&self) -> Vec<NicCandidate> {
        nics_in_sysfs(&self.root).unwrap()
    }

    /// GPU bus ids as CUDA prints them (`00000000:1B:00.0`).
    fn cuda_ids(&self) -> Vec<String> {
        self.gpus
            .iter()
            .map(|g| format!("0000{}", g.to_uppercase()))
            .collect()
    }

    fn assign(&self, hca: Option<&str>) -> Vec<(String, Distance)> {
        let ids = self.cuda_ids();
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        assign_nics(&self.root, &ids, &self.candidates(), hca)
            .unwrap()
            .into_iter()
            .map(|c| (c.name, c.distance))
            .collect()
    }

    fn choose(
        &self,
        gpu: usize,
        hca: Option<&str>,
    ) -> doorbell::Result<(String, u8, Distance, String)> {
        choose_nic(&self.root, &self.gpus[gpu], &self.candidates(), hca)
            .map(|c| (c.name, c.port, c.distance, c.why))
    }

    fn distance(&self, gpu: usize, nic: &str) -> Distance {
        let g = PciPath::of_device(&self.root, &self.gpus[gpu]).unwrap();
        g.distance_to(&PciPath::of_ib_device(&self.root, nic).unwrap())
    }
}

fn all(names: &[&str], d: Distance) -> Vec<(String, Distance)> {
    names.iter().map(|n| (n.to_string(), d)).collect()
}

#[test]
fn fixtures_read_back_as_described() {
    for file in ["dgx-h100.txt", "pcie-2-8-5.txt", "host-bridge-nics.txt"] {
        let tree = Tree::load(file);
        assert_eq!(tree.gpus.len(), 8, "{file}");
        let read: Vec<(String, u8, bool)> = tree
            .candidates()
            .into_iter()
            .map(|c| (c.name, c.port, c.active))
            .collect();
        assert_eq!(read, tree.nics, "{file}");
        for gpu in &tree.gpus {
            let p = PciPath::of_device(&tree.root, gpu).unwrap();
            assert_eq!(p.bus_id(), gpu, "{file}");
            assert!(p.numa_node.is_some(), "{file}");
        }
    }
}

#[test]
fn dgx_h100_each_gpu_gets_the_nic_of_its_switch() {
    let tree = Tree::load("dgx-h100.txt");
    let want = [
        "mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11",
    ];
    assert_eq!(tree.assign(None), all(&want, Distance::SamePciSwitch));
    // One GPU at a time, in any order, gives the same answer: no sharing is involved.
    for (gpu, nic) in want.iter().enumerate().rev() {
        let (name, port, d, why) = tree.choose(gpu, None).unwrap();
        assert_eq!((name.as_str(), port, d), (*nic, 1, Distance::SamePciSwitch));
        assert_eq!(
            why,
            format!(
                "{nic} port 1: under the same PCIe switch as GPU {} (PIX)",
                tree.gpus[gpu]
            )
        );
    }
    // The other NICs: storage and compute NICs of the same socket are on other root complexes.
    assert_eq!(tree.distance(0, "mlx5_3"), Distance::SameNuma);
    assert_eq!(tree.distance(0, "mlx5_1"), Distance::SameNuma);
    assert_eq!(tree.distance(0, "mlx5_6"), Distance::CrossNuma);
    assert_eq!(tree.distance(7, "mlx5_0"), Distance::CrossNuma);
}

#[test]
fn pcie_2_8_5_gpu_pairs_share_the_nic_of_their_switch() {
    let tree = Tree::load("pcie-2-8-5.txt");
    let want = [
        "mlx5_0", "mlx5_0", "mlx5_2", "mlx5_2", "mlx5_3", "mlx5_3", "mlx5_4", "mlx5_4",
    ];
    assert_eq!(tree.assign(None), all(&want, Distance::SamePciSwitch));
    // The north-south NIC on its own root port is never the nearest.
    assert_eq!(tree.distance(0, "mlx5_1"), Distance::SameNuma);
    assert_eq!(tree.distance(4, "mlx5_1"), Distance::CrossNuma);
    assert_eq!(tree.choose(1, None).unwrap().0, "mlx5_0");
}

#[test]
fn equally_near_nics_are_spread_over_the_gpus() {
    // Synthetic: one switch with two GPUs and two NICs, as under a DGX A100's switches.
    let tree = Tree::build(
        "one-switch",
        "bridge /sys/devices/pci0000:00/0000:00:01.1 0
         bridge /sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0 0
         bridge /sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:00.0 0
         bridge /sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:01.0 0
         bridge /sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:02.0 0
         bridge /sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:03.0 0
         gpu /sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:00.0/0000:03:00.0 0
         nic /sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:01.0/0000:04:00.0 0 mlx5_0 1 ACTIVE
         gpu /sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:02.0/0000:05:00.0 0
         nic /sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:03.0/0000:06:00.0 0 mlx5_1 1 ACTIVE",
    );
    assert_eq!(
        tree.assign(None),
        all(&["mlx5_0", "mlx5_1"], Distance::SamePciSwitch)
    );
    // Alone, each GPU takes the first of the two.
    assert_eq!(tree.choose(1, None).unwrap().0, "mlx5_0");
}

#[test]
fn nics_at_the_host_bridge_skip_the_down_port() {
    let tree = Tree::load("host-bridge-nics.txt");
    assert!(tree
        .candidates()
        .iter()
        .any(|c| c.name == "mlx5_1" && !c.active));
    // Socket 0: mlx5_1 is down, so all four take mlx5_0; socket 1 alternates over its two.
    let want = [
        "mlx5_0", "mlx5_0", "mlx5_0", "mlx5_0", "mlx5_2", "mlx5_3", "mlx5_2", "mlx5_3",
    ];
    assert_eq!(tree.assign(None), all(&want, Distance::HostBridge));
    let ids = tree.cuda_ids();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    let choices = assign_nics(&tree.root, &ids, &tree.candidates(), None).unwrap();
    assert!(
        choices[0].why.contains("same PCIe host bridge"),
        "{}",
        choices[0].why
    );
    assert!(
        choices[5]
            .why
            .contains("the least used of 2 equally near ports"),
        "{}",
        choices[5].why
    );
    assert!(
        !choices[0].why.contains("equally near"),
        "{}",
        choices[0].why
    );
    // Across sockets the distance is SYS.
    assert_eq!(tree.distance(0, "mlx5_2"), Distance::CrossNuma);
    assert_eq!(tree.distance(7, "mlx5_1"), Distance::CrossNuma);
    let (name, _, d, _) = tree.choose(0, Some("mlx5_2")).unwrap();
    assert_eq!((name.as_str(), d), ("mlx5_2", Distance::CrossNuma));
    // With socket 0's NIC down too, its GPUs cross to socket 1, and the reason says why.
    let mut nics = tree.candidates();
    nics.iter_mut()
        .filter(|c| c.name == "mlx5_0")
        .for_each(|c| c.active = false);
    let c = choose_nic(&tree.root, &tree.gpus[0], &nics, None).unwrap();
    assert_eq!(
        (c.name.as_str(), c.distance),
        ("mlx5_2", Distance::CrossNuma)
    );
    assert!(
        c.why.contains("mlx5_0 port 1 is nearer (PHB) but down"),
        "{}",
        c.why
    );
    // Only the down port allowed: an error naming it.
    let e = tree.choose(0, Some("=mlx5_1")).unwrap_err().to_string();
    assert!(e.contains("mlx5_1 port 1 (down)"), "{e}");
    // Every port down.
    nics.iter_mut().for_each(|c| c.active = false);
    let e = choose_nic(&tree.root, &tree.gpus[0], &nics, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("every RDMA NIC port is down"), "{e}");
}

#[test]
fn doorbell_ib_hca_filters() {
    let tree = Tree::load("dgx-h100.txt");
    let pick = |gpu: usize, hca: &str| {
        let (name, port, d, why) = tree.choose(gpu, Some(hca)).unwrap();
        (format!("{name}:{port}"), d, why)
    };
    // A name is a prefix: mlx5_1 allows mlx5_1, mlx5_10 and mlx5_11.
    assert_eq!(pick(0, "mlx5_1").0, "mlx5_1:1");
    assert_eq!(pick(0, "mlx5_1").1, Distance::SameNuma);
    assert_eq!(pick(6, "mlx5_1").0, "mlx5_10:1");
    assert_eq!(pick(7, "mlx5_1").0, "mlx5_11:1");
    assert!(pick(6, "mlx5_1")
        .2
        .contains("among the 3 ports DOORBELL_IB_HCA=mlx5_1"));
    // '=' makes it exact.
    let (nic, d, why) = pick(6, "=mlx5_1");
    assert_eq!((nic.as_str(), d), ("mlx5_1:1", Distance::CrossNuma));
    assert!(why.ends_with("DOORBELL_IB_HCA==mlx5_1 picks it"), "{why}");
    // '^' excludes (by prefix, or exactly with '^=').
    assert_eq!(pick(6, "^mlx5_1").0, "mlx5_6:1");
    assert_eq!(pick(6, "^mlx5_1").1, Distance::SameNuma);
    assert_eq!(pick(0, "^mlx5_1").0, "mlx5_0:1");
    assert_eq!(pick(6, "^=mlx5_1").0, "mlx5_10:1");
    assert_eq!(pick(0, "^mlx5_0,mlx5_1,mlx5_2").0, "mlx5_3:1");
    // name:port.
    let (nic, d, why) = pick(0, "mlx5_3:1");
    assert_eq!((nic.as_str(), d), ("mlx5_3:1", Distance::SameNuma));
    assert!(why.contains("DOORBELL_IB_HCA=mlx5_3:1 picks it"), "{why}");
    // Nothing matches: the error says what was given and what exists.
    for hca in ["mlx6", "mlx5_3:2", "=mlx5"] {
        let e = tree.choose(0, Some(hca)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
        let e = e.to_string();
        for part in [
            "DOORBELL_IB_HCA",
            hca,
            "mlx5_0 port 1 (active)",
            "mlx5_11 port 1",
        ] {
            assert!(e.contains(part), "{part:?} missing in: {e}");
        }
    }
    // Bad syntax.
    let e = tree.choose(0, Some("mlx5_0:one")).unwrap_err().to_string();
    assert!(e.contains("mlx5_0:one"), "{e}");
    // Every GPU under a filter: the eight compute NICs, as NCCL_IB_HCA is set on DGX H100.
    let compute = "=mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11";
    let got: Vec<String> = tree
        .assign(Some(compute))
        .into_iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(
        got,
        tree.assign(None)
            .into_iter()
            .map(|c| c.0)
            .collect::<Vec<_>>()
    );
}

#[test]
fn bus_ids_in_every_form() {
    let tree = Tree::load("dgx-h100.txt");
    for form in [
        "00000000:1B:00.0",
        "0000:1B:00.0",
        "0000:1b:00.0",
        "1b:00.0",
        " 1B:00.0 ",
    ] {
        assert_eq!(normalize_bus_id(form).unwrap(), "0000:1b:00.0", "{form}");
        let c = choose_nic(&tree.root, form, &tree.candidates(), None).unwrap();
        assert_eq!(c.name, "mlx5_0", "{form}");
    }
    let e = choose_nic(&tree.root, "GPU-1b", &tree.candidates(), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("GPU-1b"), "{e}");
    // A GPU that is not in the tree.
    let e = choose_nic(&tree.root, "0000:2A:00.0", &tree.candidates(), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("0000:2a:00.0"), "{e}");
    // No NICs at all.
    let e = choose_nic(&tree.root, "1b:00.0", &[], None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no RDMA NIC"), "{e}");
}

#[test]
fn a_tree_without_rdma_devices_lists_none() {
    let tree = Tree::build(
        "no-nics",
        "bridge /sys/devices/pci0000:00/0000:00:01.0 0
         gpu /sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0 0",
    );
    assert!(nics_in_sysfs(&tree.root).unwrap().is_empty());
}
