//! The library's layers, checked: every `crate::` path in `src/` names a module of its own layer
//! or one below it, and the transports do not import each other. With `DOORBELL_LAYERS_DOT=FILE`
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

/// `src/transport/ib/emulator.rs` -> `transport::ib::emulator`.
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
        if module == "lib" || module.starts_with("bin::") {
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
