//! The rdma-core struct mirrors of `rdma::verbs` against `infiniband/verbs.h` (a C program
//! compiled here prints every field's offset and size; needs a C compiler and rdma-core's
//! headers: `apt install libibverbs-dev`, as `scripts/install-test-deps.sh` does), and loading
//! libibverbs at run time where it is installed.

use doorbell::rdma::verbs::{DeviceAttr, GidEntry, PortAttr, Verbs};
use std::mem::{offset_of, size_of};
use std::path::PathBuf;
use std::process::Command;

const LAYOUT_C: &str = r#"#include <stddef.h>
#include <stdio.h>
#include <infiniband/verbs.h>
#define F(s, f) printf("%s %s %zu %zu\n", #s, #f, offsetof(struct s, f), sizeof(((struct s*)0)->f));
int main(void) {
  printf("ibv_device_attr SIZE %zu %zu\n", sizeof(struct ibv_device_attr), (size_t)0);
  F(ibv_device_attr, fw_ver)
  F(ibv_device_attr, node_guid)
  F(ibv_device_attr, sys_image_guid)
  F(ibv_device_attr, max_mr_size)
  F(ibv_device_attr, page_size_cap)
  F(ibv_device_attr, vendor_id)
  F(ibv_device_attr, vendor_part_id)
  F(ibv_device_attr, hw_ver)
  F(ibv_device_attr, max_qp)
  F(ibv_device_attr, max_qp_wr)
  F(ibv_device_attr, device_cap_flags)
  F(ibv_device_attr, max_sge)
  F(ibv_device_attr, max_sge_rd)
  F(ibv_device_attr, max_cq)
  F(ibv_device_attr, max_cqe)
  F(ibv_device_attr, max_mr)
  F(ibv_device_attr, max_pd)
  F(ibv_device_attr, max_qp_rd_atom)
  F(ibv_device_attr, max_ee_rd_atom)
  F(ibv_device_attr, max_res_rd_atom)
  F(ibv_device_attr, max_qp_init_rd_atom)
  F(ibv_device_attr, max_ee_init_rd_atom)
  F(ibv_device_attr, atomic_cap)
  F(ibv_device_attr, max_ee)
  F(ibv_device_attr, max_rdd)
  F(ibv_device_attr, max_mw)
  F(ibv_device_attr, max_raw_ipv6_qp)
  F(ibv_device_attr, max_raw_ethy_qp)
  F(ibv_device_attr, max_mcast_grp)
  F(ibv_device_attr, max_mcast_qp_attach)
  F(ibv_device_attr, max_total_mcast_qp_attach)
  F(ibv_device_attr, max_ah)
  F(ibv_device_attr, max_fmr)
  F(ibv_device_attr, max_map_per_fmr)
  F(ibv_device_attr, max_srq)
  F(ibv_device_attr, max_srq_wr)
  F(ibv_device_attr, max_srq_sge)
  F(ibv_device_attr, max_pkeys)
  F(ibv_device_attr, local_ca_ack_delay)
  F(ibv_device_attr, phys_port_cnt)
  printf("ibv_port_attr SIZE %zu %zu\n", sizeof(struct ibv_port_attr), (size_t)0);
  F(ibv_port_attr, state)
  F(ibv_port_attr, max_mtu)
  F(ibv_port_attr, active_mtu)
  F(ibv_port_attr, gid_tbl_len)
  F(ibv_port_attr, port_cap_flags)
  F(ibv_port_attr, max_msg_sz)
  F(ibv_port_attr, bad_pkey_cntr)
  F(ibv_port_attr, qkey_viol_cntr)
  F(ibv_port_attr, pkey_tbl_len)
  F(ibv_port_attr, lid)
  F(ibv_port_attr, sm_lid)
  F(ibv_port_attr, lmc)
  F(ibv_port_attr, max_vl_num)
  F(ibv_port_attr, sm_sl)
  F(ibv_port_attr, subnet_timeout)
  F(ibv_port_attr, init_type_reply)
  F(ibv_port_attr, active_width)
  F(ibv_port_attr, active_speed)
  F(ibv_port_attr, phys_state)
  F(ibv_port_attr, link_layer)
  F(ibv_port_attr, flags)
  F(ibv_port_attr, port_cap_flags2)
  printf("ibv_gid_entry SIZE %zu %zu\n", sizeof(struct ibv_gid_entry), (size_t)0);
  F(ibv_gid_entry, gid)
  F(ibv_gid_entry, gid_index)
  F(ibv_gid_entry, port_num)
  F(ibv_gid_entry, gid_type)
  F(ibv_gid_entry, ndev_ifindex)
  return 0;
}
"#;

macro_rules! field_size {
    ($t:ty, $f:ident) => {{
        // SAFETY: all-zero bytes are a valid value of these plain-old-data mirrors.
        let probe: $t = unsafe { std::mem::zeroed() };
        std::mem::size_of_val(&probe.$f)
    }};
}

fn ours() -> Vec<(&'static str, &'static str, usize, usize)> {
    let mut out = Vec::new();
    out.push(("ibv_device_attr", "SIZE", size_of::<DeviceAttr>(), 0));
    out.push((
        "ibv_device_attr",
        "fw_ver",
        offset_of!(DeviceAttr, fw_ver),
        field_size!(DeviceAttr, fw_ver),
    ));
    out.push((
        "ibv_device_attr",
        "node_guid",
        offset_of!(DeviceAttr, node_guid),
        field_size!(DeviceAttr, node_guid),
    ));
    out.push((
        "ibv_device_attr",
        "sys_image_guid",
        offset_of!(DeviceAttr, sys_image_guid),
        field_size!(DeviceAttr, sys_image_guid),
    ));
    out.push((
        "ibv_device_attr",
        "max_mr_size",
        offset_of!(DeviceAttr, max_mr_size),
        field_size!(DeviceAttr, max_mr_size),
    ));
    out.push((
        "ibv_device_attr",
        "page_size_cap",
        offset_of!(DeviceAttr, page_size_cap),
        field_size!(DeviceAttr, page_size_cap),
    ));
    out.push((
        "ibv_device_attr",
        "vendor_id",
        offset_of!(DeviceAttr, vendor_id),
        field_size!(DeviceAttr, vendor_id),
    ));
    out.push((
        "ibv_device_attr",
        "vendor_part_id",
        offset_of!(DeviceAttr, vendor_part_id),
        field_size!(DeviceAttr, vendor_part_id),
    ));
    out.push((
        "ibv_device_attr",
        "hw_ver",
        offset_of!(DeviceAttr, hw_ver),
        field_size!(DeviceAttr, hw_ver),
    ));
    out.push((
        "ibv_device_attr",
        "max_qp",
        offset_of!(DeviceAttr, max_qp),
        field_size!(DeviceAttr, max_qp),
    ));
    out.push((
        "ibv_device_attr",
        "max_qp_wr",
        offset_of!(DeviceAttr, max_qp_wr),
        field_size!(DeviceAttr, max_qp_wr),
    ));
    out.push((
        "ibv_device_attr",
        "device_cap_flags",
        offset_of!(DeviceAttr, device_cap_flags),
        field_size!(DeviceAttr, device_cap_flags),
    ));
    out.push((
        "ibv_device_attr",
        "max_sge",
        offset_of!(DeviceAttr, max_sge),
        field_size!(DeviceAttr, max_sge),
    ));
    out.push((
        "ibv_device_attr",
        "max_sge_rd",
        offset_of!(DeviceAttr, max_sge_rd),
        field_size!(DeviceAttr, max_sge_rd),
    ));
    out.push((
        "ibv_device_attr",
        "max_cq",
        offset_of!(DeviceAttr, max_cq),
        field_size!(DeviceAttr, max_cq),
    ));
    out.push((
        "ibv_device_attr",
        "max_cqe",
        offset_of!(DeviceAttr, max_cqe),
        field_size!(DeviceAttr, max_cqe),
    ));
    out.push((
        "ibv_device_attr",
        "max_mr",
        offset_of!(DeviceAttr, max_mr),
        field_size!(DeviceAttr, max_mr),
    ));
    out.push((
        "ibv_device_attr",
        "max_pd",
        offset_of!(DeviceAttr, max_pd),
        field_size!(DeviceAttr, max_pd),
    ));
    out.push((
        "ibv_device_attr",
        "max_qp_rd_atom",
        offset_of!(DeviceAttr, max_qp_rd_atom),
        field_size!(DeviceAttr, max_qp_rd_atom),
    ));
    out.push((
        "ibv_device_attr",
        "max_ee_rd_atom",
        offset_of!(DeviceAttr, max_ee_rd_atom),
        field_size!(DeviceAttr, max_ee_rd_atom),
    ));
    out.push((
        "ibv_device_attr",
        "max_res_rd_atom",
        offset_of!(DeviceAttr, max_res_rd_atom),
        field_size!(DeviceAttr, max_res_rd_atom),
    ));
    out.push((
        "ibv_device_attr",
        "max_qp_init_rd_atom",
        offset_of!(DeviceAttr, max_qp_init_rd_atom),
        field_size!(DeviceAttr, max_qp_init_rd_atom),
    ));
    out.push((
        "ibv_device_attr",
        "max_ee_init_rd_atom",
        offset_of!(DeviceAttr, max_ee_init_rd_atom),
        field_size!(DeviceAttr, max_ee_init_rd_atom),
    ));
    out.push((
        "ibv_device_attr",
        "atomic_cap",
        offset_of!(DeviceAttr, atomic_cap),
        field_size!(DeviceAttr, atomic_cap),
    ));
    out.push((
        "ibv_device_attr",
        "max_ee",
        offset_of!(DeviceAttr, max_ee),
        field_size!(DeviceAttr, max_ee),
    ));
    out.push((
        "ibv_device_attr",
        "max_rdd",
        offset_of!(DeviceAttr, max_rdd),
        field_size!(DeviceAttr, max_rdd),
    ));
    out.push((
        "ibv_device_attr",
        "max_mw",
        offset_of!(DeviceAttr, max_mw),
        field_size!(DeviceAttr, max_mw),
    ));
    out.push((
        "ibv_device_attr",
        "max_raw_ipv6_qp",
        offset_of!(DeviceAttr, max_raw_ipv6_qp),
        field_size!(DeviceAttr, max_raw_ipv6_qp),
    ));
    out.push((
        "ibv_device_attr",
        "max_raw_ethy_qp",
        offset_of!(DeviceAttr, max_raw_ethy_qp),
        field_size!(DeviceAttr, max_raw_ethy_qp),
    ));
    out.push((
        "ibv_device_attr",
        "max_mcast_grp",
        offset_of!(DeviceAttr, max_mcast_grp),
        field_size!(DeviceAttr, max_mcast_grp),
    ));
    out.push((
        "ibv_device_attr",
        "max_mcast_qp_attach",
        offset_of!(DeviceAttr, max_mcast_qp_attach),
        field_size!(DeviceAttr, max_mcast_qp_attach),
    ));
    out.push((
        "ibv_device_attr",
        "max_total_mcast_qp_attach",
        offset_of!(DeviceAttr, max_total_mcast_qp_attach),
        field_size!(DeviceAttr, max_total_mcast_qp_attach),
    ));
    out.push((
        "ibv_device_attr",
        "max_ah",
        offset_of!(DeviceAttr, max_ah),
        field_size!(DeviceAttr, max_ah),
    ));
    out.push((
        "ibv_device_attr",
        "max_fmr",
        offset_of!(DeviceAttr, max_fmr),
        field_size!(DeviceAttr, max_fmr),
    ));
    out.push((
        "ibv_device_attr",
        "max_map_per_fmr",
        offset_of!(DeviceAttr, max_map_per_fmr),
        field_size!(DeviceAttr, max_map_per_fmr),
    ));
    out.push((
        "ibv_device_attr",
        "max_srq",
        offset_of!(DeviceAttr, max_srq),
        field_size!(DeviceAttr, max_srq),
    ));
    out.push((
        "ibv_device_attr",
        "max_srq_wr",
        offset_of!(DeviceAttr, max_srq_wr),
        field_size!(DeviceAttr, max_srq_wr),
    ));
    out.push((
        "ibv_device_attr",
        "max_srq_sge",
        offset_of!(DeviceAttr, max_srq_sge),
        field_size!(DeviceAttr, max_srq_sge),
    ));
    out.push((
        "ibv_device_attr",
        "max_pkeys",
        offset_of!(DeviceAttr, max_pkeys),
        field_size!(DeviceAttr, max_pkeys),
    ));
    out.push((
        "ibv_device_attr",
        "local_ca_ack_delay",
        offset_of!(DeviceAttr, local_ca_ack_delay),
        field_size!(DeviceAttr, local_ca_ack_delay),
    ));
    out.push((
        "ibv_device_attr",
        "phys_port_cnt",
        offset_of!(DeviceAttr, phys_port_cnt),
        field_size!(DeviceAttr, phys_port_cnt),
    ));
    out.push(("ibv_port_attr", "SIZE", size_of::<PortAttr>(), 0));
    out.push((
        "ibv_port_attr",
        "state",
        offset_of!(PortAttr, state),
        field_size!(PortAttr, state),
    ));
    out.push((
        "ibv_port_attr",
        "max_mtu",
        offset_of!(PortAttr, max_mtu),
        field_size!(PortAttr, max_mtu),
    ));
    out.push((
        "ibv_port_attr",
        "active_mtu",
        offset_of!(PortAttr, active_mtu),
        field_size!(PortAttr, active_mtu),
    ));
    out.push((
        "ibv_port_attr",
        "gid_tbl_len",
        offset_of!(PortAttr, gid_tbl_len),
        field_size!(PortAttr, gid_tbl_len),
    ));
    out.push((
        "ibv_port_attr",
        "port_cap_flags",
        offset_of!(PortAttr, port_cap_flags),
        field_size!(PortAttr, port_cap_flags),
    ));
    out.push((
        "ibv_port_attr",
        "max_msg_sz",
        offset_of!(PortAttr, max_msg_sz),
        field_size!(PortAttr, max_msg_sz),
    ));
    out.push((
        "ibv_port_attr",
        "bad_pkey_cntr",
        offset_of!(PortAttr, bad_pkey_cntr),
        field_size!(PortAttr, bad_pkey_cntr),
    ));
    out.push((
        "ibv_port_attr",
        "qkey_viol_cntr",
        offset_of!(PortAttr, qkey_viol_cntr),
        field_size!(PortAttr, qkey_viol_cntr),
    ));
    out.push((
        "ibv_port_attr",
        "pkey_tbl_len",
        offset_of!(PortAttr, pkey_tbl_len),
        field_size!(PortAttr, pkey_tbl_len),
    ));
    out.push((
        "ibv_port_attr",
        "lid",
        offset_of!(PortAttr, lid),
        field_size!(PortAttr, lid),
    ));
    out.push((
        "ibv_port_attr",
        "sm_lid",
        offset_of!(PortAttr, sm_lid),
        field_size!(PortAttr, sm_lid),
    ));
    out.push((
        "ibv_port_attr",
        "lmc",
        offset_of!(PortAttr, lmc),
        field_size!(PortAttr, lmc),
    ));
    out.push((
        "ibv_port_attr",
        "max_vl_num",
        offset_of!(PortAttr, max_vl_num),
        field_size!(PortAttr, max_vl_num),
    ));
    out.push((
        "ibv_port_attr",
        "sm_sl",
        offset_of!(PortAttr, sm_sl),
        field_size!(PortAttr, sm_sl),
    ));
    out.push((
        "ibv_port_attr",
        "subnet_timeout",
        offset_of!(PortAttr, subnet_timeout),
        field_size!(PortAttr, subnet_timeout),
    ));
    out.push((
        "ibv_port_attr",
        "init_type_reply",
        offset_of!(PortAttr, init_type_reply),
        field_size!(PortAttr, init_type_reply),
    ));
    out.push((
        "ibv_port_attr",
        "active_width",
        offset_of!(PortAttr, active_width),
        field_size!(PortAttr, active_width),
    ));
    out.push((
        "ibv_port_attr",
        "active_speed",
        offset_of!(PortAttr, active_speed),
        field_size!(PortAttr, active_speed),
    ));
    out.push((
        "ibv_port_attr",
        "phys_state",
        offset_of!(PortAttr, phys_state),
        field_size!(PortAttr, phys_state),
    ));
    out.push((
        "ibv_port_attr",
        "link_layer",
        offset_of!(PortAttr, link_layer),
        field_size!(PortAttr, link_layer),
    ));
    out.push((
        "ibv_port_attr",
        "flags",
        offset_of!(PortAttr, flags),
        field_size!(PortAttr, flags),
    ));
    out.push((
        "ibv_port_attr",
        "port_cap_flags2",
        offset_of!(PortAttr, port_cap_flags2),
        field_size!(PortAttr, port_cap_flags2),
    ));
    out.push(("ibv_gid_entry", "SIZE", size_of::<GidEntry>(), 0));
    out.push((
        "ibv_gid_entry",
        "gid",
        offset_of!(GidEntry, gid),
        field_size!(GidEntry, gid),
    ));
    out.push((
        "ibv_gid_entry",
        "gid_index",
        offset_of!(GidEntry, gid_index),
        field_size!(GidEntry, gid_index),
    ));
    out.push((
        "ibv_gid_entry",
        "port_num",
        offset_of!(GidEntry, port_num),
        field_size!(GidEntry, port_num),
    ));
    out.push((
        "ibv_gid_entry",
        "gid_type",
        offset_of!(GidEntry, gid_type),
        field_size!(GidEntry, gid_type),
    ));
    out.push((
        "ibv_gid_entry",
        "ndev_ifindex",
        offset_of!(GidEntry, ndev_ifindex),
        field_size!(GidEntry, ndev_ifindex),
    ));
    out
}

#[test]
fn verbs_struct_mirrors_match_rdma_core() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("verbs-layout");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (src, exe) = (dir.join("layout.c"), dir.join("layout"));
    std::fs::write(&src, LAYOUT_C).expect("write layout.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-O0", "-std=gnu11", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("running {cc}: {e} (a C compiler is needed)"));
    assert!(
        out.status.success(),
        "compiling against rdma-core's verbs.h failed (apt install libibverbs-dev):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().expect("run the layout program");
    let theirs: Vec<(String, String, usize, usize)> = String::from_utf8(run.stdout)
        .expect("utf-8")
        .lines()
        .map(|l| {
            let v: Vec<&str> = l.split(' ').collect();
            (
                v[0].to_string(),
                v[1].to_string(),
                v[2].parse().unwrap(),
                v[3].parse().unwrap(),
            )
        })
        .collect();
    let ours = ours();
    assert_eq!(theirs.len(), ours.len());
    for ((cs, cf, co, cz), (rs, rf, ro, rz)) in theirs.iter().zip(&ours) {
        assert_eq!((cs.as_str(), cf.as_str()), (*rs, *rf));
        assert_eq!(
            (*co, *cz),
            (*ro, *rz),
            "{cs}.{cf}: (offset, size) in C vs Rust"
        );
    }
}

/// Where libibverbs is installed (CI installs it with the headers), loading works and listing
/// devices either succeeds (none on machines without RDMA NICs) or says why the kernel cannot;
/// where it is not installed, the error says what to install.
#[test]
fn libibverbs_loads_at_run_time_or_says_what_to_install() {
    match Verbs::load() {
        Ok(v) => match v.devices() {
            Ok(nics) => {
                for n in &nics {
                    assert!(!n.name.is_empty());
                }
                eprintln!("{} RDMA device(s)", nics.len());
            }
            // A kernel without RDMA support (CI containers): reported, with the reason.
            Err(doorbell::Error::TransportUnavailable { why, .. }) => {
                assert!(why.contains("ibv_get_device_list"), "{why}");
                eprintln!("{why}");
            }
            Err(e) => panic!("{e}"),
        },
        Err(e) => assert!(e.to_string().contains("libibverbs"), "{e}"),
    }
}
