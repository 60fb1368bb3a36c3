//! mlx5 send-queue work requests (WQEs), encoded byte for byte as a ConnectX reads them (rdma-core
//! `providers/mlx5/mlx5dv.h`, its segment layouts and `mlx5dv_set_*` helpers). The GPU posting
//! path and the CPU-assisted path build the same bytes; this is the CPU's builder and the
//! reference the device builder will be tested against.
//!
//! A send queue is a ring of 64-byte basic blocks (WQEBBs); a WQE takes one or more, made of
//! 16-byte units (DS): a control segment, then per opcode a remote-address segment, a data
//! (scatter/gather) segment, an inline segment or an atomic segment. Indices count WQEBBs, are
//! 64-bit in software and 16-bit in the control segment; a WQE that runs past the end of the
//! ring continues at its start.
//!
//! Multi-byte fields are big-endian on the wire. Keys and addresses are taken in host order and
//! swapped here; the immediate of `RDMA_WRITE_IMM` is taken as the bytes to send (rdma-core's
//! convention: the caller supplies it already in network order).

use crate::error::{Error, Result};

/// Bytes of a WQE basic block.
pub const WQEBB: usize = 64;
/// Bytes of a DS unit.
pub const DS: usize = 16;

/// Opcodes (`MLX5_OPCODE_*`).
pub mod opcode {
    /// No operation.
    pub const NOP: u8 = 0x00;
    /// RDMA write.
    pub const RDMA_WRITE: u8 = 0x08;
    /// RDMA write with immediate.
    pub const RDMA_WRITE_IMM: u8 = 0x09;
    /// Send.
    pub const SEND: u8 = 0x0a;
    /// RDMA read.
    pub const RDMA_READ: u8 = 0x10;
    /// Atomic compare-and-swap, 64-bit.
    pub const ATOMIC_CS: u8 = 0x11;
    /// Atomic fetch-and-add, 64-bit.
    pub const ATOMIC_FA: u8 = 0x12;
}

/// `fm_ce_se` bit: a CQE for this WQE whatever happens (`MLX5_WQE_CTRL_CQ_UPDATE`).
pub const CQ_UPDATE: u8 = 2 << 2;
/// `fm_ce_se` bit: solicited event.
pub const SOLICITED: u8 = 1 << 1;
/// `fm_ce_se` fence mode: wait for earlier reads and atomics (`MLX5_WQE_CTRL_FENCE`).
pub const FENCE: u8 = 4 << 5;
/// `byte_count` flag of an inline segment (`MLX5_INLINE_SEG`).
pub const INLINE_SEG: u32 = 0x8000_0000;

/// A control segment (`struct mlx5_wqe_ctrl_seg`, 16 bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ctrl {
    /// Index of the WQE's first WQEBB (low 16 bits are encoded).
    pub wqe_index: u16,
    /// Opcode.
    pub opcode: u8,
    /// Opcode modifier (the operand size of extended atomics).
    pub opmod: u8,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// WQE size in DS units, control segment included (6 bits).
    pub ds: u8,
    /// Fence mode, completion and solicited bits.
    pub fm_ce_se: u8,
    /// WQE signature (0 unless the QP was created with signatures).
    pub signature: u8,
    /// Immediate, as the 4 bytes to send.
    pub imm: u32,
}

impl Ctrl {
    /// The 16 bytes.
    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        let opmod_idx_opcode = (u32::from(self.opmod) << 24)
            | (u32::from(self.wqe_index) << 8)
            | u32::from(self.opcode);
        b[0..4].copy_from_slice(&opmod_idx_opcode.to_be_bytes());
        b[4..8].copy_from_slice(
            &(((self.qpn & 0xff_ffff) << 8) | u32::from(self.ds & 0x3f)).to_be_bytes(),
        );
        b[8] = self.signature;
        // 9..11: dci_stream_channel_id, zero for RC.
        b[11] = self.fm_ce_se;
        b[12..16].copy_from_slice(&self.imm.to_ne_bytes());
        b
    }
}

/// A remote-address segment (`struct mlx5_wqe_raddr_seg`).
pub fn raddr_seg(raddr: u64, rkey: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..8].copy_from_slice(&raddr.to_be_bytes());
    b[8..12].copy_from_slice(&rkey.to_be_bytes());
    b
}

/// A data (scatter/gather) segment (`struct mlx5_wqe_data_seg`).
pub fn data_seg(byte_count: u32, lkey: u32, addr: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&byte_count.to_be_bytes());
    b[4..8].copy_from_slice(&lkey.to_be_bytes());
    b[8..16].copy_from_slice(&addr.to_be_bytes());
    b
}

/// An atomic segment (`struct mlx5_wqe_atomic_seg`).
pub fn atomic_seg(swap_add: u64, compare: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..8].copy_from_slice(&swap_add.to_be_bytes());
    b[8..16].copy_from_slice(&compare.to_be_bytes());
    b
}

/// What a WQE does. Addresses and keys in host order; each variant's doc names its fields.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum Op {
    /// Copy `len` bytes from local `laddr` (key `lkey`) to remote `raddr` (key `rkey`).
    Write {
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        len: u32,
    },
    /// The same, then deliver `imm` to the responder (consumes one of its receive WQEs).
    WriteImm {
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        len: u32,
        imm: u32,
    },
    /// Write `payload` carried in the WQE itself.
    WriteInline {
        raddr: u64,
        rkey: u32,
        payload: Vec<u8>,
    },
    /// Copy `len` bytes from remote `raddr` to local `laddr`.
    Read {
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        len: u32,
    },
    /// Add `add` to the 8 bytes at remote `raddr`; the old value lands at local `result`.
    FetchAdd {
        raddr: u64,
        rkey: u32,
        add: u64,
        result: u64,
        lkey: u32,
    },
    /// If the 8 bytes at `raddr` equal `compare`, write `swap`; the old value lands at `result`.
    CompareSwap {
        raddr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
        result: u64,
        lkey: u32,
    },
    /// Nothing (carries a completion, or pads).
    Nop,
}

/// Largest inline payload this builder accepts (a WQE of at most 4 WQEBBs).
pub const MAX_INLINE: usize = 4 * WQEBB - 2 * DS - 4;

impl Op {
    /// The WQE's bytes, control segment first, a whole number of DS units.
    pub fn encode(&self, wqe_index: u16, qpn: u32, fm_ce_se: u8) -> Result<Vec<u8>> {
        let mut segs: Vec<u8> = Vec::with_capacity(WQEBB);
        let (opc, imm) = match self {
            Op::Write {
                raddr,
                rkey,
                laddr,
                lkey,
                len,
            }
            | Op::Read {
                raddr,
                rkey,
                laddr,
                lkey,
                len,
            } => {
                check_len(*len)?;
                segs.extend_from_slice(&raddr_seg(*raddr, *rkey));
                segs.extend_from_slice(&data_seg(*len, *lkey, *laddr));
                let opc = if matches!(self, Op::Write { .. }) {
                    opcode::RDMA_WRITE
                } else {
                    opcode::RDMA_READ
                };
                (opc, 0)
            }
            Op::WriteImm {
                raddr,
                rkey,
                laddr,
                lkey,
                len,
                imm,
            } => {
                check_len(*len)?;
                segs.extend_from_slice(&raddr_seg(*raddr, *rkey));
                segs.extend_from_slice(&data_seg(*len, *lkey, *laddr));
                (opcode::RDMA_WRITE_IMM, *imm)
            }
            Op::WriteInline {
                raddr,
                rkey,
                payload,
            } => {
                if payload.len() > MAX_INLINE {
                    return Err(Error::invalid(
                        "inline payload",
                        format!("{} bytes: at most {MAX_INLINE}", payload.len()),
                    ));
                }
                segs.extend_from_slice(&raddr_seg(*raddr, *rkey));
                segs.extend_from_slice(&(payload.len() as u32 | INLINE_SEG).to_be_bytes());
                segs.extend_from_slice(payload);
                (opcode::RDMA_WRITE, 0)
            }
            Op::FetchAdd {
                raddr,
                rkey,
                add,
                result,
                lkey,
            } => {
                segs.extend_from_slice(&raddr_seg(*raddr, *rkey));
                segs.extend_from_slice(&atomic_seg(*add, 0));
                segs.extend_from_slice(&data_seg(8, *lkey, *result));
                (opcode::ATOMIC_FA, 0)
            }
            Op::CompareSwap {
                raddr,
                rkey,
                compare,
                swap,
                result,
                lkey,
            } => {
                segs.extend_from_slice(&raddr_seg(*raddr, *rkey));
                segs.extend_from_slice(&atomic_seg(*swap, *compare));
                segs.extend_from_slice(&data_seg(8, *lkey, *result));
                (opcode::ATOMIC_CS, 0)
            }
            Op::Nop => (opcode::NOP, 0),
        };
        let ds = 1 + segs.len().div_ceil(DS);
        let ctrl = Ctrl {
            wqe_index,
            opcode: opc,
            opmod: 0,
            qpn,
            ds: ds as u8,
            fm_ce_se,
            signature: 0,
            imm,
        };
        let mut w = Vec::with_capacity(ds * DS);
        w.extend_from_slice(&ctrl.encode());
        w.extend_from_slice(&segs);
        w.resize(ds * DS, 0);
        Ok(w)
    }
}

fn check_len(len: u32) -> Result<()> {
    if len & INLINE_SEG != 0 {
        return Err(Error::invalid(
            "length",
            format!("{len} bytes: a data segment carries at most 2 GiB - 1"),
        ));
    }
    Ok(())
}

/// WQEBBs a WQE of `bytes` takes.
pub fn wqebbs(bytes: usize) -> u64 {
    bytes.div_ceil(WQEBB) as u64
}

/// A send queue: a ring of WQEBBs in memory the NIC reads (or, in tests, a plain buffer).
pub struct SendQueue<'a> {
    ring: &'a mut [u8],
}

impl<'a> SendQueue<'a> {
    /// A queue over `ring`, whose size must be a power of two number of WQEBBs.
    pub fn new(ring: &'a mut [u8]) -> Result<SendQueue<'a>> {
        let n = ring.len() / WQEBB;
        if ring.len() % WQEBB != 0 || !n.is_power_of_two() {
            return Err(Error::invalid(
                "send queue",
                format!(
                    "{} bytes: a power of two number of 64-byte blocks",
                    ring.len()
                ),
            ));
        }
        Ok(SendQueue { ring })
    }

    /// WQEBBs in the ring.
    pub fn depth(&self) -> u64 {
        (self.ring.len() / WQEBB) as u64
    }

    /// Writes `op` as the WQE starting at WQEBB `idx` (64-bit, wrapping on the ring), for QP
    /// `qpn`; returns the index one past it (the next WQE's, and the doorbell's).
    pub fn post(&mut self, idx: u64, qpn: u32, op: &Op, fm_ce_se: u8) -> Result<u64> {
        let w = op.encode(idx as u16, qpn, fm_ce_se)?;
        let n = wqebbs(w.len());
        if n > self.depth() {
            return Err(Error::invalid("WQE", "larger than the send queue"));
        }
        // A WQE is written whole WQEBBs at a time: the rest of its last block is zeroed.
        let mut padded = w;
        padded.resize(n as usize * WQEBB, 0);
        for (i, block) in padded.chunks(WQEBB).enumerate() {
            let slot = ((idx + i as u64) & (self.depth() - 1)) as usize * WQEBB;
            self.ring[slot..slot + WQEBB].copy_from_slice(block);
        }
        Ok(idx + n)
    }
}

/// The doorbell record's value after posting up to `next_idx` (big-endian 16-bit counter in a
/// 32-bit word).
pub fn doorbell_record(next_idx: u64) -> [u8; 4] {
    ((next_idx & 0xffff) as u32).to_be_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctrl_fields_land_where_the_nic_reads_them() {
        let c = Ctrl {
            wqe_index: 0x1234,
            opcode: opcode::RDMA_WRITE,
            opmod: 0x08,
            qpn: 0xabcdef,
            ds: 3,
            fm_ce_se: CQ_UPDATE,
            signature: 0,
            imm: 0,
        }
        .encode();
        assert_eq!(&c[0..4], &[0x08, 0x12, 0x34, 0x08]);
        assert_eq!(&c[4..8], &[0xab, 0xcd, 0xef, 0x03]);
        assert_eq!(c[11], 0x08);
    }

    #[test]
    fn sizes_and_errors() {
        let w = Op::WriteInline {
            raddr: 1,
            rkey: 2,
            payload: vec![7; 13],
        }
        .encode(0, 1, 0)
        .unwrap();
        assert_eq!(
            w.len(),
            4 * DS,
            "13 inline bytes: ctrl, raddr, 2 units of inline"
        );
        assert!(Op::WriteInline {
            raddr: 1,
            rkey: 2,
            payload: vec![0; MAX_INLINE + 1]
        }
        .encode(0, 1, 0)
        .is_err());
        assert!(Op::Write {
            raddr: 0,
            rkey: 0,
            laddr: 0,
            lkey: 0,
            len: 1 << 31
        }
        .encode(0, 1, 0)
        .is_err());
        let mut ring = vec![0u8; 3 * WQEBB];
        assert!(SendQueue::new(&mut ring).is_err());
        assert_eq!(doorbell_record(0x1_0005), [0, 0, 0, 5]);
    }
}
