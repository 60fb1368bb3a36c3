//! The library's layers, checked: every `crate::` path in `src/` names a module of its own layer
//! or one below it, the transports do not import each other, and no two files import each other
//! (directly or around a loop; `super::` and `self::` paths count); direct CUDA driver calls stay
//! in `src/host/gpu/` or the few rooms that own theirs. The device headers' tiers, include cycles and
//! stand-alone compiles are `tests/header_tiers.rs`'. With `DOORBELL_LAYERS_DOT=FILE`
//! it also writes the module import graph as Graphviz (the drawing in `docs/layers.svg`:
//! `DOORBELL_LAYERS_DOT=docs/layers.dot cargo test --test layers && dot -Tsvg docs/layers.dot -o
//! docs/layers.svg`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level modules, bottom to top. A module may import from its own layer and those below.
const LAYERS: &[(&str, usize)] = &[
    ("error", 0),
    ("device_api", 0),
    ("job", 1),
    ("gpu", 2),
    ("transport", 3),
    ("channel", 4),
    ("communicator", 5),
    ("collectives", 6),
];

/// Modules of one layer that must not import each other (sibling transports).
const INDEPENDENT: &[&str] = &["transport::ethernet", "transport::ib", "transport::ipc"];

fn layer(top: &str) -> Option<usize> {
    // `crate::Result`, `crate::Error`: the root's re-exports of `error`.
    if top.chars().next().is_some_and(|c| c.is_ascii_uppercase()) {
        return Some(0);
    }
    LAYERS.iter().find(|(n, _)| *n == top).map(|(_, l)| *l)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/host/transport/ib/emulated/nic.rs` -> `transport::ib::emulated::nic`.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file
        .strip_prefix(src)
        .expect("under src")
        .with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    // src/host/ holds the host layers under their crate-root names (lib.rs re-exports them).
    if parts.first().is_some_and(|p| p == "host") {
        parts.remove(0);
    }
    parts.join("::")
}

/// The code of a file without comments (doc links name modules they do not import).
fn code_of(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `crate::a::b` this code names, as `a::b` (or `a`), `use crate::a::{b, c}` included.
fn imports(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        let top: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if top.is_empty() {
            continue;
        }
        let after = &rest[top.len()..];
        if let Some(tail) = after.strip_prefix("::") {
            if let Some(group) = tail.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let name: String = item
                        .trim()
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if name.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
                        out.insert(format!("{top}::{name}"));
                    } else {
                        out.insert(top.clone());
                    }
                }
                continue;
            }
            let sub: String = tail
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if sub.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
                out.insert(format!("{top}::{sub}"));
                continue;
            }
        }
        out.insert(top);
    }
    out
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let module = module_of(&src, &f);
        if module == "lib" || module.is_empty() || module.starts_with("bin::") {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("read source");
        g.entry(module)
            .or_default()
            .extend(imports(&code_of(&text)));
    }
    g
}

/// The top-level module, or `top::sub` for the modules of one layer that are kept apart.
fn unit(path: &str) -> String {
    if path.chars().next().is_some_and(|c| c.is_ascii_uppercase()) {
        return "error".into(); // the root's re-exports of `error`
    }
    let mut it = path.split("::");
    let top = it.next().unwrap_or_default();
    match (top, it.next()) {
        (t, Some(sub)) if t != "error" && t != "device_api" => format!("{t}::{sub}"),
        (t, _) => t.to_string(),
    }
}

#[test]
fn no_module_imports_a_layer_above_it() {
    let g = graph();
    assert!(g.len() > 30, "found only {} modules under src/", g.len());
    let mut wrong = Vec::new();
    for (module, deps) in &g {
        let top = module.split("::").next().unwrap_or_default();
        let Some(mine) = layer(top) else {
            wrong.push(format!(
                "{module}: its top-level module {top} has no layer in LAYERS"
            ));
            continue;
        };
        for dep in deps {
            let dep_top = dep.split("::").next().unwrap_or_default();
            match layer(dep_top) {
                None => wrong.push(format!("{module} -> {dep}: {dep_top} has no layer")),
                Some(l) if l > mine => wrong.push(format!(
                    "{module} (layer {mine}) imports {dep} (layer {l}, above it)"
                )),
                _ => {}
            }
            let (from, to) = (unit(module), unit(dep));
            if from != to
                && INDEPENDENT.contains(&from.as_str())
                && INDEPENDENT.contains(&to.as_str())
            {
                wrong.push(format!(
                    "{module} imports {dep}: transports are independent"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "upward imports:\n{}", wrong.join("\n"));

    if let Some(path) = std::env::var_os("DOORBELL_LAYERS_DOT") {
        let mut edges = BTreeSet::new();
        let mut nodes: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
        for (module, deps) in &g {
            let from = unit(module);
            nodes
                .entry(layer(from.split("::").next().unwrap_or_default()).unwrap_or(9))
                .or_default()
                .insert(from.clone());
            for dep in deps {
                let to = unit(dep);
                if to != from {
                    edges.insert((from.clone(), to));
                }
            }
        }
        // Only modules that import or are imported (an empty `mod.rs` is no box of its own).
        let linked: BTreeSet<&String> = edges.iter().flat_map(|(a, b)| [a, b]).collect();
        let names = [
            "error, device_api",
            "job",
            "gpu",
            "transport",
            "channel",
            "communicator",
            "collectives",
        ];
        let mut dot = String::from(
            "// Written by tests/layers.rs (DOORBELL_LAYERS_DOT). Arrows: \"imports\"; layers top\n\
             // to bottom, each row one layer; no arrow points up.\n\
             digraph doorbell {\n  newrank=true; ranksep=0.9; nodesep=0.25;\n  \
             node [shape=box, fontname=\"Helvetica\", fontsize=11];\n  \
             edge [color=\"#00000060\", arrowsize=0.6];\n",
        );
        for (l, ns) in nodes.iter().rev() {
            let label = names.get(*l).copied().unwrap_or("?");
            dot.push_str(&format!(
                "  {{ rank=same; \"L{l}\" [shape=plaintext, fontsize=13, label=\"layer {l}: {label}\"];"
            ));
            for n in ns.iter().filter(|n| linked.contains(n)) {
                dot.push_str(&format!(" \"{n}\";"));
            }
            dot.push_str(" }\n");
        }
        let levels: Vec<&usize> = nodes.keys().rev().collect();
        for w in levels.windows(2) {
            dot.push_str(&format!(
                "  \"L{}\" -> \"L{}\" [style=invis];\n",
                w[0], w[1]
            ));
        }
        for (a, b) in &edges {
            dot.push_str(&format!("  \"{a}\" -> \"{b}\";\n"));
        }
        dot.push_str("}\n");
        std::fs::write(&path, dot).expect("write the graph");
    }
}

#[test]
fn the_checker_sees_grouped_and_plain_imports() {
    let code = code_of(
        "use crate::gpu::cuda::{Gpu};\nuse crate::job::{bootstrap::Bootstrap, config};\n\
         // crate::collectives::moe in a comment\nlet x = crate::error::Error::Timeout;",
    );
    let found = imports(&code);
    let want: BTreeSet<String> = ["gpu::cuda", "job::bootstrap", "job::config", "error"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(found, want);
}

/// Every module file this code names by `crate::`, `super::` or `self::` paths (a `{a, b}`
/// group one level deep included), as the longest module path of `known` the path starts with;
/// `module` itself and its ancestors (whose `mod.rs` declares it) left out.
fn file_imports(module: &str, code: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let bytes = code.as_bytes();
    let mut at = 0;
    while at < code.len() {
        let rest = &code[at..];
        let Some(root) = ["crate::", "super::", "self::"]
            .iter()
            .find(|r| rest.starts_with(**r))
            .filter(|_| {
                at == 0 || !(bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_')
            })
        else {
            at += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        };
        // The path's segments: the root, then identifiers joined by `::`.
        let mut segs = vec![root.trim_end_matches("::").to_string()];
        let mut tail = &rest[root.len()..];
        let mut group = Vec::new();
        loop {
            if let Some(g) = tail.strip_prefix('{') {
                let end = g.find('}').unwrap_or(g.len());
                group = g[..end].split(',').map(|i| ident(i.trim())).collect();
                break;
            }
            let name = ident(tail);
            if name.is_empty() {
                break;
            }
            tail = &tail[name.len()..];
            segs.push(name);
            match tail.strip_prefix("::") {
                Some(t) => tail = t,
                None => break,
            }
        }
        at += rest.len() - tail.len();
        let mut base: Vec<String> = module.split("::").map(String::from).collect();
        let mut path = Vec::new();
        for s in &segs {
            match s.as_str() {
                "crate" => base.clear(),
                "super" => {
                    base.pop();
                }
                "self" => {}
                _ => path.push(s.clone()),
            }
        }
        let heads: Vec<Vec<String>> = if group.is_empty() {
            vec![path]
        } else {
            group
                .into_iter()
                .filter(|g| !g.is_empty())
                .map(|g| path.iter().cloned().chain([g]).collect())
                .collect()
        };
        for h in heads {
            let full: Vec<String> = base.iter().cloned().chain(h).collect();
            let found = (1..=full.len())
                .rev()
                .map(|k| full[..k].join("::"))
                .find(|m| known.contains(m));
            if let Some(m) = found {
                if m != module && !module.starts_with(&format!("{m}::")) {
                    out.insert(m);
                }
            }
        }
    }
    out
}

/// Two files that import each other, directly or around a loop, are one room split in two (or
/// two rooms doing each other's work): none may. `super::` and `self::` paths count, as well as
/// `crate::`.
#[test]
fn no_import_cycle_between_files() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut texts = BTreeMap::new();
    for f in &files {
        let module = module_of(&src, f);
        if module == "lib" || module.is_empty() || module.starts_with("bin::") {
            continue;
        }
        texts.insert(
            module,
            code_of(&std::fs::read_to_string(f).expect("read source")),
        );
    }
    let known: BTreeSet<String> = texts.keys().cloned().collect();
    let g: BTreeMap<&String, BTreeSet<String>> = texts
        .iter()
        .map(|(m, code)| (m, file_imports(m, code, &known)))
        .collect();
    assert!(
        g.len() > 50,
        "found only {} module files under src/",
        g.len()
    );
    // A depth-first search that reports the first loop it closes, as the path around it.
    fn visit<'a>(
        m: &'a String,
        g: &'a BTreeMap<&String, BTreeSet<String>>,
        state: &mut BTreeMap<&'a String, u8>,
        stack: &mut Vec<&'a String>,
    ) -> Option<Vec<String>> {
        state.insert(m, 1);
        stack.push(m);
        for d in g.get(m).into_iter().flatten() {
            let Some((d, _)) = g.get_key_value(d) else {
                continue;
            };
            match state.get(*d) {
                Some(1) => {
                    let from = stack.iter().position(|s| s == d).unwrap_or(0);
                    let mut cycle: Vec<String> =
                        stack[from..].iter().map(|s| s.to_string()).collect();
                    cycle.push(d.to_string());
                    return Some(cycle);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(d, g, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(m, 2);
        None
    }
    let mut state = BTreeMap::new();
    for m in g.keys() {
        if !state.contains_key(*m) {
            if let Some(c) = visit(m, &g, &mut state, &mut Vec::new()) {
                panic!("an import cycle between files: {}", c.join(" -> "));
            }
        }
    }
}

/// Files outside `src/host/gpu/` that may still call the CUDA driver directly, each for what it owns:
/// CUDA IPC handles (the IPC transport), the dma-buf handle of a GPU range (the rdma-core
/// boundary), host-memory registration for the NIC's rings (GPU queue pairs), and the
/// `doorbell-info` tool's device queries. Copies and stores
/// go through `gpu::cuda` (`copy_async` and its kin); a new direct call elsewhere fails here.
const RAW_DRIVER_ROOMS: &[&str] = &[
    "transport::ipc",
    "transport::ib::boundary::rdma_core",
    "transport::ib::posting::gpu_qp",
    "bin::doorbell-info",
];

#[test]
fn raw_driver_calls_stay_behind_gpu_or_in_their_rooms() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut strays = Vec::new();
    for file in files {
        let module = module_of(&src, &file);
        if module == "gpu"
            || module.starts_with("gpu::")
            || RAW_DRIVER_ROOMS.contains(&module.as_str())
        {
            continue;
        }
        let code = code_of(&std::fs::read_to_string(&file).expect("read source"));
        for (i, line) in code.lines().enumerate() {
            if let Some(at) = line.find("sys::cu") {
                if line[at + 7..].starts_with(|c: char| c.is_ascii_uppercase()) {
                    strays.push(format!("{}:{}: {}", file.display(), i + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        strays.is_empty(),
        "direct CUDA driver calls outside src/host/gpu/ (add a wrapper to gpu::cuda):\n{}",
        strays.join("\n")
    );
}

/// Modules that must not name any one transport: they reach peers through
/// `transport::Connection` and the memory table alone (issue 29: "the proxy knows no transport").
const TRANSPORT_BLIND: &[&str] = &["channel::proxy", "channel::fifo"];

#[test]
fn the_proxy_names_no_transport() {
    let g = graph();
    let mut named = Vec::new();
    for module in TRANSPORT_BLIND {
        let imports = g
            .get(*module)
            .unwrap_or_else(|| panic!("{module} is not a module of src/"));
        for i in imports {
            if ["transport::ipc", "transport::ethernet", "transport::ib"]
                .iter()
                .any(|t| i == t || i.starts_with(&format!("{t}::")))
            {
                named.push(format!("{module} imports {i}"));
            }
        }
    }
    assert!(
        named.is_empty(),
        "transport-blind modules name a transport (put that in the transport's Connection):\n{}",
        named.join("\n")
    );
}
