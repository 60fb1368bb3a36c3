//! DeepEP's low-latency layout, which both low-latency paths write and read: where a packed
//! dispatch writes ([`PackedOutputs`], [`PackedBuffers`] in [`PackedFormat`]), the handle a
//! combine reads back ([`PackedHandle`]), and a combine's options and call.

use crate::error::{Error, Result};

/// Where a low-latency dispatch in DeepEP's layout writes ([`super::MoeLowLatency::dispatch_packed_raw`];
/// device addresses of this GPU, `cap = world x max_tokens` rows per local expert), and how.
/// Built with [`PackedOutputs::new`] and the `with_` setters.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct PackedOutputs {
    /// `[local experts][cap][hidden]`: bf16 rows, or e4m3 bytes when `scales` is set; each
    /// expert's rows packed from row 0, source rank 0's first.
    pub x: u64,
    /// 0: bf16 rows. Else the rows are cast to e4m3 per 128 values (DeepEP's cast) and their
    /// scales go here, column-major per expert as DeepEP's: f32 `[local experts][hidden / 128]
    /// [cap]`, or with `ue8m0` i32 `[local experts][hidden / 512][cap]`, four exponent bytes each.
    pub scales: u64,
    /// FP8: scales rounded up to powers of two.
    pub round_scale: bool,
    /// FP8: scales as exponent bytes (needs `round_scale` and a hidden size a multiple of 512).
    pub ue8m0: bool,
    /// `[local experts][cap]` i32: each row's source token (DeepEP's `src_info`).
    pub src_info: u64,
    /// `[local experts][world]` i64: `begin << 32 | rows` of each source (DeepEP's `layout_range`).
    pub layout_range: u64,
    /// `[local experts]` i32: rows per expert; -1 after a dispatch an abort cut short (its rows
    /// and scales are then all ones: NaN).
    pub count: u64,
    /// `[local experts]` i32 the counts are added to (DeepEP's
    /// `cumulative_local_expert_recv_stats`), or 0.
    pub stats: u64,
    /// The dispatch's `topk_idx` holds int64 ids (DeepEP's `topk_idx_t`; 8-byte aligned) instead
    /// of i32: read as such, no conversion needed (an id outside -1..experts selects nothing).
    pub ids_i64: bool,
    /// `[world]` i64 (8-byte aligned) the receive half adds to, for each source rank, the SM
    /// cycles (`clock64`) it waited for that rank's counts, once per local expert (DeepEP's
    /// `dispatch_wait_recv_cost_stats`: a rank slow to send shows as a large entry), or 0.
    /// On one node only (refused by name across nodes).
    pub wait_cycles: u64,
    /// Two u64 of device memory (8-byte aligned) where the send half leaves its epoch and its
    /// call-check ordinal for the receive half, so that the receive half still pairs with its own
    /// send when another send came between them (two dispatches in flight, as DeepEP allows; their
    /// receive halves in either order); 0: the receive half pairs with the last send.
    pub ticket: u64,
}

impl PackedOutputs {
    /// bf16 rows into `x`, with `src_info`, `layout_range` and `count` (see the fields).
    pub fn new(x: u64, src_info: u64, layout_range: u64, count: u64) -> PackedOutputs {
        PackedOutputs {
            x,
            src_info,
            layout_range,
            count,
            ..Default::default()
        }
    }

    /// e4m3 rows with their scales at `scales` (see [`PackedOutputs::scales`]).
    pub fn with_fp8(mut self, scales: u64, round_scale: bool, ue8m0: bool) -> PackedOutputs {
        self.scales = scales;
        self.round_scale = round_scale;
        self.ue8m0 = ue8m0;
        self
    }

    /// Counts added to `stats` too (see [`PackedOutputs::stats`]).
    pub fn with_stats(mut self, stats: u64) -> PackedOutputs {
        self.stats = stats;
        self
    }

    /// The send half's ticket (see [`PackedOutputs::ticket`]).
    pub fn with_ticket(mut self, ticket: u64) -> PackedOutputs {
        self.ticket = ticket;
        self
    }

    /// The receive half's waits added up per source (see [`PackedOutputs::wait_cycles`]).
    pub fn with_wait_cycles(mut self, wait_cycles: u64) -> PackedOutputs {
        self.wait_cycles = wait_cycles;
        self
    }

    /// The dispatch's ids are int64 (see [`PackedOutputs::ids_i64`]).
    pub fn with_i64_ids(mut self, on: bool) -> PackedOutputs {
        self.ids_i64 = on;
        self
    }

    /// Checks the outputs for rows of `hidden` values (alignment, given arrays, a row format
    /// the hidden size allows) and returns their `packed` bits (`device_api::packed`).
    pub(super) fn bits(&self, hidden: usize) -> Result<u32> {
        use crate::device_api::packed;
        let fp8 = self.scales != 0;
        let aligned = self.x % 16 == 0
            && self.x != 0
            && self.src_info % 4 == 0
            && self.src_info != 0
            && self.layout_range % 8 == 0
            && self.layout_range != 0
            && self.count % 4 == 0
            && self.count != 0
            && self.stats % 4 == 0
            && self.ticket % 8 == 0
            && self.wait_cycles % 8 == 0
            && self.scales % 4 == 0;
        if !aligned {
            return Err(Error::invalid(
                "packed outputs",
                "x 16-byte aligned, src_info, count, stats and scales 4-byte, layout_range, \
                 ticket and wait_cycles 8-byte; x, src_info, layout_range and count given",
            ));
        }
        if (self.round_scale || self.ue8m0) && !fp8 {
            return Err(Error::invalid(
                "packed outputs",
                "round_scale and ue8m0 are for FP8 rows (give scales)",
            ));
        }
        if fp8 && hidden % 128 != 0 {
            return Err(Error::invalid(
                "packed outputs",
                format!("FP8 rows need a hidden size a multiple of 128 (it is {hidden})"),
            ));
        }
        if self.ue8m0 && (!self.round_scale || hidden % 512 != 0) {
            return Err(Error::invalid(
                "packed outputs",
                format!(
                    "ue8m0 scales need round_scale and a hidden size a multiple of 512 (it is \
                     {hidden})"
                ),
            ));
        }
        let mut bits = packed::PACKED;
        if fp8 {
            bits |= packed::FP8;
        }
        if self.round_scale {
            bits |= packed::ROUND;
        }
        if self.ue8m0 {
            bits |= packed::UE8M0;
        }
        if self.ids_i64 {
            bits |= packed::IDS64;
        }
        Ok(bits)
    }
}

/// The row format of a dispatch in DeepEP's layout ([`super::MoeLowLatency::packed_buffers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackedFormat {
    /// bf16 rows.
    Bf16,
    /// e4m3 rows cast by the kernel, one scale per 128 values (see [`PackedOutputs::scales`]).
    Fp8 {
        /// Scales rounded up to powers of two.
        round_scale: bool,
        /// Scales as exponent bytes (needs `round_scale`).
        ue8m0: bool,
    },
}

/// The outputs of a dispatch in DeepEP's layout, owned and sized for the exchange they came from
/// ([`super::MoeLowLatency::packed_buffers`]): what the typed
/// [`super::MoeLowLatency::dispatch_packed`] writes and [`super::MoeLowLatency::combine_packed`]
/// reads as the handle. Read through the getters (layouts as [`PackedOutputs`]'s, `cap = world
/// x max_tokens` rows per local expert); the fields stay private so that the sizes the calls
/// rely on cannot change.
#[derive(Debug)]
pub struct PackedBuffers {
    pub(super) x: cudarc::driver::CudaSlice<u8>,
    pub(super) scales: Option<cudarc::driver::CudaSlice<u8>>,
    pub(super) src_info: cudarc::driver::CudaSlice<i32>,
    pub(super) layout_range: cudarc::driver::CudaSlice<i64>,
    pub(super) count: cudarc::driver::CudaSlice<i32>,
    pub(super) ticket: cudarc::driver::CudaSlice<u64>,
    pub(super) format: PackedFormat,
}

impl PackedBuffers {
    /// `[local experts][cap][hidden]` bf16 rows or e4m3 bytes.
    pub fn x(&self) -> &cudarc::driver::CudaSlice<u8> {
        &self.x
    }
    /// FP8: the scales (see [`PackedOutputs::scales`]).
    pub fn scales(&self) -> Option<&cudarc::driver::CudaSlice<u8>> {
        self.scales.as_ref()
    }
    /// `[local experts][cap]` each row's source token.
    pub fn src_info(&self) -> &cudarc::driver::CudaSlice<i32> {
        &self.src_info
    }
    /// `[local experts][world]` `begin << 32 | rows` of each source.
    pub fn layout_range(&self) -> &cudarc::driver::CudaSlice<i64> {
        &self.layout_range
    }
    /// `[local experts]` rows per expert (-1 after a dispatch an abort cut short).
    pub fn count(&self) -> &cudarc::driver::CudaSlice<i32> {
        &self.count
    }
    /// The row format.
    pub fn format(&self) -> PackedFormat {
        self.format
    }
}

/// What a combine in DeepEP's layout reads of its dispatch (DeepEP's handle): the
/// [`PackedOutputs::src_info`] and [`PackedOutputs::layout_range`] that dispatch wrote.
#[derive(Debug, Clone, Copy, Default)]
pub struct PackedHandle {
    /// `[local experts][world x max_tokens]` i32.
    pub src_info: u64,
    /// `[local experts][world]` i64.
    pub layout_range: u64,
}

/// The halves of a combine in DeepEP's layout ([`super::MoeLowLatency::combine_packed_raw`] and
/// its halves): what the send half reads, what the receive half reads and writes, and the
/// ticket that pairs them (0: none).
#[derive(Debug, Clone, Copy)]
pub(super) struct PackedCombine {
    pub ticket: u64,
    /// The receive half's `topk_idx` holds int64 ids.
    pub ids_i64: bool,
    /// `[local experts][world x max_tokens][hidden]` bf16 expert outputs and their handle.
    pub send: Option<(u64, PackedHandle)>,
    /// `(topk_idx, topk_weights, num_tokens, out)`.
    pub recv: Option<(u64, u64, usize, u64)>,
    /// What else the call does (wait statistics, log rows).
    pub options: PackedCombineOptions,
}

/// What a DeepEP-layout combine does beyond moving and summing its rows (see
/// [`super::MoeLowLatency::combine_packed_with_raw`]). Built with [`PackedCombineOptions::new`]
/// and the `with_` setters; the default is neither.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PackedCombineOptions {
    /// `[world]` i64 (8-byte aligned) the receive half adds to, for each source rank, the SM
    /// cycles (`clock64`) it waited for that rank's rows (DeepEP's
    /// `combine_wait_recv_cost_stats`: a rank slow to return its rows shows as a large entry),
    /// or 0. One node only (refused by name across nodes).
    pub wait_cycles: u64,
    /// The rows go back in doorbell's 10-bit log format (DeepEP's `use_logfmt`, a format of
    /// doorbell's own: each 128 values in 176 bytes instead of 256, magnitudes to within
    /// 2^(step / 2) - 1 relative, `step` the group's log2 range / 510; values more than 16
    /// octaves below a group's largest go as zero; a group with a NaN or an infinity as NaN).
    /// Every rank must agree (the call check names a mix across ranks), and so must a combine's
    /// two halves when called apart: a receive half given the other format than its send half
    /// wrote (found by ticket among the last eight sends) is refused (`InvalidArgument`) before
    /// it launches. One node only (refused by name across nodes).
    pub logfmt: bool,
}

impl PackedCombineOptions {
    /// Neither wait statistics nor log rows.
    pub fn new() -> PackedCombineOptions {
        PackedCombineOptions::default()
    }

    /// Adds the receive's waits to `wait_cycles` (see the field).
    pub fn with_wait_cycles(mut self, wait_cycles: u64) -> PackedCombineOptions {
        self.wait_cycles = wait_cycles;
        self
    }

    /// Log rows on or off (see the field).
    pub fn with_logfmt(mut self, on: bool) -> PackedCombineOptions {
        self.logfmt = on;
        self
    }
}

impl PackedCombine {
    /// Checks the send half's arguments (both paths read `x` and the handle's arrays): `x`
    /// 16-byte aligned, `src_info` 4-byte and `layout_range` 8-byte, all given.
    pub(super) fn checked_send(&self) -> Result<Option<(u64, PackedHandle)>> {
        match self.send {
            Some((y, h))
                if y % 16 != 0
                    || y == 0
                    || h.src_info % 4 != 0
                    || h.src_info == 0
                    || h.layout_range % 8 != 0
                    || h.layout_range == 0 =>
            {
                Err(Error::invalid(
                    "combine",
                    "x 16-byte aligned, the handle's src_info 4-byte and layout_range 8-byte",
                ))
            }
            send => Ok(send),
        }
    }

    /// Checks the receive half's arguments against a buffer of `max_tokens` tokens a rank:
    /// `topk_idx` aligned to its id width, `topk_weights` 4-byte, `out` 16-byte, each given
    /// when there are tokens.
    pub(super) fn checked_recv(&self, max_tokens: usize) -> Result<Option<(u64, u64, usize, u64)>> {
        let Some((topk_idx, topk_weights, num_tokens, out)) = self.recv else {
            return Ok(None);
        };
        let id_align = if self.ids_i64 { 8 } else { 4 };
        if num_tokens > max_tokens
            || topk_idx % id_align != 0
            || topk_weights % 4 != 0
            || out % 16 != 0
            || (num_tokens > 0 && (topk_idx == 0 || topk_weights == 0 || out == 0))
        {
            return Err(Error::invalid(
                "combine",
                format!(
                    "{num_tokens} tokens (at most {max_tokens}), topk_idx {id_align}-byte, \
                     topk_weights 4-byte and out 16-byte aligned"
                ),
            ));
        }
        Ok(self.recv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_combine_halves_refuse_misaligned_or_missing_arrays() {
        let handle = PackedHandle {
            src_info: 0x1000,
            layout_range: 0x2000,
        };
        let call = |send, recv, ids_i64| PackedCombine {
            ticket: 0,
            ids_i64,
            send,
            recv,
            options: PackedCombineOptions::new(),
        };
        // Good halves pass through unchanged; absent halves are None.
        let good = call(
            Some((0x4000, handle)),
            Some((0x5000, 0x6000, 128, 0x7000)),
            true,
        );
        assert!(matches!(good.checked_send(), Ok(Some((0x4000, _)))));
        assert_eq!(
            good.checked_recv(128).unwrap(),
            Some((0x5000, 0x6000, 128, 0x7000))
        );
        assert!(call(None, None, false).checked_send().unwrap().is_none());
        assert!(call(None, None, false).checked_recv(1).unwrap().is_none());
        // Send half: x 16-byte, src_info 4-byte, layout_range 8-byte, all given.
        for (y, src_info, layout_range) in [
            (0x4008, 0x1000, 0x2000),
            (0, 0x1000, 0x2000),
            (0x4000, 0x1002, 0x2000),
            (0x4000, 0x1000, 0x2004),
            (0x4000, 0x1000, 0),
        ] {
            let h = PackedHandle {
                src_info,
                layout_range,
            };
            let e = call(Some((y, h)), None, false)
                .checked_send()
                .unwrap_err()
                .to_string();
            assert!(e.contains("x 16-byte aligned"), "{e}");
        }
        // Receive half: too many tokens, int64 ids 4-byte aligned, weights, out, missing arrays.
        let recv = |idx, w, n, out, i64| call(None, Some((idx, w, n, out)), i64).checked_recv(128);
        let e = recv(0x5000, 0x6000, 129, 0x7000, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("129 tokens (at most 128)"), "{e}");
        let e = recv(0x5004, 0x6000, 1, 0x7000, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("topk_idx 8-byte"), "{e}");
        assert!(recv(0x5004, 0x6000, 1, 0x7000, false).is_ok());
        assert!(recv(0x5000, 0x6002, 1, 0x7000, false).is_err());
        assert!(recv(0x5000, 0x6000, 1, 0x7008, false).is_err());
        assert!(recv(0, 0x6000, 1, 0x7000, false).is_err());
        assert!(recv(0, 0, 0, 0, false).is_ok(), "no tokens need no arrays");
    }

    #[test]
    fn packed_outputs_are_checked_before_any_launch_and_give_their_bits() {
        use crate::device_api::packed;
        let ok = PackedOutputs::new(0x1000, 0x2000, 0x3000, 0x4000);
        assert_eq!(ok.bits(512).unwrap(), packed::PACKED);
        let fp8 = ok.with_fp8(0x5000, true, true).with_i64_ids(true);
        assert_eq!(
            fp8.bits(512).unwrap(),
            packed::PACKED | packed::FP8 | packed::ROUND | packed::UE8M0 | packed::IDS64
        );
        // Each refusal names what is wrong.
        let e = |o: PackedOutputs, hidden| o.bits(hidden).unwrap_err().to_string();
        assert!(e(PackedOutputs::new(0x1008, 0x2000, 0x3000, 0x4000), 512).contains("16-byte"));
        assert!(e(PackedOutputs::new(0x1000, 0, 0x3000, 0x4000), 512).contains("given"));
        assert!(e(ok.with_ticket(0x6004), 512).contains("ticket and wait_cycles 8-byte"));
        assert!(e(ok.with_wait_cycles(0x7004), 512).contains("ticket and wait_cycles 8-byte"));
        assert_eq!(
            ok.with_wait_cycles(0x7000).bits(512).unwrap(),
            packed::PACKED
        );
        let mut no_scales = ok;
        no_scales.round_scale = true;
        assert!(e(no_scales, 512).contains("for FP8 rows"));
        assert!(e(ok.with_fp8(0x5000, false, false), 200).contains("multiple of 128"));
        assert!(e(ok.with_fp8(0x5000, false, true), 512).contains("need round_scale"));
        assert!(e(ok.with_fp8(0x5000, true, true), 384).contains("multiple of 512"));
    }
}
