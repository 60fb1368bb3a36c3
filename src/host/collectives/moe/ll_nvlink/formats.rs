//! Small rooms of the one-node low-latency path: the row format each send half wrote (checked
//! by a receive half called apart), and the rank mask's words.

use crate::error::{Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

/// The row format of the last few send halves (a flag: FP8 rows, or log rows), by ticket.
#[derive(Default)]
pub(super) struct SentFormats(std::collections::VecDeque<(u64, bool)>);

impl SentFormats {
    /// Notes the send of `ticket` (the newest; the oldest of eight is forgotten).
    pub(super) fn note(&mut self, ticket: u64, flag: bool) {
        if self.0.len() == 8 {
            self.0.pop_front();
        }
        self.0.push_back((ticket, flag));
    }

    /// The flag of `ticket`'s send (ticket 0: the last send), if it is among the last eight.
    pub(super) fn find(&self, ticket: u64) -> Option<bool> {
        let sent = if ticket != 0 {
            self.0.iter().rev().find(|(t, _)| *t == ticket)
        } else {
            self.0.back()
        };
        sent.map(|&(_, flag)| flag)
    }
}

/// A dispatch's receive half must read the rows in the format its send half wrote them: FP8 rows
/// are cast by the send, so bf16 outputs for an FP8 send (or the reverse) would read garbage.
/// `sent`: whether its send wrote FP8 (`None` when not among the last sends); `fp8`: whether the
/// receive half's outputs carry scales.
pub(super) fn check_dispatch_format(sent: Option<bool>, fp8: bool) -> Result<()> {
    match sent {
        Some(sent_fp8) if sent_fp8 != fp8 => Err(Error::invalid(
            "dispatch receive",
            format!(
                "its send wrote {} rows; give the receive half the same outputs ({})",
                if sent_fp8 { "FP8" } else { "bf16" },
                if sent_fp8 {
                    "with scales"
                } else {
                    "without scales"
                }
            ),
        )),
        _ => Ok(()),
    }
}

/// A combine's receive half called apart from its send must decode the rows in the format the
/// send wrote them: log rows read as bf16 (or the reverse) would sum garbage without an error.
/// `sent`: its send's format (`None` when not among the last sends: nothing to compare).
pub(super) fn check_combine_format(sent: Option<bool>, logfmt: bool) -> Result<()> {
    let name = |log: bool| {
        if log {
            "log rows (logfmt on)"
        } else {
            "bf16 rows (logfmt off)"
        }
    };
    match sent {
        Some(sent) if sent != logfmt => Err(Error::invalid(
            "combine receive",
            format!(
                "its send half wrote {}; pass the receive half the same logfmt, not {}",
                name(sent),
                name(logfmt)
            ),
        )),
        _ => Ok(()),
    }
}

/// Writes `value` into `rank`'s word of the rank mask, on `stream` (one 32-bit word: the mask
/// reads 1 for a masked rank, as DeepEP's).
pub(super) fn set_mask_word(
    mask: &CudaSlice<u32>,
    stream: &CudaStream,
    rank: usize,
    value: u32,
) -> Result<()> {
    let (p, _g) = mask.device_ptr(stream);
    // SAFETY: the mask holds `world` u32 and `rank` is below the world size; the word is written
    // on `stream`, ordered with the calls that read it.
    unsafe { crate::gpu::cuda::store_u32_async(stream, p + 4 * rank as u64, value) }
}

#[cfg(test)]
mod tests {
    use super::{check_combine_format, check_dispatch_format, SentFormats};

    #[test]
    fn a_dispatch_receive_must_read_the_format_its_send_wrote() {
        assert!(check_dispatch_format(None, true).is_ok());
        assert!(check_dispatch_format(Some(true), true).is_ok());
        assert!(check_dispatch_format(Some(false), false).is_ok());
        let e = check_dispatch_format(Some(true), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("wrote FP8 rows") && e.contains("with scales"),
            "{e}"
        );
        let e = check_dispatch_format(Some(false), true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("wrote bf16 rows") && e.contains("without scales"),
            "{e}"
        );
    }

    #[test]
    fn sent_formats_are_found_by_ticket_and_forget_the_oldest() {
        let mut sends = SentFormats::default();
        assert_eq!(sends.find(0), None);
        sends.note(16, true);
        sends.note(32, false);
        assert_eq!(sends.find(16), Some(true));
        assert_eq!(sends.find(32), Some(false));
        assert_eq!(sends.find(0), Some(false));
        for t in 0..7 {
            sends.note(100 + 8 * t, false);
        }
        assert_eq!(sends.find(16), None);
        assert_eq!(sends.find(32), Some(false));
    }

    #[test]
    fn a_combine_receive_must_decode_the_format_its_send_wrote() {
        assert!(check_combine_format(None, true).is_ok());
        assert!(check_combine_format(Some(true), true).is_ok());
        assert!(check_combine_format(Some(false), false).is_ok());
        let e = check_combine_format(Some(true), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("wrote log rows") && e.contains("not bf16 rows"),
            "{e}"
        );
        let e = check_combine_format(Some(false), true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("wrote bf16 rows") && e.contains("not log rows"),
            "{e}"
        );
    }
}
