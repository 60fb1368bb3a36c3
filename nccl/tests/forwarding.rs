//! Forwarding to the real NCCL, against a stand-in: a C library built here that exports the
//! functions forwarded calls reach (NCCL 2.28's prototypes) and logs each call with its
//! arguments. `DOORBELL_NCCL_REAL` points at it, so this process's forwarded calls land there;
//! the checks read its log. Needs a C compiler (`cc`, or `CC`). One test function: the loaded
//! library is the process's.

mod common;

use doorbell_nccl::comm::Comm;
use doorbell_nccl::forwarded::{
    ncclAllGather, ncclCommFinalize, ncclCommSplit, ncclMemAlloc, ncclRedOpCreatePreMulSum,
    ncclReduce,
};
use doorbell_nccl::real::{self, RealComm};
use doorbell_nccl::{abi, NcclComm};
use doorbell_nccl::{
    ncclAllReduce, ncclCommCount, ncclCommDestroy, ncclCommUserRank, ncclGetLastError,
    ncclGroupEnd, ncclGroupStart, ncclRecv, ncclSend,
};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::Arc;

const STAND_IN: &str = r#"
#include <stdio.h>
#include <string.h>
#include <stddef.h>
typedef struct { char internal[128]; } ncclUniqueId;
static char log_[8192];
static void note(const char* s) { strncat(log_, s, sizeof log_ - strlen(log_) - 2); strcat(log_, "\n"); }
const char* stand_in_log(void) { return log_; }
#define LOG(...) do { char line_[256]; snprintf(line_, sizeof line_, __VA_ARGS__); note(line_); } while (0)
int ncclGetUniqueId(ncclUniqueId* id) { memset(id, 7, sizeof *id); LOG("id"); return 0; }
int ncclCommInitRank(void** c, int n, ncclUniqueId id, int r) {
  *c = (void*)0x5000; LOG("init %d %d %d", n, r, id.internal[5]); return 0; }
int ncclAllGather(const void* s, void* r, size_t n, int t, void* c, void* st) {
  LOG("allgather %p %p %zu %d %p %p", s, r, n, t, c, st); return n == 99 ? 5 : 0; }
int ncclAllReduce(const void* s, void* r, size_t n, int t, int op, void* c, void* st) {
  LOG("allreduce %zu %d %d %p", n, t, op, c); return 0; }
int ncclReduce(const void* s, void* r, size_t n, int t, int op, int root, void* c, void* st) {
  LOG("reduce %zu %d %d %d %p", n, t, op, root, c); return 0; }
int ncclSend(const void* b, size_t n, int t, int peer, void* c, void* st) {
  LOG("send %p %zu %d %d %p", b, n, t, peer, c); return 0; }
int ncclRecv(void* b, size_t n, int t, int peer, void* c, void* st) {
  LOG("recv %p %zu %d %d %p", b, n, t, peer, c); return 0; }
int ncclGroupStart(void) { LOG("group start"); return 0; }
int ncclGroupEnd(void) { LOG("group end"); return 0; }
int ncclCommSplit(void* c, int color, int key, void** out, void* cfg) {
  LOG("split %p %d %d", c, color, key); *out = color < 0 ? NULL : (void*)0x6000; return 0; }
int ncclCommUserRank(void* c, int* r) { *r = 1; return 0; }
int ncclCommCount(void* c, int* n) { *n = 3; return 0; }
int ncclCommDestroy(void* c) { LOG("destroy %p", c); return 0; }
int ncclCommFinalize(void* c) { LOG("finalize %p", c); return 0; }
int ncclCommGetAsyncError(void* c, int* e) { *e = 0; return 0; }
int ncclMemAlloc(void** p, size_t n) { *p = (void*)0x7000; LOG("memalloc %zu", n); return 0; }
int ncclRedOpCreatePreMulSum(int* op, void* s, int t, int res, void* c) {
  *op = 5; LOG("premulsum %d %d %p", t, res, c); return 0; }
const char* ncclGetLastError(void* c) { return "the stand-in refused"; }
"#;

fn build_stand_in() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nccl_stand_in");
    std::fs::create_dir_all(&dir).unwrap();
    let (src, lib) = (dir.join("stand_in.c"), dir.join("libnccl.so.2"));
    std::fs::write(&src, STAND_IN).unwrap();
    common::compile(&[
        "-std=c11".as_ref(),
        "-shared".as_ref(),
        "-fPIC".as_ref(),
        "-o".as_ref(),
        lib.as_os_str(),
        src.as_os_str(),
    ]);
    lib
}

/// The stand-in's log so far (the loader gives back the library already loaded).
fn log_of(lib: &PathBuf) -> String {
    // SAFETY: the stand-in built above; stand_in_log() returns its NUL-terminated buffer.
    unsafe {
        let l = libloading::Library::new(lib).unwrap();
        let f: libloading::Symbol<unsafe extern "C" fn() -> *const c_char> =
            l.get(b"stand_in_log").unwrap();
        CStr::from_ptr(f()).to_string_lossy().into_owned()
    }
}

fn handle(c: Comm) -> NcclComm {
    doorbell_nccl::comm::publish(Arc::new(c))
}

#[test]
fn calls_doorbell_does_not_run_reach_the_real_nccl_with_the_real_communicator() {
    let lib = build_stand_in();
    std::env::set_var("DOORBELL_NCCL_REAL", &lib);
    std::env::remove_var("DOORBELL_NCCL_FORWARD");
    assert!(real::enabled());
    assert!(
        !real::loaded(),
        "nothing loads the real NCCL before it is needed"
    );
    let twin = RealComm(0x5000 as *mut c_void);
    let c = handle(Comm::forward_only(twin, 0, 2, 0));
    let (s, r, st) = (
        0x10 as *const c_void,
        0x20 as *mut c_void,
        0x30 as *mut c_void,
    );
    // SAFETY: the stand-in only logs its arguments.
    unsafe {
        // A collective doorbell does not run: the same arguments, the twin's handle.
        assert_eq!(ncclAllGather(s, r, 4, 7, c, st), abi::SUCCESS);
        assert!(real::loaded());
        // On a communicator of the real NCCL only, even doorbell's own collectives go there.
        assert_eq!(ncclAllReduce(s, r, 8, 9, 0, c, st), abi::SUCCESS);
        assert_eq!(ncclReduce(s, r, 8, 7, 2, 1, c, st), abi::SUCCESS);
        // A refusal of the real NCCL: its code, and its text in ours.
        assert_eq!(ncclAllGather(s, r, 99, 7, c, st), abi::INVALID_USAGE);
        let last = CStr::from_ptr(ncclGetLastError(std::ptr::null_mut())).to_string_lossy();
        assert!(
            last.contains("ncclAllGather (forwarded to the real NCCL): the stand-in refused"),
            "{last}"
        );
        // Sends and receives outside a group, and inside one (whose start and end reach the
        // real NCCL too).
        assert_eq!(ncclSend(s, 3, 1, 1, c, st), abi::SUCCESS);
        assert_eq!(ncclGroupStart(), abi::SUCCESS);
        assert_eq!(ncclRecv(r, 5, 2, 0, c, st), abi::SUCCESS);
        assert_eq!(ncclGroupEnd(), abi::SUCCESS);
        // A split: a new handle of ours over the real NCCL's new communicator.
        let mut made: NcclComm = std::ptr::null();
        assert_eq!(
            ncclCommSplit(c, 2, 0, &mut made, std::ptr::null()),
            abi::SUCCESS
        );
        assert!(!made.is_null());
        let (mut rank, mut n) = (0, 0);
        assert_eq!(ncclCommUserRank(made, &mut rank), abi::SUCCESS);
        assert_eq!(ncclCommCount(made, &mut n), abi::SUCCESS);
        assert_eq!((rank, n), (1, 3), "the real NCCL's rank and size");
        assert_eq!(ncclAllGather(s, r, 1, 0, made, st), abi::SUCCESS);
        assert_eq!(ncclCommFinalize(made), abi::SUCCESS);
        assert_eq!(ncclCommDestroy(made), abi::SUCCESS);
        let mut none: NcclComm = 0x1 as NcclComm;
        assert_eq!(
            ncclCommSplit(c, -1, 0, &mut none, std::ptr::null()),
            abi::SUCCESS
        );
        assert!(none.is_null(), "NCCL_SPLIT_NOCOLOR: no communicator");
        // Reduction ops and memory.
        let mut op: c_int = 0;
        let mut scalar = 2.0f32;
        assert_eq!(
            ncclRedOpCreatePreMulSum(&mut op, (&mut scalar as *mut f32).cast(), 7, 1, c),
            abi::SUCCESS
        );
        assert_eq!(op, 5);
        let mut p: *mut c_void = std::ptr::null_mut();
        assert_eq!(ncclMemAlloc(&mut p, 4096), abi::SUCCESS);
        assert_eq!(p as usize, 0x7000);
        // A handle of the real NCCL's own (the real NCCL calling its API, which ours interpose
        // when preloaded): passed through as it is.
        let theirs = 0x9000 as NcclComm;
        assert_eq!(ncclAllGather(s, r, 2, 7, theirs, st), abi::SUCCESS);
        assert_eq!(ncclCommCount(theirs, &mut n), abi::SUCCESS);
        assert_eq!(n, 3, "the real NCCL's own count");
        assert_eq!(ncclCommDestroy(c), abi::SUCCESS);
    }
    let got = log_of(&lib);
    let want = [
        "allgather 0x10 0x20 4 7 0x5000 0x30",
        "allreduce 8 9 0 0x5000",
        "reduce 8 7 2 1 0x5000",
        "allgather 0x10 0x20 99 7 0x5000 0x30",
        "send 0x10 3 1 1 0x5000",
        "group start",
        "recv 0x20 5 2 0 0x5000",
        "group end",
        "split 0x5000 2 0",
        "allgather 0x10 0x20 1 0 0x6000 0x30",
        "finalize 0x6000",
        "destroy 0x6000",
        "split 0x5000 -1 0",
        "premulsum 7 1 0x5000",
        "memalloc 4096",
        "allgather 0x10 0x20 2 7 0x9000 0x30",
        "destroy 0x5000",
    ];
    assert_eq!(got.lines().collect::<Vec<_>>(), want, "the stand-in's log");

    // The real twin made beside doorbell's communicator, through doorbell's bootstrap: in a
    // one-rank job rank 0 asks the real NCCL for an id and makes its communicator with it.
    let uid = doorbell_nccl::id::create().unwrap();
    let cfg = doorbell_nccl::id::rendezvous(&uid, 0, 1, None).unwrap();
    let boot = doorbell::job::bootstrap::Bootstrap::connect(cfg).unwrap();
    let made = real::init_comm(&boot, 0, 1, "host/0000:01:00.0")
        .unwrap()
        .unwrap();
    assert_eq!(made, RealComm(0x5000 as *mut c_void));
    let got = log_of(&lib);
    assert!(
        got.lines().skip(want.len()).any(|l| l == "id") && got.lines().any(|l| l == "init 1 0 7"),
        "rank 0's real id reached ncclCommInitRank: {got}"
    );
}
