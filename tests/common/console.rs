//! The guide's ```` ```console ```` notation, for the Rust tests that run a page's
//! commands (`tests/tour.rs`, the README's tour; `tests/mpi.rs`, a `run-in` block):
//! `$ ` commands (a trailing `\` continues one on the next line), `? N` for the exit
//! code, then the lines it prints, where `[..]` stands for any text and a line `...`
//! for any lines (docs/CONVENTIONS.md; `python/tests/docblocks.py` is the Python
//! version the docs test uses).

use std::path::Path;

/// One `$ ` command of a block, with the exit code and the lines it must print.
#[derive(Debug, PartialEq)]
pub struct Step {
    pub cmd: String,
    pub code: i32,
    pub lines: Vec<String>,
}

/// The steps of one block's body (the lines between its fences); `what` names the
/// block in a panic.
pub fn steps<'a>(body: impl IntoIterator<Item = &'a str>, what: &str) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    let mut lines = body.into_iter();
    while let Some(line) = lines.next() {
        if let Some(cmd) = line.strip_prefix("$ ") {
            let mut cmd = cmd.to_owned();
            while cmd.ends_with('\\') {
                cmd.pop();
                cmd.push('\n');
                cmd.push_str(lines.next().unwrap_or_default());
            }
            steps.push(Step {
                cmd,
                code: 0,
                lines: Vec::new(),
            });
        } else if let Some(step) = steps.last_mut() {
            match line.trim().strip_prefix("? ").map(str::parse::<i32>) {
                Some(Ok(code)) if step.lines.is_empty() => step.code = code,
                _ if line.trim().is_empty() => {}
                _ => step.lines.push(line.to_owned()),
            }
        } else {
            panic!("{what}: output before the first `$ ` command: {line:?}");
        }
    }
    steps
}

/// The steps of the ```` ```console ```` block of `page` (from the repository root)
/// marked `<!-- run-in: ID by tests/FILE.rs::... -->` (docs/CONVENTIONS.md, "Run in a
/// test"; python/tests/test_docs.py checks that the test it names calls this with
/// literal arguments).
pub fn console(page: &str, id: &str) -> Vec<Step> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(page))
        .unwrap_or_else(|e| panic!("{page}: {e}"));
    let marker = format!("<!-- run-in: {id} by tests/");
    let at = text
        .find(&marker)
        .unwrap_or_else(|| panic!("{page} marks no block {marker}"));
    let mut lines = text[at..]
        .lines()
        .skip(1)
        .skip_while(|l| l.trim().is_empty());
    assert_eq!(
        lines.next().map(str::trim),
        Some("```console"),
        "{page}: {id}"
    );
    steps(
        lines.take_while(|l| !l.trim_start().starts_with("```")),
        &format!("{page}: {id}"),
    )
}

/// Whether `got` is the shown line: `[..]` stands for any text.
pub fn line_matches(want: &str, got: &str) -> bool {
    let parts: Vec<&str> = want.trim_end().split("[..]").collect();
    let got = got.trim_end();
    if parts.len() == 1 {
        return parts[0] == got;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !got.starts_with(first) || got.len() < first.len() + last.len() || !got.ends_with(last) {
        return false;
    }
    let mut rest = &got[first.len()..got.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    true
}

/// Whether the output is the shown lines, in order, nothing between them except where
/// a line `...` stands (any lines, none included).
pub fn output_matches(want: &[String], got: &[&str]) -> bool {
    match want.split_first() {
        None => got.is_empty(),
        Some((w, rest)) if w.trim() == "..." => {
            (0..=got.len()).any(|k| output_matches(rest, &got[k..]))
        }
        Some((w, rest)) => {
            !got.is_empty() && line_matches(w, got[0]) && output_matches(rest, &got[1..])
        }
    }
}
