//! The rdma-core struct mirrors of `rdma::verbs` against `infiniband/verbs.h` (a C program
//! compiled here prints every field's offset and size; needs a C compiler and rdma-core's
//! headers: `apt install libibverbs-dev`, as `scripts/install-test-deps.sh` does), and loading
//! libibverbs at run time where it is installed.

use doorbell::rdma::verbs::{
    AhAttr, DeviceAttr, GidEntry, GlobalRoute, MrRaw, PortAttr, QpAttr, QpCap, QpInitAttr, QpRaw,
    Verbs,
};
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
  printf("ibv_qp_cap SIZE %zu %zu\n", sizeof(struct ibv_qp_cap), (size_t)0);
  F(ibv_qp_cap, max_send_wr)
  F(ibv_qp_cap, max_recv_wr)
  F(ibv_qp_cap, max_send_sge)
  F(ibv_qp_cap, max_recv_sge)
  F(ibv_qp_cap, max_inline_data)
  printf("ibv_qp_init_attr SIZE %zu %zu\n", sizeof(struct ibv_qp_init_attr), (size_t)0);
  F(ibv_qp_init_attr, qp_context)
  F(ibv_qp_init_attr, send_cq)
  F(ibv_qp_init_attr, recv_cq)
  F(ibv_qp_init_attr, srq)
  F(ibv_qp_init_attr, cap)
  F(ibv_qp_init_attr, qp_type)
  F(ibv_qp_init_attr, sq_sig_all)
  printf("ibv_global_route SIZE %zu %zu\n", sizeof(struct ibv_global_route), (size_t)0);
  F(ibv_global_route, dgid)
  F(ibv_global_route, flow_label)
  F(ibv_global_route, sgid_index)
  F(ibv_global_route, hop_limit)
  F(ibv_global_route, traffic_class)
  printf("ibv_ah_attr SIZE %zu %zu\n", sizeof(struct ibv_ah_attr), (size_t)0);
  F(ibv_ah_attr, grh)
  F(ibv_ah_attr, dlid)
  F(ibv_ah_attr, sl)
  F(ibv_ah_attr, src_path_bits)
  F(ibv_ah_attr, static_rate)
  F(ibv_ah_attr, is_global)
  F(ibv_ah_attr, port_num)
  printf("ibv_qp_attr SIZE %zu %zu\n", sizeof(struct ibv_qp_attr), (size_t)0);
  F(ibv_qp_attr, qp_state)
  F(ibv_qp_attr, cur_qp_state)
  F(ibv_qp_attr, path_mtu)
  F(ibv_qp_attr, path_mig_state)
  F(ibv_qp_attr, qkey)
  F(ibv_qp_attr, rq_psn)
  F(ibv_qp_attr, sq_psn)
  F(ibv_qp_attr, dest_qp_num)
  F(ibv_qp_attr, qp_access_flags)
  F(ibv_qp_attr, cap)
  F(ibv_qp_attr, ah_attr)
  F(ibv_qp_attr, alt_ah_attr)
  F(ibv_qp_attr, pkey_index)
  F(ibv_qp_attr, alt_pkey_index)
  F(ibv_qp_attr, en_sqd_async_notify)
  F(ibv_qp_attr, sq_draining)
  F(ibv_qp_attr, max_rd_atomic)
  F(ibv_qp_attr, max_dest_rd_atomic)
  F(ibv_qp_attr, min_rnr_timer)
  F(ibv_qp_attr, port_num)
  F(ibv_qp_attr, timeout)
  F(ibv_qp_attr, retry_cnt)
  F(ibv_qp_attr, rnr_retry)
  F(ibv_qp_attr, alt_port_num)
  F(ibv_qp_attr, alt_timeout)
  F(ibv_qp_attr, rate_limit)
  printf("ibv_mr SIZE %zu %zu\n", sizeof(struct ibv_mr), (size_t)0);
  F(ibv_mr, context)
  F(ibv_mr, pd)
  F(ibv_mr, addr)
  F(ibv_mr, length)
  F(ibv_mr, handle)
  F(ibv_mr, lkey)
  F(ibv_mr, rkey)
  F(ibv_qp, context)
  F(ibv_qp, qp_context)
  F(ibv_qp, pd)
  F(ibv_qp, send_cq)
  F(ibv_qp, recv_cq)
  F(ibv_qp, srq)
  F(ibv_qp, handle)
  F(ibv_qp, qp_num)
  F(ibv_qp, state)
  F(ibv_qp, qp_type)
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
    out.push(("ibv_qp_cap", "SIZE", size_of::<QpCap>(), 0));
    out.push((
        "ibv_qp_cap",
        "max_send_wr",
        offset_of!(QpCap, max_send_wr),
        field_size!(QpCap, max_send_wr),
    ));
    out.push((
        "ibv_qp_cap",
        "max_recv_wr",
        offset_of!(QpCap, max_recv_wr),
        field_size!(QpCap, max_recv_wr),
    ));
    out.push((
        "ibv_qp_cap",
        "max_send_sge",
        offset_of!(QpCap, max_send_sge),
        field_size!(QpCap, max_send_sge),
    ));
    out.push((
        "ibv_qp_cap",
        "max_recv_sge",
        offset_of!(QpCap, max_recv_sge),
        field_size!(QpCap, max_recv_sge),
    ));
    out.push((
        "ibv_qp_cap",
        "max_inline_data",
        offset_of!(QpCap, max_inline_data),
        field_size!(QpCap, max_inline_data),
    ));
    out.push(("ibv_qp_init_attr", "SIZE", size_of::<QpInitAttr>(), 0));
    out.push((
        "ibv_qp_init_attr",
        "qp_context",
        offset_of!(QpInitAttr, qp_context),
        field_size!(QpInitAttr, qp_context),
    ));
    out.push((
        "ibv_qp_init_attr",
        "send_cq",
        offset_of!(QpInitAttr, send_cq),
        field_size!(QpInitAttr, send_cq),
    ));
    out.push((
        "ibv_qp_init_attr",
        "recv_cq",
        offset_of!(QpInitAttr, recv_cq),
        field_size!(QpInitAttr, recv_cq),
    ));
    out.push((
        "ibv_qp_init_attr",
        "srq",
        offset_of!(QpInitAttr, srq),
        field_size!(QpInitAttr, srq),
    ));
    out.push((
        "ibv_qp_init_attr",
        "cap",
        offset_of!(QpInitAttr, cap),
        field_size!(QpInitAttr, cap),
    ));
    out.push((
        "ibv_qp_init_attr",
        "qp_type",
        offset_of!(QpInitAttr, qp_type),
        field_size!(QpInitAttr, qp_type),
    ));
    out.push((
        "ibv_qp_init_attr",
        "sq_sig_all",
        offset_of!(QpInitAttr, sq_sig_all),
        field_size!(QpInitAttr, sq_sig_all),
    ));
    out.push(("ibv_global_route", "SIZE", size_of::<GlobalRoute>(), 0));
    out.push((
        "ibv_global_route",
        "dgid",
        offset_of!(GlobalRoute, dgid),
        field_size!(GlobalRoute, dgid),
    ));
    out.push((
        "ibv_global_route",
        "flow_label",
        offset_of!(GlobalRoute, flow_label),
        field_size!(GlobalRoute, flow_label),
    ));
    out.push((
        "ibv_global_route",
        "sgid_index",
        offset_of!(GlobalRoute, sgid_index),
        field_size!(GlobalRoute, sgid_index),
    ));
    out.push((
        "ibv_global_route",
        "hop_limit",
        offset_of!(GlobalRoute, hop_limit),
        field_size!(GlobalRoute, hop_limit),
    ));
    out.push((
        "ibv_global_route",
        "traffic_class",
        offset_of!(GlobalRoute, traffic_class),
        field_size!(GlobalRoute, traffic_class),
    ));
    out.push(("ibv_ah_attr", "SIZE", size_of::<AhAttr>(), 0));
    out.push((
        "ibv_ah_attr",
        "grh",
        offset_of!(AhAttr, grh),
        field_size!(AhAttr, grh),
    ));
    out.push((
        "ibv_ah_attr",
        "dlid",
        offset_of!(AhAttr, dlid),
        field_size!(AhAttr, dlid),
    ));
    out.push((
        "ibv_ah_attr",
        "sl",
        offset_of!(AhAttr, sl),
        field_size!(AhAttr, sl),
    ));
    out.push((
        "ibv_ah_attr",
        "src_path_bits",
        offset_of!(AhAttr, src_path_bits),
        field_size!(AhAttr, src_path_bits),
    ));
    out.push((
        "ibv_ah_attr",
        "static_rate",
        offset_of!(AhAttr, static_rate),
        field_size!(AhAttr, static_rate),
    ));
    out.push((
        "ibv_ah_attr",
        "is_global",
        offset_of!(AhAttr, is_global),
        field_size!(AhAttr, is_global),
    ));
    out.push((
        "ibv_ah_attr",
        "port_num",
        offset_of!(AhAttr, port_num),
        field_size!(AhAttr, port_num),
    ));
    out.push(("ibv_qp_attr", "SIZE", size_of::<QpAttr>(), 0));
    out.push((
        "ibv_qp_attr",
        "qp_state",
        offset_of!(QpAttr, qp_state),
        field_size!(QpAttr, qp_state),
    ));
    out.push((
        "ibv_qp_attr",
        "cur_qp_state",
        offset_of!(QpAttr, cur_qp_state),
        field_size!(QpAttr, cur_qp_state),
    ));
    out.push((
        "ibv_qp_attr",
        "path_mtu",
        offset_of!(QpAttr, path_mtu),
        field_size!(QpAttr, path_mtu),
    ));
    out.push((
        "ibv_qp_attr",
        "path_mig_state",
        offset_of!(QpAttr, path_mig_state),
        field_size!(QpAttr, path_mig_state),
    ));
    out.push((
        "ibv_qp_attr",
        "qkey",
        offset_of!(QpAttr, qkey),
        field_size!(QpAttr, qkey),
    ));
    out.push((
        "ibv_qp_attr",
        "rq_psn",
        offset_of!(QpAttr, rq_psn),
        field_size!(QpAttr, rq_psn),
    ));
    out.push((
        "ibv_qp_attr",
        "sq_psn",
        offset_of!(QpAttr, sq_psn),
        field_size!(QpAttr, sq_psn),
    ));
    out.push((
        "ibv_qp_attr",
        "dest_qp_num",
        offset_of!(QpAttr, dest_qp_num),
        field_size!(QpAttr, dest_qp_num),
    ));
    out.push((
        "ibv_qp_attr",
        "qp_access_flags",
        offset_of!(QpAttr, qp_access_flags),
        field_size!(QpAttr, qp_access_flags),
    ));
    out.push((
        "ibv_qp_attr",
        "cap",
        offset_of!(QpAttr, cap),
        field_size!(QpAttr, cap),
    ));
    out.push((
        "ibv_qp_attr",
        "ah_attr",
        offset_of!(QpAttr, ah_attr),
        field_size!(QpAttr, ah_attr),
    ));
    out.push((
        "ibv_qp_attr",
        "alt_ah_attr",
        offset_of!(QpAttr, alt_ah_attr),
        field_size!(QpAttr, alt_ah_attr),
    ));
    out.push((
        "ibv_qp_attr",
        "pkey_index",
        offset_of!(QpAttr, pkey_index),
        field_size!(QpAttr, pkey_index),
    ));
    out.push((
        "ibv_qp_attr",
        "alt_pkey_index",
        offset_of!(QpAttr, alt_pkey_index),
        field_size!(QpAttr, alt_pkey_index),
    ));
    out.push((
        "ibv_qp_attr",
        "en_sqd_async_notify",
        offset_of!(QpAttr, en_sqd_async_notify),
        field_size!(QpAttr, en_sqd_async_notify),
    ));
    out.push((
        "ibv_qp_attr",
        "sq_draining",
        offset_of!(QpAttr, sq_draining),
        field_size!(QpAttr, sq_draining),
    ));
    out.push((
        "ibv_qp_attr",
        "max_rd_atomic",
        offset_of!(QpAttr, max_rd_atomic),
        field_size!(QpAttr, max_rd_atomic),
    ));
    out.push((
        "ibv_qp_attr",
        "max_dest_rd_atomic",
        offset_of!(QpAttr, max_dest_rd_atomic),
        field_size!(QpAttr, max_dest_rd_atomic),
    ));
    out.push((
        "ibv_qp_attr",
        "min_rnr_timer",
        offset_of!(QpAttr, min_rnr_timer),
        field_size!(QpAttr, min_rnr_timer),
    ));
    out.push((
        "ibv_qp_attr",
        "port_num",
        offset_of!(QpAttr, port_num),
        field_size!(QpAttr, port_num),
    ));
    out.push((
        "ibv_qp_attr",
        "timeout",
        offset_of!(QpAttr, timeout),
        field_size!(QpAttr, timeout),
    ));
    out.push((
        "ibv_qp_attr",
        "retry_cnt",
        offset_of!(QpAttr, retry_cnt),
        field_size!(QpAttr, retry_cnt),
    ));
    out.push((
        "ibv_qp_attr",
        "rnr_retry",
        offset_of!(QpAttr, rnr_retry),
        field_size!(QpAttr, rnr_retry),
    ));
    out.push((
        "ibv_qp_attr",
        "alt_port_num",
        offset_of!(QpAttr, alt_port_num),
        field_size!(QpAttr, alt_port_num),
    ));
    out.push((
        "ibv_qp_attr",
        "alt_timeout",
        offset_of!(QpAttr, alt_timeout),
        field_size!(QpAttr, alt_timeout),
    ));
    out.push((
        "ibv_qp_attr",
        "rate_limit",
        offset_of!(QpAttr, rate_limit),
        field_size!(QpAttr, rate_limit),
    ));
    out.push(("ibv_mr", "SIZE", size_of::<MrRaw>(), 0));
    out.push((
        "ibv_mr",
        "context",
        offset_of!(MrRaw, context),
        field_size!(MrRaw, context),
    ));
    out.push((
        "ibv_mr",
        "pd",
        offset_of!(MrRaw, pd),
        field_size!(MrRaw, pd),
    ));
    out.push((
        "ibv_mr",
        "addr",
        offset_of!(MrRaw, addr),
        field_size!(MrRaw, addr),
    ));
    out.push((
        "ibv_mr",
        "length",
        offset_of!(MrRaw, length),
        field_size!(MrRaw, length),
    ));
    out.push((
        "ibv_mr",
        "handle",
        offset_of!(MrRaw, handle),
        field_size!(MrRaw, handle),
    ));
    out.push((
        "ibv_mr",
        "lkey",
        offset_of!(MrRaw, lkey),
        field_size!(MrRaw, lkey),
    ));
    out.push((
        "ibv_mr",
        "rkey",
        offset_of!(MrRaw, rkey),
        field_size!(MrRaw, rkey),
    ));
    out.push((
        "ibv_qp",
        "context",
        offset_of!(QpRaw, context),
        field_size!(QpRaw, context),
    ));
    out.push((
        "ibv_qp",
        "qp_context",
        offset_of!(QpRaw, qp_context),
        field_size!(QpRaw, qp_context),
    ));
    out.push((
        "ibv_qp",
        "pd",
        offset_of!(QpRaw, pd),
        field_size!(QpRaw, pd),
    ));
    out.push((
        "ibv_qp",
        "send_cq",
        offset_of!(QpRaw, send_cq),
        field_size!(QpRaw, send_cq),
    ));
    out.push((
        "ibv_qp",
        "recv_cq",
        offset_of!(QpRaw, recv_cq),
        field_size!(QpRaw, recv_cq),
    ));
    out.push((
        "ibv_qp",
        "srq",
        offset_of!(QpRaw, srq),
        field_size!(QpRaw, srq),
    ));
    out.push((
        "ibv_qp",
        "handle",
        offset_of!(QpRaw, handle),
        field_size!(QpRaw, handle),
    ));
    out.push((
        "ibv_qp",
        "qp_num",
        offset_of!(QpRaw, qp_num),
        field_size!(QpRaw, qp_num),
    ));
    out.push((
        "ibv_qp",
        "state",
        offset_of!(QpRaw, state),
        field_size!(QpRaw, state),
    ));
    out.push((
        "ibv_qp",
        "qp_type",
        offset_of!(QpRaw, qp_type),
        field_size!(QpRaw, qp_type),
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
