//! mlx5 completion queue entries (`struct mlx5_cqe64`, 64 bytes, rdma-core's
//! `providers/mlx5/mlx5dv.h`) as a ConnectX writes them and a poller reads them. The emulated NIC
//! writes these; the CPU and GPU pollers read them.
//!
//! Layout (big-endian fields): `imm_inval_pkey` at 36, `byte_cnt` at 44, `sop_drop_qpn` at 56
//! (`[31:24]` opcode of the completed send WQE, `[23:0]` QPN), `wqe_counter` at 60 (16-bit index of
//! the completed WQE's first WQEBB), `op_own` at 63 (`[7:4]` CQE opcode, `[0]` owner). An error CQE
//! (`struct mlx5_err_cqe`) keeps those places and adds `vendor_err_synd` at 54 and `syndrome` at 55.
//!
//! Ownership on a ring of `n` entries: the producer's k-th CQE goes to slot `k % n` with owner bit
//! `(k / n) & 1`; the consumer waiting for its k-th checks the same parity and that the opcode is
//! not INVALID (entries start as `0xf0`: opcode INVALID, owner 0, as rdma-core initializes them).

/// Bytes of a CQE.
pub const CQE_BYTES: usize = 64;

/// The `op_own` byte of an entry no CQE has been written to.
pub const EMPTY_OP_OWN: u8 = 0xf0;

/// CQE opcodes (`MLX5_CQE_*`, `op_own >> 4`).
pub mod opcode {
    /// A send WQE completed (requester).
    pub const REQ: u8 = 0;
    /// An RDMA write with immediate landed here (responder).
    pub const RESP_WR_IMM: u8 = 1;
    /// A send WQE failed (requester).
    pub const REQ_ERR: u8 = 13;
    /// A responder error.
    pub const RESP_ERR: u8 = 14;
    /// Nothing written.
    pub const INVALID: u8 = 15;
}

/// Error syndromes (`MLX5_CQE_SYNDROME_*`, byte 55 of an error CQE).
pub mod syndrome {
    /// Local length error.
    pub const LOCAL_LENGTH: u8 = 0x01;
    /// Local QP operation error (a malformed WQE).
    pub const LOCAL_QP_OP: u8 = 0x02;
    /// Local protection error (bad lkey, or the local range is outside its region).
    pub const LOCAL_PROTECTION: u8 = 0x04;
    /// Flushed: the QP was already in the error state.
    pub const WR_FLUSH: u8 = 0x05;
    /// Remote invalid request (for example a misaligned atomic).
    pub const REMOTE_INVALID_REQUEST: u8 = 0x12;
    /// Remote access error (bad rkey, the remote range is outside its region, or the region or
    /// the responder's QP lacks the remote access the operation needs).
    pub const REMOTE_ACCESS: u8 = 0x13;
    /// Transport retry counter exceeded: the responder never acknowledged (no such QP, not
    /// connected back to this one, or a GID or path MTU that does not match).
    pub const TRANSPORT_RETRY_EXCEEDED: u8 = 0x15;
}

/// One completion, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cqe {
    /// CQE opcode (see [`opcode`]).
    pub opcode: u8,
    /// Owner bit.
    pub owner: u8,
    /// Index of the completed WQE's first WQEBB (low 16 bits).
    pub wqe_counter: u16,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Opcode of the completed (or failed) send WQE.
    pub wqe_opcode: u8,
    /// Bytes moved (responder: bytes written).
    pub byte_cnt: u32,
    /// Immediate (responder of a write with immediate), as the 4 bytes sent.
    pub imm: u32,
    /// Error syndrome (error CQEs).
    pub syndrome: u8,
    /// Vendor syndrome (error CQEs).
    pub vendor_syndrome: u8,
}

impl Cqe {
    /// The 64 bytes, `op_own` last (a writer stores bytes 0..56 before the word that holds it).
    pub fn encode(&self) -> [u8; CQE_BYTES] {
        let mut b = [0u8; CQE_BYTES];
        b[36..40].copy_from_slice(&self.imm.to_ne_bytes());
        b[44..48].copy_from_slice(&self.byte_cnt.to_be_bytes());
        b[54] = self.vendor_syndrome;
        b[55] = self.syndrome;
        let sop = (u32::from(self.wqe_opcode) << 24) | (self.qpn & 0xff_ffff);
        b[56..60].copy_from_slice(&sop.to_be_bytes());
        b[60..62].copy_from_slice(&self.wqe_counter.to_be_bytes());
        b[63] = (self.opcode << 4) | (self.owner & 1);
        b
    }

    /// Reads the 64 bytes back.
    pub fn decode(b: &[u8; CQE_BYTES]) -> Cqe {
        let be32 = |o: usize| u32::from_be_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let sop = be32(56);
        Cqe {
            opcode: b[63] >> 4,
            owner: b[63] & 1,
            wqe_counter: u16::from_be_bytes([b[60], b[61]]),
            qpn: sop & 0xff_ffff,
            wqe_opcode: (sop >> 24) as u8,
            byte_cnt: be32(44),
            imm: u32::from_ne_bytes([b[36], b[37], b[38], b[39]]),
            syndrome: b[55],
            vendor_syndrome: b[54],
        }
    }

    /// Whether this is an error completion.
    pub fn is_error(&self) -> bool {
        self.opcode == opcode::REQ_ERR || self.opcode == opcode::RESP_ERR
    }
}

/// The owner bit of the `k`-th CQE on a ring of `entries`.
pub fn owner_of(k: u64, entries: u64) -> u8 {
    ((k / entries) & 1) as u8
}

/// Whether `op_own`, read from the slot of the consumer's `k`-th CQE, holds that CQE.
pub fn is_ready(op_own: u8, k: u64, entries: u64) -> bool {
    op_own >> 4 != opcode::INVALID && (op_own & 1) == owner_of(k, entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_land_where_pollers_read_them() {
        let c = Cqe {
            opcode: opcode::REQ_ERR,
            owner: 1,
            wqe_counter: 0xbeef,
            qpn: 0x12_3456,
            wqe_opcode: 0x08,
            byte_cnt: 4096,
            imm: 0x0102_0304,
            syndrome: syndrome::REMOTE_ACCESS,
            vendor_syndrome: 0x88,
        };
        let b = c.encode();
        assert_eq!(b[63], 0xd1);
        assert_eq!(&b[56..62], &[0x08, 0x12, 0x34, 0x56, 0xbe, 0xef]);
        assert_eq!(&b[44..48], &[0, 0, 0x10, 0]);
        assert_eq!((b[54], b[55]), (0x88, 0x13));
        assert_eq!(Cqe::decode(&b), c);
        assert!(c.is_error());
    }

    #[test]
    fn ownership_by_lap_parity() {
        assert!(!is_ready(EMPTY_OP_OWN, 0, 4), "a fresh ring holds nothing");
        assert!(is_ready(0x00, 0, 4));
        assert!(
            !is_ready(0x00, 4, 4),
            "last lap's CQE is stale on the next lap"
        );
        assert!(is_ready(0x01, 5, 4));
        assert_eq!(owner_of(7, 4), 1);
        assert_eq!(owner_of(8, 4), 0);
    }
}
