use super::*;
use crate::abi::{NcclConfig, CONFIG_UNDEF_INT};
use crate::error::last_error_text;
use crate::id::{answers, rendezvous, RegInfo, UniqueId};
use std::ffi::CStr;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

#[test]
fn the_version_is_nccl_2_28_9s_code_and_null_is_refused() {
    let mut v = 0;
    // SAFETY: a writable int.
    assert_eq!(unsafe { ncclGetVersion(&mut v) }, abi::SUCCESS);
    assert_eq!(v, 22809);
    assert_eq!(
        abi::version_code(2, 8, 4),
        2804,
        "one digit of minor version before 2.9"
    );
    // SAFETY: NULL is checked.
    assert_eq!(
        unsafe { ncclGetVersion(std::ptr::null_mut()) },
        abi::INVALID_ARGUMENT
    );
}

#[test]
fn every_result_code_has_its_own_text_and_unknown_ones_say_so() {
    let texts: Vec<String> = (0..8)
        .map(|c| {
            let p = ncclGetErrorString(c);
            assert!(!p.is_null());
            // SAFETY: a static C string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        })
        .collect();
    let mut unique = texts.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 8, "{texts:?}");
    assert_eq!(texts[0], "no error");
    for c in [-1, 8, 1000] {
        // SAFETY: a static C string.
        let t = unsafe { CStr::from_ptr(ncclGetErrorString(c)) };
        assert_eq!(t.to_str().unwrap(), "unknown result code");
    }
}

#[test]
fn the_last_error_is_cut_at_a_character_boundary_and_its_pointer_stays() {
    let before = ncclGetLastError(std::ptr::null_mut());
    let long = "é".repeat(2000); // 4000 bytes of 2-byte characters
    let code = error::record(&error::ShimError::new(abi::REMOTE_ERROR, long));
    assert_eq!(code, abi::REMOTE_ERROR);
    assert_eq!(
        ncclGetLastError(std::ptr::null_mut()),
        before,
        "a stable pointer"
    );
    let text = last_error_text();
    // Other tests may record errors concurrently; this one's text, if still there, is whole
    // characters.
    if text.starts_with('é') {
        assert_eq!(
            text.len(),
            1022,
            "1023 bytes of room, cut back to an even count"
        );
        assert!(text.chars().all(|c| c == 'é'));
    }
}

#[test]
fn doorbells_errors_map_onto_nccls_codes() {
    use doorbell::Error as E;
    let peer = E::PeerFailed {
        me: 1,
        rank: 3,
        cause: "killed".into(),
    };
    assert_eq!(
        error::ShimError::from_doorbell(&peer).code,
        abi::REMOTE_ERROR
    );
    let bad = E::invalid("count", "at least 1");
    let e = error::ShimError::from_doorbell(&bad);
    assert_eq!(e.code, abi::INVALID_ARGUMENT);
    assert!(e.message.contains("count"), "{}", e.message);
}

fn parse(c: &NcclConfig) -> Result<config::CommConfig, error::ShimError> {
    // SAFETY: a whole config, commName NULL or a C string.
    unsafe { config::parse(c) }
}

#[test]
fn a_config_is_read_as_far_as_its_size_says_and_checked() {
    if std::env::var_os("NCCL_COMM_BLOCKING").is_some() {
        return; // the setting overrides `blocking`; this test is about the struct
    }
    // SAFETY: NULL means every default.
    assert_eq!(
        unsafe { config::parse(std::ptr::null()) }.unwrap(),
        config::CommConfig::default()
    );
    let init = NcclConfig::initializer();
    assert_eq!(parse(&init).unwrap(), config::CommConfig::default());
    let name = c"tp-group";
    let c = NcclConfig {
        blocking: 0,
        min_ctas: 4,
        max_ctas: 16,
        split_share: 1,
        comm_name: name.as_ptr(),
        ..init
    };
    let got = parse(&c).unwrap();
    assert!(!got.blocking && got.split_share);
    assert_eq!((got.min_ctas, got.max_ctas), (Some(4), Some(16)));
    assert_eq!(got.name.as_deref(), Some("tp-group"));
    // Headers older than the field: bytes past `size` are not the caller's and are not read.
    let short = NcclConfig {
        size: 32,                 // through maxCTAs
        comm_name: 8 as *const _, // garbage past the size
        split_share: 99,
        ..c
    };
    let got = parse(&short).unwrap();
    assert_eq!(
        (got.name, got.split_share, got.max_ctas),
        (None, false, Some(16))
    );
    for (bad, what) in [
        (
            NcclConfig {
                magic: 0x1234,
                ..init
            },
            "magic",
        ),
        (
            NcclConfig {
                blocking: 2,
                ..init
            },
            "blocking 2",
        ),
        (
            NcclConfig {
                min_ctas: 0,
                ..init
            },
            "minCTAs 0",
        ),
        (
            NcclConfig {
                min_ctas: 8,
                max_ctas: 4,
                ..init
            },
            "above maxCTAs",
        ),
        (NcclConfig { size: 8, ..init }, "not a config"),
    ] {
        let e = parse(&bad).unwrap_err();
        assert_eq!(e.code, abi::INVALID_ARGUMENT);
        assert!(e.message.contains(what), "{what}: {}", e.message);
    }
    assert_eq!(init.blocking, CONFIG_UNDEF_INT);
}

#[test]
fn a_unique_id_round_trips_and_a_foreign_one_is_refused() {
    for ip in [IpAddr::from([10, 1, 2, 3]), IpAddr::V6(Ipv6Addr::LOCALHOST)] {
        let id = UniqueId {
            server: SocketAddr::new(ip, 40123),
            secret: [7; 32],
        };
        assert_eq!(UniqueId::decode(&id.encode()).unwrap(), id);
    }
    let mut b = [0u8; 128];
    b[0] = 0x02; // a real NCCL id starts with its own magic
    let e = UniqueId::decode(&abi::NcclUniqueId::from_bytes(&b)).unwrap_err();
    assert_eq!(e.code, abi::INVALID_ARGUMENT);
    assert!(e.message.contains("ncclGetUniqueId"), "{}", e.message);
    // SAFETY: NULL is checked.
    assert_eq!(
        unsafe { ncclGetUniqueId(std::ptr::null_mut()) },
        abi::INVALID_ARGUMENT
    );
}

fn info(rank: u32, nranks: u32, host: &str) -> RegInfo {
    RegInfo {
        rank,
        nranks,
        host: host.into(),
        addr: if rank == 0 {
            "10.0.0.1".into()
        } else {
            String::new()
        },
        port: if rank == 0 { 5000 } else { 0 },
    }
}

#[test]
fn the_rendezvous_gives_each_rank_its_place_on_its_host_and_rank_0s_address() {
    let regs = [
        info(2, 4, "b"),
        info(0, 4, "a"),
        info(3, 4, "a"),
        info(1, 4, "b"),
    ];
    let a = answers(&regs).unwrap();
    let want = |l, n| (l, n, "10.0.0.1".to_string(), 5000);
    assert_eq!(a, vec![want(1, 2), want(0, 2), want(1, 2), want(0, 2)]);
    let e = answers(&[info(0, 2, "a"), info(0, 2, "a")]).unwrap_err();
    assert!(e.contains("registered twice"), "{e}");
    let e = answers(&[info(0, 2, "a"), info(1, 3, "a")]).unwrap_err();
    assert!(e.contains("3 ranks"), "{e}");
    let e = answers(&[info(0, 2, "a"), info(2, 2, "a")]).unwrap_err();
    assert!(e.contains("rank 2 of 2"), "{e}");
}

#[test]
fn ranks_that_initialize_with_one_id_meet_and_connect_doorbells_bootstrap() {
    let mut raw = std::mem::MaybeUninit::<abi::NcclUniqueId>::uninit();
    // SAFETY: 128 writable bytes.
    assert_eq!(unsafe { ncclGetUniqueId(raw.as_mut_ptr()) }, abi::SUCCESS);
    // SAFETY: written by the successful call.
    let id = UniqueId::decode(&unsafe { raw.assume_init() }).unwrap();
    let hosts = ["h0", "h0", "h1", "h1"];
    let joined: Vec<(usize, usize, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|r| {
                let id = id.clone();
                let host = hosts[r];
                s.spawn(move || {
                    let cfg = rendezvous(&id, r, 4, Some(host)).unwrap();
                    assert_eq!(cfg.secret, id.secret.to_vec());
                    let (local, count) = (cfg.local_rank, cfg.local_world_size);
                    let b = doorbell::job::bootstrap::Bootstrap::connect(cfg).unwrap();
                    b.barrier().unwrap();
                    let all = b.all_gather(&[r as u8]).unwrap();
                    assert_eq!(all, (0..4).map(|q| vec![q as u8]).collect::<Vec<_>>());
                    (b.rank(), local, count)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(joined, vec![(0, 0, 2), (1, 1, 2), (2, 0, 2), (3, 1, 2)]);
    // A rank outside the count is refused before anything is sent.
    let e = rendezvous(&id, 4, 4, None).unwrap_err();
    assert_eq!(e.code, abi::INVALID_ARGUMENT);
}

#[test]
fn a_rank_registered_twice_ends_the_rendezvous_with_invalid_usage_on_both() {
    let id = id::create().unwrap();
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|_| {
                let id = id.clone();
                s.spawn(move || rendezvous(&id, 1, 2, None))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        let e = r.unwrap_err();
        assert_eq!(e.code, abi::INVALID_USAGE);
        assert!(e.message.contains("registered twice"), "{}", e.message);
    }
}

#[test]
fn group_end_without_start_is_invalid_usage_and_groups_nest() {
    assert_eq!(ncclGroupEnd(), abi::INVALID_USAGE);
    // (The last error is every thread's; tests run side by side, so its text is read from the
    // call's own result.)
    let e = group::end().0.unwrap_err();
    assert!(
        e.message.contains("without ncclGroupStart"),
        "{}",
        e.message
    );
    assert_eq!(ncclGroupStart(), abi::SUCCESS);
    assert_eq!(ncclGroupStart(), abi::SUCCESS);
    assert!(group::inside());
    assert_eq!(ncclGroupEnd(), abi::SUCCESS);
    assert!(group::inside(), "still inside the outer group");
    assert_eq!(ncclGroupEnd(), abi::SUCCESS);
    assert!(!group::inside());
}

#[test]
fn init_refuses_bad_arguments_and_names_a_missing_driver() {
    let mut raw = std::mem::MaybeUninit::<abi::NcclUniqueId>::uninit();
    // SAFETY: 128 writable bytes.
    assert_eq!(unsafe { ncclGetUniqueId(raw.as_mut_ptr()) }, abi::SUCCESS);
    // SAFETY: written by the successful call.
    let id = unsafe { raw.assume_init() };
    // SAFETY: NULL out is checked.
    assert_eq!(
        unsafe { ncclCommInitRank(std::ptr::null_mut(), 2, id, 0) },
        abi::INVALID_ARGUMENT
    );
    for (n, r) in [(0, 0), (2, 2), (2, -1)] {
        let e = comm::init_rank(&id, r, n, config::CommConfig::default(), 0)
            .err()
            .unwrap();
        assert_eq!(e.code, abi::INVALID_ARGUMENT, "rank {r} of {n}");
    }
    let bad_cfg = NcclConfig {
        magic: 1,
        ..NcclConfig::initializer()
    };
    let mut out: NcclComm = std::ptr::null();
    // SAFETY: a writable handle and a whole config.
    assert_eq!(
        unsafe { ncclCommInitRankConfig(&mut out, 1, id, 0, &bad_cfg) },
        abi::INVALID_ARGUMENT
    );
    assert!(out.is_null(), "nothing written on failure");
    if let Err(e) = comm::current_device() {
        // No driver here (CI): the init says so before it meets anyone.
        assert!(e.message.contains("libcuda"), "{}", e.message);
        // SAFETY: a writable handle.
        assert_eq!(
            unsafe { ncclCommInitRank(&mut out, 1, id, 0) },
            abi::UNHANDLED_CUDA_ERROR
        );
        assert!(out.is_null());
    }
}

#[test]
fn one_thread_initializes_two_ranks_in_a_group_and_both_reach_the_gpu_step() {
    // As nccl-tests with -g 2: both inits in one group of one thread. Held until the group's
    // end, they run side by side (one after another they would wait for each other until the
    // bootstrap timeout). Here without a GPU, both meet, connect doorbell's bootstrap, and stop
    // where the communicator needs the driver.
    let id = id::create().unwrap().encode();
    assert_eq!(ncclGroupStart(), abi::SUCCESS);
    let comms: Vec<_> = (0..2)
        .map(|r| comm::init_rank(&id, r, 2, config::CommConfig::default(), 0).unwrap())
        .collect();
    for c in &comms {
        assert_eq!(
            c.async_error(),
            abi::IN_PROGRESS,
            "not built before the group ends"
        );
        assert_eq!(c.communicator().err().unwrap().code, abi::INVALID_USAGE);
    }
    let started = std::time::Instant::now();
    let r = ncclGroupEnd();
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "side by side, not one after another"
    );
    if comm::current_device().is_err() {
        assert_eq!(r, abi::UNHANDLED_CUDA_ERROR);
        for c in &comms {
            assert_eq!(c.async_error(), abi::UNHANDLED_CUDA_ERROR);
        }
    } else {
        assert_eq!(r, abi::SUCCESS);
    }
    // The handle's queries work either way.
    let h = comm::publish(comms[1].clone());
    let (mut n, mut rank, mut dev) = (0, 0, -1);
    // SAFETY: a live handle (another Arc keeps it) and writable ints.
    unsafe {
        assert_eq!(ncclCommCount(h, &mut n), abi::SUCCESS);
        assert_eq!(ncclCommUserRank(h, &mut rank), abi::SUCCESS);
        assert_eq!(ncclCommCuDevice(h, &mut dev), abi::SUCCESS);
        assert_eq!(
            ncclCommCount(h, std::ptr::null_mut()),
            abi::INVALID_ARGUMENT
        );
        assert_eq!(ncclCommDestroy(h), abi::SUCCESS);
        assert_eq!(
            ncclCommCount(std::ptr::null(), &mut n),
            abi::INVALID_ARGUMENT
        );
    }
    assert_eq!((n, rank, dev), (2, 1, 0));
}

/// A one-rank communicator; without a GPU (CI) its init fails at the GPU step and it stays
/// unbuilt.
fn one_rank_comm() -> Arc<comm::Comm> {
    let id = id::create().unwrap().encode();
    group::start();
    let c = comm::init_rank(&id, 0, 1, config::CommConfig::default(), 0).unwrap();
    let _ = group::end();
    c
}

#[test]
fn collectives_check_their_arguments_and_name_what_is_not_native() {
    use abi::{dtype, op};
    let c = one_rank_comm();
    let code = |r: Result<(), error::ShimError>| r.map_err(|e| (e.code, e.message)).err();
    let ar = |t, o, n, s: u64, r: u64| code(colls::all_reduce(&c, s, r, n, t, o, 0));
    // Checked before anything else, GPU or not.
    let (k, m) = ar(12, op::SUM, 4, 16, 32).unwrap();
    assert_eq!(k, abi::INVALID_ARGUMENT);
    assert!(m.contains("no NCCL type"), "{m}");
    assert_eq!(
        ar(dtype::FLOAT32, -1, 4, 16, 32).unwrap().0,
        abi::INVALID_ARGUMENT
    );
    let (k, m) = ar(dtype::FLOAT32, op::SUM, 4, 0, 32).unwrap();
    assert_eq!(k, abi::INVALID_ARGUMENT);
    assert!(m.contains("sendbuff is NULL"), "{m}");
    assert_eq!(
        ar(dtype::FLOAT64, op::SUM, usize::MAX / 4, 16, 32)
            .unwrap()
            .0,
        abi::INVALID_ARGUMENT
    );
    // Not doorbell's: named, not run.
    let (k, m) = ar(dtype::INT64, op::PROD, 4, 16, 32).unwrap();
    assert_eq!(k, abi::INVALID_USAGE);
    assert!(m.contains("int64") && m.contains("real NCCL"), "{m}");
    let (k, m) = ar(dtype::BFLOAT16, op::PROD, 4, 16, 32).unwrap();
    assert_eq!(k, abi::INVALID_USAGE);
    assert!(m.contains("prod"), "{m}");
    // Which allreduces doorbell runs: the sum and the average of the float types always (the
    // real NCCL never sees them), the maximum and minimum where no real NCCL runs them.
    for t in [dtype::BFLOAT16, dtype::FLOAT16, dtype::FLOAT32] {
        assert!(colls::all_reduce_native(t, op::SUM) && colls::all_reduce_native(t, op::AVG));
        assert!(!colls::all_reduce_native(t, op::MAX) && !colls::all_reduce_native(t, op::MIN));
        for o in [op::SUM, op::AVG, op::MAX, op::MIN] {
            assert!(colls::all_reduce_doorbell(t, o), "{t} {o}");
        }
        assert!(!colls::all_reduce_doorbell(t, op::PROD));
    }
    for t in [
        dtype::INT32,
        dtype::INT64,
        dtype::FLOAT64,
        dtype::FLOAT8_E4M3,
    ] {
        assert!(!colls::all_reduce_doorbell(t, op::SUM) && !colls::all_reduce_doorbell(t, op::MAX));
    }
    if comm::current_device().is_err() {
        // Doorbell's maximum on a communicator whose init failed: invalid usage, named.
        let (k, m) = ar(dtype::BFLOAT16, op::MAX, 4, 16, 32).unwrap();
        assert_eq!(k, abi::INVALID_USAGE);
        assert!(m.contains("not initialized"), "{m}");
    }
    let a2a = |n, s: u64, r: u64| code(colls::all_to_all(&c, s, r, n, dtype::FLOAT32, 0));
    if comm::current_device().is_err() {
        // In place is NCCL's too (the input is copied aside): only the missing init refuses it.
        let (k, m) = a2a(4, 64, 64).unwrap();
        assert_eq!(k, abi::INVALID_USAGE);
        assert!(m.contains("not initialized"), "{m}");
    }
    assert_eq!(
        a2a(usize::MAX / 2, 64, 128).unwrap().0,
        abi::INVALID_ARGUMENT
    );
    if comm::current_device().is_err() {
        // A valid call on a communicator whose init failed: invalid usage, named.
        let (k, m) = ar(dtype::FLOAT32, op::SUM, 4, 16, 32).unwrap();
        assert_eq!(k, abi::INVALID_USAGE);
        assert!(m.contains("not initialized"), "{m}");
        assert_eq!(a2a(4, 64, 128).unwrap().0, abi::INVALID_USAGE);
    }
    // Through the C entry points: a NULL communicator.
    // SAFETY: NULL comm is checked first.
    let r = unsafe {
        ncclAllReduce(
            16 as *const _,
            32 as *mut _,
            4,
            dtype::FLOAT32,
            op::SUM,
            std::ptr::null(),
            std::ptr::null_mut(),
        )
    };
    assert_eq!(r, abi::INVALID_ARGUMENT);
    // SAFETY: as above.
    let r = unsafe {
        ncclAlltoAll(
            16 as *const _,
            32 as *mut _,
            4,
            dtype::FLOAT32,
            std::ptr::null(),
            std::ptr::null_mut(),
        )
    };
    assert_eq!(r, abi::INVALID_ARGUMENT);
}

#[test]
fn the_real_nccl_is_the_setting_or_the_first_one_found_that_is_not_this_library() {
    let root = std::env::temp_dir().join(format!("doorbell-nccl-forward-{}", std::process::id()));
    let (a, b, c) = (root.join("a"), root.join("b"), root.join("c"));
    for d in [&a, &b, &c] {
        std::fs::create_dir_all(d).unwrap();
    }
    // a: this library installed as libnccl.so.2 (a link to it); b: a real one; c: another.
    let me = root.join("libdoorbell_nccl.so");
    std::fs::write(&me, b"me").unwrap();
    let _ = std::fs::remove_file(a.join(forward::SONAME));
    std::os::unix::fs::symlink(&me, a.join(forward::SONAME)).unwrap();
    std::fs::write(b.join(forward::SONAME), b"real").unwrap();
    std::fs::write(c.join(forward::SONAME), b"other").unwrap();
    let dirs = vec![root.join("missing"), a.clone(), b.clone(), c.clone()];
    let got = forward::choose(None, &dirs, Some(&me)).unwrap();
    assert_eq!(
        got,
        b.join(forward::SONAME),
        "itself skipped, the first real one taken"
    );
    // The setting wins, and must be a real file that is not this library.
    let set = c.join(forward::SONAME);
    assert_eq!(
        forward::choose(set.to_str(), &dirs, Some(&me)).unwrap(),
        set
    );
    let e = forward::choose(a.join(forward::SONAME).to_str(), &dirs, Some(&me)).unwrap_err();
    assert!(e.message.contains("this library itself"), "{}", e.message);
    let e = forward::choose(Some("/nonexistent/libnccl.so.2"), &dirs, Some(&me)).unwrap_err();
    assert!(e.message.contains("no such file"), "{}", e.message);
    // None at all: the error says how to name one.
    let e = forward::choose(None, std::slice::from_ref(&a), Some(&me)).unwrap_err();
    assert_eq!(e.code, abi::SYSTEM_ERROR);
    assert!(e.message.contains("DOORBELL_NCCL_REAL"), "{}", e.message);
    let dirs = forward::search_dirs(Some("/x::/y"));
    assert_eq!(
        &dirs[..2],
        &[
            std::path::PathBuf::from("/x"),
            std::path::PathBuf::from("/y")
        ]
    );
    assert!(
        forward::own_path().is_some(),
        "the loader knows this object's file"
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn sends_and_receives_are_held_in_a_group_and_checked_at_its_end() {
    use abi::dtype;
    let c = one_rank_comm();
    let h = comm::publish(c.clone());
    let f32s = dtype::FLOAT32;
    // SAFETY: a live handle (kept by `c`), buffers never touched without a built communicator.
    unsafe {
        // Outside a group: not doorbell's to run.
        assert_eq!(
            ncclSend(64 as *const _, 4, f32s, 0, h, std::ptr::null_mut()),
            abi::INVALID_USAGE
        );
        // A peer outside the communicator, a NULL buffer: invalid arguments.
        assert_eq!(ncclGroupStart(), abi::SUCCESS);
        assert_eq!(
            ncclRecv(128 as *mut _, 4, f32s, 1, h, std::ptr::null_mut()),
            abi::INVALID_ARGUMENT
        );
        assert_eq!(
            ncclRecv(std::ptr::null_mut(), 4, f32s, 0, h, std::ptr::null_mut()),
            abi::INVALID_ARGUMENT
        );
        // An all-to-all of one rank: held, then run at the end (without a GPU the communicator
        // is not built, which the end reports).
        assert_eq!(
            ncclSend(64 as *const _, 4, f32s, 0, h, std::ptr::null_mut()),
            abi::SUCCESS
        );
        assert_eq!(
            ncclRecv(128 as *mut _, 4, f32s, 0, h, std::ptr::null_mut()),
            abi::SUCCESS
        );
        let r = ncclGroupEnd();
        if comm::current_device().is_err() {
            assert_eq!(r, abi::INVALID_USAGE);
        }
        // A pattern that is no all-to-all (two sends to one rank): named at the end.
        assert_eq!(ncclGroupStart(), abi::SUCCESS);
        assert_eq!(
            ncclSend(64 as *const _, 4, f32s, 0, h, std::ptr::null_mut()),
            abi::SUCCESS
        );
        assert_eq!(
            ncclSend(96 as *const _, 4, f32s, 0, h, std::ptr::null_mut()),
            abi::SUCCESS
        );
        assert_eq!(ncclGroupEnd(), abi::INVALID_USAGE);
        let e = colls::grouped_p2p(
            &c,
            &[
                p2p::P2pOp {
                    send: true,
                    peer: 0,
                    ptr: 64,
                    bytes: 16,
                    stream: 0,
                },
                p2p::P2pOp {
                    send: true,
                    peer: 0,
                    ptr: 96,
                    bytes: 16,
                    stream: 0,
                },
            ],
        )
        .unwrap_err();
        assert!(
            e.message.contains("more than one send to rank 0"),
            "{}",
            e.message
        );
        assert_eq!(ncclCommDestroy(h), abi::SUCCESS);
    }
}

#[test]
fn init_all_makes_every_rank_of_one_process_side_by_side_or_leaves_no_handle() {
    let mut comms: [NcclComm; 3] = [std::ptr::null(); 3];
    // SAFETY: room for 3 handles; a NULL devlist.
    unsafe {
        assert_eq!(
            ncclCommInitAll(std::ptr::null_mut(), 3, std::ptr::null()),
            abi::INVALID_ARGUMENT
        );
        assert_eq!(
            ncclCommInitAll(comms.as_mut_ptr(), 0, std::ptr::null()),
            abi::INVALID_ARGUMENT
        );
        let bad = [0, -1, 2];
        assert_eq!(
            ncclCommInitAll(comms.as_mut_ptr(), 3, bad.as_ptr()),
            abi::INVALID_ARGUMENT
        );
        let started = std::time::Instant::now();
        let r = ncclCommInitAll(comms.as_mut_ptr(), 3, std::ptr::null());
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "side by side"
        );
        if comm::current_device().is_err() {
            // Without a GPU all three meet and stop at the GPU step: no handle left.
            assert_eq!(r, abi::UNHANDLED_CUDA_ERROR);
            assert!(comms.iter().all(|c| c.is_null()));
        } else if r == abi::SUCCESS {
            for (i, &c) in comms.iter().enumerate() {
                let mut rank = -1;
                assert_eq!(ncclCommUserRank(c, &mut rank), abi::SUCCESS);
                assert_eq!(rank, i as i32);
                assert_eq!(ncclCommDestroy(c), abi::SUCCESS);
            }
        }
    }
}
