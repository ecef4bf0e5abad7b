//! `muster --help` and the docs say the same thing: every launch flag (and every flag of
//! `muster dry-run --help`, [`DRY_RUN_FLAGS`]) is documented in `docs/launch.md`, every `--flag`
//! that page names is one of those (or one listed below with the reason it is not), and every
//! exit code of the README's table is in `--help`.
//!
//! Keeping it green: a new launch flag goes into [`FLAGS`](crate::cli::lowargs::FLAGS) (which is
//! `--help`) and anywhere in `docs/launch.md` as `--its-name`. A `--token` on that page that is not
//! a launch flag (another tool's option, a torchrun flag muster rejects) goes into
//! [`NOT_LAUNCH_FLAGS`] with its reason.

use crate::cli::lowargs::{help_text, FLAGS};
use crate::cmd::dry_run::fault::DRY_RUN_FLAGS;

const LAUNCH_MD: &str = include_str!("../../../docs/launch.md");
const README_MD: &str = include_str!("../../../README.md");

/// `--tokens` in docs/launch.md that are not flags of the launch form, and why.
const NOT_LAUNCH_FLAGS: &[(&str, &str)] = &[
    ("help", "built in, listed at the end of --help"),
    ("version", "built in, listed at the end of --help"),
    ("dash-name", "placeholder in the prose on spellings"),
    ("underscore-name", "placeholder in the prose on spellings"),
    (
        "logs-specs",
        "torchrun flag muster rejects (the differences table)",
    ),
    ("virtual-local-rank", "torchrun flag muster rejects"),
    ("event-log-handler", "torchrun flag muster rejects"),
    ("duplicate-stdout-filters", "torchrun flag muster rejects"),
    ("duplicate-stderr-filters", "torchrun flag muster rejects"),
    (
        "timeout",
        "`muster stacks --timeout`, listed by `muster stacks --help`",
    ),
    ("memory", "`docker run --memory`, in the OOM section"),
    (
        "memory-swap",
        "`docker run --memory-swap`, in the OOM section",
    ),
];

/// Every `--name` in `text`, in the dash spelling (`--nproc_per_node=4` gives `nproc-per-node`).
fn long_flags(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("--") {
        let after = &rest[at + 2..];
        // `---`, a bare `--` separator and `a--b` are not flags.
        let starts_word = rest[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !c.is_ascii_alphanumeric() && c != '-');
        let name: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
            .collect();
        if starts_word && name.starts_with(|c: char| c.is_ascii_lowercase()) {
            found.push(name.trim_end_matches(['-', '_']).replace('_', "-"));
        }
        rest = after;
    }
    found
}

/// The `--flags` of docs/launch.md. In a code block, what follows the training script on a
/// command line is the script's own (`train.py --lr 0.1`), as in the launch form itself.
fn launch_md_flags() -> Vec<String> {
    let mut in_code = false;
    let mut found = Vec::new();
    for line in LAUNCH_MD.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        let muster_part = if in_code {
            match line.split_whitespace().position(|w| {
                std::path::Path::new(w)
                    .extension()
                    .is_some_and(|e| e == "py")
            }) {
                Some(at) => line
                    .split_whitespace()
                    .take(at)
                    .collect::<Vec<_>>()
                    .join(" "),
                None => line.to_owned(),
            }
        } else {
            line.to_owned()
        };
        found.extend(long_flags(&muster_part));
    }
    found
}

/// The first column of the README's exit-code table (`0`, `1-127`, `128+N`, `200`, ...).
fn readme_exit_codes() -> Vec<String> {
    let mut rows = README_MD
        .lines()
        .skip_while(|l| !l.replace(' ', "").starts_with("|code|meaning|"))
        .skip(2);
    let mut codes = Vec::new();
    while let Some(row) = rows.next().filter(|l| l.starts_with('|')) {
        if let Some(cell) = row.split('|').nth(1) {
            codes.push(cell.trim().replace('–', "-"));
        }
    }
    codes
}

/// The exit-code paragraph of `--help`, one line.
fn help_exit_codes() -> String {
    let help = help_text();
    help.split_once("Exit codes:")
        .map(|(_, codes)| codes.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn contains_word(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        before.is_none_or(|c| !c.is_ascii_alphanumeric() && c != '+' && c != '-')
            && after.is_none_or(|c| !c.is_ascii_alphanumeric() && c != '+' && c != '-')
    })
}

/// The flags among `names` that docs/launch.md never names.
fn undocumented<'a>(names: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let documented = launch_md_flags();
    names
        .filter(|name| !documented.iter().any(|d| d == name))
        .collect()
}

#[test]
fn every_launch_flag_is_in_docs_launch_md() {
    let missing = undocumented(FLAGS.iter().map(|f| f.name));
    assert!(
        missing.is_empty(),
        "flags in `muster --help` that docs/launch.md never names (add `--NAME` there): {missing:?}"
    );
}

#[test]
fn every_dry_run_flag_is_in_docs_launch_md() {
    let missing = undocumented(DRY_RUN_FLAGS.iter().map(|f| f.name));
    assert!(
        missing.is_empty(),
        "flags in `muster dry-run --help` that docs/launch.md never names: {missing:?}"
    );
}

#[test]
fn every_flag_docs_launch_md_names_is_in_help() {
    let help = help_text();
    let mut unknown: Vec<String> = launch_md_flags()
        .into_iter()
        .filter(|name| !FLAGS.iter().any(|f| f.name == name))
        .filter(|name| !DRY_RUN_FLAGS.iter().any(|f| f.name == name))
        .filter(|name| !NOT_LAUNCH_FLAGS.iter().any(|(n, _)| n == name))
        .collect();
    unknown.sort();
    unknown.dedup();
    assert!(
        unknown.is_empty(),
        "docs/launch.md names flags that `muster --help` does not list: {unknown:?} (add them to \
         FLAGS in cli/lowargs.rs, or to NOT_LAUNCH_FLAGS in cmd/doc_check.rs with the reason)"
    );
    for (name, _) in NOT_LAUNCH_FLAGS {
        assert!(
            !FLAGS.iter().any(|f| f.name == *name),
            "--{name} is a launch flag now: drop it from NOT_LAUNCH_FLAGS"
        );
    }
    assert!(help.contains("--help") && help.contains("--version"));
}

#[test]
fn every_readme_exit_code_is_in_help_and_back() {
    let codes = readme_exit_codes();
    assert!(
        codes.len() >= 10 && codes.contains(&"0".to_owned()),
        "README exit-code table not found or too short: {codes:?}"
    );
    let help = help_exit_codes();
    let missing: Vec<&String> = codes.iter().filter(|c| !contains_word(&help, c)).collect();
    assert!(
        missing.is_empty(),
        "exit codes in the README table missing from `muster --help`: {missing:?}\n{help}"
    );
    // And back: every reserved code --help names has a README row.
    for word in help.split(|c: char| !c.is_ascii_digit()) {
        if word.len() == 3 && word.starts_with('2') {
            assert!(
                codes.iter().any(|c| c == word),
                "`muster --help` names exit code {word}, the README table does not"
            );
        }
    }
}

#[test]
fn the_flag_scanner_reads_both_spellings_and_skips_non_flags() {
    assert_eq!(
        long_flags("`--nproc_per_node=4`, -m/--module, a -- b, x--y, ---, --Big, --log-dir."),
        ["nproc-per-node", "module", "log-dir"]
    );
    assert!(contains_word("0 all; 1-127 code; 128+N signal", "1-127"));
    assert!(!contains_word("2000", "200"));
    assert!(!contains_word("128+N", "128"));
}
