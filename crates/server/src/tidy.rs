//! Tidy tests: rules about this crate's source that the compiler does not check, read from the
//! files themselves (as rust-analyzer's tidy tests do), so a change that breaks one fails here.
//!
//! - The top-level modules form a DAG: `crate::x` paths outside tests never close a circle,
//!   `core` imports nothing of the crate, and features import each other only through the
//!   named hand-offs.
//! - No production function is longer than [`MAX_FN_LINES`] lines.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The longest a production function may be.
const MAX_FN_LINES: usize = 100;

const FEATURES: [&str; 8] = [
    "proxy",
    "lock",
    "jobs",
    "webhooks",
    "admin",
    "database",
    "cache",
    "dashboard",
];

/// The real hand-offs between features (ARCHITECTURE.md names them).
const HAND_OFFS: [(&str, &str); 5] = [
    ("proxy", "jobs"),
    ("webhooks", "jobs"),
    ("database", "jobs"),
    ("proxy", "cache"),
    ("admin", "cache"),
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Each source file's top-level module and its production lines (up to its test module).
fn production_code() -> Vec<(String, PathBuf, Vec<String>)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut out = Vec::new();
    for path in files {
        let Ok(rel) = path.strip_prefix(&src) else {
            continue;
        };
        let module = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .unwrap_or_default()
            .trim_end_matches(".rs")
            .to_string();
        if module == "lib" || module == "tidy" {
            continue;
        }
        let text = fs::read_to_string(&path).unwrap_or_default();
        let lines = text
            .lines()
            .take_while(|l| l.trim() != "#[cfg(test)]")
            .map(str::to_string)
            .collect();
        out.push((module, path, lines));
    }
    out
}

/// The `crate::x` modules a line names (comments skipped).
fn crate_paths(line: &str) -> Vec<String> {
    let code = line.split("//").next().unwrap_or_default();
    code.match_indices("crate::")
        .filter(|(i, _)| {
            // `nthbouncer_server::crate::` is not a thing, but `$crate::` in macros is.
            *i == 0 || !code[..*i].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == '$')
        })
        .map(|(i, m)| {
            code[i + m.len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, _, lines) in production_code() {
        let edges = graph.entry(module.clone()).or_default();
        for line in &lines {
            for target in crate_paths(line) {
                if target != module && !target.is_empty() {
                    edges.insert(target);
                }
            }
        }
    }
    graph
}

/// A circle through `start`, if there is one.
fn circle(graph: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    fn walk(
        graph: &BTreeMap<String, BTreeSet<String>>,
        start: &str,
        at: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in graph.get(at).into_iter().flatten() {
            if next == start {
                path.push(next.clone());
                return true;
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if walk(graph, start, next, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![start.to_string()];
    let mut seen = BTreeSet::new();
    walk(graph, start, start, &mut path, &mut seen).then_some(path)
}

#[test]
fn top_level_modules_form_a_dag() {
    let graph = module_graph();
    assert!(graph.contains_key("proxy") && graph.contains_key("core"));
    for module in graph.keys() {
        if let Some(path) = circle(&graph, module) {
            panic!(
                "the modules import each other in a circle: {}",
                path.join(" -> ")
            );
        }
    }
}

#[test]
fn core_imports_nothing_and_features_only_their_hand_offs() {
    let graph = module_graph();
    assert_eq!(
        graph.get("core").cloned().unwrap_or_default(),
        BTreeSet::new(),
        "core must not import the rest of the crate"
    );
    for from in FEATURES {
        for to in graph.get(from).into_iter().flatten() {
            let feature = FEATURES.contains(&to.as_str());
            assert!(
                !feature || HAND_OFFS.contains(&(from, to.as_str())),
                "feature {from} imports feature {to}, which is not a named hand-off"
            );
            assert_ne!(to, "app", "feature {from} imports the composition root");
        }
    }
}

/// Production functions and their lengths in lines, from `fn` to its closing brace.
fn function_lengths() -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for (_, path, lines) in production_code() {
        for (i, line) in lines.iter().enumerate() {
            let trimmed = line.trim_start();
            let is_fn = [
                "fn ",
                "pub fn ",
                "async fn ",
                "pub async fn ",
                "pub(crate) fn ",
            ]
            .iter()
            .chain(
                [
                    "pub(super) fn ",
                    "pub(crate) async fn ",
                    "pub(super) async fn ",
                ]
                .iter(),
            )
            .any(|p| trimmed.starts_with(p));
            if !is_fn || line.trim_end().ends_with(';') {
                continue;
            }
            let indent = line.len() - trimmed.len();
            let close = format!("{}}}", " ".repeat(indent));
            let Some(end) = lines[i..].iter().position(|l| l.trim_end() == close) else {
                continue;
            };
            let name = trimmed
                .split("fn ")
                .nth(1)
                .and_then(|r| r.split(['(', '<']).next())
                .unwrap_or_default();
            out.push((format!("{}::{name}", path.display()), end + 1));
        }
    }
    out
}

#[test]
fn no_production_function_is_over_the_limit() {
    let long: Vec<String> = function_lengths()
        .into_iter()
        .filter(|(_, n)| *n > MAX_FN_LINES)
        .map(|(name, n)| format!("{name}: {n} lines"))
        .collect();
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines: {long:#?}"
    );
}

#[test]
fn the_checks_see_what_they_check() {
    assert_eq!(
        crate_paths("use crate::core::error::ApiError; // crate::app"),
        ["core"]
    );
    assert!(crate_paths("$crate::x").is_empty());
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    graph.entry("a".into()).or_default().insert("b".into());
    graph.entry("b".into()).or_default().insert("c".into());
    assert_eq!(circle(&graph, "a"), None);
    graph.entry("c".into()).or_default().insert("a".into());
    assert_eq!(
        circle(&graph, "a").map(|p| p.join(">")),
        Some("a>b>c>a".into())
    );
    assert!(function_lengths()
        .iter()
        .any(|(n, _)| n.ends_with("::handle")));
}
