//! The Python files muster ships inside the binary and puts where the workers import them from.
//!
//! They are the `muster_launcher` package (`python/muster_launcher/`: the channel to the agent,
//! the checkpoint helper, the zero-code step reports, the import hook, the framework
//! integrations), the two old module names scripts import (`muster_checkpoint`,
//! `muster_frameworks`, one-line shims), and muster's start-up hook written as
//! `sitecustomize.py` (python/muster_sitecustomize.py). Two callers [`install`] them and put the
//! entry it returns first on the workers' `PYTHONPATH`: the checkpoint barrier all of them
//! ([`Files::Workers`]), the script metrics only the hook and what it imports at every start
//! ([`Files::StartupHook`]) where the barrier has no directory. The entry is the user's shared
//! copy ([`shared`]) where one can be used or made, else a zip archive ([`ARCHIVE`]) in the
//! agent's private directory. Every rank reads them at start: ship only what a rank imports.

pub mod shared;

use std::io;
use std::path::{Path, PathBuf};

/// One shipped file: where it goes below the directory, and its text.
struct PythonFile {
    path: &'static str,
    text: &'static str,
    /// The text's CRC-32, which the archive records: computed by the compiler, not at each start.
    crc: u32,
    /// Imported by `sitecustomize` at every rank's start (the script metrics' hook needs it).
    startup: bool,
}

/// A file of `python/` shipped at the same path below the directory.
macro_rules! same_path {
    ($path:literal, startup: $startup:literal) => {
        PythonFile {
            path: $path,
            text: include_str!(concat!("../../python/", $path)),
            crc: zip::crc32(include_str!(concat!("../../python/", $path)).as_bytes()),
            startup: $startup,
        }
    };
}

/// Every shipped file, in the archive's order.
const FILES: &[PythonFile] = &[
    PythonFile {
        path: "sitecustomize.py",
        text: include_str!("../../python/muster_sitecustomize.py"),
        crc: zip::crc32(include_str!("../../python/muster_sitecustomize.py").as_bytes()),
        startup: true,
    },
    same_path!("muster_launcher/__init__.py", startup: true),
    same_path!("muster_launcher/channel.py", startup: false),
    same_path!("muster_launcher/importhook.py", startup: true),
    same_path!("muster_launcher/checkpoint.py", startup: false),
    same_path!("muster_launcher/autoreport.py", startup: false),
    same_path!("muster_launcher/standby.py", startup: false),
    same_path!("muster_launcher/snapshot.py", startup: false),
    same_path!("muster_launcher/integrations/__init__.py", startup: false),
    same_path!("muster_launcher/integrations/barrier.py", startup: false),
    same_path!("muster_launcher/integrations/transformers.py", startup: false),
    same_path!("muster_launcher/integrations/transformers_snapshot.py", startup: false),
    same_path!("muster_launcher/integrations/lightning.py", startup: false),
    same_path!("muster_launcher/integrations/lightning_snapshot.py", startup: false),
    same_path!("muster_launcher/integrations/rng.py", startup: false),
    same_path!("muster_launcher/integrations/snapshots.py", startup: false),
    same_path!("muster_checkpoint.py", startup: false),
    same_path!("muster_frameworks.py", startup: false),
];

/// Which of the shipped files a directory gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Files {
    /// All of them: `import muster_checkpoint` and the framework callbacks work.
    Workers,
    /// `sitecustomize.py` and the package files it imports at start, for the script metrics'
    /// hook alone (no helper: muster's barrier has no directory of its own).
    StartupHook,
}

/// The private copy, where there is no shared one: a zip archive of the shipped files, which the
/// workers' Python imports from as it would from a directory (`zipimport`, slower: see
/// [`shared`]). One inode made and removed per start instead of one per file and folder.
pub const ARCHIVE: &str = "muster-python.zip";

/// A shipped file that could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {}: {source}", path.display())]
pub struct WriteError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Puts `which` of the shipped files where the workers import them from and returns the entry
/// for their `PYTHONPATH`: the shared copy under `base` (the directory `private` was made in),
/// else the archive [`ARCHIVE`] written into `private`.
pub fn install(base: &Path, private: &Path, which: Files) -> Result<PathBuf, WriteError> {
    let files = selected(which);
    if let Some(dir) = shared::ensure(base, &files) {
        return Ok(dir);
    }
    write_archive(private, &files)
}

/// The shipped files `which` names, in the archive's order.
fn selected(which: Files) -> Vec<&'static PythonFile> {
    FILES
        .iter()
        .filter(|file| which == Files::Workers || file.startup)
        .collect()
}

/// Writes `files` into `dir` as the archive [`ARCHIVE`]; returns its path.
fn write_archive(dir: &Path, files: &[&PythonFile]) -> Result<PathBuf, WriteError> {
    let path = dir.join(ARCHIVE);
    let entries = files
        .iter()
        .map(|file| (file.path, file.text.as_bytes(), file.crc));
    std::fs::write(&path, zip::stored(entries)).map_err(|source| WriteError {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// The few bytes of the zip format `zipimport` reads: stored (uncompressed) entries, a central
/// directory and its end record (PKWARE's APPNOTE, sections 4.3.7, 4.3.12 and 4.3.16).
mod zip {
    const LOCAL_HEADER: u32 = 0x0403_4b50;
    const CENTRAL_HEADER: u32 = 0x0201_4b50;
    const END_OF_CENTRAL_DIRECTORY: u32 = 0x0605_4b50;
    /// Version 1.0: stored entries, nothing newer needed to extract.
    const VERSION: u16 = 10;
    /// 1980-01-01 00:00, the format's first day (a zero date is invalid).
    const DOS_DATE: u16 = (1 << 5) | 1;

    /// An archive of `files` (name, contents, the contents' [`crc32`]), stored in that order.
    pub fn stored<'a>(files: impl Iterator<Item = (&'a str, &'a [u8], u32)>) -> Vec<u8> {
        let mut out = Vec::new();
        let mut central = Vec::new();
        let mut count: u16 = 0;
        for (name, data, crc) in files {
            let offset = out.len() as u32;
            let sizes = data.len() as u32;
            put32(&mut out, LOCAL_HEADER);
            put_entry_fields(&mut out, crc, sizes, name);
            out.extend_from_slice(&0u16.to_le_bytes()); // extra field length
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(data);

            put32(&mut central, CENTRAL_HEADER);
            put16(&mut central, VERSION); // made by
            put_entry_fields(&mut central, crc, sizes, name);
            for field in [0u16; 4] {
                // extra and comment lengths, disk number, internal attributes
                put16(&mut central, field);
            }
            put32(&mut central, 0); // external attributes
            put32(&mut central, offset);
            central.extend_from_slice(name.as_bytes());
            count += 1;
        }
        let central_offset = out.len() as u32;
        let central_size = central.len() as u32;
        out.extend_from_slice(&central);
        put32(&mut out, END_OF_CENTRAL_DIRECTORY);
        put16(&mut out, 0); // this disk
        put16(&mut out, 0); // the central directory's disk
        put16(&mut out, count);
        put16(&mut out, count);
        put32(&mut out, central_size);
        put32(&mut out, central_offset);
        put16(&mut out, 0); // comment length
        out
    }

    /// The fields a local and a central header share, from "version needed" to the name's length.
    fn put_entry_fields(out: &mut Vec<u8>, crc: u32, size: u32, name: &str) {
        put16(out, VERSION);
        put16(out, 0); // flags
        put16(out, 0); // method: stored
        put16(out, 0); // time
        put16(out, DOS_DATE);
        put32(out, crc);
        put32(out, size); // compressed
        put32(out, size); // uncompressed
        put16(out, name.len() as u16);
    }

    fn put16(out: &mut Vec<u8>, value: u16) {
        out.extend_from_slice(&value.to_le_bytes());
    }

    fn put32(out: &mut Vec<u8>, value: u32) {
        out.extend_from_slice(&value.to_le_bytes());
    }

    /// CRC-32 (IEEE, reflected), as zip and zlib compute it; `const`, so that the shipped
    /// files' are computed at build time.
    pub const fn crc32(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        let mut i = 0;
        while i < data.len() {
            crc = CRC_TABLE[((crc ^ data[i] as u32) & 0xff) as usize] ^ (crc >> 8);
            i += 1;
        }
        !crc
    }

    const CRC_TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut crc = i as u32;
            let mut bit = 0;
            while bit < 8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
                bit += 1;
            }
            table[i] = crc;
            i += 1;
        }
        table
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("muster-py-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// The names in an archive's central directory, read back as an unzipper would.
    fn names(archive: &[u8]) -> Vec<String> {
        let end = archive.len() - 22;
        assert_eq!(archive[end..end + 4], 0x0605_4b50u32.to_le_bytes());
        let count = u16::from_le_bytes([archive[end + 10], archive[end + 11]]);
        let mut at = u32::from_le_bytes(archive[end + 16..end + 20].try_into().unwrap()) as usize;
        let mut names = Vec::new();
        for _ in 0..count {
            assert_eq!(archive[at..at + 4], 0x0201_4b50u32.to_le_bytes());
            let len = u16::from_le_bytes([archive[at + 28], archive[at + 29]]) as usize;
            names.push(String::from_utf8(archive[at + 46..at + 46 + len].to_vec()).unwrap());
            at += 46 + len;
        }
        names
    }

    #[test]
    fn crc32_matches_zlib() {
        assert_eq!(zip::crc32(b""), 0);
        assert_eq!(zip::crc32(b"123456789"), 0xCBF4_3926);
        for file in FILES {
            assert_eq!(file.crc, zip::crc32(file.text.as_bytes()), "{}", file.path);
        }
    }

    #[test]
    fn the_startup_hook_gets_sitecustomize_and_the_import_hook_only() {
        let dir = scratch("startup");
        let entry = write_archive(&dir, &selected(Files::StartupHook)).unwrap();
        assert_eq!(entry, dir.join(ARCHIVE));
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        let names = names(&std::fs::read(&entry).unwrap());
        assert_eq!(
            names,
            [
                "sitecustomize.py",
                "muster_launcher/__init__.py",
                "muster_launcher/importhook.py"
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_workers_get_the_package_and_the_old_names_in_one_file() {
        let dir = scratch("workers");
        let entry = write_archive(&dir, &selected(Files::Workers)).unwrap();
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        let archive = std::fs::read(&entry).unwrap();
        let expected: Vec<&str> = FILES.iter().map(|file| file.path).collect();
        assert_eq!(names(&archive), expected);
        // Stored, not compressed: each file's text is in the archive as it is.
        for file in FILES {
            let text = file.text.as_bytes();
            assert!(
                archive.windows(text.len()).any(|w| w == text),
                "{}",
                file.path
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn install_shares_one_copy_and_writes_the_archive_only_where_it_cannot() {
        let base = scratch("install");
        let private = base.join("muster-private");
        std::fs::create_dir(&private).unwrap();
        let entry = install(&base, &private, Files::Workers).unwrap();
        assert!(entry.starts_with(&base) && entry.join("muster_checkpoint.py").is_file());
        assert_eq!(install(&base, &private, Files::Workers).unwrap(), entry);
        assert_eq!(std::fs::read_dir(&private).unwrap().count(), 0);
        // A base where nothing can be shared (not a directory of ours): the private archive.
        let entry = install(Path::new("/proc/self"), &private, Files::Workers).unwrap();
        assert_eq!(entry, private.join(ARCHIVE));
        std::fs::remove_dir_all(&base).unwrap();
    }
}
