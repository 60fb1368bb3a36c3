//! The device headers' tiers, checked: every header under `cuda/include/doorbell/` sits in a tier
//! folder (only `doorbell.cuh` sits above them), includes only headers of its own tier or the
//! tiers below it, and no include cycle runs through them; `doorbell.cuh` brings in `core/`, `ib/`
//! and `channel/` and never `coll/` or `detail/`; each header compiles alone from host code.
//!
//! The order, bottom to top, and why:
//! - `core/`: memory-model leaves, bounded waits, copies, sums, LL packets. Includes nothing of
//!   doorbell's outside itself.
//! - `ib/`: mlx5 work requests the GPU posts (IBGDA), built on `core/` only.
//! - `channel/`: semaphores, MemoryChannel, the trigger FIFO and PortChannel. It sits above `ib/`
//!   because a PortChannel whose kernel posts its own RDMA calls into `ib/` (the host side has the
//!   same order: `transport/` below `channel/` in `tests/layers.rs`).
//! - `coll/`: the collective call check and the MoE exchanges as device calls for the user's own
//!   kernels, with their argument structs and limits.
//! - `detail/`: launch arguments of doorbell's own kernels, which no user kernel needs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Tier folders, bottom to top. A header may include its own tier and those below.
const TIERS: &[&str] = &["core", "ib", "channel", "coll", "detail"];

/// The one header that sits above the tier folders.
const UMBRELLA: &str = "doorbell.cuh";

/// Tiers the umbrella header must not reach, directly or through another header.
const NOT_IN_UMBRELLA: &[&str] = &["coll", "detail"];

fn header_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda/include/doorbell")
}

/// Every `.cuh` under `dir`, as paths relative to `root` with `/` separators.
fn headers_under(root: &Path, dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            headers_under(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "cuh") {
            let rel = path.strip_prefix(root).expect("under the header root");
            let parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            out.push(parts.join("/"));
        }
    }
}

/// `a/b/../c/./d` -> `a/c/d`; `None` if it climbs out of the root.
fn normalize(path: &str) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    for p in path.split('/') {
        match p {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            p => parts.push(p),
        }
    }
    Some(parts.join("/"))
}

/// The doorbell headers `text` (the header `name`) includes, as paths relative to the header root:
/// `#include "x"` relative to the header's own folder, `#include <doorbell/x>` relative to the
/// root. System and CUDA headers (`<stdint.h>`, `<cuda_bf16.h>`) are not doorbell's and are left
/// out. An include that climbs out of the root is kept as written, so the checks name it.
fn includes_of(name: &str, text: &str) -> Vec<String> {
    let dir = name.rsplit_once('/').map_or("", |(d, _)| d);
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.trim_start().strip_prefix('#') else {
            continue;
        };
        let Some(rest) = rest.trim_start().strip_prefix("include") else {
            continue;
        };
        let rest = rest.trim_start();
        if let Some(q) = rest.strip_prefix('"') {
            let target = q.split('"').next().unwrap_or_default();
            let joined = if dir.is_empty() {
                target.to_string()
            } else {
                format!("{dir}/{target}")
            };
            out.push(normalize(&joined).unwrap_or_else(|| target.to_string()));
        } else if let Some(a) = rest.strip_prefix("<doorbell/") {
            let target = a.split('>').next().unwrap_or_default();
            out.push(normalize(target).unwrap_or_else(|| target.to_string()));
        }
    }
    out
}

/// The tier of a header path (`core/wait.cuh` -> `Some(0)`); `None` for the umbrella header or a
/// path outside the tier folders.
fn tier_of(path: &str) -> Option<usize> {
    let (folder, file) = path.split_once('/')?;
    if file.contains('/') {
        return None;
    }
    TIERS.iter().position(|t| *t == folder)
}

/// Everything wrong with the include graph `graph` (header -> the headers it includes), each as
/// one line naming the header and the include at fault. Empty when the tiers hold.
fn violations(graph: &BTreeMap<String, Vec<String>>) -> Vec<String> {
    let mut bad = Vec::new();
    for (header, includes) in graph {
        let tier = tier_of(header);
        if tier.is_none() && header != UMBRELLA {
            bad.push(format!(
                "{header} sits outside the tier folders ({}): move it into the one its contents \
                 belong to",
                TIERS.join(", ")
            ));
        }
        for inc in includes {
            if !graph.contains_key(inc) {
                bad.push(format!(
                    "{header} includes \"{inc}\", which is no header of doorbell's"
                ));
                continue;
            }
            let inc_tier = tier_of(inc);
            match (tier, inc_tier) {
                (Some(t), Some(i)) if i > t => bad.push(format!(
                    "{header} (tier {}) includes {inc} from the higher tier {}: a header includes \
                     only its own tier or those below ({})",
                    TIERS[t],
                    TIERS[i],
                    TIERS.join(" < ")
                )),
                (Some(_), None) => bad.push(format!(
                    "{header} includes {inc}, which is above every tier: include the tier headers \
                     it needs instead"
                )),
                _ => {}
            }
            if header == UMBRELLA {
                if let Some(i) = inc_tier.filter(|i| NOT_IN_UMBRELLA.contains(&TIERS[*i])) {
                    bad.push(format!(
                        "{UMBRELLA} includes {inc}: it brings in core, ib and channel only; \
                         {}/ headers are included by the kernels that use them",
                        TIERS[i]
                    ));
                }
            }
        }
    }
    // What the umbrella reaches through other headers (a direct include is reported above).
    let mut reached = BTreeSet::new();
    let mut stack: Vec<(String, String)> = graph
        .get(UMBRELLA)
        .into_iter()
        .flatten()
        .map(|i| (i.clone(), i.clone()))
        .collect();
    while let Some((h, via)) = stack.pop() {
        if !reached.insert(h.clone()) {
            continue;
        }
        if let Some(t) = tier_of(&h).filter(|t| NOT_IN_UMBRELLA.contains(&TIERS[*t])) {
            if h != via {
                bad.push(format!(
                    "{UMBRELLA} reaches {h} (tier {}) through {via}",
                    TIERS[t]
                ));
            }
        }
        for i in graph.get(&h).into_iter().flatten() {
            stack.push((i.clone(), via.clone()));
        }
    }
    if let Some(cycle) = find_cycle(graph) {
        bad.push(format!(
            "an include cycle (#pragma once hides it from the compiler): {}",
            cycle.join(" -> ")
        ));
    }
    bad
}

/// One include cycle of `graph`, as the headers along it with the first repeated at the end.
fn find_cycle(graph: &BTreeMap<String, Vec<String>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum State {
        OnPath,
        Done,
    }
    fn visit(
        h: &str,
        graph: &BTreeMap<String, Vec<String>>,
        state: &mut BTreeMap<String, State>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(h.to_string(), State::OnPath);
        path.push(h.to_string());
        for i in graph.get(h).into_iter().flatten() {
            match state.get(i.as_str()) {
                Some(State::OnPath) => {
                    let from = path.iter().position(|p| p == i).expect("on the path");
                    let mut cycle = path[from..].to_vec();
                    cycle.push(i.clone());
                    return Some(cycle);
                }
                Some(State::Done) => {}
                None => {
                    if graph.contains_key(i) {
                        if let Some(c) = visit(i, graph, state, path) {
                            return Some(c);
                        }
                    }
                }
            }
        }
        path.pop();
        state.insert(h.to_string(), State::Done);
        None
    }
    let mut state = BTreeMap::new();
    for h in graph.keys() {
        if !state.contains_key(h) {
            if let Some(c) = visit(h, graph, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

/// The include graph of the headers in the tree.
fn tree_graph() -> BTreeMap<String, Vec<String>> {
    let root = header_root();
    let mut names = Vec::new();
    headers_under(&root, &root, &mut names);
    names
        .into_iter()
        .map(|name| {
            let text = std::fs::read_to_string(root.join(&name))
                .unwrap_or_else(|e| panic!("read {name}: {e}"));
            let includes = includes_of(&name, &text);
            (name, includes)
        })
        .collect()
}

#[test]
fn headers_keep_their_tiers() {
    let graph = tree_graph();
    assert!(
        graph.contains_key(UMBRELLA),
        "cuda/include/doorbell/{UMBRELLA} is missing: user code includes it"
    );
    for tier in TIERS {
        assert!(
            graph
                .keys()
                .any(|h| tier_of(h) == TIERS.iter().position(|t| t == tier)),
            "the tier folder {tier}/ holds no header"
        );
    }
    let bad = violations(&graph);
    assert!(
        bad.is_empty(),
        "the device headers break their tiers:\n  {}",
        bad.join("\n  ")
    );
}

#[test]
fn the_umbrella_header_brings_in_every_core_ib_and_channel_header() {
    let graph = tree_graph();
    let mut reached = BTreeSet::new();
    let mut stack = vec![UMBRELLA.to_string()];
    while let Some(h) = stack.pop() {
        if reached.insert(h.clone()) {
            stack.extend(graph.get(&h).into_iter().flatten().cloned());
        }
    }
    let missing: Vec<&String> = graph
        .keys()
        .filter(|h| tier_of(h).is_some_and(|t| !NOT_IN_UMBRELLA.contains(&TIERS[t])))
        .filter(|h| !reached.contains(*h))
        .collect();
    assert!(
        missing.is_empty(),
        "{UMBRELLA} does not bring in {missing:?}: include them there"
    );
}

/// Each header compiles alone from host code (it includes what its host-visible part uses), with
/// the host C++ compiler build.rs uses (`CXX`, else `c++`).
#[test]
fn each_header_compiles_alone_from_host_code() {
    let root = header_root();
    let include = root.parent().expect("cuda/include");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    for name in tree_graph().keys() {
        let mut child = std::process::Command::new(&cxx)
            .args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-fsyntax-only"])
            .args(["-x", "c++"])
            .arg(format!("-I{}", include.display()))
            .arg("-")
            .stdin(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{cxx}: {e} (build.rs needs the same compiler)"));
        use std::io::Write;
        writeln!(
            child.stdin.take().expect("stdin"),
            "#include <doorbell/{name}>"
        )
        .expect("write to the compiler");
        let out = child.wait_with_output().expect("the compiler ran");
        assert!(
            out.status.success(),
            "{name} does not compile alone from host code:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The checks themselves fail on each kind of break (a synthetic tree, so this holds whatever
/// the real headers look like).
#[test]
fn the_checks_catch_each_break() {
    let graph = |edges: &[(&str, &[&str])]| -> BTreeMap<String, Vec<String>> {
        edges
            .iter()
            .map(|(h, inc)| (h.to_string(), inc.iter().map(|s| s.to_string()).collect()))
            .collect()
    };
    let good = graph(&[
        ("doorbell.cuh", &["core/a.cuh", "channel/c.cuh"]),
        ("core/a.cuh", &[]),
        ("channel/c.cuh", &["core/a.cuh"]),
        ("coll/m.cuh", &["channel/c.cuh"]),
        ("detail/args.cuh", &["coll/m.cuh"]),
    ]);
    assert_eq!(violations(&good), Vec::<String>::new());

    let one = |edges: &[(&str, &[&str])], expect: &str| {
        let bad = violations(&graph(edges));
        assert!(
            bad.iter().any(|b| b.contains(expect)),
            "expected a violation mentioning {expect:?}, got {bad:?}"
        );
    };
    // Upward: core includes channel.
    one(
        &[("core/a.cuh", &["channel/c.cuh"]), ("channel/c.cuh", &[])],
        "core/a.cuh (tier core) includes channel/c.cuh from the higher tier channel",
    );
    // Upward from channel to coll.
    one(
        &[("channel/c.cuh", &["coll/m.cuh"]), ("coll/m.cuh", &[])],
        "channel/c.cuh (tier channel) includes coll/m.cuh",
    );
    // A cycle inside one tier.
    one(
        &[
            ("core/a.cuh", &["core/b.cuh"]),
            ("core/b.cuh", &["core/a.cuh"]),
        ],
        "core/a.cuh -> core/b.cuh -> core/a.cuh",
    );
    // The umbrella includes coll/ or detail/.
    one(
        &[("doorbell.cuh", &["coll/m.cuh"]), ("coll/m.cuh", &[])],
        "doorbell.cuh includes coll/m.cuh",
    );
    one(
        &[("doorbell.cuh", &["detail/x.cuh"]), ("detail/x.cuh", &[])],
        "doorbell.cuh includes detail/x.cuh",
    );
    // A header outside the tier folders, or nested below one.
    one(&[("moe.cuh", &[])], "moe.cuh sits outside the tier folders");
    one(
        &[("core/impl/x.cuh", &[])],
        "core/impl/x.cuh sits outside the tier folders",
    );
    // An include of nothing doorbell has.
    one(
        &[("core/a.cuh", &["core/gone.cuh"])],
        "no header of doorbell's",
    );

    // Include lines resolve against the including header's folder, or the root for <doorbell/..>.
    assert_eq!(
        includes_of(
            "coll/m.cuh",
            "#include \"../core/wait.cuh\"\n#  include \"args.cuh\"\n#include <doorbell/ib/q.cuh>\n\
             #include <cuda_bf16.h>\n// #include \"commented.cuh\"\n"
        ),
        vec!["core/wait.cuh", "coll/args.cuh", "ib/q.cuh"]
    );
}
