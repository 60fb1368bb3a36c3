//! Which way RDMA work gets posted, and why (issue 6 deliverable 3: automatic, logged with its
//! reason, forced by `DOORBELL_IB_POSTING`), and whether GPU memory can be registered. Used by
//! `doorbell-info`; the Ib transport will use the same answers.

use crate::error::{Error, Result};
use crate::job::config::IbPosting;
use crate::transport::ib::boundary::verbs::Nic;

/// How work requests reach the NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostingMode {
    /// The GPU writes WQEs and rings the doorbell through the UAR page mapped into it.
    Ibgda,
    /// The GPU writes WQEs; a host thread writes the doorbell record and rings.
    CpuAssisted,
    /// PortChannel triggers become mlx5 WQEs the host proxy writes on the QP's rings.
    ProxyMlx5,
    /// PortChannel triggers become `ibv_post_send` on a host proxy (any NIC).
    VerbsProxy,
}

/// The posting mode for a NIC behind the verbs boundary: what [`choose_posting`] picks for a
/// real one; on the emulated NIC the proxy writes mlx5 WQEs unless a mode is forced (it takes
/// every mode). NICs that are not mlx5 take the verbs proxy whatever is asked, with the reason.
pub fn posting_for(
    provider: &dyn crate::transport::ib::boundary::provider::Provider,
    platform: &Platform,
    forced: IbPosting,
) -> (PostingMode, String) {
    if !provider.is_mlx5() {
        let why = format!(
            "{} is not an mlx5 NIC: the proxy posts with ibv_post_send",
            provider.device_name()
        );
        return (PostingMode::VerbsProxy, why);
    }
    if provider.is_emulated() {
        let mode = match forced {
            IbPosting::Auto | IbPosting::Proxy => PostingMode::ProxyMlx5,
            IbPosting::Ibgda => PostingMode::Ibgda,
            IbPosting::CpuAssisted => PostingMode::CpuAssisted,
            IbPosting::Verbs => PostingMode::VerbsProxy,
        };
        let why = if forced == IbPosting::Auto {
            "the emulated NIC: the proxy writes mlx5 WQEs (DOORBELL_IB_POSTING picks another mode)"
                .to_string()
        } else {
            "forced by DOORBELL_IB_POSTING (emulated NIC)".to_string()
        };
        return (mode, why);
    }
    let nic = Nic {
        name: provider.device_name().to_string(),
        firmware: String::new(),
        vendor_id: 0x15b3,
        vendor_part_id: 0,
        ports: Vec::new(),
    };
    choose_posting(&nic, platform, forced)
}

/// What the platform allows, as probed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Platform {
    /// The nvidia module runs with `PeerMappingOverride=1`: a NIC's UAR page may be mapped into
    /// the GPU (`cudaHostRegister` with IoMemory).
    pub peer_mapping_override: bool,
    /// `nvidia_peermem` is loaded.
    pub peermem: bool,
    /// The GPU exports dma-bufs (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`).
    pub dmabuf: bool,
}

impl Platform {
    /// Reads `/proc/driver/nvidia/params` and `/sys/module`; `dmabuf` as the caller found it.
    pub fn probe(dmabuf: bool) -> Platform {
        let params = std::fs::read_to_string("/proc/driver/nvidia/params").unwrap_or_default();
        Platform {
            peer_mapping_override: peer_mapping_override(&params),
            peermem: std::path::Path::new("/sys/module/nvidia_peermem").exists(),
            dmabuf,
        }
    }
}

/// Whether the nvidia module's `RegistryDwords` (from `/proc/driver/nvidia/params`) set
/// `PeerMappingOverride=1`.
pub fn peer_mapping_override(params: &str) -> bool {
    params
        .lines()
        .filter_map(|l| l.strip_prefix("RegistryDwords:"))
        .flat_map(|v| {
            v.trim()
                .trim_matches('"')
                .split(';')
                .map(str::trim)
                .collect::<Vec<_>>()
        })
        .any(|kv| {
            kv.split_once('=')
                .is_some_and(|(k, v)| k.trim() == "PeerMappingOverride" && v.trim() == "1")
        })
}

/// The posting mode for `nic` on `platform`, with the reason; `forced` overrides the choice (the
/// reason then says what is missing, if anything).
pub fn choose_posting(nic: &Nic, platform: &Platform, forced: IbPosting) -> (PostingMode, String) {
    let auto = if !nic.is_mlx5() {
        (
            PostingMode::VerbsProxy,
            format!(
                "{} is not an mlx5 NIC: the GPU cannot build its work requests",
                nic.name
            ),
        )
    } else if platform.peer_mapping_override {
        (
            PostingMode::Ibgda,
            "IBGDA: the NIC's doorbell page can be mapped into the GPU (PeerMappingOverride=1)"
                .into(),
        )
    } else {
        (
            PostingMode::CpuAssisted,
            "IBGDA unavailable: the nvidia module refuses to map the NIC's doorbell (UAR) page \
             into the GPU; set NVreg_RegistryDwords=\"PeerMappingOverride=1;\" for the nvidia \
             module to let kernels ring it. Until then the GPU builds WQEs and a host thread rings"
                .into(),
        )
    };
    let forced_mode = match forced {
        IbPosting::Auto => return auto,
        IbPosting::Ibgda => PostingMode::Ibgda,
        IbPosting::CpuAssisted => PostingMode::CpuAssisted,
        IbPosting::Proxy if nic.is_mlx5() => PostingMode::ProxyMlx5,
        IbPosting::Proxy | IbPosting::Verbs => PostingMode::VerbsProxy,
    };
    let note = if forced_mode == auto.0 {
        String::new()
    } else {
        format!(" (automatic choice would be {:?}: {})", auto.0, auto.1)
    };
    (forced_mode, format!("forced by DOORBELL_IB_POSTING{note}"))
}

/// How GPU memory gets registered with the NIC: dma-buf first, nvidia-peermem as the fallback,
/// else an error that says what to install or set.
pub fn gpu_registration(platform: &Platform) -> Result<&'static str> {
    if platform.dmabuf {
        Ok("dma-buf (cuMemGetHandleForAddressRange + ibv_reg_dmabuf_mr)")
    } else if platform.peermem {
        Ok("nvidia-peermem (ibv_reg_mr on device addresses)")
    } else {
        Err(Error::TransportUnavailable {
            transport: "ib",
            why: "GPU memory cannot be registered with the NIC: this GPU/driver exports no \
                  dma-buf (needs the open nvidia kernel module) and nvidia_peermem is not loaded \
                  (modprobe nvidia_peermem)"
                .into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(name: &str, vendor: u32) -> Nic {
        Nic {
            name: name.into(),
            firmware: String::new(),
            vendor_id: vendor,
            vendor_part_id: 0,
            ports: vec![],
        }
    }

    #[test]
    fn the_mode_follows_the_nic_and_the_driver() {
        let off = Platform::default();
        let on = Platform {
            peer_mapping_override: true,
            ..Platform::default()
        };
        let mlx = nic("mlx5_0", 0x15b3);
        assert_eq!(
            choose_posting(&mlx, &on, IbPosting::Auto).0,
            PostingMode::Ibgda
        );
        let (m, why) = choose_posting(&mlx, &off, IbPosting::Auto);
        assert_eq!(m, PostingMode::CpuAssisted);
        assert!(why.contains("PeerMappingOverride=1"), "{why}");
        assert_eq!(
            choose_posting(&nic("efa_0", 0x1d0f), &on, IbPosting::Auto).0,
            PostingMode::VerbsProxy
        );
        // The proxy writes mlx5 WQEs only on mlx5 NICs; elsewhere it posts through verbs.
        assert_eq!(
            choose_posting(&mlx, &off, IbPosting::Proxy).0,
            PostingMode::ProxyMlx5
        );
        let efa = nic("efa_0", 0x1d0f);
        assert_eq!(
            choose_posting(&efa, &off, IbPosting::Proxy).0,
            PostingMode::VerbsProxy
        );
        assert_eq!(
            choose_posting(&mlx, &off, IbPosting::Verbs).0,
            PostingMode::VerbsProxy
        );
        let (m, why) = choose_posting(&mlx, &off, IbPosting::Ibgda);
        assert_eq!(m, PostingMode::Ibgda);
        assert!(
            why.contains("forced") && why.contains("CpuAssisted"),
            "{why}"
        );
    }

    #[test]
    fn registry_dwords_are_parsed() {
        assert!(peer_mapping_override(
            "Foo: 1\nRegistryDwords: \"RMFoo=3; PeerMappingOverride=1;\"\n"
        ));
        assert!(!peer_mapping_override("RegistryDwords: \"\"\n"));
        assert!(!peer_mapping_override(
            "RegistryDwords: \"PeerMappingOverride=0\"\n"
        ));
        assert!(gpu_registration(&Platform::default()).is_err());
        assert!(gpu_registration(&Platform {
            dmabuf: true,
            ..Platform::default()
        })
        .unwrap()
        .starts_with("dma-buf"));
    }
}
