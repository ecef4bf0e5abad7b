//! The dry run's own flags among the agents' flags: `--fault`, `--replace-after` and the
//! `--chaos` family ([`crate::cmd::dry_run::chaos`]) are taken out
//! of the launch options (before the training script, as every launch option), and everything
//! else is passed to each agent unchanged. The launch form's flag table says which options take
//! a value, so `--rdzv-conf x --fault ...` and the script's own `--fault` are both read right.

use std::ffi::OsString;

use super::spec::{self, SpecError};
use super::Options;
use crate::cli::lowargs::{Kind as FlagKind, FLAGS};
use crate::cmd::dry_run::{chaos, kinds};

/// A flag of `muster dry-run` itself, for its `--help` and the docs check.
#[derive(Debug)]
pub struct DryRunFlag {
    /// The dash spelling without `--` (the underscore twin is accepted too, as everywhere).
    pub name: &'static str,
    /// Empty for a switch (a flag without a value).
    pub value_name: &'static str,
    /// Read through [`DryRunFlag::help`]: `{fault kinds}` and `{chaos kinds}` stand for the
    /// lists of the fault kind table ([`crate::cmd::dry_run::kinds`]).
    help: &'static str,
}

impl DryRunFlag {
    pub fn help(&self) -> String {
        self.help
            .replace("{fault kinds}", &kinds::fault_help_list())
            .replace("{chaos kinds}", &chaos::kind_list())
    }
}

/// The flags only `muster dry-run` has.
pub const DRY_RUN_FLAGS: &[DryRunFlag] = &[
    DryRunFlag {
        name: "fault",
        value_name: "KIND:TARGET@SECS",
        help:
            "Inject a failure (repeatable): {fault kinds}; SECS count from the first worker output \
               after every worker of the first generation joined its process group",
    },
    DryRunFlag {
        name: "replace-after",
        value_name: "SECS",
        help: "Start a killed agent's replacement (same flags) SECS after the kill; without it a \
               killed node stays lost",
    },
    DryRunFlag {
        name: "spares",
        value_name: "N",
        help: "Also start N spare agents, as pods beyond --nnodes MAX of an Indexed Job \
               (JOB_COMPLETION_INDEX N..): they pass the pre-flight, wait, and take a lost \
               node's place at the next round (default 0)",
    },
    DryRunFlag {
        name: "chaos",
        value_name: "SEED[:COUNT]",
        help:
            "Rehearse COUNT (6) seeded random strikes: crashed and frozen ranks, lost pods (node \
               0 included, replaced after --replace-after, 3 s by default), two pods at once, \
               preemptions; pods come back as a Job's podFailurePolicy brings them back. The same \
               seed is the same schedule. Ends with a report: recovery time and steps lost per \
               strike. Docs: docs/chaos.md",
    },
    DryRunFlag {
        name: "chaos-kinds",
        value_name: "LIST",
        help: "The kinds of strike to draw from (comma-separated): {chaos kinds} (default: all)",
    },
    DryRunFlag {
        name: "chaos-interval",
        value_name: "MIN:MAX",
        help: "Each strike comes MIN to MAX seconds (drawn evenly) after the gang recovered from \
               the one before, so each strike's cost is its own (default 20:40)",
    },
    DryRunFlag {
        name: "chaos-recovery-bound",
        value_name: "SECS",
        help: "A strike not followed by a step of every rank within SECS is not recovered: the \
               dry run exits 220 (default 120)",
    },
    DryRunFlag {
        name: "chaos-plan",
        value_name: "",
        help: "Print the --chaos schedule for this job's size and exit without running anything",
    },
];

/// `--NAME` of one of our flags, for messages.
fn dashed(name: &str) -> &'static str {
    match name {
        "fault" => "--fault",
        "replace-after" => "--replace-after",
        "spares" => "--spares",
        "chaos" => "--chaos",
        "chaos-kinds" => "--chaos-kinds",
        "chaos-interval" => "--chaos-interval",
        _ => "--chaos-recovery-bound",
    }
}

/// Which of our flags `arg` is, and its inline value (`--fault=kill:0@3`).
fn ours(arg: &str) -> Option<(&'static str, Option<&str>)> {
    let body = arg.strip_prefix("--")?;
    let (name, inline) = match body.split_once('=') {
        Some((n, v)) => (n, Some(v)),
        None => (body, None),
    };
    let name = name.replace('_', "-");
    DRY_RUN_FLAGS
        .iter()
        .find(|f| f.name == name)
        .map(|f| (f.name, inline))
}

/// Whether the launch option `arg` (`--rdzv-conf`, `-r`) takes the next argument as its value.
fn takes_next(arg: &str) -> bool {
    if let Some(body) = arg.strip_prefix("--") {
        if body.contains('=') {
            return false;
        }
        let name = body.replace('_', "-");
        FLAGS
            .iter()
            .any(|f| f.name == name && f.kind == FlagKind::Value)
    } else {
        // `-r 3` takes the next one; `-r3` and `-m` do not.
        let mut chars = arg.chars().skip(1);
        match (chars.next(), chars.next()) {
            (Some(c), None) => FLAGS
                .iter()
                .any(|f| f.short == Some(c) && f.kind == FlagKind::Value),
            _ => false,
        }
    }
}

/// Splits `args` (what follows `dry-run`) into the dry run's options and the agents' arguments.
pub fn split(args: &[OsString]) -> Result<(Options, Vec<OsString>), SpecError> {
    let mut options = Options::default();
    let mut rest = Vec::with_capacity(args.len());
    let mut i = 0;
    while let Some(arg) = args.get(i) {
        let text = arg.to_str().unwrap_or_default();
        if let Some((flag, inline)) = ours(text) {
            if flag == "chaos-plan" {
                options.chaos.plan_only = true;
                i += 1;
                continue;
            }
            let value = if let Some(v) = inline {
                v.to_owned()
            } else {
                i += 1;
                args.get(i)
                    .and_then(|v| v.to_str())
                    .map(str::to_owned)
                    .ok_or(SpecError::MissingValue { flag: dashed(flag) })?
            };
            match flag {
                "fault" => options.faults.push(spec::parse(&value)?),
                "replace-after" => {
                    options.replace_after =
                        Some(spec::parse_seconds(&value).ok_or(SpecError::ReplaceAfter(value))?);
                }
                "spares" => {
                    options.spares = value
                        .trim()
                        .parse()
                        .map_err(|_| SpecError::Spares(value.clone()))?;
                }
                "chaos" => options.chaos.chaos = Some(value),
                "chaos-kinds" => options.chaos.kinds = Some(value),
                "chaos-interval" => options.chaos.interval = Some(value),
                _ => options.chaos.recovery_bound = Some(value),
            }
            i += 1;
            continue;
        }
        // `--` or the script: everything from here on is the agents' (and the script's).
        if text == "--" || !text.starts_with('-') || text == "-" {
            rest.extend(args[i..].iter().cloned());
            break;
        }
        rest.push(arg.clone());
        if takes_next(text) {
            if let Some(value) = args.get(i + 1) {
                rest.push(value.clone());
                i += 1;
            }
        }
        i += 1;
    }
    Ok((options, rest))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[test]
    fn our_flags_come_out_and_the_rest_stays_in_order() {
        let (opts, rest) = split(&os(&[
            "--nnodes",
            "3",
            "--fault",
            "kill:0@15",
            "--rdzv-conf",
            "--fault",
            "--replace_after=3",
            "--fault=term:1@2",
            "-r",
            "3",
            "train.py",
            "--fault",
            "kill:1@1",
        ]))
        .unwrap();
        assert_eq!(
            opts.faults
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["kill:0@15", "term:1@2"]
        );
        assert_eq!(opts.replace_after, Some(Duration::from_secs(3)));
        // `--rdzv-conf --fault` is the value `--fault` of --rdzv-conf (cli reports it), and what
        // follows the script is the script's.
        assert_eq!(
            rest,
            os(&[
                "--nnodes",
                "3",
                "--rdzv-conf",
                "--fault",
                "-r",
                "3",
                "train.py",
                "--fault",
                "kill:1@1"
            ])
        );
    }

    #[test]
    fn the_chaos_flags_come_out_too() {
        let (opts, rest) = split(&os(&[
            "--chaos",
            "42:3",
            "--chaos-plan",
            "--chaos_kinds=kill,term",
            "--chaos-interval",
            "2:4",
            "--chaos-recovery-bound",
            "30",
            "--nnodes",
            "2",
            "x.py",
            "--chaos-plan",
        ]))
        .unwrap();
        assert_eq!(opts.chaos.chaos.as_deref(), Some("42:3"));
        assert_eq!(opts.chaos.kinds.as_deref(), Some("kill,term"));
        assert_eq!(opts.chaos.interval.as_deref(), Some("2:4"));
        assert_eq!(opts.chaos.recovery_bound.as_deref(), Some("30"));
        assert!(opts.chaos.plan_only);
        assert_eq!(rest, os(&["--nnodes", "2", "x.py", "--chaos-plan"]));
        assert_eq!(
            split(&os(&["--chaos"])).unwrap_err().to_string(),
            "--chaos needs a value"
        );
    }

    #[test]
    fn after_a_double_dash_nothing_is_ours() {
        let (opts, rest) = split(&os(&["-m", "--", "--fault", "kill:0@1"])).unwrap();
        assert!(opts.is_empty());
        assert_eq!(rest, os(&["-m", "--", "--fault", "kill:0@1"]));
    }

    #[test]
    fn bad_values_are_errors_naming_the_flag() {
        assert_eq!(
            split(&os(&["--fault"])).unwrap_err().to_string(),
            "--fault needs a value"
        );
        assert_eq!(
            split(&os(&["--replace-after", "soon", "x.py"]))
                .unwrap_err()
                .to_string(),
            "--replace-after `soon`: expected a number of seconds (0 or more)"
        );
        assert!(matches!(
            split(&os(&["--fault", "boom", "x.py"])),
            Err(SpecError::Shape { .. })
        ));
    }

    #[test]
    fn every_dry_run_flag_is_not_a_launch_flag() {
        for f in DRY_RUN_FLAGS {
            assert!(!FLAGS.iter().any(|l| l.name == f.name), "--{}", f.name);
        }
    }
}
