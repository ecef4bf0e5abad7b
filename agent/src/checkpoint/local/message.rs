//! The words a worker sends on the local channel ([`super`]), parsed: the pure half of
//! handling a line, apart from carrying it out. The protocol is described in the local channel's
//! module doc; this reads one line of it into a [`Message`] or says why it is none.

use std::path::PathBuf;

/// Which kind of connection a worker opened (see [`super`]'s doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `hello`: the checkpoint helper.
    Helper,
    /// `watch`: the zero-code reporter.
    Reporter,
}

/// The first line of a connection: who is on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub role: Role,
    pub local_rank: u32,
    /// RANK (`None`: an old helper, or not a number).
    pub rank: Option<u32>,
    /// The helper's or reporter's process (`None`: an old helper, or not a number).
    pub pid: Option<u32>,
}

/// One line a worker sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// `hello <local_rank> <rank> <pid>` or `watch <local_rank> <rank> <pid>`.
    Hello(Hello),
    /// `faulthandler <signal> <path>`: where the rank's stacks go on that signal.
    Faulthandler { signal: i32, path: PathBuf },
    /// `section <name…>`: the helper's rank entered a named section.
    Section { name: String },
    /// `endsection`: it left it.
    EndSection,
    /// `init`: the rank entered `init_process_group`.
    Init,
    /// `initdone`: it returned from it.
    InitDone,
    /// `exiting`: the script finished; the interpreter exits.
    Exiting,
    /// `alive`: the rank's stack moved (it works between steps).
    Alive,
    /// `step <n>`.
    Step { step: u64 },
    /// `saved <generation> <step> [<checkpoint id>]`.
    Saved {
        generation: u64,
        step: u64,
        checkpoint_id: String,
    },
    /// `missed <generation> <step>`: the save request came after that step.
    Missed { generation: u64, step: u64 },
    /// `failed <generation> <reason…>`.
    Failed { generation: u64, reason: String },
}

impl Message {
    /// The message's first word on the wire.
    pub fn word(&self) -> &'static str {
        match self {
            Message::Hello(Hello {
                role: Role::Helper, ..
            }) => "hello",
            Message::Hello(Hello {
                role: Role::Reporter,
                ..
            }) => "watch",
            Message::Faulthandler { .. } => "faulthandler",
            Message::Section { .. } => "section",
            Message::EndSection => "endsection",
            Message::Init => "init",
            Message::InitDone => "initdone",
            Message::Exiting => "exiting",
            Message::Alive => "alive",
            Message::Step { .. } => "step",
            Message::Saved { .. } => "saved",
            Message::Missed { .. } => "missed",
            Message::Failed { .. } => "failed",
        }
    }
}

/// A line that is no message of the protocol; `reason` is what the closing log line says.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct ParseError {
    /// The line's first word where it is one of the protocol's (its arguments were wrong).
    pub word: Option<&'static str>,
    pub reason: String,
}

/// Reads one line (without its newline) into a [`Message`].
pub fn parse(line: &str) -> Result<Message, ParseError> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let Some(word) = words.first().and_then(|w| protocol_word(w)) else {
        return Err(ParseError {
            word: None,
            reason: format!("unknown message {line:?}"),
        });
    };
    let fail = |reason: String| ParseError {
        word: Some(word),
        reason,
    };
    let number = |i: usize| -> Result<u64, ParseError> {
        words
            .get(i)
            .and_then(|w| w.parse().ok())
            .ok_or_else(|| fail(format!("malformed message {line:?}")))
    };
    let rest = |from: usize| words.get(from..).map(|w| w.join(" ")).unwrap_or_default();
    Ok(match word {
        "hello" | "watch" => {
            let local_rank =
                u32::try_from(number(1)?).map_err(|_| fail(format!("bad rank in {line:?}")))?;
            let optional = |i: usize| words.get(i).and_then(|w| w.parse::<u32>().ok());
            Message::Hello(Hello {
                role: if word == "hello" {
                    Role::Helper
                } else {
                    Role::Reporter
                },
                local_rank,
                rank: optional(2),
                pid: optional(3),
            })
        }
        "faulthandler" => {
            let signal =
                i32::try_from(number(1)?).map_err(|_| fail(format!("bad signal in {line:?}")))?;
            // The path is the rest of the line (it may hold spaces).
            let path = line
                .trim()
                .splitn(3, ' ')
                .nth(2)
                .filter(|p| !p.is_empty())
                .ok_or_else(|| fail(format!("malformed message {line:?}")))?;
            Message::Faulthandler {
                signal,
                path: PathBuf::from(path),
            }
        }
        "section" => Message::Section { name: rest(1) },
        "endsection" => Message::EndSection,
        "init" => Message::Init,
        "initdone" => Message::InitDone,
        "exiting" => Message::Exiting,
        "alive" => Message::Alive,
        "step" => Message::Step { step: number(1)? },
        "saved" => Message::Saved {
            generation: number(1)?,
            step: number(2)?,
            checkpoint_id: words.get(3).copied().unwrap_or_default().to_owned(),
        },
        "missed" => Message::Missed {
            generation: number(1)?,
            step: number(2)?,
        },
        _ => Message::Failed {
            generation: number(1)?,
            reason: rest(2),
        },
    })
}

/// `word` as the protocol's own `'static` spelling, or `None` when it is not one of its words.
fn protocol_word(word: &str) -> Option<&'static str> {
    const WORDS: [&str; 13] = [
        "hello",
        "watch",
        "faulthandler",
        "section",
        "endsection",
        "init",
        "initdone",
        "exiting",
        "alive",
        "step",
        "saved",
        "missed",
        "failed",
    ];
    WORDS.into_iter().find(|&w| w == word)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn malformed(line: &str) -> ParseError {
        parse(line).expect_err(line)
    }

    #[test]
    fn every_message_of_the_protocol_parses() {
        assert_eq!(
            parse("hello 3 11 4242").unwrap(),
            Message::Hello(Hello {
                role: Role::Helper,
                local_rank: 3,
                rank: Some(11),
                pid: Some(4242)
            })
        );
        // An old helper says only its local rank; words that are no numbers are left out.
        assert_eq!(
            parse("watch 1 x").unwrap(),
            Message::Hello(Hello {
                role: Role::Reporter,
                local_rank: 1,
                rank: None,
                pid: None
            })
        );
        assert_eq!(
            parse("faulthandler 12 /tmp/my stacks/rank 0.txt").unwrap(),
            Message::Faulthandler {
                signal: 12,
                path: PathBuf::from("/tmp/my stacks/rank 0.txt")
            }
        );
        assert_eq!(
            parse("section data  loading").unwrap(),
            Message::Section {
                name: "data loading".into()
            }
        );
        assert_eq!(
            parse("section").unwrap(),
            Message::Section {
                name: String::new()
            }
        );
        for (line, message) in [
            ("endsection", Message::EndSection),
            ("init", Message::Init),
            ("initdone", Message::InitDone),
            ("exiting", Message::Exiting),
            ("  alive  ", Message::Alive),
            ("step 17", Message::Step { step: 17 }),
        ] {
            assert_eq!(parse(line).unwrap(), message, "{line}");
            assert_eq!(message.word(), line.split_whitespace().next().unwrap());
        }
        assert_eq!(
            parse("saved 2 40 ckpt-40").unwrap(),
            Message::Saved {
                generation: 2,
                step: 40,
                checkpoint_id: "ckpt-40".into()
            }
        );
        assert_eq!(
            parse("saved 2 40").unwrap(),
            Message::Saved {
                generation: 2,
                step: 40,
                checkpoint_id: String::new()
            }
        );
        assert_eq!(
            parse("missed 2 39").unwrap(),
            Message::Missed {
                generation: 2,
                step: 39
            }
        );
        assert_eq!(
            parse("failed 2 disk full on /ckpt").unwrap(),
            Message::Failed {
                generation: 2,
                reason: "disk full on /ckpt".into()
            }
        );
    }

    #[test]
    fn malformed_lines_are_refused_with_the_reason_the_log_line_names() {
        for line in ["", "   ", "helo 1", "STEP 3", "saved"] {
            let e = malformed(line);
            if line == "saved" {
                assert_eq!(e.word, Some("saved"));
                assert_eq!(e.reason, "malformed message \"saved\"");
            } else {
                assert_eq!(e.word, None, "{line:?}");
                assert_eq!(e.reason, format!("unknown message {line:?}"));
            }
        }
        assert_eq!(
            malformed("hello"),
            ParseError {
                word: Some("hello"),
                reason: "malformed message \"hello\"".into()
            }
        );
        assert_eq!(
            malformed("hello 4294967296").reason,
            "bad rank in \"hello 4294967296\""
        );
        assert_eq!(
            malformed("faulthandler 99999999999 /p").reason,
            "bad signal in \"faulthandler 99999999999 /p\""
        );
        assert_eq!(
            malformed("faulthandler 12").reason,
            "malformed message \"faulthandler 12\""
        );
        assert_eq!(malformed("step -1").reason, "malformed message \"step -1\"");
        assert_eq!(malformed("step").word, Some("step"));
        assert_eq!(
            malformed("missed 2").reason,
            "malformed message \"missed 2\""
        );
        assert_eq!(malformed("failed x oops").word, Some("failed"));
        assert_eq!(
            malformed("faulthandler x /p").to_string(),
            "malformed message \"faulthandler x /p\""
        );
    }
}
