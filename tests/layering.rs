//! Which way the dependencies point: the example trainers depend on the libraries, the
//! `rankexec` library never uses them, and the `rankexec` binary (which registers them
//! for `rankexec worker`) carries no numeric library for their data.

mod common;

use std::path::Path;

/// The removed numeric stack, as its names appear in a binary that links it (symbols,
/// panic locations): smartcore itself and the serde plug-ins it pulled in.
const NUMERIC_STACK: [&str; 3] = ["smartcore", "typetag", "erased_serde"];

#[test]
fn the_cli_binary_carries_no_numeric_stack() {
    let bin = common::rankexec_bin();
    let bytes = std::fs::read(&bin).unwrap();
    for needle in NUMERIC_STACK {
        let hits = bytes
            .windows(needle.len())
            .filter(|w| *w == needle.as_bytes())
            .count();
        println!("{}: `{needle}` x {hits}", bin.display());
        assert_eq!(hits, 0, "the rankexec binary links `{needle}`");
    }
}

/// The code of a Rust file: its lines less `//` comments (docs may name the examples).
fn code(f: &Path) -> String {
    std::fs::read_to_string(f)
        .unwrap()
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Rust files under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn the_library_does_not_use_the_examples() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    // The binary's crate: src/main.rs and the modules it declares (src/cli/).
    let binary = |p: &Path| p == src.join("main.rs") || p.starts_with(src.join("cli"));
    let (bin, lib): (Vec<_>, Vec<_>) = files.into_iter().partition(|p| binary(p));
    assert!(lib.len() > 10, "{lib:?}");
    for f in &lib {
        assert!(
            !code(f).contains("rankexec_examples"),
            "{} (library code) uses rankexec_examples",
            f.display()
        );
    }
    let composes = bin.iter().any(|f| code(f).contains("rankexec_examples::"));
    println!(
        "{} library files free of rankexec_examples; the binary composes it: {composes}",
        lib.len()
    );
    assert!(composes, "the binary no longer registers the examples");
}
