//! The proxy's side of the device-to-host trigger FIFO (`cuda/include/doorbell/channel/fifo.cuh`):
//! reading committed triggers in order. The kernels' side is `FifoHandle::push` on the device.

use crate::device_api::ProxyTrigger;
use std::sync::atomic::{fence, Ordering};

/// The consumer side of the FIFO ring, over any memory laid out as `channel/fifo.cuh` describes (pinned
/// host memory in service, plain memory in the CPU model test).
pub(crate) struct RingReader {
    size_log2: u32,
}

impl RingReader {
    /// A reader of a ring of `1 << size_log2` slots.
    pub(crate) fn new(size_log2: u32) -> RingReader {
        RingReader { size_log2 }
    }

    /// The trigger at position `tail`, if its pusher committed it. `word(slot, i)` reads the
    /// i-th u64 of a slot with a volatile load.
    pub(crate) fn poll(
        &self,
        tail: u64,
        word: impl Fn(usize, usize) -> u64,
    ) -> Option<ProxyTrigger> {
        let slot = (tail & ((1u64 << self.size_log2) - 1)) as usize;
        let want = ((tail >> self.size_log2) & 1) ^ 1;
        // Each 16-byte half lands whole and carries the commit parity in bit 63 of its second
        // word; the slot is committed once both do.
        let meta = word(slot, 3);
        if meta >> 63 != want {
            return None;
        }
        let dst = word(slot, 1);
        if dst >> 63 != want {
            return None;
        }
        fence(Ordering::Acquire);
        Some(ProxyTrigger {
            src_offset: word(slot, 0),
            dst_offset: dst & !(1 << 63),
            size: word(slot, 2),
            meta,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device_api::{trigger, TriggerMeta};
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    /// The FIFO protocol on plain memory: host threads push exactly as `FifoHandle::push` does
    /// (claim a position, wait for room, write three words, publish the commit word with a
    /// release store carrying the lap parity), the proxy's own `RingReader` drains. A tiny ring
    /// and many pushers make every slot go through hundreds of laps; every trigger must arrive
    /// exactly once, with its fields intact (zeros included).
    #[test]
    fn many_pushers_many_laps_every_trigger_exactly_once() {
        const LOG2: u32 = 3; // 8 slots
        const PUSHERS: u64 = 4;
        const EACH: u64 = 5_000; // 20 000 triggers through 8 slots: 2 500 laps
        let slots: Arc<Vec<AtomicU64>> =
            Arc::new((0..(4 << LOG2)).map(|_| AtomicU64::new(0)).collect());
        let head = Arc::new(AtomicU64::new(0));
        let tail = Arc::new(AtomicU64::new(0));
        let capacity = 1u64 << LOG2;
        let pushers: Vec<_> = (0..PUSHERS)
            .map(|p| {
                let (slots, head, tail) = (slots.clone(), head.clone(), tail.clone());
                std::thread::spawn(move || {
                    for i in 0..EACH {
                        let pos = head.fetch_add(1, Ordering::Relaxed);
                        let deadline =
                            std::time::Instant::now() + std::time::Duration::from_secs(30);
                        while pos >= tail.load(Ordering::Acquire) + capacity {
                            assert!(std::time::Instant::now() < deadline, "ring never drained");
                            // More threads than cores here: let the consumer run.
                            std::thread::yield_now();
                        }
                        let base = ((pos & (capacity - 1)) * 4) as usize;
                        // Zeros are legal values: every third trigger is all zeros but the meta.
                        let payload = if i % 3 == 0 { 0 } else { p << 32 | i };
                        let parity = ((pos >> LOG2) & 1) ^ 1;
                        // As the device: both halves carry the parity; no order between them.
                        fence(Ordering::Release);
                        slots[base + 2].store(i, Ordering::Relaxed);
                        let meta = ProxyTrigger::pack(TriggerMeta {
                            kind: trigger::DATA,
                            semaphore: p as u32,
                            src_mem: 0,
                            dst_mem: (i % 7) as u32,
                            parity: parity as u32,
                        });
                        slots[base + 3].store(meta, Ordering::Relaxed);
                        slots[base].store(payload, Ordering::Relaxed);
                        slots[base + 1].store((payload ^ 0xABCD) | parity << 63, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let ring = RingReader { size_log2: LOG2 };
        let mut seen = vec![vec![false; EACH as usize]; PUSHERS as usize];
        let mut t = 0u64;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while t < PUSHERS * EACH {
            assert!(
                std::time::Instant::now() < deadline,
                "consumer stalled at {t}"
            );
            let Some(trig) = ring.poll(t, |slot, w| slots[slot * 4 + w].load(Ordering::Relaxed))
            else {
                std::thread::yield_now();
                continue;
            };
            let m = ProxyTrigger::unpack(trig.meta);
            let (p, i) = (m.semaphore as u64, trig.size);
            assert_eq!(m.kind, trigger::DATA);
            assert_eq!(m.dst_mem as u64, i % 7);
            let payload = if i % 3 == 0 { 0 } else { p << 32 | i };
            assert_eq!(
                (trig.src_offset, trig.dst_offset),
                (payload, payload ^ 0xABCD),
                "pusher {p} #{i}"
            );
            assert!(
                !seen[p as usize][i as usize],
                "pusher {p} #{i} delivered twice"
            );
            seen[p as usize][i as usize] = true;
            t += 1;
            tail.store(t, Ordering::Release);
        }
        for h in pushers {
            h.join().expect("pusher");
        }
        assert!(
            seen.iter().all(|v| v.iter().all(|&b| b)),
            "a trigger was lost"
        );
        assert_eq!(t, PUSHERS * EACH);
    }
}
