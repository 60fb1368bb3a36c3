//! Build script: compiles every `cuda/kernels/*.cu` with nvcc into a fatbin (sm_80 and sm_90a
//! machine code plus compute_90 PTX) embedded in the library, and runs the layout probe that pins
//! the device handles' C++ layout for the Rust mirrors' test.
//!
//! nvcc is looked for in this order: `NVCC`, `CUDA_HOME`/`CUDA_PATH` (`bin/nvcc`), `PATH`, the
//! pinned wheels installed by `scripts/install-nvcc.sh` (`.toolchain/cuda-venv`), and the wheels
//! in the current `python3`'s environment. Kernels recompile only when something under `cuda/`
//! changes, and only the files whose inputs changed (a hash of the file, every header and the
//! flags is kept next to each fatbin).

use std::collections::hash_map::DefaultHasher;
use std::env;
use std::fs;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::{exit, Command};

const INSTALL_HINT: &str = "install the pinned CUDA 13.0 compiler with `scripts/install-nvcc.sh` \
     (pip wheels, no GPU needed), or set NVCC=/path/to/nvcc";

const GENCODE: &[&str] = &[
    "-gencode",
    "arch=compute_80,code=sm_80",
    "-gencode",
    "arch=compute_90a,code=sm_90a",
    "-gencode",
    "arch=compute_90,code=compute_90",
];

fn main() {
    let root =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=cuda");
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH", "CXX"] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let include = root.join("cuda/include");
    let headers_hash = hash_tree(&include);
    let nvcc = find_nvcc(&root).unwrap_or_else(|| {
        eprintln!("doorbell build: nvcc not found; {INSTALL_HINT}");
        exit(1);
    });

    let mut sources: Vec<PathBuf> = fs::read_dir(root.join("cuda/kernels"))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    sources.retain(|p| p.extension().is_some_and(|e| e == "cu"));
    sources.sort();

    let results: Vec<Result<(String, PathBuf), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = sources
            .iter()
            .map(|src| {
                let (nvcc, include, out) = (&nvcc, &include, &out);
                s.spawn(move || compile(nvcc, include, out, src, headers_hash))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("nvcc thread panicked".into()))
            })
            .collect()
    });
    let mut table = String::from(
        "/// Fatbins built from `cuda/kernels/*.cu`, by file stem.\n\
         pub static KERNEL_MODULES: &[(&str, &[u8])] = &[\n",
    );
    let mut failed = false;
    for r in results {
        match r {
            Ok((stem, fatbin)) => {
                table.push_str(&format!(
                    "    ({stem:?}, include_bytes!({:?})),\n",
                    fatbin.display().to_string()
                ));
            }
            Err(e) => {
                eprintln!("{e}");
                failed = true;
            }
        }
    }
    if failed {
        exit(1);
    }
    table.push_str("];\n");
    write_if_changed(&out.join("kernels.rs"), &table);

    layout_probe(&root, &include, &out);
}

/// Compiles one `.cu` into `OUT_DIR/<stem>.fatbin` unless its recorded input hash is unchanged.
fn compile(
    nvcc: &Path,
    include: &Path,
    out: &Path,
    src: &Path,
    headers_hash: u64,
) -> Result<(String, PathBuf), String> {
    let stem = src
        .file_stem()
        .and_then(|s| s.to_str())
        .ok_or_else(|| format!("odd kernel file name {}", src.display()))?
        .to_string();
    let fatbin = out.join(format!("{stem}.fatbin"));
    let stamp = out.join(format!("{stem}.fatbin.hash"));
    let mut args: Vec<String> = vec![
        "-O3".into(),
        "-std=c++17".into(),
        "--fatbin".into(),
        "-lineinfo".into(),
        "-Xptxas=-warn-spills".into(),
    ];
    args.extend(GENCODE.iter().map(|s| s.to_string()));
    args.push(format!("-I{}", include.display()));

    let text = fs::read(src).map_err(|e| format!("cannot read {}: {e}", src.display()))?;
    let mut h = DefaultHasher::new();
    text.hash(&mut h);
    headers_hash.hash(&mut h);
    args.hash(&mut h);
    nvcc.hash(&mut h);
    let key = format!("{:016x}", h.finish());
    if fatbin.exists() && fs::read_to_string(&stamp).ok().as_deref() == Some(key.as_str()) {
        return Ok((stem, fatbin));
    }
    let output = Command::new(nvcc)
        .args(&args)
        .arg("-o")
        .arg(&fatbin)
        .arg(src)
        .output()
        .map_err(|e| {
            format!(
                "doorbell build: cannot run {}: {e}; {INSTALL_HINT}",
                nvcc.display()
            )
        })?;
    if !output.status.success() {
        return Err(format!(
            "doorbell build: nvcc failed on {}:\n{}{}",
            src.display(),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let warnings = String::from_utf8_lossy(&output.stderr);
    for line in warnings.lines().filter(|l| !l.trim().is_empty()) {
        println!("cargo:warning={stem}.cu: {line}");
    }
    fs::write(&stamp, key).map_err(|e| format!("cannot write {}: {e}", stamp.display()))?;
    Ok((stem, fatbin))
}

fn find_nvcc(root: &Path) -> Option<PathBuf> {
    let runs = |p: &Path| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if let Some(p) = env::var_os("NVCC") {
        let p = PathBuf::from(p);
        if runs(&p) {
            return Some(p);
        }
        eprintln!(
            "doorbell build: NVCC={} does not run; {INSTALL_HINT}",
            p.display()
        );
        exit(1);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = env::var_os(var) {
            let p = PathBuf::from(home).join("bin/nvcc");
            if runs(&p) {
                return Some(p);
            }
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.is_file() && runs(&p) {
                return Some(p);
            }
        }
    }
    // The pinned wheels: never symlink nvcc (it finds nvcc.profile next to its real path).
    let venv_lib = root.join(".toolchain/cuda-venv/lib");
    if let Ok(entries) = fs::read_dir(&venv_lib) {
        for e in entries.flatten() {
            let p = e.path().join("site-packages/nvidia/cu13/bin/nvcc");
            if runs(&p) {
                return Some(p);
            }
        }
    }
    let py = Command::new("python3")
        .args([
            "-c",
            "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'bin', 'nvcc'))",
        ])
        .output()
        .ok()?;
    let p = PathBuf::from(String::from_utf8_lossy(&py.stdout).trim());
    (py.status.success() && runs(&p)).then_some(p)
}

/// Compiles and runs `cuda/probe/layout_probe.cpp` with the host C++ compiler and writes the
/// layout table the Rust mirror test reads.
fn layout_probe(root: &Path, include: &Path, out: &Path) {
    let cxx = env::var("CXX").unwrap_or_else(|_| "c++".into());
    let exe = out.join("layout_probe");
    let status = Command::new(&cxx)
        .args(["-std=c++17", "-Wall", "-Wextra", "-Werror"])
        .arg(format!("-I{}", include.display()))
        .arg(root.join("cuda/probe/layout_probe.cpp"))
        .arg("-o")
        .arg(&exe)
        .status();
    if !status.is_ok_and(|s| s.success()) {
        eprintln!(
            "doorbell build: the host C++ compiler `{cxx}` could not build cuda/probe/layout_probe.cpp \
             (the device headers must stay includable from host code); install g++ or set CXX"
        );
        exit(1);
    }
    let output = Command::new(&exe).output();
    let Ok(output) = output.map_err(|e| eprintln!("doorbell build: layout probe: {e}")) else {
        exit(1);
    };
    let text = String::from_utf8_lossy(&output.stdout);
    let mut rs = String::from(
        "/// (kind, struct, field, offset, size) as the C++ compiler lays out the device handles;\n\
         /// kind \"struct\" rows carry the size in `offset` and the alignment in `size`.\n\
         pub static CUDA_LAYOUT: &[(&str, &str, &str, usize, usize)] = &[\n",
    );
    let mut consts = String::from(
        "/// (name, value) of the constants and enum codes the device headers share with Rust.\n\
         pub static CUDA_CONSTS: &[(&str, u64)] = &[\n",
    );
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["struct", name, size, align] => rs.push_str(&format!(
                "    (\"struct\", {name:?}, \"\", {size}, {align}),\n"
            )),
            ["field", name, field, off, size] => rs.push_str(&format!(
                "    (\"field\", {name:?}, {field:?}, {off}, {size}),\n"
            )),
            ["const", name, value] => consts.push_str(&format!("    ({name:?}, {value}),\n")),
            _ => {
                eprintln!("doorbell build: unexpected layout probe line {line:?}");
                exit(1);
            }
        }
    }
    rs.push_str("];\n");
    rs.push_str(&consts);
    rs.push_str("];\n");
    write_if_changed(&out.join("cuda_layout.rs"), &rs);
}

fn hash_tree(dir: &Path) -> u64 {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut h = DefaultHasher::new();
    for f in files {
        f.hash(&mut h);
        fs::read(&f).unwrap_or_default().hash(&mut h);
    }
    h.finish()
}

fn write_if_changed(path: &Path, text: &str) {
    if fs::read_to_string(path).ok().as_deref() != Some(text) {
        if let Err(e) = fs::write(path, text) {
            eprintln!("doorbell build: cannot write {}: {e}", path.display());
            exit(1);
        }
    }
}
