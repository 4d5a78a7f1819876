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
    ("ops", 1),
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
    ("tls", 2),
    ("recurring", 2),
    ("schedules", 2),
    ("cli", 3),
];

/// The library's public modules: what an application uses (the root re-exports the rest of
/// it), and `ops`, the operator API the tools use. Anything else stays inside the crate.
const PUBLIC_MODULES: &[&str] = &[
    "gateway",
    "headers",
    "layout",
    "metrics",
    "ops",
    "recurring",
    "settings",
    "time",
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
fn the_public_surface_is_the_listed_modules() {
    let lib = code_of(&root().join("src/lib.rs"));
    let public: BTreeSet<&str> = lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .map(|l| l.trim_end_matches(';').trim())
        .collect();
    let listed: BTreeSet<&str> = PUBLIC_MODULES.iter().copied().collect();
    assert_eq!(
        public, listed,
        "src/lib.rs's public modules differ from PUBLIC_MODULES: a module is public only when \
         an application (or, in `ops`, a tool) needs it"
    );
    assert!(PUBLIC_MODULES.len() <= 8, "at most 8 public modules");
    for line in lib.lines().map(str::trim) {
        assert!(
            !line.starts_with("pub use") || !line.contains("::*"),
            "a glob re-export widens the surface unseen: {line}"
        );
    }
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
    for src in ["src", "cli/src", "bench/src"] {
        for (parent, graph) in sibling_graphs(&root().join(src)) {
            let left = cycle_in(&graph);
            assert!(
                left.is_empty(),
                "modules of {src}/{} in a cycle (through `crate::` or `super::` paths): {left:?}",
                parent.join("/")
            );
        }
    }
}

/// The module path of the file `rel` (relative to its crate's `src`): `runner/measure.rs` →
/// `[runner, measure]`; a `mod.rs`, `lib.rs` or `main.rs` names its directory.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts
        .last()
        .is_some_and(|l| ["mod", "lib", "main"].contains(&l.as_str()))
    {
        parts.pop();
    }
    parts
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The absolute module paths that the code of the module at `path` names with `crate::`,
/// `super::` or `self::` (each name of a `{...}` group too), as far as identifiers go.
fn named_paths(path: &[String], code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for start in ["crate::", "super::", "self::"] {
        for (i, _) in code.match_indices(start) {
            let before = code[..i].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let mut base: Vec<String> = match start {
                "crate::" => Vec::new(),
                "self::" => path.to_vec(),
                _ => path[..path.len().saturating_sub(1)].to_vec(),
            };
            let mut rest = &code[i + start.len()..];
            while let Some(r) = rest.strip_prefix("super::") {
                base.pop();
                rest = r;
            }
            loop {
                if let Some(group) = rest.strip_prefix('{') {
                    let inner = &group[..group.find('}').unwrap_or(group.len())];
                    for item in inner.split(',') {
                        let name = ident(item.trim());
                        if !name.is_empty() && name != "self" {
                            out.push([base.clone(), vec![name.to_string()]].concat());
                        }
                    }
                    break;
                }
                let name = ident(rest);
                if name.is_empty() {
                    break;
                }
                base.push(name.to_string());
                rest = &rest[name.len()..];
                match rest.strip_prefix("::") {
                    Some(r) => rest = r,
                    None => break,
                }
            }
            out.push(base);
        }
    }
    out
}

/// For the modules of the crate whose sources are in `src` (its `bin/` left out): for every
/// module with children, the graph of those children, child `a` → child `b` when code in `a`
/// (or below it) names `b` (or something below it).
fn sibling_graphs(src: &Path) -> BTreeMap<Vec<String>, BTreeMap<String, BTreeSet<String>>> {
    let files: Vec<(Vec<String>, String)> = files_in(src)
        .into_iter()
        .filter_map(|(file, code)| {
            let rel = root().join(&file);
            let rel = rel.strip_prefix(src).ok()?.to_path_buf();
            (!rel.starts_with("bin")).then(|| (module_path(&rel), code))
        })
        .collect();
    let mut graphs: BTreeMap<Vec<String>, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (path, _) in &files {
        for k in 0..path.len() {
            let children = graphs.entry(path[..k].to_vec()).or_default();
            children.entry(path[k].clone()).or_default();
        }
    }
    for (path, code) in &files {
        for named in named_paths(path, code) {
            let k = path.iter().zip(&named).take_while(|(a, b)| a == b).count();
            if k >= path.len() || k >= named.len() {
                continue;
            }
            let graph = graphs
                .get_mut(&path[..k])
                .expect("every prefix has a graph");
            if graph.contains_key(&named[k]) {
                let tos = graph.get_mut(&path[k]).expect("a child of its parent");
                tos.insert(named[k].clone());
            }
        }
    }
    graphs
}

#[test]
fn paths_are_read_through_super_self_and_groups() {
    let path = ["runner".to_string(), "measure".to_string()];
    let named = named_paths(
        &path,
        "use super::publish::Published; use super::{app::Sender, stage}; \
         use crate::amqp::x; use self::inner::y; let a = my_super::z;",
    );
    let named: Vec<String> = named.iter().map(|p| p.join("::")).collect();
    for want in [
        "runner::publish::Published",
        "runner::app",
        "runner::stage",
        "amqp::x",
        "runner::measure::inner::y",
    ] {
        assert!(named.iter().any(|n| n == want), "{want} in {named:?}");
    }
    assert!(!named.iter().any(|n| n.ends_with('z')), "{named:?}");
    assert_eq!(module_path(Path::new("runner/mod.rs")), ["runner"]);
    assert_eq!(
        module_path(Path::new("runner/measure.rs")),
        ["runner", "measure"]
    );
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
    let left = cycle_in(g);
    assert!(left.is_empty(), "modules in a cycle: {left:?}");
}

/// The modules of `g` left in or behind a cycle (none when it has no cycle).
fn cycle_in(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
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
    left.into_keys().collect()
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
