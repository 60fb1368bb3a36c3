//! `#[repr(C)]` mirrors of the device handles in `cuda/include/doorbell/`.
