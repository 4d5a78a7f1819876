//! The layer rules of ARCHITECTURE.md, checked on the source of the library and the tools: in
//! each, every `crate::<module>` reference points to the same or a lower layer and the module
//! graph has no cycle; the library's pure core does no broker I/O (no `async`, no tokio, no lapin
//! connection or channel) and the planner, layout, time and retry rules know nothing about lapin
//! at all. Files that are pure inside a layer that is not (`PURE_FILES`) are held to the same
//! no-I/O rule. The library never names the tools' crate, and its normal dependencies leave out
//! what only the tools use (`TOOLS_ONLY_DEPS`). The benchmark (`bench/`) sits on top: it may use
//! the library and the tools, nothing uses it, its module graph has no cycle, and it alone picks
//! a global allocator.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Layer of every library module: 0 pure core, 1 broker edge, 2 applications, 3 binaries' pieces.
const LAYERS: &[(&str, u8)] = &[
    ("time", 0),
    ("batch", 0),
    ("layout", 0),
    ("planner", 0),
    ("headers", 0),
    ("endpoints", 0),
    ("envelope", 0),
    ("message", 0),
    ("metrics", 0),
    ("retry", 0),
    ("jsonl", 0),
    ("settings", 0),
    ("tally", 0),
    ("error", 0),
    ("trust", 0),
    ("recurring", 0),
    ("broker", 1),
    ("cancel", 1),
    ("connection", 1),
    ("control", 1),
    ("journal", 1),
    ("ledger", 1),
    ("management", 1),
    ("topology", 1),
    ("publisher", 1),
    ("parked", 1),
    ("stream_log", 1),
    ("worker", 1),
    ("gateway", 2),
    ("layering", 3),
];

/// Layer of every module of the tools' crate (`cli/src`): 0 pure, 2 applications, 3 the
/// binaries' shared pieces. The binaries (`cli/src/bin`) sit above all of them.
const TOOL_LAYERS: &[(&str, u8)] = &[
    ("jsonl", 0),
    ("logline", 0),
    ("plugin_store", 0),
    ("actions", 2),
    ("admin", 2),
    ("bulk", 2),
    ("console", 2),
    ("import", 2),
    ("observe", 2),
    ("pending", 2),
    ("pending_index", 2),
    ("proxy", 2),
    ("recurring", 2),
    ("cli", 3),
];

/// Crates only the tools or the benchmark use: never a normal, non-optional dependency of the
/// library.
const TOOLS_ONLY_DEPS: &[&str] = &[
    "clap",
    "axum",
    "ureq",
    "indicatif",
    "hdrhistogram",
    "mimalloc",
    "tracing-subscriber",
    "shell-words",
    "nix",
    "rusqlite",
];

/// Core modules that must not even name lapin.
const LAPIN_FREE: &[&str] = &["time", "layout", "planner", "retry"];

/// Files outside the pure core that are pure all the same, relative to `src/`: the no-I/O rule
/// holds for each of them.
const PURE_FILES: &[&str] = &[
    "src/gateway/x_delay.rs",
    "src/cancel/quota.rs",
    "cli/src/jsonl.rs",
    "cli/src/proxy/frames.rs",
    "cli/src/pending/translate.rs",
    "cli/src/pending/translate/flushes.rs",
    "cli/src/pending/when.rs",
    "cli/src/pending/wire.rs",
    "bench/src/hops.rs",
    "bench/src/search.rs",
];

/// What broker I/O looks like in the source.
const IO_WORDS: &[&str] = &["async ", "tokio", "Connection", "Channel", "std::net"];

/// `line` without its `//` comment: one that starts the line or follows white space, outside a
/// string literal as far as counting the quotes before it can tell (so `"amqp://h"` is code).
fn strip_comment(line: &str) -> &str {
    let b = line.as_bytes();
    let mut in_string = false;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' if in_string => i += 1,
            b'"' => in_string = !in_string,
            // The char literal '"' opens no string.
            b'\'' if !in_string && b.get(i + 1) == Some(&b'"') && b.get(i + 2) == Some(&b'\'') => {
                i += 2
            }
            b'/' if !in_string
                && b.get(i + 1) == Some(&b'/')
                && (i == 0 || b[i - 1].is_ascii_whitespace()) =>
            {
                return &line[..i];
            }
            _ => {}
        }
        i += 1;
    }
    line
}

/// The code of the file at `path`, comments removed.
fn code_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(strip_comment)
        .collect::<Vec<_>>()
        .join("\n")
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Source of every library module, comments removed, keyed by top-level module name.
fn sources() -> BTreeMap<String, String> {
    sources_in(&root().join("src"))
}

/// Source of every module under `src` (not its `bin/`), comments removed, keyed by top-level
/// module name.
fn sources_in(src: &Path) -> BTreeMap<String, String> {
    let src = src.to_path_buf();
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path
                .strip_prefix(&src)
                .unwrap()
                .to_string_lossy()
                .to_string();
            if path.is_dir() {
                if rel != "bin" {
                    stack.push(path);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") || rel == "lib.rs" || rel == "layering.rs"
            {
                continue;
            }
            let module = rel.split(['/', '.']).next().unwrap_or_default().to_string();
            out.entry(module).or_default().push_str(&code_of(&path));
        }
    }
    out
}

fn layer(module: &str) -> u8 {
    layer_in(LAYERS, module)
}

fn layer_in(layers: &[(&str, u8)], module: &str) -> u8 {
    layers
        .iter()
        .find(|(m, _)| *m == module)
        .unwrap_or_else(|| {
            panic!("module '{module}' has no layer: add it to LAYERS and ARCHITECTURE.md")
        })
        .1
}

/// `crate::x` references of each module (to other modules).
fn edges(sources: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for (module, code) in sources {
        let mut targets = BTreeSet::new();
        for (i, _) in code.match_indices("crate::") {
            let rest = &code[i + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '{')
                .collect();
            if name.starts_with('{') {
                panic!(
                    "module '{module}' uses a grouped `crate::{{...}}` import; import each module on its own line so the layer check sees it"
                );
            }
            assert!(
                !name.starts_with(|c: char| c.is_uppercase()),
                "module '{module}' names `crate::{name}` through a root re-export; use the module path"
            );
            if name != *module {
                targets.insert(name);
            }
        }
        out.insert(module.clone(), targets);
    }
    out
}

/// References of `src` that point up, by `layers`.
fn upward(src: &BTreeMap<String, String>, layers: &[(&str, u8)]) -> Vec<String> {
    let mut upward = Vec::new();
    for (from, tos) in edges(src) {
        let (lf, l) = (layer_in(layers, &from), |m: &str| layer_in(layers, m));
        for to in tos {
            if l(&to) > lf {
                upward.push(format!("{from} (layer {lf}) → {to} (layer {})", l(&to)));
            }
        }
    }
    upward
}

#[test]
fn every_reference_points_down_or_sideways() {
    let up = upward(&sources(), LAYERS);
    assert!(up.is_empty(), "upward references in the library: {up:#?}");
    let up = upward(&sources_in(&root().join("cli/src")), TOOL_LAYERS);
    assert!(up.is_empty(), "upward references in the tools: {up:#?}");
}

#[test]
fn the_library_never_names_the_tools() {
    for (module, code) in sources() {
        assert!(
            !code.contains("amqp_delay_cli"),
            "library module '{module}' names the tools' crate: the library is below the tools"
        );
    }
}

#[test]
fn the_library_does_not_depend_on_what_only_the_tools_use() {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let deps = manifest
        .split("\n[dependencies]\n")
        .nth(1)
        .expect("the library's Cargo.toml has a [dependencies] table");
    let deps = deps.split("\n[").next().unwrap_or(deps);
    for line in deps.lines().filter(|l| !l.trim_start().starts_with('#')) {
        let name = line.split(['=', '.']).next().unwrap_or("").trim();
        if TOOLS_ONLY_DEPS.contains(&name) {
            assert!(
                line.contains("optional = true"),
                "the library depends on `{name}`, which only the tools use: {line}"
            );
        }
    }
}

#[test]
fn the_module_graph_has_no_cycle() {
    no_cycle(&edges(&sources()));
    no_cycle(&edges(&sources_in(&root().join("cli/src"))));
    no_cycle(&edges(&sources_in(&root().join("bench/src"))));
}

/// Every `.rs` file under `dir` (binaries included; not this file, whose messages name what they
/// forbid), comments removed, keyed by path relative to the library's root.
fn files_in(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && !path.ends_with("src/layering.rs")
            {
                let rel = path.strip_prefix(root()).unwrap_or(&path);
                out.insert(rel.display().to_string(), code_of(&path));
            }
        }
    }
    out
}

/// The library's and the tools' code, binaries included: everything below the benchmark.
fn below_the_bench() -> BTreeMap<String, String> {
    let mut out = files_in(&root().join("src"));
    out.extend(files_in(&root().join("cli/src")));
    out
}

#[test]
fn nothing_uses_the_bench() {
    for (file, code) in below_the_bench() {
        assert!(
            !code.contains("amqp_delay_bench"),
            "{file} names the benchmark's crate: the benchmark sits on top, nothing uses it"
        );
    }
    for manifest in ["Cargo.toml", "cli/Cargo.toml"] {
        let text = std::fs::read_to_string(root().join(manifest)).unwrap();
        let deps = text
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .filter(|l| l.trim_start().starts_with("amqp-delay-bench"));
        assert_eq!(
            deps.count(),
            0,
            "{manifest} depends on amqp-delay-bench: the benchmark sits on top, nothing uses it"
        );
    }
}

#[test]
fn only_the_bench_picks_an_allocator() {
    for (file, code) in below_the_bench() {
        assert!(
            !code.contains("global_allocator"),
            "{file} sets a global allocator: the library and the tools leave it to the system \
             (or the application); only the benchmark picks its own"
        );
    }
}

fn no_cycle(g: &BTreeMap<String, BTreeSet<String>>) {
    // Kahn's algorithm: repeatedly remove modules nothing left depends on.
    let mut left: BTreeMap<String, BTreeSet<String>> = g.clone();
    loop {
        let leaves: Vec<String> = left
            .iter()
            .filter(|(_, tos)| tos.iter().all(|t| !left.contains_key(t)))
            .map(|(m, _)| m.clone())
            .collect();
        if leaves.is_empty() {
            break;
        }
        for m in leaves {
            left.remove(&m);
        }
    }
    assert!(left.is_empty(), "modules in a cycle: {:?}", left.keys());
}

#[test]
fn the_core_does_no_broker_io() {
    for (module, code) in sources() {
        if layer(&module) != 0 {
            continue;
        }
        for banned in IO_WORDS {
            assert!(
                !code.contains(banned),
                "core module '{module}' contains `{banned}`: broker I/O belongs in the broker edge"
            );
        }
        if LAPIN_FREE.contains(&module.as_str()) {
            assert!(
                !code.contains("lapin"),
                "'{module}' must know nothing about lapin"
            );
        }
    }
}

#[test]
fn pure_files_do_no_broker_io() {
    for file in PURE_FILES {
        let code = code_of(&root().join(file));
        for banned in IO_WORDS {
            assert!(
                !code.contains(banned),
                "pure file '{file}' contains `{banned}`: broker I/O belongs in the broker edge"
            );
        }
    }
}

#[test]
fn only_real_comments_are_stripped() {
    assert_eq!(strip_comment("// all comment"), "");
    assert_eq!(strip_comment("    /// doc"), "    ");
    assert_eq!(strip_comment("let a = 1; // note"), "let a = 1; ");
    assert_eq!(
        strip_comment(r#"let u = "amqp://h"; async fn f() {}"#),
        r#"let u = "amqp://h"; async fn f() {}"#
    );
    assert_eq!(
        strip_comment(r#"f("a \" //", '"', x); // c"#),
        r#"f("a \" //", '"', x); "#
    );
    assert_eq!(strip_comment("let p = a//b;"), "let p = a//b;");
}
