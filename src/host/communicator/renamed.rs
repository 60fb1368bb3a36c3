//! Names the communicator had before, kept for code written against them (doc-hidden).

use super::Communicator;
use crate::error::Result;

impl Communicator {
    /// The name before [`Communicator::cuda_result`] ("check" now means only the call check).
    #[doc(hidden)]
    #[deprecated(note = "renamed to `cuda_result`")]
    pub fn check<T>(
        &self,
        r: std::result::Result<T, cudarc::driver::DriverError>,
        call: &'static str,
    ) -> Result<T> {
        self.cuda_result(r, call)
    }
}
