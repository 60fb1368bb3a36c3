//! The real NCCL behind the calls doorbell does not run itself (issue 28): loaded once, on the
//! first communicator or the first call that needs it, from the path [`crate::forward`] chooses;
//! its functions looked up by name and kept. Each communicator has a real one beside doorbell's,
//! created with it (every rank agrees first that each has a real NCCL, so none waits alone), and
//! the calls doorbell leaves (other collectives, other types and ops, registration, splits,
//! sends and receives of other patterns) go there with it. `DOORBELL_NCCL_FORWARD=0` turns this
//! off: those calls then fail naming why.

use crate::abi::{self, NcclResult, NcclUniqueId};
use crate::error::ShimError;
use doorbell::job::bootstrap::Bootstrap;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{OnceLock, RwLock};

/// The loaded library.
pub struct Real {
    lib: libloading::Library,
    pub path: PathBuf,
}

static REAL: OnceLock<Result<Real, ShimError>> = OnceLock::new();

/// Calls doorbell ran and calls it forwarded, for `DOORBELL_NCCL_LOG`.
pub static RAN: AtomicU64 = AtomicU64::new(0);
pub static FORWARDED: AtomicU64 = AtomicU64::new(0);

/// Whether forwarding is on (`DOORBELL_NCCL_FORWARD` unset, or anything but `0`).
pub fn enabled() -> bool {
    std::env::var("DOORBELL_NCCL_FORWARD").map_or(true, |v| v.trim() != "0")
}

/// The real NCCL, loaded on first use, or why there is none.
pub fn real() -> Result<&'static Real, ShimError> {
    REAL.get_or_init(|| {
        if !enabled() {
            return Err(ShimError::new(
                abi::INVALID_USAGE,
                "forwarding to a real NCCL is off (DOORBELL_NCCL_FORWARD=0)",
            ));
        }
        let path = crate::forward::real_nccl()?;
        // SAFETY: loading runs the library's initializers; a real NCCL's only set up its own
        // state. RTLD_LOCAL keeps its symbols out of the global scope, where ours answer.
        let lib = unsafe {
            libloading::os::unix::Library::open(Some(&path), libc::RTLD_NOW | libc::RTLD_LOCAL)
        }
        .map_err(|e| {
            ShimError::new(
                abi::SYSTEM_ERROR,
                format!("loading the real NCCL {}: {e}", path.display()),
            )
        })?;
        Ok(Real {
            lib: lib.into(),
            path,
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Whether the real NCCL is loaded already (without loading it).
pub fn loaded() -> bool {
    matches!(REAL.get(), Some(Ok(_)))
}

/// The real NCCL's function `name`, of C type `F` (a function pointer).
///
/// # Safety
/// `F` must be the C signature NCCL 2.28 declares for `name`.
pub unsafe fn function<F: Copy>(name: &'static str) -> Result<F, ShimError> {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<usize>());
    static CACHE: OnceLock<RwLock<HashMap<&'static str, usize>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let known = cache
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(name)
        .copied();
    let addr = match known {
        Some(a) => a,
        None => {
            let real = real()?;
            // SAFETY: the symbol is used only as the type the caller vouches for.
            let f: libloading::Symbol<'_, F> =
                unsafe { real.lib.get(name.as_bytes()) }.map_err(|e| {
                    ShimError::new(
                        abi::INVALID_USAGE,
                        format!(
                            "{name}: the real NCCL {} lacks it ({e})",
                            real.path.display()
                        ),
                    )
                })?;
            // SAFETY: F is a function pointer, the size of usize (asserted above).
            let a: usize = unsafe { std::mem::transmute_copy(&*f) };
            cache
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .insert(name, a);
            a
        }
    };
    // SAFETY: `addr` came from F (the same name is always looked up with the same type).
    Ok(unsafe { std::mem::transmute_copy(&addr) })
}

thread_local! {
    /// Set while this thread is inside a call of the real NCCL: a call of ours made then is the
    /// real NCCL calling its own API (ours interpose it when this library is preloaded).
    static INSIDE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Whether this thread is inside a call of the real NCCL.
pub fn inside() -> bool {
    INSIDE.with(|c| c.get() > 0)
}

/// Runs `f` (a call into the real NCCL) marked as inside it.
pub fn within<T>(f: impl FnOnce() -> T) -> T {
    INSIDE.with(|c| c.set(c.get() + 1));
    let r = f();
    INSIDE.with(|c| c.set(c.get() - 1));
    r
}

/// Counts a call forwarded to the real NCCL (or, `doorbell`, one doorbell ran).
pub fn count(doorbell: bool) {
    if doorbell { &RAN } else { &FORWARDED }.fetch_add(1, Ordering::Relaxed);
}

/// `DOORBELL_NCCL_LOG`: how many calls each side ran, on stderr.
pub fn log_counts(what: &str) {
    if std::env::var_os("DOORBELL_NCCL_LOG").is_some() {
        eprintln!(
            "doorbell-nccl: {what}: {} calls run by doorbell, {} forwarded to the real NCCL",
            RAN.load(Ordering::Relaxed),
            FORWARDED.load(Ordering::Relaxed)
        );
    }
}

/// A real NCCL communicator (`ncclComm_t` of the loaded library).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RealComm(pub *mut c_void);

// SAFETY: an NCCL communicator handle may be used from any thread (NCCL's contract).
unsafe impl Send for RealComm {}
// SAFETY: as above.
unsafe impl Sync for RealComm {}

/// A real call's result as ours: its code, and its last error's text.
pub fn check(call: &str, r: NcclResult) -> Result<(), ShimError> {
    if r == abi::SUCCESS {
        return Ok(());
    }
    let text = last_error();
    Err(ShimError::new(
        r,
        format!("{call} (forwarded to the real NCCL): {text}"),
    ))
}

/// The real NCCL's last error text ("" when it has none, or is not loaded).
pub fn last_error() -> String {
    type F = unsafe extern "C" fn(*mut c_void) -> *const std::ffi::c_char;
    if !loaded() {
        return String::new();
    }
    // SAFETY: ncclGetLastError(ncclComm_t) -> const char*, NULL comm allowed.
    match unsafe { function::<F>("ncclGetLastError") } {
        Ok(f) => {
            // SAFETY: NCCL returns a NUL-terminated string (never NULL) it keeps.
            let p = within(|| unsafe { f(std::ptr::null_mut()) });
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: as above.
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned()
            }
        }
        Err(_) => String::new(),
    }
}

/// The real communicator of rank `rank` of `nranks`, made beside doorbell's (collective over
/// `boot`, on the thread's current GPU, named by `gpu`: its host and PCI address): every rank
/// says whether it has a real NCCL and which GPU it is on, and rank 0 gives its unique id. Unless
/// every rank has one and no two share a GPU (the real NCCL needs a GPU per rank; doorbell does
/// not), none is made and the inner `Err` says why.
pub fn init_comm(
    boot: &Bootstrap,
    rank: usize,
    nranks: usize,
    gpu: &str,
) -> Result<Result<RealComm, String>, ShimError> {
    type GetId = unsafe extern "C" fn(*mut NcclUniqueId) -> NcclResult;
    type Init = unsafe extern "C" fn(*mut *mut c_void, c_int, NcclUniqueId, c_int) -> NcclResult;
    let mine = real().err();
    let mut id = NcclUniqueId::from_bytes(&[0; abi::UNIQUE_ID_BYTES]);
    let key = gpu.as_bytes();
    let mut word = vec![u8::from(mine.is_none()), key.len().min(255) as u8];
    word.extend_from_slice(&key[..key.len().min(255)]);
    let mut id_error = None;
    if rank == 0 && mine.is_none() {
        // SAFETY: ncclGetUniqueId(ncclUniqueId*) with a writable id.
        let f = unsafe { function::<GetId>("ncclGetUniqueId")? };
        // SAFETY: as above.
        let r = within(|| unsafe { f(&mut id) });
        id_error = check("ncclGetUniqueId", r).err();
        if id_error.is_some() {
            word[0] = 0;
        }
    }
    word.extend_from_slice(&id.bytes());
    let all = boot
        .all_gather(&word)
        .map_err(|e| ShimError::from_doorbell(&e))?;
    if let Some(r) = all.iter().position(|w| w.first() != Some(&1)) {
        let why = if r == rank {
            mine.or(id_error).map_or_else(String::new, |e| e.message)
        } else {
            "it has none (or forwarding is off there)".to_string()
        };
        return Ok(Err(format!(
            "no real NCCL communicator: rank {r} of {nranks}: {why}"
        )));
    }
    let gpu_of = |w: &Vec<u8>| w.get(2..2 + usize::from(w[1])).unwrap_or(&[]).to_vec();
    let gpus: Vec<Vec<u8>> = all.iter().map(gpu_of).collect();
    for (a, ga) in gpus.iter().enumerate() {
        if let Some(b) = gpus[a + 1..].iter().position(|g| g == ga) {
            return Ok(Err(format!(
                "no real NCCL communicator: ranks {a} and {} share a GPU ({}), and the real \
                 NCCL needs one GPU per rank",
                a + 1 + b,
                String::from_utf8_lossy(ga)
            )));
        }
    }
    let root = &all[0];
    let bytes: [u8; abi::UNIQUE_ID_BYTES] = root[root.len() - abi::UNIQUE_ID_BYTES..]
        .try_into()
        .map_err(|_| ShimError::new(abi::INTERNAL_ERROR, "rank 0's real unique id is cut"))?;
    let mut comm = std::ptr::null_mut();
    // SAFETY: ncclCommInitRank(ncclComm_t*, int, ncclUniqueId, int) with a writable handle.
    let init = unsafe { function::<Init>("ncclCommInitRank")? };
    // SAFETY: as above.
    let r = within(|| unsafe {
        init(
            &mut comm,
            nranks as c_int,
            NcclUniqueId::from_bytes(&bytes),
            rank as c_int,
        )
    });
    check("ncclCommInitRank", r)?;
    Ok(Ok(RealComm(comm)))
}
