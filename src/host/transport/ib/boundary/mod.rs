//! The verbs boundary: the one interface doorbell asks an RDMA NIC through ([`provider`]), its
//! rdma-core implementation ([`rdma_core`]), the verbs types and device discovery ([`verbs`]), and
//! a real mlx5 NIC's queue-pair rings ([`mlx5dv`]), all typed with [`sys`], rdma-core's headers
//! as bindgen generates them (checked in; `scripts/regen-verbs.sh`). The emulated NIC's provider
//! implements the same interface in `super::emulated`.

pub mod mlx5dv;
pub mod provider;
pub mod rdma_core;
// Generated: the C names stay, and the file is formatted and checked by scripts/regen-verbs.sh.
#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    missing_docs,
    clippy::all
)]
#[rustfmt::skip]
pub mod sys;
pub mod verbs;

/// Asserts that a hand-written mirror of a C struct lays out as bindgen's [`sys`] struct does:
/// size, alignment, and each named field's offset and size (`ours_field => their.field.path`).
#[cfg(test)]
macro_rules! assert_same_layout {
    ($ours:ty, $theirs:ty, [$($f:ident => $($g:ident).+),* $(,)?]) => {{
        use std::mem::{align_of, offset_of, size_of, size_of_val};
        let what = concat!(stringify!($ours), " vs ", stringify!($theirs));
        assert_eq!(size_of::<$ours>(), size_of::<$theirs>(), "size of {what}");
        assert_eq!(align_of::<$ours>(), align_of::<$theirs>(), "alignment of {what}");
        // SAFETY: all-zero bytes are a valid value of both (integers, pointers, unions of them);
        // the union fields read below are only measured.
        unsafe {
            let ours: $ours = std::mem::zeroed();
            let theirs: $theirs = std::mem::zeroed();
            $(
                assert_eq!(
                    (offset_of!($ours, $f), size_of_val(&ours.$f)),
                    (offset_of!($theirs, $($g).+), size_of_val(&theirs.$($g).+)),
                    "{what}: (offset, size) of {}", stringify!($f)
                );
            )*
        }
    }};
}
#[cfg(test)]
pub(crate) use assert_same_layout;
