//! Every kind of fault a rehearsal injects, in one table: its spelling, what it hits, the signal
//! it sends, what it models, and whether `--fault` names it or only `--chaos` draws it. The
//! `--fault` parser, both flags' help, their error messages and the chaos schedule read this
//! table, so a new kind is one row here (and its injection, where the rehearsal sends signals).

use nix::sys::signal::Signal;

/// A kind of fault. `TwoPods` is a chaos strike only: two `kill` faults at the same moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    KillRank,
    Kill,
    Term,
    StopRank,
    TwoPods,
}

/// What a fault's target number is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A node rank: the fault signals that node's agent (its workers go with it).
    Node,
    /// A global worker rank: the fault signals that one worker.
    Rank,
}

impl Target {
    pub fn noun(self) -> &'static str {
        match self {
            Target::Node => "node",
            Target::Rank => "rank",
        }
    }
}

/// One row of [`KINDS`].
#[derive(Debug)]
pub struct KindDef {
    pub kind: Kind,
    /// The spelling in `--fault KIND:TARGET@SECS` and `--chaos-kinds`.
    pub name: &'static str,
    pub target: Target,
    /// Sent to the target's agent or worker. `stop-rank`'s SIGSTOP is followed by SIGCONT after
    /// [`STOP_HOLD`](super::fault::spec::STOP_HOLD).
    pub signal: Signal,
    /// What `--fault`'s help says it does.
    pub injects: &'static str,
    /// What a chaos strike of this kind models, in the schedule and the report.
    pub models: &'static str,
    /// Whether `--fault` takes it (else `--chaos` only).
    pub fault_flag: bool,
    /// An example `--fault` value for the error messages.
    pub example: &'static str,
}

/// Every kind, in the order `--fault`'s help and messages name them ([`Kind::ALL`] is the
/// order chaos draws in).
pub const KINDS: &[KindDef] = &[
    KindDef {
        kind: Kind::Kill,
        name: "kill",
        target: Target::Node,
        signal: Signal::SIGKILL,
        injects: "SIGKILL that agent",
        models: "a lost pod, replaced",
        fault_flag: true,
        example: "kill:0@15",
    },
    KindDef {
        kind: Kind::Term,
        name: "term",
        target: Target::Node,
        signal: Signal::SIGTERM,
        injects: "SIGTERM it: the checkpoint barrier",
        models: "a preemption",
        fault_flag: true,
        example: "term:1@10",
    },
    KindDef {
        kind: Kind::KillRank,
        name: "kill-rank",
        target: Target::Rank,
        signal: Signal::SIGKILL,
        injects: "SIGKILL that worker",
        models: "a crashed rank",
        fault_flag: true,
        example: "kill-rank:3@20",
    },
    KindDef {
        kind: Kind::StopRank,
        name: "stop-rank",
        target: Target::Rank,
        signal: Signal::SIGSTOP,
        injects: "SIGSTOP that worker, SIGCONT 8 s later",
        models: "a frozen rank",
        fault_flag: true,
        example: "stop-rank:1@30",
    },
    KindDef {
        kind: Kind::TwoPods,
        name: "two-pods",
        target: Target::Node,
        signal: Signal::SIGKILL,
        injects: "SIGKILL two agents at once",
        models: "two pods lost at once, replaced",
        fault_flag: false,
        example: "kill:0@15 with kill:1@15",
    },
];

impl Kind {
    /// Every kind, in the order `--chaos-kinds` lists them and a schedule draws from: a seed's
    /// schedule depends on it, so it stays as it is when a kind is added (at the end).
    pub const ALL: &'static [Kind] = &[
        Kind::KillRank,
        Kind::Kill,
        Kind::Term,
        Kind::StopRank,
        Kind::TwoPods,
    ];

    /// Its row of [`KINDS`].
    pub fn def(self) -> &'static KindDef {
        // Every variant has a row (a unit test walks them); the first row stands in otherwise.
        KINDS.iter().find(|d| d.kind == self).unwrap_or(&KINDS[0])
    }

    pub fn name(self) -> &'static str {
        self.def().name
    }

    pub fn target(self) -> Target {
        self.def().target
    }

    /// What it models.
    pub fn meaning(self) -> &'static str {
        self.def().models
    }

    /// The kind spelled `text` (either flag's spelling), if any.
    pub fn parse(text: &str) -> Option<Kind> {
        KINDS.iter().find(|d| d.name == text.trim()).map(|d| d.kind)
    }
}

/// The kinds `--fault` takes.
pub fn fault_kinds() -> impl Iterator<Item = &'static KindDef> {
    KINDS.iter().filter(|d| d.fault_flag)
}

/// `kill, term, kill-rank or stop-rank`: the kinds' names for a message.
pub fn names<'a>(defs: impl Iterator<Item = &'a KindDef>) -> String {
    one_of(&defs.map(|d| d.name).collect::<Vec<_>>())
}

/// `a, b or c`.
pub fn one_of(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

/// The `--fault` help's list: `kill:NODE (SIGKILL that agent), ...`.
pub fn fault_help_list() -> String {
    let each: Vec<String> = fault_kinds()
        .map(|d| {
            format!(
                "{}:{} ({})",
                d.name,
                d.target.noun().to_uppercase(),
                d.injects
            )
        })
        .collect();
    each.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_one_row_and_every_row_one_kind() {
        for &kind in Kind::ALL {
            assert_eq!(
                KINDS.iter().filter(|d| d.kind == kind).count(),
                1,
                "{kind:?}"
            );
            assert_eq!(kind.def().kind, kind);
            assert_eq!(Kind::parse(kind.name()), Some(kind));
        }
        assert_eq!(KINDS.len(), Kind::ALL.len());
    }

    #[test]
    fn each_example_parses_as_its_kind() {
        for d in fault_kinds() {
            let (name, _) = d.example.split_once(':').unwrap();
            assert_eq!(Kind::parse(name), Some(d.kind), "{}", d.example);
        }
    }

    #[test]
    fn lists_read_as_english() {
        assert_eq!(names(fault_kinds()), "kill, term, kill-rank or stop-rank");
        assert!(fault_help_list().starts_with("kill:NODE (SIGKILL that agent), term:NODE"));
        assert!(
            fault_help_list().ends_with("stop-rank:RANK (SIGSTOP that worker, SIGCONT 8 s later)")
        );
        let hold = super::super::fault::spec::STOP_HOLD.as_secs();
        assert!(Kind::StopRank.def().injects.contains(&format!("{hold} s")));
    }
}
