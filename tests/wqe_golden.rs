//! Golden WQE bytes (issue 6): every opcode this library posts, inline and not, signaled or not, at
//! positions that wrap around the send queue, built by `doorbell::transport::ib::posting::wqe` and
//! by a C program using rdma-core's own `mlx5dv.h` (its `mlx5dv_set_ctrl_seg` /
//! `mlx5dv_set_data_seg` helpers, and its segment structs where no helper exists), compared byte
//! for byte.
//!
//! Needs a C compiler and rdma-core's headers (`apt install libibverbs-dev`; `.ci/run` installs
//! them). Nothing is linked: the helpers are inline.

mod c_program;

use doorbell::transport::ib::posting::wqe::{Op, SendQueue, CQ_UPDATE, FENCE, WQEBB};

const GOLDEN_C: &str = r#"
#include <endian.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <infiniband/mlx5dv.h>

#define DEPTH 4
static uint8_t ring[DEPTH * MLX5_SEND_WQE_BB];

/* Copies a WQE of `len` bytes into the ring at WQEBB `idx`, block by block, wrapping, the rest of
   its last block zeroed: how a WQE crosses the end of the queue. */
static uint64_t place(uint64_t idx, const uint8_t *wqe, size_t len) {
  size_t blocks = (len + MLX5_SEND_WQE_BB - 1) / MLX5_SEND_WQE_BB;
  for (size_t i = 0; i < blocks; ++i) {
    uint8_t *slot = ring + ((idx + i) & (DEPTH - 1)) * MLX5_SEND_WQE_BB;
    memset(slot, 0, MLX5_SEND_WQE_BB);
    size_t n = len - i * MLX5_SEND_WQE_BB;
    memcpy(slot, wqe + i * MLX5_SEND_WQE_BB, n < MLX5_SEND_WQE_BB ? n : MLX5_SEND_WQE_BB);
  }
  return idx + blocks;
}

static void dump(const char *name) {
  printf("%s ", name);
  for (size_t i = 0; i < sizeof ring; ++i) printf("%02x", ring[i]);
  printf("\n");
}

/* ctrl + raddr + data: WRITE, WRITE_IMM, READ. */
static void rdma(const char *name, uint64_t idx, uint8_t op, uint32_t qpn, uint8_t flags, uint64_t raddr,
                 uint32_t rkey, uint64_t laddr, uint32_t lkey, uint32_t len, uint32_t imm) {
  uint8_t wqe[4 * MLX5_SEND_WQE_BB] = {0};
  struct mlx5_wqe_ctrl_seg *c = (void *)wqe;
  struct mlx5_wqe_raddr_seg *r = (void *)(wqe + 16);
  struct mlx5_wqe_data_seg *d = (void *)(wqe + 32);
  mlx5dv_set_ctrl_seg(c, (uint16_t)idx, op, 0, qpn, flags, 3, 0, imm);
  r->raddr = htobe64(raddr);
  r->rkey = htobe32(rkey);
  r->reserved = 0;
  mlx5dv_set_data_seg(d, len, lkey, (uintptr_t)laddr);
  memset(ring, 0, sizeof ring);
  place(idx, wqe, 48);
  dump(name);
}

static void inl(const char *name, uint64_t idx, uint32_t qpn, uint8_t flags, uint64_t raddr, uint32_t rkey,
                uint32_t len) {
  uint8_t wqe[4 * MLX5_SEND_WQE_BB] = {0};
  struct mlx5_wqe_ctrl_seg *c = (void *)wqe;
  struct mlx5_wqe_raddr_seg *r = (void *)(wqe + 16);
  struct mlx5_wqe_inl_data_seg *h = (void *)(wqe + 32);
  size_t seg = (sizeof *h + len + 15) / 16 * 16;
  uint8_t ds = (uint8_t)(2 + seg / 16);
  mlx5dv_set_ctrl_seg(c, (uint16_t)idx, MLX5_OPCODE_RDMA_WRITE, 0, qpn, flags, ds, 0, 0);
  r->raddr = htobe64(raddr);
  r->rkey = htobe32(rkey);
  h->byte_count = htobe32(len | MLX5_INLINE_SEG);
  for (uint32_t i = 0; i < len; ++i) wqe[36 + i] = (uint8_t)(i * 7 + 3);
  memset(ring, 0, sizeof ring);
  place(idx, wqe, ds * 16);
  dump(name);
}

static void atomic(const char *name, uint64_t idx, uint8_t op, uint32_t qpn, uint8_t flags, uint64_t raddr,
                   uint32_t rkey, uint64_t swap_add, uint64_t compare, uint64_t result, uint32_t lkey) {
  uint8_t wqe[4 * MLX5_SEND_WQE_BB] = {0};
  struct mlx5_wqe_ctrl_seg *c = (void *)wqe;
  struct mlx5_wqe_raddr_seg *r = (void *)(wqe + 16);
  struct mlx5_wqe_atomic_seg *a = (void *)(wqe + 32);
  struct mlx5_wqe_data_seg *d = (void *)(wqe + 48);
  mlx5dv_set_ctrl_seg(c, (uint16_t)idx, op, 0, qpn, flags, 4, 0, 0);
  r->raddr = htobe64(raddr);
  r->rkey = htobe32(rkey);
  r->reserved = 0;
  a->swap_add = htobe64(swap_add);
  a->compare = htobe64(compare);
  mlx5dv_set_data_seg(d, 8, lkey, (uintptr_t)result);
  memset(ring, 0, sizeof ring);
  place(idx, wqe, 64);
  dump(name);
}

static void nop(const char *name, uint64_t idx, uint32_t qpn, uint8_t flags) {
  uint8_t wqe[MLX5_SEND_WQE_BB] = {0};
  mlx5dv_set_ctrl_seg((void *)wqe, (uint16_t)idx, MLX5_OPCODE_NOP, 0, qpn, flags, 1, 0, 0);
  memset(ring, 0, sizeof ring);
  place(idx, wqe, 16);
  dump(name);
}

int main(void) {
  const uint64_t idxs[] = {0, 3, 0x1fffe, 0x12345};
  for (int i = 0; i < 4; ++i) {
    for (int s = 0; s < 2; ++s) {
      uint64_t idx = idxs[i];
      uint8_t flags = s ? MLX5_WQE_CTRL_CQ_UPDATE : 0;
      char name[64];
      snprintf(name, sizeof name, "write-%d-%d", i, s);
      rdma(name, idx, MLX5_OPCODE_RDMA_WRITE, 0x1a2b3c, flags, 0x7f0011223344ull, 0xdeadbeef, 0x7f00aabbccddull,
           0x1234567, 4096 + i, 0);
      snprintf(name, sizeof name, "write_imm-%d-%d", i, s);
      rdma(name, idx, MLX5_OPCODE_RDMA_WRITE_IMM, 0x1a2b3c, flags, 0x7f0011223344ull, 0xdeadbeef, 0x7f00aabbccddull,
           0x1234567, 1 + i, 0x04030201u);
      snprintf(name, sizeof name, "read-%d-%d", i, s);
      rdma(name, idx, MLX5_OPCODE_RDMA_READ, 0x000001, flags | MLX5_WQE_CTRL_FENCE, 0xffffffff00000000ull, 7,
           0x10, 0x100, 0x7fffffffu, 0);
      snprintf(name, sizeof name, "fetch_add-%d-%d", i, s);
      atomic(name, idx, MLX5_OPCODE_ATOMIC_FA, 0xffffff, flags, 0x1000, 0x42, 5, 0, 0x2000, 0x43);
      snprintf(name, sizeof name, "cas-%d-%d", i, s);
      atomic(name, idx, MLX5_OPCODE_ATOMIC_CS, 0xffffff, flags, 0x1008, 0x42, 0x1111222233334444ull,
             0x5555666677778888ull, 0x2008, 0x43);
      snprintf(name, sizeof name, "nop-%d-%d", i, s);
      nop(name, idx, 0x77, flags);
      const uint32_t lens[] = {1, 12, 13, 28, 29, 60, 100, 220};
      for (int l = 0; l < 8; ++l) {
        snprintf(name, sizeof name, "inline%u-%d-%d", lens[l], i, s);
        inl(name, idx, 0x1a2b3c, flags, 0x5000 + l, 0x99, lens[l]);
      }
    }
  }
  return 0;
}
"#;

fn golden() -> Vec<(String, Vec<u8>)> {
    c_program::run("wqe-golden", GOLDEN_C, "-O1", "mlx5dv.h")
        .lines()
        .map(|l| {
            let (name, hex) = l.split_once(' ').expect("name and bytes");
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                .collect();
            (name.to_string(), bytes)
        })
        .collect()
}

fn ours(name: &str) -> Vec<u8> {
    let (kind, rest) = name.split_once('-').expect("kind-i-s");
    let (i, s) = rest.split_once('-').expect("i-s");
    let (i, s): (usize, bool) = (i.parse().unwrap(), s == "1");
    let idx = [0u64, 3, 0x1fffe, 0x12345][i];
    let flags = if s { CQ_UPDATE } else { 0 };
    let (op, qpn, flags) = match kind {
        "write" => (
            Op::Write {
                raddr: 0x7f0011223344,
                rkey: 0xdeadbeef,
                laddr: 0x7f00aabbccdd,
                lkey: 0x1234567,
                len: 4096 + i as u32,
            },
            0x1a2b3c,
            flags,
        ),
        "write_imm" => (
            Op::WriteImm {
                raddr: 0x7f0011223344,
                rkey: 0xdeadbeef,
                laddr: 0x7f00aabbccdd,
                lkey: 0x1234567,
                len: 1 + i as u32,
                imm: 0x04030201,
            },
            0x1a2b3c,
            flags,
        ),
        "read" => (
            Op::Read {
                raddr: 0xffffffff00000000,
                rkey: 7,
                laddr: 0x10,
                lkey: 0x100,
                len: 0x7fffffff,
            },
            1,
            flags | FENCE,
        ),
        "fetch_add" => (
            Op::FetchAdd {
                raddr: 0x1000,
                rkey: 0x42,
                add: 5,
                result: 0x2000,
                lkey: 0x43,
            },
            0xffffff,
            flags,
        ),
        "cas" => (
            Op::CompareSwap {
                raddr: 0x1008,
                rkey: 0x42,
                compare: 0x5555666677778888,
                swap: 0x1111222233334444,
                result: 0x2008,
                lkey: 0x43,
            },
            0xffffff,
            flags,
        ),
        "nop" => (Op::Nop, 0x77, flags),
        k if k.starts_with("inline") => {
            let len: usize = k["inline".len()..].parse().unwrap();
            let l = [1usize, 12, 13, 28, 29, 60, 100, 220]
                .iter()
                .position(|&x| x == len)
                .unwrap();
            let payload = (0..len).map(|j| (j * 7 + 3) as u8).collect();
            (
                Op::WriteInline {
                    raddr: 0x5000 + l as u64,
                    rkey: 0x99,
                    payload,
                },
                0x1a2b3c,
                flags,
            )
        }
        other => panic!("unknown case {other}"),
    };
    let mut ring = vec![0u8; 4 * WQEBB];
    let mut sq = SendQueue::new(&mut ring).unwrap();
    sq.post(idx, qpn, &op, flags).unwrap();
    ring
}

#[test]
fn every_wqe_matches_rdma_core_byte_for_byte() {
    let cases = golden();
    assert_eq!(cases.len(), 4 * 2 * (6 + 8), "the golden program's cases");
    let mut wrapped = 0;
    for (name, want) in &cases {
        let got = ours(name);
        assert_eq!(got.len(), want.len(), "{name}: ring size");
        if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
            panic!(
                "{name}: byte {at} (WQEBB {}, offset {}) is {:#04x}, rdma-core's is {:#04x}",
                at / WQEBB,
                at % WQEBB,
                got[at],
                want[at]
            );
        }
        // Count the cases whose WQE crossed the end of the ring (index 3 of 4, more than one WQEBB).
        if name.ends_with("-1-0") || name.ends_with("-1-1") {
            wrapped += usize::from(want[..WQEBB].iter().any(|&b| b != 0));
        }
    }
    assert!(
        wrapped >= 4,
        "some cases must wrap around the ring ({wrapped})"
    );
}
