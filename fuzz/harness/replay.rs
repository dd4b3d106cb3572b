//! Replays a fuzz target's seeds (`fuzz/seeds/<target>/`) and saved crashes
//! (`fuzz/regressions/<target>/`) through its harness, for the workspace's own tests.
//!
//! Included with `#[path]` by the crates' `fuzz_regressions.rs` tests; not part of any fuzz target.

use std::path::{Path, PathBuf};

/// Every input file of `target`, seeds first, each group sorted by name. `manifest_dir` is the
/// testing crate's `CARGO_MANIFEST_DIR` (`crates/<name>`).
pub fn inputs(manifest_dir: &str, target: &str) -> Vec<PathBuf> {
    let fuzz = Path::new(manifest_dir).join("../../fuzz");
    let mut all = Vec::new();
    for group in ["seeds", "regressions"] {
        let dir = fuzz.join(group).join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.is_file() && !is_hidden(p))
            .collect();
        files.sort();
        all.extend(files);
    }
    all
}

fn is_hidden(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with('.') || n.ends_with(".md"))
}

/// Runs `run` on every input of `target`; panics naming each input that panicked. Returns how
/// many inputs ran.
pub fn replay(manifest_dir: &str, target: &str, run: fn(&[u8])) -> usize {
    let files = inputs(manifest_dir, target);
    let mut failed = Vec::new();
    for path in &files {
        let data = match std::fs::read(path) {
            Ok(d) => d,
            Err(e) => {
                failed.push(format!("{}: unreadable: {e}", path.display()));
                continue;
            }
        };
        if std::panic::catch_unwind(|| run(&data)).is_err() {
            failed.push(path.display().to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{target}: {} of {} inputs failed:\n{}",
        failed.len(),
        files.len(),
        failed.join("\n")
    );
    files.len()
}
