//! `doorbell-info`: what this machine offers doorbell, and what doorbell would use between its
//! ranks, with the reasons: GPUs and their peer access, RDMA NICs with their place in the PCIe
//! tree, the NIC each GPU would use, the IBGDA prerequisites, and for each pair of local GPUs the
//! transport and (between nodes) the RDMA posting mode.

use cudarc::driver::sys;
use doorbell::gpu::cuda::{device_count, driver_result, Gpu};
use doorbell::job::config::{IbPosting, Settings};
use doorbell::transport::ib::boundary::verbs::{choose_gid, Verbs};
use doorbell::transport::ib::posting::select::{choose_posting, gpu_registration, Platform};
use doorbell::transport::ib::topology::{assign_nics, HcaFilter, NicCandidate, NicChoice, PciPath};

const HELP: &str = "doorbell-info: GPUs, peer access, RDMA NICs, the NIC each GPU would use, \
IBGDA prerequisites, and the transport and posting mode doorbell would use between each pair of \
ranks on this host, with the reasons.

usage: doorbell-info [--help]

Settings it honours (see the README): DOORBELL_SEPARATE_NODES, DOORBELL_IB_EMULATE,
DOORBELL_IB_POSTING, DOORBELL_IB_GID_INDEX, DOORBELL_IB_HCA, DOORBELL_IB_DISABLE.";

struct GpuInfo {
    name: String,
    bus: String,
    sms: u32,
    dmabuf: bool,
}

fn gpu_info(ordinal: usize) -> doorbell::Result<GpuInfo> {
    let gpu = Gpu::open(ordinal)?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: the driver is initialized (Gpu::open); out-pointers are locals.
    driver_result("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal as i32)
    })?;
    let mut name = [0 as std::ffi::c_char; 256];
    // SAFETY: as above; the buffer holds 256 bytes.
    driver_result("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev)
    })?;
    let mut dmabuf = 0;
    // SAFETY: as above.
    let _ = unsafe {
        sys::cuDeviceGetAttribute(
            &mut dmabuf,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
            dev,
        )
    };
    Ok(GpuInfo {
        // SAFETY: the driver wrote a NUL-terminated name.
        name: unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned(),
        bus: gpu.pci_bus_id()?,
        sms: gpu.sm_count()?,
        dmabuf: dmabuf != 0,
    })
}

/// (peer access, native atomics over the link) from GPU `a` to GPU `b`.
fn peer_access(a: usize, b: usize) -> (bool, bool) {
    let (mut da, mut db): (sys::CUdevice, sys::CUdevice) = (0, 0);
    let (mut access, mut atomics) = (0, 0);
    // SAFETY: the driver is initialized; out-pointers are locals.
    unsafe {
        if sys::cuDeviceGet(&mut da, a as i32) != sys::CUresult::CUDA_SUCCESS
            || sys::cuDeviceGet(&mut db, b as i32) != sys::CUresult::CUDA_SUCCESS
        {
            return (false, false);
        }
        let _ = sys::cuDeviceCanAccessPeer(&mut access, da, db);
        let _ = sys::cuDeviceGetP2PAttribute(
            &mut atomics,
            sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
            da,
            db,
        );
    }
    (access != 0, atomics != 0)
}

fn main() {
    // SAFETY: restoring the default SIGPIPE disposition before any output, so `doorbell-info |
    // head` ends quietly instead of panicking on a closed pipe.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{HELP}");
        return;
    }
    if let Some(a) = std::env::args().nth(1) {
        eprintln!("doorbell-info: unknown argument {a:?}\n\n{HELP}");
        std::process::exit(2);
    }
    let settings = match Settings::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("doorbell-info: {e}");
            std::process::exit(2);
        }
    };
    println!("doorbell {}", env!("CARGO_PKG_VERSION"));

    // GPUs.
    println!();
    let gpus: Vec<GpuInfo> = match device_count() {
        Ok(n) => (0..n)
            .filter_map(|i| match gpu_info(i) {
                Ok(g) => Some(g),
                Err(e) => {
                    println!("GPU {i}: {e}");
                    None
                }
            })
            .collect(),
        Err(e) => {
            println!("GPUs: none usable ({e})");
            Vec::new()
        }
    };
    if !gpus.is_empty() {
        println!("GPUs: {}", gpus.len());
    }
    for (i, g) in gpus.iter().enumerate() {
        println!(
            "  GPU {i}: {}, PCI {}, {} SMs, dma-buf export: {}",
            g.name,
            g.bus,
            g.sms,
            if g.dmabuf { "yes" } else { "no" }
        );
    }
    if gpus.len() > 1 {
        println!("  peer access (P = load/store access, A = also native atomics, the NVLink case; - = none):");
        print!("        ");
        for j in 0..gpus.len() {
            print!(" GPU{j:<2}");
        }
        println!();
        for i in 0..gpus.len() {
            print!("  GPU{i:<2} ");
            for j in 0..gpus.len() {
                let cell = if i == j {
                    "  X  "
                } else {
                    match peer_access(i, j) {
                        (true, true) => "  A  ",
                        (true, false) => "  P  ",
                        _ => "  -  ",
                    }
                };
                print!("{cell} ");
            }
            println!();
        }
    }

    // RDMA.
    let platform = Platform::probe(gpus.first().is_some_and(|g| g.dmabuf));
    println!("\nRDMA NICs:");
    let nics = match Verbs::load().and_then(|v| v.devices()) {
        Ok(n) if n.is_empty() => {
            println!("  none (libibverbs loaded, no devices)");
            n
        }
        Ok(n) => n,
        Err(e) => {
            println!("  none: {e}");
            Vec::new()
        }
    };
    let sysfs = std::path::Path::new("/sys");
    for nic in &nics {
        let place = match PciPath::of_ib_device(sysfs, &nic.name) {
            Ok(p) => format!(
                ", PCI {}{}",
                p.bus_id(),
                p.numa_node
                    .map_or(String::new(), |n| format!(" (NUMA node {n})"))
            ),
            Err(_) => ", no PCI device in /sys (software RDMA?)".into(),
        };
        println!(
            "  {}: firmware {}, vendor {:#06x} device {:#06x}{}{place}",
            nic.name,
            nic.firmware,
            nic.vendor_id,
            nic.vendor_part_id,
            if nic.is_mlx5() { " (mlx5)" } else { "" }
        );
        for p in &nic.ports {
            let gid = match choose_gid(p, settings.ib_gid_index) {
                Ok(g) => format!(
                    "GID {} ({:?}{})",
                    g.index,
                    g.kind,
                    g.ipv4().map_or(String::new(), |a| format!(", {a}"))
                ),
                Err(e) => format!("no GID: {e}"),
            };
            println!(
                "    port {}: {}, {:?}, MTU {}, {}",
                p.num,
                if p.active() { "active" } else { "down" },
                p.link_layer,
                p.active_mtu,
                gid
            );
        }
    }
    // The NIC of each GPU.
    println!(
        "\nNIC per GPU (the nearest active port in the PCIe tree; DOORBELL_IB_HCA={}):",
        settings.ib_hca.as_deref().unwrap_or("unset")
    );
    let candidates: Vec<NicCandidate> = nics
        .iter()
        .flat_map(|n| {
            n.ports.iter().map(|p| NicCandidate {
                name: n.name.clone(),
                port: p.num,
                active: p.active(),
            })
        })
        .collect();
    let bus_ids: Vec<&str> = gpus.iter().map(|g| g.bus.as_str()).collect();
    let choices: Vec<NicChoice> = if nics.is_empty() {
        println!("  none: this host has no RDMA NIC");
        if let Some(Err(e)) = settings.ib_hca.as_deref().map(HcaFilter::parse) {
            println!("  (and {e})");
        }
        Vec::new()
    } else if gpus.is_empty() {
        println!("  no GPU to place");
        Vec::new()
    } else {
        match assign_nics(sysfs, &bus_ids, &candidates, settings.ib_hca.as_deref()) {
            Ok(c) => c,
            Err(e) => {
                println!("  none: {e}");
                Vec::new()
            }
        }
    };
    for (i, c) in choices.iter().enumerate() {
        println!("  GPU {i}: {}", c.why);
    }

    println!("\nIBGDA prerequisites:");
    println!(
        "  NIC doorbell page mappable into the GPU (nvidia PeerMappingOverride=1): {}",
        if platform.peer_mapping_override {
            "yes"
        } else {
            "no"
        }
    );
    println!(
        "  nvidia_peermem loaded: {}",
        if platform.peermem { "yes" } else { "no" }
    );
    println!(
        "  GPU memory registration: {}",
        gpu_registration(&platform).unwrap_or_else(|e| e.to_string().leak())
    );
    println!(
        "  posting mode setting (DOORBELL_IB_POSTING): {:?}",
        settings.ib_posting
    );
    for nic in &nics {
        let (mode, why) = choose_posting(nic, &platform, settings.ib_posting);
        println!("  {}: {mode:?} ({why})", nic.name);
    }

    // Transports between the ranks of this host, one per GPU.
    println!(
        "\nBetween ranks on this host (one per GPU; DOORBELL_SEPARATE_NODES={}):",
        u8::from(settings.separate_nodes)
    );
    if gpus.len() < 2 {
        println!("  (fewer than two GPUs: nothing to connect)");
    }
    for i in 0..gpus.len() {
        for j in i + 1..gpus.len() {
            let (access, atomics) = peer_access(i, j);
            let how = if settings.separate_nodes && settings.ib_emulate {
                format!(
                    "Ib over doorbell's emulated mlx5 NIC (DOORBELL_IB_EMULATE=1), queue pairs connected through the verbs calls a ConnectX would get: PortChannels as RDMA work requests {} (no real NIC involved); MemoryChannels: none between nodes",
                    match settings.ib_posting {
                        IbPosting::Ibgda => "kernels write and ring themselves (IBGDA)",
                        IbPosting::CpuAssisted => "kernels write, a host thread rings (CPU-assisted)",
                        IbPosting::Verbs => "the proxies post with ibv_post_send (verbs proxy)",
                        _ => "the proxies write mlx5 WQEs (proxy posting)",
                    }
                )
            } else if settings.separate_nodes {
                // GPU i's own NIC where one was chosen.
                let ib = choices
                    .get(i)
                    .and_then(|c| nics.iter().find(|n| n.name == c.name));
                match ib {
                    _ if settings.ib_disable => "Ethernet: PortChannels over TCP through the proxies (DOORBELL_IB_DISABLE=1); MemoryChannels: none between nodes".into(),
                    Some(nic) => {
                        let (mode, why) = choose_posting(nic, &platform, settings.ib_posting);
                        format!(
                            "Ib over {} (GPU {i}'s NIC) when every rank has a NIC, posting {mode:?} ({why}); else Ethernet; MemoryChannels: none between nodes",
                            nic.name
                        )
                    }
                    None => "Ethernet: PortChannels over TCP through the proxies (no active RDMA NIC); MemoryChannels: none between nodes".into(),
                }
            } else if access {
                format!(
                    "CudaIpc: MemoryChannels by loads and stores, PortChannels by copy engines ({})",
                    if atomics { "NVLink-class peer access with native atomics" } else { "peer access without native atomics (PCIe)" }
                )
            } else {
                "CudaIpc mapping without peer access: the GPUs cannot reach each other's memory (no NVLink or PCIe P2P)".into()
            };
            println!("  GPU {i} <-> GPU {j}: {how}");
        }
    }
    if settings.ib_posting != IbPosting::Auto && nics.is_empty() {
        println!("\nnote: DOORBELL_IB_POSTING is set but there is no RDMA NIC to post to");
    }
}
