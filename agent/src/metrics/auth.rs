//! Who may call `POST /checkpoint` (issue #12): the pod itself, over loopback, always; another
//! address only with `--checkpoint-token-file` and `Authorization: Bearer <token>`.
//!
//! The endpoint listens on every interface so that Prometheus and the kubelet can reach the GET
//! routes; without this check, any pod on the network could stop any training job. Loopback is
//! the operator's way in (`kubectl exec POD -- curl -X POST localhost:8000/checkpoint`): whoever
//! can exec into the pod can signal the agent anyway. The token is for a controller that must
//! trigger checkpoints remotely; it is read once at start, compared in constant time, and never
//! logged or printed (its `Debug` is redacted).

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The checkpoint token of `--checkpoint-token-file`.
#[derive(Clone)]
pub struct CheckpointToken(Arc<[u8]>);

impl fmt::Debug for CheckpointToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CheckpointToken(<redacted>)")
    }
}

/// `--checkpoint-token-file` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("--checkpoint-token-file {}: cannot read it: {source}", path.display())]
    Unreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--checkpoint-token-file {}: the file is empty", path.display())]
    Empty { path: PathBuf },
    #[error(
        "--checkpoint-token-file {}: the token may only hold the characters of an HTTP Bearer token (letters, digits, -._~+/ and trailing =), one line",
        path.display()
    )]
    Malformed { path: PathBuf },
}

impl CheckpointToken {
    /// Reads the token from `path` (a mounted Secret), without its trailing newline or spaces.
    pub fn from_file(path: &Path) -> Result<Self, TokenError> {
        let bytes = std::fs::read(path).map_err(|source| TokenError::Unreadable {
            path: path.to_owned(),
            source,
        })?;
        Self::from_bytes(&bytes).map_err(|empty| {
            if empty {
                TokenError::Empty {
                    path: path.to_owned(),
                }
            } else {
                TokenError::Malformed {
                    path: path.to_owned(),
                }
            }
        })
    }

    /// `Err(true)`: nothing left after trimming; `Err(false)`: not a token68 string.
    fn from_bytes(bytes: &[u8]) -> Result<Self, bool> {
        let end = bytes
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())
            .map_or(0, |i| i + 1);
        let token = &bytes[..end];
        if token.is_empty() {
            return Err(true);
        }
        // RFC 7235 token68: what an Authorization header can carry without quoting.
        let body_end = token.iter().rposition(|b| *b != b'=').map_or(0, |i| i + 1);
        let token68 = body_end > 0
            && token[..body_end]
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(b));
        if !token68 {
            return Err(false);
        }
        Ok(Self(token.into()))
    }

    /// Whether `presented` is the token. The time taken depends only on the token's length.
    pub fn matches(&self, presented: &[u8]) -> bool {
        constant_time_eq(&self.0, presented)
    }
}

/// Compares every byte of `expected` whatever `presented` holds, so the time taken tells an
/// attacker nothing about how many leading bytes they guessed right.
fn constant_time_eq(expected: &[u8], presented: &[u8]) -> bool {
    let mut diff = u8::from(expected.len() != presented.len());
    for (i, e) in expected.iter().enumerate() {
        diff |= e ^ presented.get(i).copied().unwrap_or(!e);
    }
    std::hint::black_box(diff) == 0
}

/// Whether `ip` is this pod's own loopback: 127.0.0.0/8, ::1, or IPv4-mapped loopback
/// (::ffff:127.x.y.z, how a dual-stack listener sees an IPv4 loopback peer).
pub fn is_loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// Why a checkpoint request was refused (`reason` label of
/// `muster_checkpoint_requests_rejected_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    /// Not loopback, and no token is configured: 403.
    Forbidden,
    /// Not loopback, and the bearer token is missing or wrong: 401.
    Unauthorized,
}

impl Rejected {
    pub(super) const ALL: [Rejected; 2] = [Rejected::Forbidden, Rejected::Unauthorized];

    pub(super) fn as_str(self) -> &'static str {
        match self {
            Rejected::Forbidden => "forbidden",
            Rejected::Unauthorized => "unauthorized",
        }
    }
}

/// Decides a `POST /checkpoint` from `peer` that presented `bearer` (the value after `Bearer `).
pub(super) fn authorize(
    peer: IpAddr,
    bearer: Option<&[u8]>,
    token: Option<&CheckpointToken>,
) -> Result<(), Rejected> {
    if is_loopback(peer) {
        return Ok(());
    }
    let Some(token) = token else {
        return Err(Rejected::Forbidden);
    };
    match bearer {
        Some(presented) if token.matches(presented) => Ok(()),
        _ => Err(Rejected::Unauthorized),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn loopback_in_every_spelling_and_nothing_else() {
        for yes in [
            "127.0.0.1",
            "127.1.2.3",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:127.9.9.9",
        ] {
            assert!(is_loopback(ip(yes)), "{yes}");
        }
        for no in [
            "10.0.0.5",
            "0.0.0.0",
            "::",
            "::ffff:10.0.0.5",
            "fe80::1",
            "::127.0.0.1",
            "128.0.0.1",
        ] {
            assert!(!is_loopback(ip(no)), "{no}");
        }
    }

    #[test]
    fn who_may_trigger_a_checkpoint() {
        let token = CheckpointToken::from_bytes(b"s3cret-Token_=\n").unwrap();
        let remote = ip("10.1.2.3");
        let local = ip("::ffff:127.0.0.1");
        assert_eq!(authorize(local, None, None), Ok(()));
        assert_eq!(authorize(local, Some(b"wrong"), Some(&token)), Ok(()));
        assert_eq!(authorize(remote, None, None), Err(Rejected::Forbidden));
        assert_eq!(
            authorize(remote, Some(b"s3cret-Token_="), None),
            Err(Rejected::Forbidden),
            "a token is only honoured when one is configured"
        );
        assert_eq!(
            authorize(remote, Some(b"s3cret-Token_="), Some(&token)),
            Ok(())
        );
        for wrong in [
            &b""[..],
            b"s3cret-Token_",
            b"s3cret-Token_==",
            b"S3cret-Token_=",
            b"x",
        ] {
            assert_eq!(
                authorize(remote, Some(wrong), Some(&token)),
                Err(Rejected::Unauthorized),
                "{}",
                String::from_utf8_lossy(wrong)
            );
        }
        assert_eq!(
            authorize(remote, None, Some(&token)),
            Err(Rejected::Unauthorized)
        );
    }

    #[test]
    fn token_files_are_trimmed_and_checked() {
        assert!(CheckpointToken::from_bytes(b"abc\r\n")
            .unwrap()
            .matches(b"abc"));
        assert_eq!(CheckpointToken::from_bytes(b"").err(), Some(true));
        assert_eq!(CheckpointToken::from_bytes(b" \n\n").err(), Some(true));
        assert_eq!(CheckpointToken::from_bytes(b"two words").err(), Some(false));
        assert_eq!(CheckpointToken::from_bytes(b"a\nb").err(), Some(false));
        assert_eq!(CheckpointToken::from_bytes(b"===").err(), Some(false));
        assert_eq!(
            CheckpointToken::from_bytes("é".as_bytes()).err(),
            Some(false)
        );
        let token = CheckpointToken::from_bytes(b"hunter2").unwrap();
        assert!(!format!("{token:?}").contains("hunter2"));

        let dir = std::env::temp_dir().join(format!("muster-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing");
        let err = CheckpointToken::from_file(&missing).unwrap_err();
        assert!(
            err.to_string().contains(&missing.display().to_string()),
            "{err}"
        );
        let empty = dir.join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let err = CheckpointToken::from_file(&empty).unwrap_err();
        assert!(
            err.to_string().contains("empty") && err.to_string().contains("empty"),
            "{err}"
        );
        let good = dir.join("good");
        std::fs::write(&good, "tok.en/+~\n").unwrap();
        assert!(CheckpointToken::from_file(&good)
            .unwrap()
            .matches(b"tok.en/+~"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn comparison_is_exact() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        // A presented byte equal to the complement must not fake a match past the end.
        assert!(!constant_time_eq(b"a", &[b'a', !b'a']));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
