//! The verbs boundary on the CPU, through the emulated provider only (the calls a ConnectX would
//! receive): ranks trade endpoints over the bootstrap and bring their queue pairs to RTS, then
//! move bytes with `ibv_post_send` and `ibv_poll_cq`; and every refusal a ConnectX makes:
//! transitions out of order or missing attributes, MTU and GID mismatches between the ends,
//! regions or QPs without the remote access an operation needs, READs beyond
//! `max_dest_rd_atomic`.

use doorbell::job::bootstrap::{Bootstrap, BootstrapConfig};
use doorbell::job::launch::free_port;
use doorbell::transport::ib::boundary::provider::{
    access, mask, mtu_code, wc_status, Memory, Provider, QpId, QpState, SendWr, WorkCompletion,
};
use doorbell::transport::ib::boundary::verbs::{LinkLayer, QpAttr};
use doorbell::transport::ib::emulated::nic::{Delivery, EmulatedNic, HostDma};
use doorbell::transport::ib::emulated::{Emulated, Fabric, PortConfig};
use doorbell::transport::ib::posting::conn::{
    connect_peers, exchange_regions, ConnectedQp, Endpoint, IbDevice, QueuePair, Registration,
};
use doorbell::transport::ib::posting::wqe::Op;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Host memory the NICs read and write, 8-aligned.
struct Host(Box<[u64]>);

impl Host {
    fn new(bytes: usize) -> Host {
        Host(vec![0u64; bytes / 8].into_boxed_slice())
    }
    fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
    fn bytes(&self) -> usize {
        self.0.len() * 8
    }
    fn word(&self, i: usize) -> u64 {
        // SAFETY: in bounds; the NIC writes it concurrently, hence volatile.
        unsafe { std::ptr::read_volatile(self.0.as_ptr().add(i)) }
    }
}

fn tag() -> String {
    format!(
        "test-{}-{:x}",
        std::process::id(),
        Instant::now().elapsed().as_nanos() ^ rand_u64()
    )
}

fn rand_u64() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(7);
    u128::from(h.finish())
}

fn nic(id: u32, fabric: &Fabric, config: PortConfig) -> Arc<IbDevice> {
    // SAFETY: every region registered below is host memory of this test that outlives its NIC
    // (the tests drop devices before buffers).
    let dma = Box::new(unsafe { HostDma::new() });
    let nic = Arc::new(EmulatedNic::start_for_rank(dma, Delivery::Strict, id as usize).unwrap());
    let provider: Arc<dyn Provider> =
        Arc::new(Emulated::new(nic, id, fabric.clone(), config).unwrap());
    IbDevice::open(provider, 1, None).unwrap()
}

fn register(dev: &Arc<IbDevice>, buf: &Host, flags: u32) -> Registration {
    // SAFETY: `buf` outlives the registration in every test.
    unsafe { dev.register(buf.addr(), buf.bytes(), flags, Memory::Host) }.unwrap()
}

/// Polls `qp` until `n` completions arrived (10 s at most).
fn completions(qp: &ConnectedQp, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < n {
        qp.poll_cq(n - out.len(), &mut out).unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{} of {n} completions",
            out.len()
        );
        std::thread::yield_now();
    }
    out
}

fn write(wr_id: u64, to: (u64, u32), from: (u64, u32), len: u32) -> SendWr {
    SendWr {
        wr_id,
        op: Op::Write {
            raddr: to.0,
            rkey: to.1,
            laddr: from.0,
            lkey: from.1,
            len,
        },
        signaled: true,
    }
}

fn read(wr_id: u64, from: (u64, u32), to: (u64, u32), len: u32) -> SendWr {
    SendWr {
        wr_id,
        op: Op::Read {
            raddr: from.0,
            rkey: from.1,
            laddr: to.0,
            lkey: to.1,
            len,
        },
        signaled: true,
    }
}

/// Two QPs of two NICs, connected to each other with the usual attributes.
fn pair(a: &Arc<IbDevice>, b: &Arc<IbDevice>) -> (ConnectedQp, ConnectedQp) {
    let (qa, qb) = (a.create_qp(64).unwrap(), b.create_qp(64).unwrap());
    let (ea, eb) = (qa.endpoint(), qb.endpoint());
    (qa.connect(&eb).unwrap(), qb.connect(&ea).unwrap())
}

#[test]
fn ranks_connect_over_the_bootstrap_and_write_read_and_add() {
    const RANKS: usize = 3;
    const PER_PEER: usize = 2;
    let port = free_port().unwrap();
    let fabric = Fabric::for_job(&tag()).unwrap();
    std::thread::scope(|s| {
        for rank in 0..RANKS {
            let fabric = fabric.clone();
            s.spawn(move || {
                let b = Bootstrap::connect(BootstrapConfig {
                    rank,
                    world_size: RANKS,
                    local_rank: rank,
                    local_world_size: RANKS,
                    master_addr: "127.0.0.1".into(),
                    master_port: port,
                    secret: format!("verbs-{port}").into_bytes(),
                    timeout: Duration::from_secs(30),
                    heartbeat: Duration::from_secs(5),
                })
                .unwrap();
                // Slot p of `inbox` receives rank p's write; word 63 counts fetch-adds.
                let inbox = Host::new(64 * 8);
                let outbox = Host::new(4096);
                let dev = nic(rank as u32 + 1, &fabric, PortConfig::default());
                let inbox_mr = register(
                    &dev,
                    &inbox,
                    access::LOCAL_WRITE
                        | access::REMOTE_WRITE
                        | access::REMOTE_READ
                        | access::REMOTE_ATOMIC,
                );
                let out_mr = register(&dev, &outbox, access::LOCAL_WRITE);
                let regions = exchange_regions(&b, Some(&inbox_mr)).unwrap();
                let peers: Vec<usize> = (0..RANKS).filter(|&p| p != rank).collect();
                let qps = connect_peers(&b, &dev, &peers, PER_PEER, 64).unwrap();
                for (i, &p) in peers.iter().enumerate() {
                    assert_eq!(qps[i].len(), PER_PEER);
                    let r = regions[p].expect("every rank shares its inbox");
                    // This process reaches the peer's memory at its own address (threads).
                    dev.provider()
                        .attach_remote(r.rkey, r.addr, r.len, r.addr)
                        .unwrap();
                }
                b.barrier().unwrap();
                for (i, &p) in peers.iter().enumerate() {
                    let r = regions[p].unwrap();
                    // SAFETY: this thread's own buffer, before the NIC reads it.
                    unsafe {
                        (outbox.addr() as *mut u64)
                            .add(i)
                            .write_volatile(0xab00 + rank as u64)
                    };
                    let qp = &qps[i][i % PER_PEER];
                    qp.post_send(&[
                        write(
                            1,
                            (r.addr + 8 * rank as u64, r.rkey),
                            (outbox.addr() + 8 * i as u64, out_mr.lkey()),
                            8,
                        ),
                        SendWr {
                            wr_id: 2,
                            op: Op::FetchAdd {
                                raddr: r.addr + 8 * 63,
                                rkey: r.rkey,
                                add: 1,
                                result: outbox.addr() + 2048 + 8 * i as u64,
                                lkey: out_mr.lkey(),
                            },
                            signaled: true,
                        },
                        read(
                            3,
                            (r.addr + 8 * rank as u64, r.rkey),
                            (outbox.addr() + 1024 + 8 * i as u64, out_mr.lkey()),
                            8,
                        ),
                    ])
                    .unwrap();
                    let done = completions(qp, 3);
                    assert!(
                        done.iter().all(|c| c.status == wc_status::SUCCESS),
                        "rank {rank} -> {p}: {done:?}"
                    );
                    assert_eq!(done.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [1, 2, 3]);
                    // The READ came back with what the WRITE put there.
                    // SAFETY: the READ completed.
                    let back = unsafe {
                        std::ptr::read_volatile((outbox.addr() + 1024 + 8 * i as u64) as *const u64)
                    };
                    assert_eq!(back, 0xab00 + rank as u64);
                }
                b.barrier().unwrap();
                for p in peers {
                    assert_eq!(inbox.word(p), 0xab00 + p as u64, "rank {rank}: from {p}");
                }
                assert_eq!(
                    inbox.word(63),
                    (RANKS - 1) as u64,
                    "rank {rank}: fetch-adds"
                );
                b.barrier().unwrap();
                drop(qps);
                drop((inbox_mr, out_mr));
                drop(dev);
            });
        }
    });
}

fn attr(state: QpState) -> QpAttr {
    QpAttr {
        qp_state: state as u32,
        port_num: 1,
        qp_access_flags: access::REMOTE_WRITE,
        path_mtu: 5,
        max_dest_rd_atomic: 4,
        max_rd_atomic: 4,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        min_rnr_timer: 12,
        ..Default::default()
    }
}

fn refusal(r: doorbell::Result<()>) -> String {
    match r {
        Err(e) => e.to_string(),
        Ok(()) => panic!("the emulated NIC accepted it"),
    }
}

#[test]
fn transitions_out_of_order_or_missing_attributes_are_refused() {
    let fabric = Fabric::for_job(&tag()).unwrap();
    let dev = nic(1, &fabric, PortConfig::default());
    let p = dev.provider().clone();
    let q = dev.create_qp(16).unwrap();
    let remote = Endpoint {
        qpn: 0x42,
        psn: 1,
        lid: 0,
        gid: dev.gid().bytes,
        mtu: 5,
    };
    // RESET -> RTR skips INIT.
    let e = {
        let mut rtr = attr(QpState::Rtr);
        rtr.ah_attr.is_global = 1;
        rtr.ah_attr.grh.dgid = remote.gid;
        rtr.ah_attr.grh.sgid_index = dev.gid().index as u8;
        refusal(modify(&p, q.id(), &rtr, mask::TO_RTR))
    };
    assert!(e.contains("Reset -> Rtr is not a transition"), "{e}");
    // INIT without the port.
    let e = refusal(modify(
        &p,
        q.id(),
        &attr(QpState::Init),
        mask::TO_INIT & !mask::PORT,
    ));
    assert!(e.contains("needs IBV_QP_PORT"), "{e}");
    // A port that does not exist.
    let mut bad_port = attr(QpState::Init);
    bad_port.port_num = 2;
    let e = refusal(modify(&p, q.id(), &bad_port, mask::TO_INIT));
    assert!(e.contains("port 2 does not exist"), "{e}");
    modify(&p, q.id(), &attr(QpState::Init), mask::TO_INIT).unwrap();
    // RTR without the path MTU and the remote QPN.
    let mut rtr = attr(QpState::Rtr);
    rtr.ah_attr.is_global = 1;
    rtr.ah_attr.grh.dgid = remote.gid;
    rtr.ah_attr.grh.sgid_index = dev.gid().index as u8;
    rtr.dest_qp_num = remote.qpn;
    let e = refusal(modify(
        &p,
        q.id(),
        &rtr,
        mask::TO_RTR & !(mask::PATH_MTU | mask::DEST_QPN),
    ));
    assert!(
        e.contains("IBV_QP_PATH_MTU") && e.contains("IBV_QP_DEST_QPN"),
        "{e}"
    );
    // No GRH on a RoCE port.
    let mut no_grh = rtr;
    no_grh.ah_attr.is_global = 0;
    let e = refusal(modify(&p, q.id(), &no_grh, mask::TO_RTR));
    assert!(e.contains("needs a GRH"), "{e}");
    // A source GID index past the table.
    let mut bad_gid = rtr;
    bad_gid.ah_attr.grh.sgid_index = 9;
    let e = refusal(modify(&p, q.id(), &bad_gid, mask::TO_RTR));
    assert!(e.contains("GID index 9"), "{e}");
    // More outstanding READs than the device takes.
    let mut greedy = rtr;
    greedy.max_dest_rd_atomic = 17;
    let e = refusal(modify(&p, q.id(), &greedy, mask::TO_RTR));
    assert!(e.contains("max_dest_rd_atomic 17"), "{e}");
    // Posting before RTS.
    // A QP in INIT taken for connected: the NIC refuses the post.
    let q = q.assume_connected();
    let e = refusal(q.post_send(&[SendWr {
        wr_id: 0,
        op: Op::Nop,
        signaled: true,
    }]));
    assert!(e.contains("not RTS"), "{e}");
    modify(&p, q.id(), &rtr, mask::TO_RTR).unwrap();
    // RTS without the send PSN; then RTS -> INIT backwards.
    let e = refusal(modify(
        &p,
        q.id(),
        &attr(QpState::Rts),
        mask::TO_RTS & !mask::SQ_PSN,
    ));
    assert!(e.contains("IBV_QP_SQ_PSN"), "{e}");
    modify(&p, q.id(), &attr(QpState::Rts), mask::TO_RTS).unwrap();
    let e = refusal(modify(&p, q.id(), &attr(QpState::Init), mask::TO_INIT));
    assert!(e.contains("Rts -> Init is not a transition"), "{e}");
    // Any state -> RESET is allowed, and starts over.
    modify(
        &p,
        q.id(),
        &QpAttr {
            qp_state: QpState::Reset as u32,
            ..Default::default()
        },
        mask::STATE,
    )
    .unwrap();
    modify(&p, q.id(), &attr(QpState::Init), mask::TO_INIT).unwrap();
}

/// `ibv_modify_qp` on `qp` through its provider.
fn modify(p: &Arc<dyn Provider>, qp: QpId, a: &QpAttr, m: u32) -> doorbell::Result<()> {
    p.modify_qp(qp, a, m)
}

#[test]
fn a_path_mtu_above_the_port_is_refused_and_mismatched_ends_never_answer() {
    let fabric = Fabric::for_job(&tag()).unwrap();
    let small = PortConfig {
        mtu: 1024,
        link_layer: LinkLayer::Ethernet,
    };
    let (a, b) = (
        nic(1, &fabric, PortConfig::default()),
        nic(2, &fabric, small),
    );
    let (buf_a, buf_b) = (Host::new(4096), Host::new(4096));
    let (mr_a, mr_b) = (
        register(&a, &buf_a, access::ALL),
        register(&b, &buf_b, access::ALL),
    );
    a.provider()
        .attach_remote(mr_b.rkey(), buf_b.addr(), 4096, buf_b.addr())
        .unwrap();

    // The usual connection takes the smaller MTU on both ends and works.
    let (qa, _qb) = pair(&a, &b);
    qa.post_send(&[write(
        7,
        (buf_b.addr(), mr_b.rkey()),
        (buf_a.addr(), mr_a.lkey()),
        64,
    )])
    .unwrap();
    assert_eq!(completions(&qa, 1)[0].status, wc_status::SUCCESS);

    // b cannot take 4096 at all.
    let qb = b.create_qp(16).unwrap();
    let mut ea = a.create_qp(16).unwrap().endpoint();
    ea.mtu = mtu_code(4096);
    let mut init = attr(QpState::Init);
    init.qp_access_flags = access::ALL;
    let p = b.provider().clone();
    modify(&p, qb.id(), &init, mask::TO_INIT).unwrap();
    let mut rtr = attr(QpState::Rtr);
    rtr.path_mtu = mtu_code(4096);
    rtr.dest_qp_num = ea.qpn;
    rtr.ah_attr.is_global = 1;
    rtr.ah_attr.grh.dgid = ea.gid;
    rtr.ah_attr.grh.sgid_index = b.gid().index as u8;
    let e = refusal(modify(&p, qb.id(), &rtr, mask::TO_RTR));
    assert!(
        e.contains("path MTU 4096 above the port's active MTU 1024"),
        "{e}"
    );

    // Ends that disagree: a at 2048, b at 1024 (both valid for their ports).
    let (qa2, qb2) = (a.create_qp(16).unwrap(), b.create_qp(16).unwrap());
    let (mut ea2, eb2) = (qa2.endpoint(), qb2.endpoint());
    let mut eb2_big = eb2;
    eb2_big.mtu = mtu_code(2048);
    let qa2 = qa2.connect(&eb2_big).unwrap();
    ea2.mtu = mtu_code(1024);
    let _qb2 = qb2.connect(&ea2).unwrap(); // kept: the far end
    qa2.post_send(&[write(
        8,
        (buf_b.addr(), mr_b.rkey()),
        (buf_a.addr(), mr_a.lkey()),
        64,
    )])
    .unwrap();
    let c = completions(&qa2, 1)[0];
    assert_eq!(c.status, wc_status::RETRY_EXC_ERR, "{c:?}");
    assert_eq!(c.vendor_err & 0x7f, 0x15);
    assert!(
        a.provider()
            .faults()
            .iter()
            .any(|f| f.contains("path MTU 2048 here, 1024")),
        "{:?}",
        a.provider().faults()
    );

    // A GID that is not the far end's.
    let (qa3, qb3) = (a.create_qp(16).unwrap(), b.create_qp(16).unwrap());
    let (ea3, mut eb3) = (qa3.endpoint(), qb3.endpoint());
    eb3.gid[15] ^= 0xff;
    let qa3 = qa3.connect(&eb3).unwrap();
    let _qb3 = qb3.connect(&ea3).unwrap(); // kept: the far end
    qa3.post_send(&[write(
        9,
        (buf_b.addr(), mr_b.rkey()),
        (buf_a.addr(), mr_a.lkey()),
        8,
    )])
    .unwrap();
    assert_eq!(completions(&qa3, 1)[0].status, wc_status::RETRY_EXC_ERR);

    // A far end connected to someone else.
    let (qa4, qb4) = (a.create_qp(16).unwrap(), b.create_qp(16).unwrap());
    let qa4 = qa4.connect(&qb4.endpoint()).unwrap();
    qa4.post_send(&[write(
        10,
        (buf_b.addr(), mr_b.rkey()),
        (buf_a.addr(), mr_a.lkey()),
        8,
    )])
    .unwrap();
    assert_eq!(completions(&qa4, 1)[0].status, wc_status::RETRY_EXC_ERR);
}

#[test]
fn operations_without_the_matching_remote_access_fail_with_a_remote_access_error() {
    let fabric = Fabric::for_job(&tag()).unwrap();
    let (a, b) = (
        nic(1, &fabric, PortConfig::default()),
        nic(2, &fabric, PortConfig::default()),
    );
    let local = Host::new(4096);
    let mr_local = register(&a, &local, access::LOCAL_WRITE);
    let cases = [
        (
            "WRITE",
            access::LOCAL_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
        ),
        (
            "READ",
            access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_ATOMIC,
        ),
        (
            "atomic",
            access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ,
        ),
    ];
    for (what, flags) in cases {
        let target = Host::new(4096);
        let mr = register(&b, &target, flags);
        a.provider()
            .attach_remote(mr.rkey(), target.addr(), 4096, target.addr())
            .unwrap();
        let (qa, _qb) = pair(&a, &b);
        let (r, l) = ((target.addr(), mr.rkey()), (local.addr(), mr_local.lkey()));
        let wr = match what {
            "WRITE" => write(1, r, l, 8),
            "READ" => read(1, r, l, 8),
            _ => SendWr {
                wr_id: 1,
                op: Op::FetchAdd {
                    raddr: r.0,
                    rkey: r.1,
                    add: 1,
                    result: l.0,
                    lkey: l.1,
                },
                signaled: true,
            },
        };
        // The other two operations work on this region, the missing one does not.
        qa.post_send(&[wr]).unwrap();
        let c = completions(&qa, 1)[0];
        assert_eq!(c.status, wc_status::REM_ACCESS_ERR, "{what}: {c:?}");
        drop(qa);
        drop(mr);
    }
    // A READ into a local region without local write: local protection error.
    let ro = Host::new(4096);
    let mr_ro = register(&a, &ro, 0);
    let target = Host::new(4096);
    let mr_t = register(&b, &target, access::ALL);
    a.provider()
        .attach_remote(mr_t.rkey(), target.addr(), 4096, target.addr())
        .unwrap();
    let (qa, _qb) = pair(&a, &b);
    qa.post_send(&[read(
        1,
        (target.addr(), mr_t.rkey()),
        (ro.addr(), mr_ro.lkey()),
        8,
    )])
    .unwrap();
    assert_eq!(completions(&qa, 1)[0].status, wc_status::LOC_PROT_ERR);
    // Registering remote write without local write is refused at registration.
    // SAFETY: `ro` outlives the (refused) registration.
    let e = unsafe { a.register(ro.addr(), 4096, access::REMOTE_WRITE, Memory::Host) }
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("without IBV_ACCESS_LOCAL_WRITE"), "{e}");
    // A QP that did not grant remote READ at INIT refuses READs even on an open region.
    let (qa2, qb2) = (a.create_qp(16).unwrap(), b.create_qp(16).unwrap());
    let p = b.provider().clone();
    let ea = qa2.endpoint();
    let mut init = attr(QpState::Init);
    init.qp_access_flags = access::LOCAL_WRITE | access::REMOTE_WRITE;
    modify(&p, qb2.id(), &init, mask::TO_INIT).unwrap();
    let mut rtr = attr(QpState::Rtr);
    rtr.dest_qp_num = ea.qpn;
    rtr.rq_psn = ea.psn;
    rtr.ah_attr.is_global = 1;
    rtr.ah_attr.grh.dgid = ea.gid;
    rtr.ah_attr.grh.sgid_index = b.gid().index as u8;
    modify(&p, qb2.id(), &rtr, mask::TO_RTR).unwrap();
    let qa2 = qa2.connect(&qb2.endpoint()).unwrap();
    let scratch = Host::new(4096);
    let mr_s = register(&a, &scratch, access::LOCAL_WRITE);
    qa2.post_send(&[read(
        2,
        (target.addr(), mr_t.rkey()),
        (scratch.addr(), mr_s.lkey()),
        8,
    )])
    .unwrap();
    assert_eq!(completions(&qa2, 1)[0].status, wc_status::REM_ACCESS_ERR);
}

#[test]
fn reads_beyond_max_dest_rd_atomic_are_a_remote_invalid_request() {
    let fabric = Fabric::for_job(&tag()).unwrap();
    let (a, b) = (
        nic(1, &fabric, PortConfig::default()),
        nic(2, &fabric, PortConfig::default()),
    );
    let (src, dst) = (Host::new(4096), Host::new(4096));
    let mr_src = register(&b, &src, access::ALL);
    let mr_dst = register(&a, &dst, access::LOCAL_WRITE);
    a.provider()
        .attach_remote(mr_src.rkey(), src.addr(), 4096, src.addr())
        .unwrap();
    // b accepts 2 outstanding READs; a keeps `max_rd_atomic` outstanding.
    let run = |max_rd_atomic: u8| -> Vec<u32> {
        let (qa, qb) = (a.create_qp(16).unwrap(), b.create_qp(16).unwrap());
        let ea = qa.endpoint();
        let p = b.provider().clone();
        let mut init = attr(QpState::Init);
        init.qp_access_flags = access::ALL;
        modify(&p, qb.id(), &init, mask::TO_INIT).unwrap();
        let mut rtr = attr(QpState::Rtr);
        rtr.max_dest_rd_atomic = 2;
        rtr.dest_qp_num = ea.qpn;
        rtr.ah_attr.is_global = 1;
        rtr.ah_attr.grh.dgid = ea.gid;
        rtr.ah_attr.grh.sgid_index = b.gid().index as u8;
        modify(&p, qb.id(), &rtr, mask::TO_RTR).unwrap();
        let pa = a.provider().clone();
        let eb = qb.endpoint();
        let mut init = attr(QpState::Init);
        init.qp_access_flags = access::ALL;
        modify(&pa, qa.id(), &init, mask::TO_INIT).unwrap();
        let mut rtr = attr(QpState::Rtr);
        rtr.dest_qp_num = eb.qpn;
        rtr.ah_attr.is_global = 1;
        rtr.ah_attr.grh.dgid = eb.gid;
        rtr.ah_attr.grh.sgid_index = a.gid().index as u8;
        modify(&pa, qa.id(), &rtr, mask::TO_RTR).unwrap();
        let mut rts = attr(QpState::Rts);
        rts.max_rd_atomic = max_rd_atomic;
        modify(&pa, qa.id(), &rts, mask::TO_RTS).unwrap();
        let wrs: Vec<SendWr> = (0..4)
            .map(|i| {
                read(
                    i,
                    (src.addr() + 8 * i, mr_src.rkey()),
                    (dst.addr() + 8 * i, mr_dst.lkey()),
                    8,
                )
            })
            .collect();
        let qa = qa.assume_connected();
        qa.post_send(&wrs).unwrap();
        completions(&qa, 4).iter().map(|c| c.status).collect()
    };
    // Keeping 2 outstanding fits; 4 at once overruns the responder at the third.
    assert_eq!(run(2), [wc_status::SUCCESS; 4]);
    let over = run(4);
    assert_eq!(&over[..2], [wc_status::SUCCESS; 2]);
    assert_eq!(over[2], wc_status::REM_INV_REQ_ERR, "{over:?}");
    assert_eq!(over[3], wc_status::WR_FLUSH_ERR, "{over:?}");
}

/// The rdma-core provider where there is no NIC (CI, the GPU machines here): opening the NIC
/// nearest a GPU fails with the reason, which the communicator logs before taking Ethernet.
#[test]
fn the_rdma_core_provider_says_why_it_cannot_open_a_nic() {
    use doorbell::transport::ib::boundary::rdma_core::RdmaCore;
    match RdmaCore::open_nearest("0000:1b:00.0", None) {
        Ok((nic, choice)) => {
            // A machine with a NIC: it opened the one it chose.
            assert_eq!(nic.device_name(), choice.name);
        }
        Err(e) => {
            let why = e.to_string();
            assert!(
                why.contains("libibverbs") || why.contains("RDMA"),
                "an unhelpful reason: {why}"
            );
        }
    }
}

/// QP numbers stay unique among live queue pairs however many were made and destroyed before
/// (the emulated fabric's records are named by them).
#[test]
fn queue_pair_numbers_stay_unique_across_many_creations() {
    let fabric = Fabric::for_job(&tag()).unwrap();
    let dev = nic(3, &fabric, PortConfig::default());
    let keep: Vec<QueuePair> = (0..100).map(|_| dev.create_qp(4).unwrap()).collect();
    let mut seen: std::collections::HashSet<u32> = keep.iter().map(|q| q.qpn()).collect();
    assert_eq!(seen.len(), 100);
    for _ in 0..5000 {
        let q = dev.create_qp(4).unwrap();
        assert!(
            seen.insert(q.qpn()),
            "QP number {:#x} reused while live",
            q.qpn()
        );
        seen.remove(&q.qpn());
    }
    assert!(keep.iter().all(|q| q.qpn() >> 12 == 3));
}

/// Which posting mode the emulated provider gets: the proxy writing mlx5 WQEs unless forced;
/// every forced mode is taken (it is an mlx5 NIC).
#[test]
fn posting_modes_on_the_emulated_provider() {
    use doorbell::job::config::IbPosting;
    use doorbell::transport::ib::posting::select::{posting_for, Platform, PostingMode};
    let fabric = Fabric::for_job(&tag()).unwrap();
    let dev = nic(4, &fabric, PortConfig::default());
    let p = dev.provider().as_ref();
    let plat = Platform::default();
    for (forced, want) in [
        (IbPosting::Auto, PostingMode::ProxyMlx5),
        (IbPosting::Proxy, PostingMode::ProxyMlx5),
        (IbPosting::Verbs, PostingMode::VerbsProxy),
        (IbPosting::Ibgda, PostingMode::Ibgda),
        (IbPosting::CpuAssisted, PostingMode::CpuAssisted),
    ] {
        let (mode, why) = posting_for(p, &plat, forced);
        assert_eq!(mode, want, "{forced:?}: {why}");
        assert!(!why.is_empty());
    }
}

/// Fabrics nothing has written for a while (a killed job's) are swept; live ones stay.
#[test]
fn stale_fabrics_are_swept() {
    let root = std::env::temp_dir().join(format!("doorbell-sweep-test-{}", std::process::id()));
    let stale = root.join("doorbell-emulated-fabric-old");
    let live = root.join("doorbell-emulated-fabric-new");
    let other = root.join("something-else");
    for d in [&stale, &live, &other] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("qp-1"), "qpn=1\n").unwrap();
    }
    std::thread::sleep(Duration::from_millis(1100));
    std::fs::write(live.join("qp-2"), "qpn=2\n").unwrap();
    Fabric::sweep(&root, Duration::from_millis(1000));
    assert!(!stale.exists(), "the stale fabric stays");
    assert!(
        live.exists() && other.exists(),
        "a live fabric or another directory went"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
