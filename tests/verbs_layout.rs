//! The rdma-core structs of the verbs boundary (`transport::ib::boundary::{verbs, rdma_core,
//! mlx5dv}`: bindgen's, generated into `boundary::sys`, and the few written by hand) against
//! `infiniband/verbs.h` and `infiniband/mlx5dv.h` as the C compiler lays them out (a C program
//! compiled here prints every field's offset and size; needs a C compiler and rdma-core's
//! headers: `apt install libibverbs-dev`, as `scripts/install-test-deps.sh` does), and loading
//! libibverbs at run time where it is installed. `scripts/regen-verbs.sh --check` checks that the
//! generated ones are what bindgen makes of the installed headers.

use doorbell::transport::ib::boundary::mlx5dv::{DvCq, DvObj, DvQp};
use doorbell::transport::ib::boundary::rdma_core::{
    SendWrRaw, Sge, WcRaw, CTX_POLL_CQ, CTX_POST_SEND,
};
use doorbell::transport::ib::boundary::verbs::{
    AhAttr, DeviceAttr, GidEntry, GlobalRoute, MrRaw, PortAttr, QpAttr, QpCap, QpInitAttr, QpRaw,
    Verbs,
};
use std::mem::{offset_of, size_of};

mod c_program;

/// The C program printing, for every row of [`ours`], the same row as rdma-core lays it out.
fn layout_c(rows: &[(&str, &str, usize, usize)]) -> String {
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\n\
         #include <infiniband/mlx5dv.h>\n\
         #define F(s, f) printf(\"%s %s %zu %zu\\n\", #s, #f, offsetof(struct s, f), \
         sizeof(((struct s*)0)->f));\nint main(void) {\n",
    );
    for (st, field, _, _) in rows {
        if *field == "SIZE" {
            c += &format!("  printf(\"{st} SIZE %zu 0\\n\", sizeof(struct {st}));\n");
        } else {
            c += &format!("  F({st}, {field})\n");
        }
    }
    c + "  return 0;\n}\n"
}

/// (struct, field, offset, size) as Rust lays the mirrors out; "SIZE" rows give the struct's
/// size, for mirrors of a whole struct (`head` mirrors cover its first fields only).
// The `unsafe` around measuring a member is needed only where the path crosses a union.
#[allow(unused_unsafe)]
fn ours() -> Vec<(&'static str, &'static str, usize, usize)> {
    macro_rules! fields {
        ($c:literal, $t:ty, $kind:ident, [$($f:ident),* $(,)?]) => {{
            // SAFETY: all-zero bytes are a valid value of these plain-old-data mirrors.
            let probe: $t = unsafe { std::mem::zeroed() };
            let mut v = Vec::new();
            if stringify!($kind) == "full" {
                v.push(($c, "SIZE", size_of::<$t>(), 0));
            }
            $(v.push(($c, stringify!($f), offset_of!($t, $f), std::mem::size_of_val(&probe.$f)));)*
            v
        }};
    }
    // Structs whose Rust field paths differ from C's (flattened, or bindgen's anonymous
    // members): (C field path, Rust field path).
    macro_rules! named {
        ($c:literal, $t:ty, [$($cf:literal => $($f:ident).+),* $(,)?]) => {{
            // SAFETY: as above; union members are only measured.
            let probe: $t = unsafe { std::mem::zeroed() };
            let mut v = vec![($c, "SIZE", size_of::<$t>(), 0)];
            $(
                // SAFETY: a zeroed value's member (of a union, for some), measured, not read.
                let size = unsafe { std::mem::size_of_val(&probe.$($f).+) };
                v.push(($c, $cf, offset_of!($t, $($f).+), size));
            )*
            v
        }};
    }
    [
        named!("ibv_send_wr", SendWrRaw, [
            "wr_id" => wr_id, "next" => next, "sg_list" => sg_list, "num_sge" => num_sge,
            "opcode" => opcode, "send_flags" => send_flags, "imm_data" => imm_data,
            "wr.rdma.remote_addr" => remote_addr, "wr.atomic.compare_add" => rkey_or_compare_add,
            "wr.atomic.swap" => swap, "wr.atomic.rkey" => atomic_rkey,
        ]),
        fields!("ibv_sge", Sge, full, [addr, length, lkey]),
        named!("ibv_wc", WcRaw, [
            "wr_id" => wr_id, "status" => status, "opcode" => opcode,
            "vendor_err" => vendor_err, "byte_len" => byte_len,
            "imm_data" => __bindgen_anon_1.imm_data, "qp_num" => qp_num, "src_qp" => src_qp,
            "wc_flags" => wc_flags, "pkey_index" => pkey_index, "slid" => slid, "sl" => sl,
            "dlid_path_bits" => dlid_path_bits,
        ]),
        // ibv_post_send / ibv_poll_cq are inline calls through the context's ops table.
        vec![
            ("ibv_context", "ops.poll_cq", CTX_POLL_CQ, 8),
            ("ibv_context", "ops.post_send", CTX_POST_SEND, 8),
        ],
        named!("mlx5dv_qp", DvQp, [
            "dbrec" => dbrec, "sq.buf" => sq.buf, "sq.wqe_cnt" => sq.wqe_cnt,
            "sq.stride" => sq.stride, "rq.buf" => rq.buf, "rq.wqe_cnt" => rq.wqe_cnt,
            "rq.stride" => rq.stride, "bf.reg" => bf.reg, "bf.size" => bf.size,
            "comp_mask" => comp_mask, "uar_mmap_offset" => uar_mmap_offset, "tirn" => tirn,
            "tisn" => tisn, "rqn" => rqn, "sqn" => sqn, "tir_icm_addr" => tir_icm_addr,
        ]),
        named!("mlx5dv_cq", DvCq, [
            "buf" => buf, "dbrec" => dbrec, "cqe_cnt" => cqe_cnt, "cqe_size" => cqe_size,
            "cq_uar" => cq_uar, "cqn" => cqn, "comp_mask" => comp_mask,
        ]),
        named!("mlx5dv_obj", DvObj, [
            "qp.in" => qp.in_, "qp.out" => qp.out, "cq.in" => cq.in_, "cq.out" => cq.out,
            "srq.in" => srq.in_, "srq.out" => srq.out, "rwq.in" => rwq.in_,
            "rwq.out" => rwq.out, "dm.in" => dm.in_, "dm.out" => dm.out, "ah.in" => ah.in_,
            "ah.out" => ah.out, "pd.in" => pd.in_, "pd.out" => pd.out,
        ]),
        fields!(
            "ibv_device_attr",
            DeviceAttr,
            full,
            [
                fw_ver,
                node_guid,
                sys_image_guid,
                max_mr_size,
                page_size_cap,
                vendor_id,
                vendor_part_id,
                hw_ver,
                max_qp,
                max_qp_wr,
                device_cap_flags,
                max_sge,
                max_sge_rd,
                max_cq,
                max_cqe,
                max_mr,
                max_pd,
                max_qp_rd_atom,
                max_ee_rd_atom,
                max_res_rd_atom,
                max_qp_init_rd_atom,
                max_ee_init_rd_atom,
                atomic_cap,
                max_ee,
                max_rdd,
                max_mw,
                max_raw_ipv6_qp,
                max_raw_ethy_qp,
                max_mcast_grp,
                max_mcast_qp_attach,
                max_total_mcast_qp_attach,
                max_ah,
                max_fmr,
                max_map_per_fmr,
                max_srq,
                max_srq_wr,
                max_srq_sge,
                max_pkeys,
                local_ca_ack_delay,
                phys_port_cnt
            ]
        ),
        fields!(
            "ibv_port_attr",
            PortAttr,
            full,
            [
                state,
                max_mtu,
                active_mtu,
                gid_tbl_len,
                port_cap_flags,
                max_msg_sz,
                bad_pkey_cntr,
                qkey_viol_cntr,
                pkey_tbl_len,
                lid,
                sm_lid,
                lmc,
                max_vl_num,
                sm_sl,
                subnet_timeout,
                init_type_reply,
                active_width,
                active_speed,
                phys_state,
                link_layer,
                flags,
                port_cap_flags2
            ]
        ),
        fields!(
            "ibv_gid_entry",
            GidEntry,
            full,
            [gid, gid_index, port_num, gid_type, ndev_ifindex]
        ),
        fields!(
            "ibv_qp_cap",
            QpCap,
            full,
            [
                max_send_wr,
                max_recv_wr,
                max_send_sge,
                max_recv_sge,
                max_inline_data
            ]
        ),
        fields!(
            "ibv_qp_init_attr",
            QpInitAttr,
            full,
            [qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all]
        ),
        fields!(
            "ibv_global_route",
            GlobalRoute,
            full,
            [dgid, flow_label, sgid_index, hop_limit, traffic_class]
        ),
        fields!(
            "ibv_ah_attr",
            AhAttr,
            full,
            [
                grh,
                dlid,
                sl,
                src_path_bits,
                static_rate,
                is_global,
                port_num
            ]
        ),
        fields!(
            "ibv_qp_attr",
            QpAttr,
            full,
            [
                qp_state,
                cur_qp_state,
                path_mtu,
                path_mig_state,
                qkey,
                rq_psn,
                sq_psn,
                dest_qp_num,
                qp_access_flags,
                cap,
                ah_attr,
                alt_ah_attr,
                pkey_index,
                alt_pkey_index,
                en_sqd_async_notify,
                sq_draining,
                max_rd_atomic,
                max_dest_rd_atomic,
                min_rnr_timer,
                port_num,
                timeout,
                retry_cnt,
                rnr_retry,
                alt_port_num,
                alt_timeout,
                rate_limit
            ]
        ),
        fields!(
            "ibv_mr",
            MrRaw,
            full,
            [context, pd, addr, length, handle, lkey, rkey]
        ),
        fields!(
            "ibv_qp",
            QpRaw,
            full,
            [
                context,
                qp_context,
                pd,
                send_cq,
                recv_cq,
                srq,
                handle,
                qp_num,
                state,
                qp_type,
                mutex,
                cond,
                events_completed
            ]
        ),
    ]
    .concat()
}

#[test]
fn verbs_struct_mirrors_match_rdma_core() {
    let theirs: Vec<(String, String, usize, usize)> =
        c_program::run("verbs-layout", &layout_c(&ours()), "-O0", "verbs.h")
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

/// Whether the dynamic loader knows `lib` (`ldconfig -p`); `None` where ldconfig cannot say.
fn loader_knows(lib: &str) -> Option<bool> {
    let out = std::process::Command::new("ldconfig")
        .arg("-p")
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).contains(lib))
}

/// The RDMA devices the kernel lists (`/sys/class/infiniband`), sorted; empty without any.
fn sysfs_devices() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| {
            d.filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Where the loader knows libibverbs (CI installs it), loading must work, and the devices it
/// lists must be the kernel's (`/sys/class/infiniband`); with none there, listing may instead
/// fail with the reason. Where the loader does not know it, the error says what to install.
#[test]
fn libibverbs_loads_at_run_time_or_says_what_to_install() {
    let installed = loader_knows("libibverbs.so.1");
    let v = match Verbs::load() {
        Ok(v) => v,
        Err(e) => {
            assert_ne!(
                installed,
                Some(true),
                "libibverbs.so.1 is installed but: {e}"
            );
            assert!(e.to_string().contains("libibverbs"), "{e}");
            return;
        }
    };
    assert_ne!(
        installed,
        Some(false),
        "loaded a libibverbs the loader does not know"
    );
    let kernel = sysfs_devices();
    match v.devices() {
        Ok(nics) => {
            let mut names: Vec<String> = nics.iter().map(|n| n.name.clone()).collect();
            names.sort();
            assert_eq!(
                names, kernel,
                "libibverbs' devices against /sys/class/infiniband"
            );
            eprintln!("{} RDMA device(s)", nics.len());
        }
        // A kernel without RDMA support (CI containers): reported, with the reason.
        Err(doorbell::Error::TransportUnavailable { why, .. }) => {
            assert!(kernel.is_empty(), "{kernel:?} in sysfs, but: {why}");
            assert!(why.contains("ibv_get_device_list"), "{why}");
            eprintln!("{why}");
        }
        Err(e) => panic!("{e}"),
    }
}

/// Opening an RDMA device through the rdma-core provider: the kernel's first device must open;
/// with none (this project's machines), opening mlx5_0 must fail with a reason naming it.
#[test]
fn the_rdma_core_provider_opens_or_says_why_not() {
    let Ok(verbs) = Verbs::load() else {
        return; // covered by the test above: the error says what to install
    };
    let verbs = std::sync::Arc::new(verbs);
    let kernel = sysfs_devices();
    let name = kernel.first().cloned().unwrap_or_else(|| "mlx5_0".into());
    match doorbell::transport::ib::boundary::rdma_core::RdmaCore::open(verbs, &name) {
        Ok(_) => {
            assert!(
                !kernel.is_empty(),
                "opened {name}, which the kernel does not list"
            );
            eprintln!("{name} opened");
        }
        Err(doorbell::Error::TransportUnavailable { why, .. }) => {
            assert!(
                kernel.is_empty(),
                "{name} is in /sys/class/infiniband, but: {why}"
            );
            assert!(
                why.contains(&name) || why.contains("ibv_get_device_list"),
                "{why}"
            );
            eprintln!("{why}");
        }
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}
