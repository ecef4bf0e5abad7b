//! NCCL's flight recorder, switched on for the workers: each rank keeps a ring of its last
//! collectives and, when torch's NCCL watchdog times out, writes it to `<prefix><rank>` — the
//! evidence of which collective every rank was in when the gang stopped. muster sets the
//! variables unless the user did (under either spelling) and names the dumps in the summary.
//!
//! Names as torch 2.15 reads them (`getCvarInt`/`getCvarBool`/`getCvarString` take a list: the
//! first set one wins): `TORCH_FR_*`, with the older `TORCH_NCCL_*` spelling still read after it.
//! A user who set the old spelling must not have it shadowed by a new one muster sets, so both
//! spellings count as "set by the user".

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// One flight-recorder setting: torch's current name, and the older one it still reads.
struct Setting {
    name: &'static str,
    twin: &'static str,
}

/// How many collectives each rank keeps (torch's default is 0: recorder off). 2000 entries are a
/// few hundred KiB per rank.
const BUFFER: Setting = Setting {
    name: "TORCH_FR_BUFFER_SIZE",
    twin: "TORCH_NCCL_TRACE_BUFFER_SIZE",
};
const BUFFER_ENTRIES: &str = "2000";
/// Dump the ring when the NCCL watchdog times out.
const DUMP_ON_TIMEOUT: Setting = Setting {
    name: "TORCH_FR_DUMP_ON_TIMEOUT",
    twin: "TORCH_NCCL_DUMP_ON_TIMEOUT",
};
/// The dump file's prefix; torch appends the global rank.
const TEMP_FILE: Setting = Setting {
    name: "TORCH_FR_DUMP_TEMP_FILE",
    twin: "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
};

/// The file name muster gives the dumps, before the rank.
pub const DUMP_PREFIX: &str = "nccl_trace_rank_";

/// The flight recorder of one attempt's workers: the variables to set and where the dumps go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlightRecorder {
    /// Set for every worker, on top of the inherited environment.
    pub env: Vec<(&'static str, OsString)>,
    /// `<dir>/<file prefix>` the dumps are written to (`<prefix><rank>`): muster's, or the
    /// user's own; `None` when neither (torch's default, `/tmp`, is not looked at).
    pub prefix: Option<PathBuf>,
}

/// Decides the variables from the agent's environment `inherited`: each one the user set (either
/// spelling, non-empty) is left alone; `dir` (the attempt's directory) holds the dumps when the
/// user named no file. Without a `dir` nothing that writes a file is set (the default place may
/// not be writable), only the buffer, so that `torch`'s on-demand dump works.
pub fn decide(dir: Option<&Path>, inherited: &dyn Fn(&str) -> Option<OsString>) -> FlightRecorder {
    let user = |s: &Setting| {
        inherited(s.name)
            .filter(|v| !v.is_empty())
            .or_else(|| inherited(s.twin).filter(|v| !v.is_empty()))
    };
    let mut env = Vec::new();
    if user(&BUFFER).is_none() {
        env.push((BUFFER.name, OsString::from(BUFFER_ENTRIES)));
    }
    let prefix = match (user(&TEMP_FILE), dir) {
        (Some(own), _) => Some(PathBuf::from(own)),
        (None, Some(dir)) => {
            let prefix = dir.join(DUMP_PREFIX);
            env.push((TEMP_FILE.name, prefix.clone().into_os_string()));
            Some(prefix)
        }
        (None, None) => None,
    };
    if prefix.is_some() && user(&DUMP_ON_TIMEOUT).is_none() {
        env.push((DUMP_ON_TIMEOUT.name, OsString::from("1")));
    }
    FlightRecorder { env, prefix }
}

impl FlightRecorder {
    /// The dumps written since `since` (`<prefix><rank>`, sorted): files from an earlier attempt
    /// under a prefix of the user's are not this attempt's.
    pub fn dumps(&self, since: SystemTime) -> Vec<PathBuf> {
        let Some(prefix) = &self.prefix else {
            return Vec::new();
        };
        let (Some(dir), Some(stem)) = (prefix.parent(), prefix.file_name()) else {
            return Vec::new();
        };
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        let stem = stem.to_string_lossy();
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        let mut found: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|name| name.strip_prefix(stem.as_ref()))
                    .is_some_and(|rank| {
                        !rank.is_empty() && rank.bytes().all(|b| b.is_ascii_digit())
                    })
            })
            .filter(|e| {
                e.metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t >= since)
            })
            .map(|e| e.path())
            .collect();
        found.sort();
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get<'a>(fr: &'a FlightRecorder, k: &str) -> Option<&'a str> {
        fr.env
            .iter()
            .find(|(n, _)| *n == k)
            .and_then(|(_, v)| v.to_str())
    }

    #[test]
    fn unset_means_on_with_dumps_into_the_attempt_directory() {
        let fr = decide(Some(Path::new("/logs/run/attempt_0")), &|_| None);
        assert_eq!(get(&fr, "TORCH_FR_BUFFER_SIZE"), Some("2000"));
        assert_eq!(get(&fr, "TORCH_FR_DUMP_ON_TIMEOUT"), Some("1"));
        assert_eq!(
            get(&fr, "TORCH_FR_DUMP_TEMP_FILE"),
            Some("/logs/run/attempt_0/nccl_trace_rank_")
        );
        assert_eq!(
            fr.prefix.as_deref(),
            Some(Path::new("/logs/run/attempt_0/nccl_trace_rank_"))
        );
        assert_eq!(fr.env.len(), 3, "only the new spellings are set");
    }

    #[test]
    fn either_spelling_set_by_the_user_wins() {
        let inherited = |k: &str| match k {
            "TORCH_NCCL_TRACE_BUFFER_SIZE" => Some(OsString::from("50")),
            "TORCH_FR_DUMP_ON_TIMEOUT" => Some(OsString::from("0")),
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" => Some(OsString::from("/mine/fr_")),
            _ => None,
        };
        let fr = decide(Some(Path::new("/logs/a")), &inherited);
        assert!(fr.env.is_empty(), "{:?}", fr.env);
        assert_eq!(fr.prefix.as_deref(), Some(Path::new("/mine/fr_")));
        // An empty value is not a setting.
        let empty = |k: &str| (k == "TORCH_FR_BUFFER_SIZE").then(OsString::new);
        assert_eq!(
            get(&decide(None, &empty), "TORCH_FR_BUFFER_SIZE"),
            Some("2000")
        );
    }

    #[test]
    fn without_a_directory_nothing_writes_a_file() {
        let fr = decide(None, &|_| None);
        assert_eq!(get(&fr, "TORCH_FR_BUFFER_SIZE"), Some("2000"));
        assert_eq!(get(&fr, "TORCH_FR_DUMP_ON_TIMEOUT"), None);
        assert_eq!(get(&fr, "TORCH_FR_DUMP_TEMP_FILE"), None);
        assert_eq!(fr.prefix, None);
        // The user's own file is still dumped to, and looked for.
        let own = |k: &str| (k == "TORCH_FR_DUMP_TEMP_FILE").then(|| OsString::from("/x/t_"));
        let fr = decide(None, &own);
        assert_eq!(get(&fr, "TORCH_FR_DUMP_ON_TIMEOUT"), Some("1"));
        assert_eq!(fr.prefix.as_deref(), Some(Path::new("/x/t_")));
    }

    #[test]
    fn dumps_are_the_ranks_files_of_this_attempt() {
        let dir = std::env::temp_dir().join(format!("muster-fr-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in [
            "nccl_trace_rank_3",
            "nccl_trace_rank_0",
            "nccl_trace_rank_",
            "other_1",
        ] {
            std::fs::write(dir.join(name), b"x").unwrap();
        }
        let fr = decide(Some(&dir), &|_| None);
        assert_eq!(
            fr.dumps(SystemTime::UNIX_EPOCH),
            vec![dir.join("nccl_trace_rank_0"), dir.join("nccl_trace_rank_3")]
        );
        let later = SystemTime::now() + std::time::Duration::from_secs(3600);
        assert!(
            fr.dumps(later).is_empty(),
            "older files are another attempt's"
        );
        assert!(decide(None, &|_| None)
            .dumps(SystemTime::UNIX_EPOCH)
            .is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
