//! Workloads: JSON Lines of `{"id", "task", "prompt", "max_tokens"}` (`../shared/BENCH.md`).

use std::io::BufRead;
use std::path::Path;

use anyhow::{Context as _, Result};
use serde::Deserialize;

/// One request.
#[derive(Debug, Clone, Deserialize)]
pub struct Request {
    pub id: String,
    pub task: String,
    pub prompt: String,
    pub max_tokens: usize,
}

/// Read `path`, keep the requests whose task is in `tasks` (all when empty), leave out the
/// first `skip` of those, then take the first `limit`.
///
/// # Errors
/// I/O errors and malformed lines (with their line number).
pub fn load(
    path: &Path,
    tasks: &[String],
    skip: usize,
    limit: Option<usize>,
) -> Result<Vec<Request>> {
    let f = std::fs::File::open(path)
        .with_context(|| format!("opening workload {}", path.display()))?;
    read(std::io::BufReader::new(f), path, tasks, skip, limit)
}

/// [`load`] from a reader; `path` names it in error messages.
///
/// # Errors
/// I/O errors and malformed lines (with their line number).
pub fn read(
    reader: impl BufRead,
    path: &Path,
    tasks: &[String],
    skip: usize,
    limit: Option<usize>,
) -> Result<Vec<Request>> {
    let mut out = Vec::new();
    let mut skipped = 0;
    for (n, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let r: Request = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not a workload request", path.display(), n + 1))?;
        if !tasks.is_empty() && !tasks.contains(&r.task) {
            continue;
        }
        if skipped < skip {
            skipped += 1;
            continue;
        }
        out.push(r);
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn filters_then_limits() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        for (i, t) in ["code", "rag", "code", "summary", "code"]
            .iter()
            .enumerate()
        {
            writeln!(
                f,
                r#"{{"id":"r{i}","task":"{t}","prompt":"p","max_tokens":8}}"#
            )
            .unwrap();
        }
        let ids = |skip, limit| {
            load(f.path(), &["code".into()], skip, limit)
                .unwrap()
                .into_iter()
                .map(|r| r.id)
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(0, Some(2)), ["r0", "r2"]);
        // --skip counts requests of the kept tasks, before --limit.
        assert_eq!(ids(1, Some(1)), ["r2"]);
        assert_eq!(ids(1, None), ["r2", "r4"]);
        assert!(ids(3, None).is_empty());
        assert_eq!(load(f.path(), &[], 0, None).unwrap().len(), 5);
    }

    #[test]
    fn bad_line_names_its_number() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(
            f,
            r#"{{"id":"a","task":"code","prompt":"p","max_tokens":8}}"#
        )
        .unwrap();
        writeln!(f, "not json").unwrap();
        let e = format!("{:#}", load(f.path(), &[], 0, None).unwrap_err());
        assert!(e.contains(":2:"), "{e}");
    }
}
