//! The C ABI as a C program sees it: NCCL's prototypes (declared here from NCCL 2.28's
//! documented API), linked against libdoorbell_nccl.so, the unique id passed by value. Needs a C
//! compiler (`cc`, or `CC`).

mod common;

use std::path::PathBuf;
use std::process::Command;

const PROGRAM: &str = r#"
#include <stdio.h>
#include <string.h>
#include <stddef.h>
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct ncclComm* ncclComm_t;
int ncclGetVersion(int* version);
const char* ncclGetErrorString(int result);
const char* ncclGetLastError(ncclComm_t comm);
int ncclGetUniqueId(ncclUniqueId* id);
int ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
int ncclCommCount(ncclComm_t comm, int* count);
int ncclCommDestroy(ncclComm_t comm);
int ncclGroupStart(void);
int ncclGroupEnd(void);
int ncclAllReduce(const void* s, void* r, size_t n, int t, int op, ncclComm_t c, void* stream);

int main(void) {
  int v = 0;
  int rv = ncclGetVersion(&v);
  printf("version %d %d\n", rv, v);
  printf("string %s\n", ncclGetErrorString(4));
  ncclUniqueId id;
  memset(&id, 0x55, sizeof id);
  printf("uid %d\n", ncclGetUniqueId(&id));
  ncclUniqueId bad = id;
  bad.internal[0] ^= 1;
  ncclComm_t c = NULL;
  /* A damaged id, by value: refused as invalid before anything else. */
  int rb = ncclCommInitRank(&c, 1, bad, 0);
  printf("bad %d %s\n", rb, c == NULL ? "null" : "set");
  printf("last %s\n", ncclGetLastError(NULL));
  /* The real id: a communicator of one (without a GPU: the driver is missing). */
  int r = ncclCommInitRank(&c, 1, id, 0);
  printf("init %d\n", r);
  if (r == 0) {
    int n = 0;
    int rc = ncclCommCount(c, &n);
    printf("count %d %d\n", rc, n);
    printf("destroy %d\n", ncclCommDestroy(c));
  } else {
    printf("why %s\n", ncclGetLastError(NULL));
  }
  int g1 = ncclGroupStart();
  int g2 = ncclGroupEnd();
  int g3 = ncclGroupEnd();
  printf("group %d %d %d\n", g1, g2, g3);
  printf("null comm %d\n", ncclAllReduce(NULL, NULL, 0, 7, 0, NULL, NULL));
  return 0;
}
"#;

#[test]
fn a_c_program_calls_the_abi_with_the_unique_id_by_value() {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    assert!(
        deps.join("libdoorbell_nccl.so").is_file(),
        "cargo builds the cdylib for integration tests"
    );
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nccl_c_abi");
    std::fs::create_dir_all(&dir).unwrap();
    let (src, bin) = (dir.join("abi.c"), dir.join("abi"));
    std::fs::write(&src, PROGRAM).unwrap();
    let (lib_dir, rpath) = (
        format!("-L{}", deps.display()),
        format!("-Wl,-rpath,{}", deps.display()),
    );
    common::compile(&[
        "-std=c11".as_ref(),
        "-o".as_ref(),
        bin.as_os_str(),
        src.as_os_str(),
        lib_dir.as_ref(),
        "-ldoorbell_nccl".as_ref(),
        rpath.as_ref(),
    ]);
    let out = Command::new(&bin).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{k} ")))
            .unwrap_or_else(|| panic!("no {k} line in:\n{text}"))
            .to_string()
    };
    assert_eq!(line("version"), "0 22809");
    assert!(line("string").starts_with("invalid argument"), "{text}");
    assert_eq!(line("uid"), "0");
    assert_eq!(
        line("bad"),
        "4 null",
        "the damaged id's bytes arrived by value"
    );
    assert!(line("last").contains("ncclUniqueId"), "{text}");
    match line("init").as_str() {
        "0" => assert_eq!(line("count"), "0 1"),
        "1" => assert!(line("why").contains("libcuda"), "{text}"),
        other => panic!("init {other}:\n{text}"),
    }
    assert_eq!(
        line("group"),
        "0 0 5",
        "an end without a start is invalid usage"
    );
    assert_eq!(line("null comm"), "4");
}
