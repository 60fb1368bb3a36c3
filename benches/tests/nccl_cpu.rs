//! NCCL baseline checks that need no GPU: on a machine without `libnccl.so` the module must say
//! so with [`Error::TransportUnavailable`] instead of letting cudarc panic.

use doorbell::collectives::DataType;
use doorbell::Error;
use doorbell_bench::nccl::{format_version, nccl_available, nccl_data_type};

#[test]
fn missing_nccl_is_an_error_not_a_panic() {
    // SAFETY: only probes whether the library can be loaded.
    let present = unsafe { cudarc::nccl::sys::is_culib_present() };
    match nccl_available() {
        Ok(()) => assert!(present, "nccl_available said yes without a libnccl.so"),
        Err(Error::TransportUnavailable { transport, why }) => {
            assert_eq!(transport, "NCCL");
            if !present {
                assert!(why.contains("libnccl.so"), "unhelpful message: {why}");
                assert!(why.contains("LD_LIBRARY_PATH"), "unhelpful message: {why}");
            }
        }
        Err(other) => panic!("expected TransportUnavailable, got {other}"),
    }
}

#[test]
fn every_data_type_has_an_nccl_type() {
    for dtype in DataType::ALL {
        let _ = nccl_data_type(dtype);
    }
}

#[test]
fn version_codes_read_as_nccl_prints_them() {
    assert_eq!(format_version(22809), "2.28.9");
    assert_eq!(format_version(2708), "2.7.8");
}
