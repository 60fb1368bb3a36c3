//! The emulated mlx5 NIC driven from the CPU (no GPU): WQEs built by `rdma::wqe` go into a send
//! queue in host memory, the doorbell record and doorbell are written as a GPU or the CPU-assisted
//! thread writes them, and the CQEs the NIC writes are polled with mlx5's ownership rule. Covers
//! every opcode, write with immediate and receive credits (RNR stall), error CQEs and the flush
//! that follows, 16-bit index and ring wrap-around, a doorbell ahead of its record, and relaxed
//! delivery that only a READ (or idleness) makes visible.

use doorbell::transport::ib::emulated::nic::{
    Delivery, EmulatedNic, HostDma, QpRings, Responder, RingDma,
};
use doorbell::transport::ib::posting::cq::{self, Cqe, CQE_BYTES, EMPTY_OP_OWN};
use doorbell::transport::ib::posting::wqe::{
    doorbell_record, opcode, wqebbs, Op, CQ_UPDATE, WQEBB,
};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Zeroed host memory with a stable address.
struct Buf(Box<[u64]>);

impl Buf {
    fn new(bytes: usize) -> Buf {
        Buf(vec![0u64; bytes.div_ceil(8)].into_boxed_slice())
    }
    fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
    fn ptr(&self) -> *mut u8 {
        self.0.as_ptr() as *mut u8
    }
    fn len(&self) -> u64 {
        self.0.len() as u64 * 8
    }
    fn read(&self, off: usize, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        // SAFETY: in bounds; volatile-equivalent through a fence (the NIC thread writes it).
        fence(Ordering::Acquire);
        unsafe { std::ptr::copy(self.ptr().add(off), v.as_mut_ptr(), n) };
        v
    }
    fn write(&self, off: usize, data: &[u8]) {
        // SAFETY: in bounds.
        unsafe { std::ptr::copy(data.as_ptr(), self.ptr().add(off), data.len()) };
        fence(Ordering::Release);
    }
    fn u64_at(&self, off: usize) -> u64 {
        u64::from_ne_bytes(self.read(off, 8).try_into().unwrap())
    }
}

fn empty_cq(entries: usize) -> Buf {
    let b = Buf::new(entries * CQE_BYTES);
    for i in 0..entries {
        b.write(i * CQE_BYTES + 63, &[EMPTY_OP_OWN]);
    }
    b
}

/// One QP's memory and the poster's and poller's state; dropping it removes the QP from the NIC
/// before its memory goes.
struct Qp<'a> {
    nic: &'a EmulatedNic,
    qpn: u32,
    sq: Buf,
    depth: u64,
    dbr: Buf,
    db: Buf,
    cq: Buf,
    cq_entries: u64,
    cq_ci: Buf,
    pi: u64,
    polled: u64,
}

impl Drop for Qp<'_> {
    fn drop(&mut self) {
        self.nic.remove_qp(self.qpn);
    }
}

impl<'a> Qp<'a> {
    fn new(
        nic: &'a EmulatedNic,
        qpn: u32,
        depth: u64,
        cq_entries: u64,
        responder: Option<Responder>,
    ) -> Qp<'a> {
        Qp::with_ring_dma(nic, qpn, depth, cq_entries, responder, None)
    }

    /// A QP whose send queue and record the NIC reads through `ring_dma` (as it reads rings in
    /// GPU memory) instead of directly.
    fn with_ring_dma(
        nic: &'a EmulatedNic,
        qpn: u32,
        depth: u64,
        cq_entries: u64,
        responder: Option<Responder>,
        ring_dma: Option<RingDma>,
    ) -> Qp<'a> {
        let qp = Qp {
            nic,
            qpn,
            sq: Buf::new(depth as usize * WQEBB),
            depth,
            dbr: Buf::new(8),
            db: Buf::new(8),
            cq: empty_cq(cq_entries as usize),
            cq_entries,
            cq_ci: Buf::new(8),
            pi: 0,
            polled: 0,
        };
        let rings = QpRings {
            sq: qp.sq.ptr(),
            sq_wqebbs: depth,
            dbr: qp.dbr.ptr() as *const u32,
            doorbell: qp.db.ptr() as *const u64,
            cq: qp.cq.ptr(),
            cq_entries,
            cq_ci: qp.cq_ci.ptr() as *const u32,
            ring_dma,
        };
        // SAFETY: the buffers live in `qp`, whose drop removes the QP first.
        unsafe { nic.add_qp(qpn, rings, responder) }.unwrap();
        qp
    }

    /// Writes `op` at the producer index (wrapping), without ringing.
    fn post(&mut self, op: &Op, signaled: bool) -> u64 {
        let w = op
            .encode(
                self.pi as u16,
                self.qpn,
                if signaled { CQ_UPDATE } else { 0 },
            )
            .unwrap();
        let n = wqebbs(w.len());
        let mut padded = w;
        padded.resize(n as usize * WQEBB, 0);
        for (i, block) in padded.chunks(WQEBB).enumerate() {
            let slot = ((self.pi + i as u64) & (self.depth - 1)) as usize * WQEBB;
            self.sq.write(slot, block);
        }
        let at = self.pi;
        self.pi += n;
        at
    }

    /// The doorbell record, then the doorbell, as a GPU poster writes them.
    fn ring(&self) {
        self.ring_at(self.pi, self.pi);
    }

    fn ring_at(&self, record: u64, doorbell: u64) {
        self.dbr.write(0, &doorbell_record(record));
        let mut db = [0u8; 8];
        db[0..4].copy_from_slice(&(((doorbell & 0xffff) as u32) << 8).to_be_bytes());
        db[4..8].copy_from_slice(&(self.qpn << 8).to_be_bytes());
        // SAFETY: the doorbell word, one aligned 8-byte store.
        unsafe { std::ptr::write_volatile(self.db.ptr() as *mut u64, u64::from_ne_bytes(db)) };
    }

    /// The next CQE (bounded wait), publishing the consumer index.
    fn poll(&mut self) -> Cqe {
        let c = wait_cqe(&self.cq, self.cq_entries, self.polled);
        self.polled += 1;
        self.cq_ci
            .write(0, &((self.polled & 0xff_ffff) as u32).to_be_bytes());
        c
    }
}

/// Waits (bounded) for the consumer's `k`-th CQE as a real poller does: the word holding
/// `op_own` first, then (after an acquire fence) the rest.
fn wait_cqe(cq: &Buf, entries: u64, k: u64) -> Cqe {
    let at = (k % entries) as usize * CQE_BYTES;
    let start = Instant::now();
    loop {
        // SAFETY: an aligned word inside the CQ.
        let tail =
            unsafe { std::ptr::read_volatile(cq.ptr().add(at + 56) as *const u64) }.to_ne_bytes();
        if cq::is_ready(tail[7], k, entries) {
            fence(Ordering::Acquire);
            let mut b: [u8; CQE_BYTES] = cq.read(at, CQE_BYTES).try_into().unwrap();
            b[56..].copy_from_slice(&tail);
            return Cqe::decode(&b);
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no CQE {k} within 10 s"
        );
        std::thread::yield_now();
    }
}

fn nic(delivery: Delivery) -> EmulatedNic {
    // SAFETY: every region registered in these tests is a live `Buf` for the NIC's lifetime.
    EmulatedNic::start(Box::new(unsafe { HostDma::new() }), delivery).unwrap()
}

#[test]
fn every_opcode_moves_the_right_bytes_and_completes() {
    let nic = nic(Delivery::Strict);
    let (src, dst, res) = (Buf::new(4096), Buf::new(4096), Buf::new(64));
    let pattern: Vec<u8> = (0..4096).map(|i| (i * 7 % 251) as u8).collect();
    src.write(0, &pattern);
    let ks = nic.register(src.addr(), src.len(), false).unwrap();
    let kd = nic.register(dst.addr(), dst.len(), false).unwrap();
    let kr = nic.register(res.addr(), res.len(), true).unwrap();
    let mut qp = Qp::new(&nic, 0x1234, 64, 16, None);
    let write = Op::Write {
        raddr: dst.addr() + 100,
        rkey: kd,
        laddr: src.addr() + 8,
        lkey: ks,
        len: 3000,
    };
    let at = qp.post(&write, true);
    qp.ring();
    let c = qp.poll();
    assert_eq!(
        (c.opcode, c.wqe_counter, c.qpn, c.wqe_opcode, c.byte_cnt),
        (cq::opcode::REQ, at as u16, 0x1234, opcode::RDMA_WRITE, 3000)
    );
    assert_eq!(dst.read(100, 3000), pattern[8..3008]);
    // Inline, unsignaled, then a NOP that carries the completion.
    qp.post(
        &Op::WriteInline {
            raddr: dst.addr() + 3500,
            rkey: kd,
            payload: b"hello, doorbell".to_vec(),
        },
        false,
    );
    let nop = qp.post(&Op::Nop, true);
    qp.ring();
    let c = qp.poll();
    assert_eq!((c.wqe_counter, c.wqe_opcode), (nop as u16, opcode::NOP));
    assert_eq!(dst.read(3500, 15), b"hello, doorbell");
    // Read back into src's tail.
    qp.post(
        &Op::Read {
            raddr: dst.addr() + 3500,
            rkey: kd,
            laddr: src.addr() + 4000,
            lkey: ks,
            len: 15,
        },
        true,
    );
    // Fetch-add on a strict word; compare-and-swap that fails, then one that succeeds.
    dst.write(8, &41u64.to_ne_bytes());
    qp.post(
        &Op::FetchAdd {
            raddr: dst.addr() + 8,
            rkey: kd,
            add: 1,
            result: res.addr(),
            lkey: kr,
        },
        true,
    );
    qp.post(
        &Op::CompareSwap {
            raddr: dst.addr() + 8,
            rkey: kd,
            compare: 7,
            swap: 99,
            result: res.addr() + 8,
            lkey: kr,
        },
        true,
    );
    qp.post(
        &Op::CompareSwap {
            raddr: dst.addr() + 8,
            rkey: kd,
            compare: 42,
            swap: 99,
            result: res.addr() + 16,
            lkey: kr,
        },
        true,
    );
    qp.ring();
    for want in [
        opcode::RDMA_READ,
        opcode::ATOMIC_FA,
        opcode::ATOMIC_CS,
        opcode::ATOMIC_CS,
    ] {
        let c = qp.poll();
        assert_eq!((c.opcode, c.wqe_opcode), (cq::opcode::REQ, want));
    }
    assert_eq!(src.read(4000, 15), b"hello, doorbell");
    assert_eq!([res.u64_at(0), res.u64_at(8), res.u64_at(16)], [41, 42, 42]);
    assert_eq!(dst.u64_at(8), 99);
    assert!(nic.faults().is_empty(), "{:?}", nic.faults());
    assert_eq!(nic.executed(0x1234), 7);
}

#[test]
fn write_with_immediate_needs_a_receive_credit() {
    let nic = nic(Delivery::Strict);
    let (src, dst) = (Buf::new(256), Buf::new(256));
    let ks = nic.register(src.addr(), src.len(), false).unwrap();
    let kd = nic.register(dst.addr(), dst.len(), false).unwrap();
    let recv_cq = empty_cq(4);
    let credits = Arc::new(AtomicU64::new(1));
    let responder = Responder {
        recv_cq: recv_cq.ptr(),
        recv_cq_entries: 4,
        credits: credits.clone(),
        completions: Arc::new(AtomicU64::new(0)),
    };
    let mut qp = Qp::new(&nic, 7, 16, 8, Some(responder));
    src.write(0, &[5u8; 64]);
    let imm = |i: u32| Op::WriteImm {
        raddr: dst.addr(),
        rkey: kd,
        laddr: src.addr(),
        lkey: ks,
        len: 64,
        imm: i.to_be(),
    };
    qp.post(&imm(0xa1), true);
    qp.post(&imm(0xa2), true);
    qp.ring();
    assert_eq!(qp.poll().wqe_opcode, opcode::RDMA_WRITE_IMM);
    let r = wait_cqe(&recv_cq, 4, 0);
    assert_eq!(
        (r.opcode, r.byte_cnt, u32::from_be(r.imm)),
        (cq::opcode::RESP_WR_IMM, 64, 0xa1)
    );
    // No credit for the second: the QP waits (a real RC QP retries on RNR).
    let start = Instant::now();
    while !nic.stalled(7) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the QP never stalled"
        );
        std::thread::yield_now();
    }
    credits.fetch_add(1, Ordering::AcqRel);
    assert_eq!(qp.poll().wqe_opcode, opcode::RDMA_WRITE_IMM);
    assert_eq!(u32::from_be(wait_cqe(&recv_cq, 4, 1).imm), 0xa2);
    assert_eq!(dst.read(0, 64), vec![5u8; 64]);
}

#[test]
fn bad_keys_and_ranges_give_error_cqes_then_flushes() {
    let nic = nic(Delivery::Strict);
    let (a, b) = (Buf::new(128), Buf::new(128));
    let ka = nic.register(a.addr(), a.len(), false).unwrap();
    let kb = nic.register(b.addr(), b.len(), true).unwrap();
    let cases: [(Op, u8); 4] = [
        (
            Op::Write {
                raddr: b.addr(),
                rkey: kb ^ 0xffff,
                laddr: a.addr(),
                lkey: ka,
                len: 8,
            },
            cq::syndrome::REMOTE_ACCESS,
        ),
        (
            Op::Write {
                raddr: b.addr() + 100,
                rkey: kb,
                laddr: a.addr(),
                lkey: ka,
                len: 64,
            },
            cq::syndrome::REMOTE_ACCESS,
        ),
        (
            Op::Read {
                raddr: b.addr(),
                rkey: kb,
                laddr: a.addr() + 120,
                lkey: ka,
                len: 16,
            },
            cq::syndrome::LOCAL_PROTECTION,
        ),
        (
            Op::FetchAdd {
                raddr: b.addr() + 4,
                rkey: kb,
                add: 1,
                result: a.addr(),
                lkey: ka,
            },
            cq::syndrome::REMOTE_INVALID_REQUEST,
        ),
    ];
    for (i, (bad, syndrome)) in cases.into_iter().enumerate() {
        let mut qp = Qp::new(&nic, 100 + i as u32, 16, 8, None);
        let at = qp.post(&bad, false); // unsignaled: an error completes anyway
        qp.post(
            &Op::Write {
                raddr: b.addr(),
                rkey: kb,
                laddr: a.addr(),
                lkey: ka,
                len: 8,
            },
            true,
        );
        qp.ring();
        let e = qp.poll();
        assert_eq!(
            (e.opcode, e.syndrome, e.wqe_counter),
            (cq::opcode::REQ_ERR, syndrome, at as u16),
            "case {i}"
        );
        let f = qp.poll();
        assert_eq!(
            (f.opcode, f.syndrome),
            (cq::opcode::REQ_ERR, cq::syndrome::WR_FLUSH),
            "case {i}"
        );
    }
    assert_eq!(b.u64_at(0), 0, "nothing was written after an error");
}

#[test]
fn indices_wrap_past_16_bits_and_wqes_wrap_the_ring() {
    let nic = nic(Delivery::Strict);
    let dst = Buf::new(1024);
    let kd = nic.register(dst.addr(), dst.len(), false).unwrap();
    // 8 WQEBBs; inline writes of 1-3 WQEBBs, so WQEs keep straddling the ring's end.
    let mut qp = Qp::new(&nic, 0x42, 8, 8, None);
    let mut wqes = 0u64;
    while qp.pi < 70_000 {
        let n = 1 + (wqes % 100) as usize;
        let payload: Vec<u8> = (0..n).map(|i| (wqes as usize + i) as u8).collect();
        let before = qp.pi;
        qp.post(
            &Op::WriteInline {
                raddr: dst.addr() + (wqes % 8) * 128,
                rkey: kd,
                payload: payload.clone(),
            },
            true,
        );
        assert!(qp.pi - before <= 3);
        qp.ring();
        let c = qp.poll();
        assert_eq!(
            (c.opcode, c.wqe_counter),
            (cq::opcode::REQ, before as u16),
            "WQE {wqes}"
        );
        assert_eq!(
            dst.read(((wqes % 8) * 128) as usize, n),
            payload,
            "WQE {wqes}"
        );
        wqes += 1;
    }
    assert!(nic.faults().is_empty(), "{:?}", nic.faults());
    assert_eq!(nic.executed(0x42), wqes);
}

/// A send queue the NIC reads through a DMA engine (rings in GPU memory): each doorbell fetches
/// the WQEBBs its record covers, including batches of several WQEs that straddle the ring's end.
#[test]
fn rings_read_through_dma_serve_batches_across_the_ring_end() {
    let nic = nic(Delivery::Strict);
    let dst = Buf::new(4096);
    let kd = nic.register(dst.addr(), dst.len(), false).unwrap();
    // SAFETY: the rings are host buffers of this test, alive while the QP is.
    let dma = RingDma(std::sync::Arc::new(unsafe { HostDma::new() }));
    let mut qp = Qp::with_ring_dma(&nic, 0x43, 16, 64, None, Some(dma));
    let mut wqes = 0u64;
    for round in 0..500u64 {
        // 1..=5 inline writes (1-3 WQEBBs each) per doorbell, only the last signaled.
        let batch = 1 + round % 5;
        let mut expect = Vec::new();
        let mut last = 0;
        for b in 0..batch {
            let n = 1 + ((wqes * 7) % 150) as usize;
            let payload: Vec<u8> = (0..n).map(|i| (wqes as usize * 3 + i) as u8).collect();
            let slot = (wqes % 16) * 256;
            last = qp.post(
                &Op::WriteInline {
                    raddr: dst.addr() + slot,
                    rkey: kd,
                    payload: payload.clone(),
                },
                b == batch - 1,
            );
            expect.push((slot as usize, payload));
            wqes += 1;
        }
        qp.ring();
        let c = qp.poll();
        assert_eq!(
            (c.opcode, c.wqe_counter),
            (cq::opcode::REQ, last as u16),
            "round {round}"
        );
        for (slot, payload) in expect {
            assert_eq!(dst.read(slot, payload.len()), payload, "round {round}");
        }
    }
    assert!(nic.faults().is_empty(), "{:?}", nic.faults());
    assert_eq!(nic.executed(0x43), wqes);
}

#[test]
fn a_doorbell_ahead_of_its_record_is_a_fault() {
    let nic = nic(Delivery::Strict);
    let mut qp = Qp::new(&nic, 9, 16, 8, None);
    qp.post(&Op::Nop, true);
    qp.ring_at(0, qp.pi);
    let start = Instant::now();
    while nic.faults().is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "no fault reported"
        );
        std::thread::yield_now();
    }
    assert!(
        nic.faults()[0].contains("ahead of its record"),
        "{:?}",
        nic.faults()
    );
    assert_eq!(nic.executed(9), 0);
}

#[test]
fn relaxed_writes_need_a_read_to_be_seen_before_the_signal() {
    let nic = nic(Delivery::Relaxed {
        max_delay: 1000,
        seed: 1,
    });
    let (data, signal, local) = (Buf::new(4096), Buf::new(64), Buf::new(4096));
    let kd = nic.register(data.addr(), data.len(), false).unwrap();
    let ks = nic.register(signal.addr(), signal.len(), true).unwrap();
    let kl = nic.register(local.addr(), local.len(), false).unwrap();
    let mut qp = Qp::new(&nic, 0x77, 64, 16, None);
    let write = Op::Write {
        raddr: data.addr(),
        rkey: kd,
        laddr: local.addr(),
        lkey: kl,
        len: 8,
    };
    let bump = Op::FetchAdd {
        raddr: signal.addr(),
        rkey: ks,
        add: 1,
        result: local.addr() + 64,
        lkey: kl,
    };
    // A write is also delivered once its QP has been idle for a millisecond, so a test thread
    // descheduled between the signal's completion and its look at the data (a loaded 2-core CI
    // machine) sees it delivered: at least 20 rounds, and on until a reordering has been seen
    // (or 10 s have passed).
    let mut stale = 0;
    let start = Instant::now();
    let mut round = 0u64;
    while round < 20 || (stale == 0 && start.elapsed() < Duration::from_secs(10)) {
        round += 1;
        local.write(0, &round.to_ne_bytes());
        // Data, then the signal: without a flush the signal may land first.
        qp.post(&write, false);
        qp.post(&bump, true);
        qp.ring();
        qp.poll();
        assert_eq!(signal.u64_at(0), 2 * round - 1);
        if data.u64_at(0) != round {
            stale += 1;
        }
        // Data, a READ of it (the flush), then the signal: always in order.
        qp.post(&write, false);
        qp.post(
            &Op::Read {
                raddr: data.addr(),
                rkey: kd,
                laddr: local.addr() + 128,
                lkey: kl,
                len: 8,
            },
            false,
        );
        qp.post(&bump, true);
        qp.ring();
        qp.poll();
        assert_eq!(
            data.u64_at(0),
            round,
            "round {round}: a READ must deliver the write before the signal"
        );
    }
    assert!(
        stale > 0,
        "relaxed delivery never reordered a write past its signal in {round} rounds"
    );
    // Left alone, a pending write still lands (after the QP has been idle for a millisecond).
    local.write(0, &1234u64.to_ne_bytes());
    qp.post(
        &Op::Write {
            raddr: data.addr() + 8,
            rkey: kd,
            laddr: local.addr(),
            lkey: kl,
            len: 8,
        },
        true,
    );
    qp.ring();
    qp.poll();
    let start = Instant::now();
    while data.u64_at(8) != 1234 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "a relaxed write never landed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn another_ranks_region_is_named_by_its_own_address_and_key() {
    // Rank 1's NIC knows rank 0's buffer (key and address as rank 0 registered them) mapped at a
    // different address here, as a CUDA IPC mapping would be.
    let (peer_view, src, res) = (Buf::new(256), Buf::new(256), Buf::new(64));
    let owner = nic(Delivery::Strict);
    let theirs = 0x7f00_dead_0000u64;
    let key = owner.register(theirs, 256, false).unwrap();
    // SAFETY: as in nic().
    let mine =
        EmulatedNic::start_for_rank(Box::new(unsafe { HostDma::new() }), Delivery::Strict, 1)
            .unwrap();
    mine.register_remote(key, theirs, 256, false, peer_view.addr())
        .unwrap();
    // The owner registered the key anew: the newest description replaces the old one.
    mine.register_remote(key, theirs, 256, false, peer_view.addr())
        .unwrap();
    let ks = mine.register(src.addr(), src.len(), false).unwrap();
    assert!(
        mine.register_remote(ks, theirs, 256, false, peer_view.addr())
            .is_err(),
        "one of its own keys as another rank's"
    );
    let kr = mine.register(res.addr(), res.len(), true).unwrap();
    assert_ne!(ks & 0xfff0_0000, key & 0xfff0_0000, "keys carry their rank");
    src.write(0, &[9u8; 32]);
    let mut qp = Qp::new(&mine, 0x31, 16, 8, None);
    qp.post(
        &Op::Write {
            raddr: theirs + 64,
            rkey: key,
            laddr: src.addr(),
            lkey: ks,
            len: 32,
        },
        true,
    );
    qp.post(
        &Op::FetchAdd {
            raddr: theirs + 128,
            rkey: key,
            add: 5,
            result: res.addr(),
            lkey: kr,
        },
        true,
    );
    qp.post(
        &Op::Write {
            raddr: theirs + 250,
            rkey: key,
            laddr: src.addr(),
            lkey: ks,
            len: 32,
        },
        true,
    );
    qp.ring();
    assert_eq!(qp.poll().opcode, cq::opcode::REQ);
    assert_eq!(qp.poll().opcode, cq::opcode::REQ);
    let e = qp.poll();
    assert_eq!(
        (e.opcode, e.syndrome),
        (cq::opcode::REQ_ERR, cq::syndrome::REMOTE_ACCESS),
        "past the region's end"
    );
    assert_eq!(peer_view.read(64, 32), vec![9u8; 32]);
    assert_eq!(peer_view.u64_at(128), 5);
    drop(qp);
    drop(mine);
    drop(owner);
}
