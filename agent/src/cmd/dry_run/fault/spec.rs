//! `--fault KIND:TARGET@SECS`: one failure to inject into a dry run, parsed and checked against
//! the size of the job before any agent starts, so a typo costs a message, not a rehearsal.

use std::fmt;
use std::time::Duration;

pub use crate::cmd::dry_run::kinds::Kind;
use crate::cmd::dry_run::kinds::{self, Target};

/// How long `stop-rank` keeps its worker stopped before it sends SIGCONT: longer than the
/// few-second `--hang-timeout` a rehearsal uses, far shorter than the default (`auto`), so both
/// outcomes can be rehearsed.
pub const STOP_HOLD: Duration = Duration::from_secs(8);

/// One parsed `--fault`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub kind: Kind,
    /// The node rank (`kill`, `term`) or the global rank (`kill-rank`).
    pub target: u32,
    /// When, counted from the first worker output after every worker of the first generation
    /// joined its process group (training under way; see [`crate::cmd::dry_run::timeline`]): agent and torch
    /// start-up then do not shift a fault, however loaded the machine.
    pub at: Duration,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}@{}",
            self.kind.name(),
            self.target,
            self.at.as_secs_f64()
        )
    }
}

/// Why a `--fault` (or `--replace-after`) value was refused; each message names the value and
/// shows the form that would have been accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("--fault `{spec}`: expected KIND:TARGET@SECS, e.g. {}", examples())]
    Shape { spec: String },
    #[error(
        "--fault `{spec}`: unknown kind `{kind}` (expected {})",
        kinds::names(kinds::fault_kinds())
    )]
    Kind { spec: String, kind: String },
    #[error("--fault `{spec}`: `{kind}` is a --chaos-kinds kind; as a --fault, name its faults, e.g. {example}")]
    ChaosOnly {
        spec: String,
        kind: &'static str,
        example: &'static str,
    },
    #[error("--fault `{spec}`: the {what} must be a whole number, not `{value}`")]
    Target {
        spec: String,
        what: &'static str,
        value: String,
    },
    #[error("--fault `{spec}`: the time must be a number of seconds (0 or more), not `{value}`")]
    Time { spec: String, value: String },
    #[error("--fault `{spec}`: there is no node {node} in a dry run of {nnodes} node(s) (nodes 0 to {last})", last = nnodes.saturating_sub(1))]
    NoSuchNode {
        spec: String,
        node: u32,
        nnodes: u32,
    },
    #[error("--fault `{spec}`: there is no rank {rank} in a job of at most {world} worker(s) (ranks 0 to {last})", last = world.saturating_sub(1))]
    NoSuchRank { spec: String, rank: u32, world: u32 },
    #[error("--replace-after `{0}`: expected a number of seconds (0 or more)")]
    ReplaceAfter(String),
    #[error("--spares `{0}`: expected a whole number of spare agents (0 or more)")]
    Spares(String),
    #[error("--replace-after without a kill:NODE@SECS fault: there is no agent to replace")]
    NothingToReplace,
    #[error("{flag} needs a value")]
    MissingValue { flag: &'static str },
}

/// `kill:0@15, term:1@10, kill-rank:3@20 or stop-rank:1@30`.
fn examples() -> String {
    kinds::one_of(&kinds::fault_kinds().map(|d| d.example).collect::<Vec<_>>())
}

/// Parses a number of seconds (`15`, `2.5`, `0`), in the one syntax and range of every duration
/// setting ([`rendezvous::seconds`]).
pub fn parse_seconds(text: &str) -> Option<Duration> {
    rendezvous::seconds::parse(text).ok()
}

/// Parses `KIND:TARGET@SECS`.
pub fn parse(spec: &str) -> Result<Fault, SpecError> {
    let shape = || SpecError::Shape {
        spec: spec.to_owned(),
    };
    let (kind, rest) = spec.split_once(':').ok_or_else(shape)?;
    let (target, at) = rest.split_once('@').ok_or_else(shape)?;
    let kind = match kind.trim() {
        "" => return Err(shape()),
        name => match Kind::parse(name) {
            Some(kind) if kind.def().fault_flag => kind,
            Some(kind) => {
                return Err(SpecError::ChaosOnly {
                    spec: spec.to_owned(),
                    kind: kind.name(),
                    example: kind.def().example,
                })
            }
            None => {
                return Err(SpecError::Kind {
                    spec: spec.to_owned(),
                    kind: name.to_owned(),
                })
            }
        },
    };
    let target = target
        .trim()
        .parse::<u32>()
        .map_err(|_| SpecError::Target {
            spec: spec.to_owned(),
            what: kind.target().noun(),
            value: target.to_owned(),
        })?;
    let at = parse_seconds(at).ok_or_else(|| SpecError::Time {
        spec: spec.to_owned(),
        value: at.to_owned(),
    })?;
    Ok(Fault { kind, target, at })
}

/// Checks a fault against the job: its node among `nnodes`, its rank below `world` (the most
/// workers the job can have).
pub fn check(fault: &Fault, nnodes: u32, world: u32) -> Result<(), SpecError> {
    let spec = fault.to_string();
    match fault.kind.target() {
        Target::Node if fault.target >= nnodes => Err(SpecError::NoSuchNode {
            spec,
            node: fault.target,
            nnodes,
        }),
        Target::Rank if fault.target >= world => Err(SpecError::NoSuchRank {
            spec,
            rank: fault.target,
            world,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn the_three_kinds_parse() {
        assert_eq!(
            parse("kill:0@15"),
            Ok(Fault {
                kind: Kind::Kill,
                target: 0,
                at: secs(15.0)
            })
        );
        assert_eq!(
            parse("term:1@2.5"),
            Ok(Fault {
                kind: Kind::Term,
                target: 1,
                at: secs(2.5)
            })
        );
        assert_eq!(
            parse("kill-rank:3@0"),
            Ok(Fault {
                kind: Kind::KillRank,
                target: 3,
                at: Duration::ZERO
            })
        );
        assert_eq!(
            parse("kill-rank:3@0").map(|f| f.to_string()),
            Ok("kill-rank:3@0".into())
        );
        assert_eq!(
            parse("term:1@2.5").map(|f| f.to_string()),
            Ok("term:1@2.5".into())
        );
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        assert_eq!(
            parse("kill:0"),
            Err(SpecError::Shape {
                spec: "kill:0".into()
            })
        );
        assert_eq!(
            parse("kill@3"),
            Err(SpecError::Shape {
                spec: "kill@3".into()
            })
        );
        assert_eq!(
            parse(":0@3"),
            Err(SpecError::Shape {
                spec: ":0@3".into()
            })
        );
        assert_eq!(
            parse("stop:0@3"),
            Err(SpecError::Kind {
                spec: "stop:0@3".into(),
                kind: "stop".into()
            })
        );
        assert_eq!(
            parse("stop-rank:2@3").map(|f| (f.kind, f.to_string())),
            Ok((Kind::StopRank, "stop-rank:2@3".into()))
        );
        let err = parse("kill:x@3").unwrap_err();
        assert_eq!(
            err.to_string(),
            "--fault `kill:x@3`: the node must be a whole number, not `x`"
        );
        let err = parse("kill-rank:-1@3").unwrap_err();
        assert_eq!(
            err.to_string(),
            "--fault `kill-rank:-1@3`: the rank must be a whole number, not `-1`"
        );
        for bad in [
            "term:1@-2",
            "term:1@soon",
            "term:1@",
            "term:1@inf",
            "term:1@NaN",
        ] {
            assert!(
                matches!(parse(bad), Err(SpecError::Time { .. })),
                "{bad}: {:?}",
                parse(bad)
            );
        }
        assert!(parse("nope")
            .unwrap_err()
            .to_string()
            .contains("e.g. kill:0@15"));
    }

    #[test]
    fn targets_must_exist_in_the_job() {
        let kill3 = parse("kill:3@1").unwrap();
        assert_eq!(
            check(&kill3, 3, 6).unwrap_err().to_string(),
            "--fault `kill:3@1`: there is no node 3 in a dry run of 3 node(s) (nodes 0 to 2)"
        );
        assert_eq!(check(&kill3, 4, 8), Ok(()));
        let rank6 = parse("kill-rank:6@1").unwrap();
        assert_eq!(
            check(&rank6, 3, 6).unwrap_err().to_string(),
            "--fault `kill-rank:6@1`: there is no rank 6 in a job of at most 6 worker(s) (ranks 0 to 5)"
        );
        assert_eq!(check(&parse("kill-rank:5@1").unwrap(), 3, 6), Ok(()));
        assert_eq!(check(&parse("term:2@1").unwrap(), 3, 6), Ok(()));
    }

    #[test]
    fn seconds_are_finite_and_not_negative() {
        assert_eq!(parse_seconds("3"), Some(secs(3.0)));
        assert_eq!(parse_seconds(" 0.5 "), Some(secs(0.5)));
        assert_eq!(parse_seconds("-0.1"), None);
        assert_eq!(parse_seconds("1e400"), None);
        assert_eq!(parse_seconds(""), None);
    }
}
