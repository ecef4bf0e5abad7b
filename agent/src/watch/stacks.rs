//! Reading a worker's Python stacks without its cooperation, and writing them into the log.
//!
//! The first way is py-spy's: the agent is the workers' parent, and a parent may read its
//! children's memory (`process_vm_readv`, ptrace's access rule, also under Yama's
//! `ptrace_scope` 1), so py-spy finds the interpreter's thread states and walks every thread's
//! frames while the process is paused for a moment. Where memory reads are refused (a seccomp
//! profile without `process_vm_readv`, a worker that is not a Python process itself), the second
//! way needs the checkpoint helper: it registered `faulthandler` on a signal and said so
//! ("faulthandler <signum> <path>"); the agent sends the signal and reads what faulthandler wrote
//! into the file — faulthandler writes from its C signal handler, so even a rank stuck in C code
//! holding the GIL answers. Each dump says which way was used.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::hang::Waiting;

/// Where the helper's `faulthandler` fallback writes (`stacks-<pid>.txt`): a private directory
/// of the agent's, removed with it.
pub const STACKS_DIR_ENV: &str = "MUSTER_STACKS_DIR";

/// One frame, innermost first in [`ThreadStack::frames`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub function: String,
    pub file: String,
    pub line: u32,
}

impl std::fmt::Display for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}:{})", self.function, self.file, self.line)
    }
}

/// One thread's stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadStack {
    /// `0x7f…` as py-spy and faulthandler print it.
    pub thread_id: String,
    pub name: Option<String>,
    /// Whether this is the thread running the script's `<module>` (the main thread).
    pub main: bool,
    /// Innermost first.
    pub frames: Vec<Frame>,
}

/// How the stacks were read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    PySpy,
    Faulthandler,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Via::PySpy => "py-spy",
            Via::Faulthandler => "faulthandler through the helper",
        }
    }
}

/// Every thread of one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessStacks {
    pub pid: u32,
    pub via: Via,
    pub threads: Vec<ThreadStack>,
}

impl ProcessStacks {
    /// The main thread (else the first one).
    pub fn main_thread(&self) -> Option<&ThreadStack> {
        self.threads
            .iter()
            .find(|t| t.main)
            .or_else(|| self.threads.first())
    }

    /// The main thread's innermost frame.
    pub fn innermost(&self) -> Option<&Frame> {
        self.main_thread().and_then(|t| t.frames.first())
    }

    /// Whether the main thread waits inside `torch.distributed` (for another rank).
    pub fn waiting(&self) -> Waiting {
        match self.main_thread() {
            None => Waiting::Unknown,
            Some(t) if t.frames.iter().any(is_collective) => Waiting::InCollective,
            Some(_) => Waiting::Elsewhere,
        }
    }

    /// The dump as log lines (no prefix, no newline).
    pub fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        for t in &self.threads {
            let mut head = format!("Thread {}", t.thread_id);
            if let Some(name) = &t.name {
                let _ = write!(head, " {name:?}");
            }
            if t.main {
                head.push_str(" (main)");
            }
            head.push_str(", most recent call first:");
            out.push(head);
            for f in &t.frames {
                out.push(format!("    {f}"));
            }
        }
        out
    }
}

/// Frames of `torch.distributed` (collectives, barriers, `Work.wait`, the store): a rank there
/// waits for another one. So does a rank stalled in autograd's backward or in DDP's forward:
/// DDP reduces the gradients inside backward (its reducer's hooks, in C++, with no
/// `torch.distributed` frame on the Python stack) and syncs buffers in its forward, and a
/// backward itself never takes as long as a hang limit; this is where the healthy ranks of a
/// plain DDP loop wait when one of them is stuck.
fn is_collective(frame: &Frame) -> bool {
    let file = frame.file.as_str();
    file.contains("torch/distributed/")
        || file.contains("torch/nn/parallel/distributed.py")
        || (file.contains("torch/autograd/") && frame.function == "_engine_run_backward")
}

/// Why no stack could be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ReadError(pub String);

/// Reads every thread of `pid` with py-spy (blocking: run it off the async threads).
///
/// Without pausing the process (py-spy's non-blocking mode: memory reads only): pausing attaches
/// with ptrace, and the agent's reaper — which waits for any child — would take the tracee's
/// stop notifications that py-spy waits for. A hung rank does not change under the read; a
/// running one (`muster stacks`) may give a torn stack, which is retried.
pub fn read_pyspy(pid: u32) -> Result<ProcessStacks, ReadError> {
    let pid_t = i32::try_from(pid).map_err(|_| ReadError(format!("bad pid {pid}")))?;
    let config = py_spy::Config {
        blocking: py_spy::config::LockingStrategy::NonBlocking,
        ..py_spy::Config::default()
    };
    let mut spy =
        py_spy::PythonSpy::new(pid_t, &config).map_err(|e| ReadError(format!("{e:#}")))?;
    let mut last = String::new();
    for _ in 0..PYSPY_TRIES {
        match spy.get_stack_traces() {
            Ok(traces) => {
                return Ok(ProcessStacks {
                    pid,
                    via: Via::PySpy,
                    threads: traces.iter().map(thread_of_trace).collect(),
                })
            }
            Err(err) => last = format!("{err:#}"),
        }
    }
    Err(ReadError(last))
}

/// Reads of a running process that may be torn by the process moving on.
const PYSPY_TRIES: u32 = 5;
/// The longest one py-spy read may take before the fallback is tried.
const PYSPY_TIMEOUT: Duration = Duration::from_secs(10);

fn thread_of_trace(trace: &py_spy::StackTrace) -> ThreadStack {
    let frames: Vec<Frame> = trace
        .frames
        .iter()
        .map(|f| Frame {
            function: f.name.clone(),
            file: f.filename.clone(),
            line: u32::try_from(f.line).unwrap_or(0),
        })
        .collect();
    let main = trace.thread_name.as_deref() == Some("MainThread")
        || frames.last().is_some_and(|f| f.function == "<module>");
    ThreadStack {
        thread_id: format!("{:#x}", trace.thread_id),
        name: trace.thread_name.clone(),
        main,
        frames,
    }
}

/// A rank's faulthandler registration, as the helper announced it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Faulthandler {
    pub signal: i32,
    pub file: PathBuf,
}

/// How long faulthandler gets to write after the signal.
const FAULTHANDLER_WAIT: Duration = Duration::from_secs(2);

/// Sends the registered signal to `pid` and reads what faulthandler appended to its file.
pub async fn read_faulthandler(
    pid: u32,
    registration: &Faulthandler,
) -> Result<ProcessStacks, ReadError> {
    let before = file_len(&registration.file);
    let signal = nix::sys::signal::Signal::try_from(registration.signal)
        .map_err(|e| ReadError(format!("signal {}: {e}", registration.signal)))?;
    let target = nix::unistd::Pid::from_raw(
        i32::try_from(pid).map_err(|_| ReadError(format!("bad pid {pid}")))?,
    );
    nix::sys::signal::kill(target, signal)
        .map_err(|e| ReadError(format!("cannot signal pid {pid}: {e}")))?;
    // faulthandler writes everything at once from the handler; wait until the file stops growing.
    let deadline = tokio::time::Instant::now() + FAULTHANDLER_WAIT;
    let mut seen = before;
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = file_len(&registration.file);
        if now > before && now == seen {
            break;
        }
        seen = now;
        if tokio::time::Instant::now() >= deadline {
            break;
        }
    }
    let bytes = std::fs::read(&registration.file)
        .map_err(|e| ReadError(format!("{}: {e}", registration.file.display())))?;
    let start = usize::try_from(before).unwrap_or(0).min(bytes.len());
    let text = String::from_utf8_lossy(&bytes[start..]);
    let threads = parse_faulthandler(&text);
    if threads.is_empty() {
        return Err(ReadError(format!(
            "faulthandler wrote nothing within {} (the rank may have replaced the signal's handler)",
            rendezvous::words::duration(FAULTHANDLER_WAIT)
        )));
    }
    Ok(ProcessStacks {
        pid,
        via: Via::Faulthandler,
        threads,
    })
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// Parses faulthandler's dump:
///
/// ```text
/// Thread 0x00007f3a (most recent call first):
///   File "/app/train.py", line 42 in load_batch
///
/// Current thread 0x00007f3b (most recent call first):
///   File "/app/train.py", line 80 in <module>
/// ```
pub fn parse_faulthandler(text: &str) -> Vec<ThreadStack> {
    let mut threads: Vec<ThreadStack> = Vec::new();
    for line in text.lines() {
        let trimmed = line.trim();
        let header = trimmed
            .strip_prefix("Current thread ")
            .or_else(|| trimmed.strip_prefix("Thread "));
        if let Some(rest) = header {
            let id = rest.split_whitespace().next().unwrap_or_default();
            threads.push(ThreadStack {
                thread_id: id.to_owned(),
                name: None,
                main: false,
                frames: Vec::new(),
            });
            continue;
        }
        let (Some(thread), Some(rest)) = (threads.last_mut(), trimmed.strip_prefix("File \""))
        else {
            continue;
        };
        let Some((file, tail)) = rest.split_once('"') else {
            continue;
        };
        // `, line 42 in load_batch`
        let tail = tail.trim_start_matches(',').trim();
        let (line_no, function) = tail
            .strip_prefix("line ")
            .and_then(|t| t.split_once(" in "))
            .map_or((0, "???"), |(n, f)| {
                (n.trim().parse().unwrap_or(0), f.trim())
            });
        thread.frames.push(Frame {
            function: function.to_owned(),
            file: file.to_owned(),
            line: line_no,
        });
    }
    for t in &mut threads {
        t.main = t.frames.last().is_some_and(|f| f.function == "<module>");
    }
    threads
}

/// Test hook, not a user setting: `MUSTER_TEST_NO_PYSPY=1` makes every read skip py-spy, as if
/// the rank's memory could not be read, so the suites can prove the `faulthandler` fallback end
/// to end on a machine where py-spy works (docs/launch.md § Test hooks). Unset, empty or `0`:
/// py-spy is used.
pub const TEST_NO_PYSPY_ENV: &str = "MUSTER_TEST_NO_PYSPY";

fn pyspy_disabled_for_tests() -> bool {
    std::env::var_os(TEST_NO_PYSPY_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Reads `pid`'s stacks: py-spy first, then faulthandler where the helper registered it. The
/// error names both failures.
pub async fn read(
    pid: u32,
    faulthandler: Option<&Faulthandler>,
) -> Result<ProcessStacks, ReadError> {
    let spied = if pyspy_disabled_for_tests() {
        Err(ReadError(format!("disabled by {TEST_NO_PYSPY_ENV}")))
    } else {
        read_pyspy_bounded(pid).await
    };
    let spy_err = match spied {
        Ok(stacks) if !stacks.threads.is_empty() => return Ok(stacks),
        Ok(_) => "py-spy found no Python thread".to_owned(),
        Err(e) => e.0,
    };
    let Some(registration) = faulthandler else {
        return Err(ReadError(format!(
            "py-spy: {spy_err}; no faulthandler fallback (the rank does not use the checkpoint helper)"
        )));
    };
    read_faulthandler(pid, registration)
        .await
        .map_err(|e| ReadError(format!("py-spy: {spy_err}; faulthandler: {e}")))
}

/// [`read_pyspy`] off the async threads, within [`PYSPY_TIMEOUT`].
async fn read_pyspy_bounded(pid: u32) -> Result<ProcessStacks, ReadError> {
    match tokio::time::timeout(
        PYSPY_TIMEOUT,
        tokio::task::spawn_blocking(move || read_pyspy(pid)),
    )
    .await
    {
        Ok(Ok(read)) => read,
        Ok(Err(e)) => Err(ReadError(format!("py-spy panicked: {e}"))),
        Err(_) => Err(ReadError(format!(
            "no answer within {}s",
            PYSPY_TIMEOUT.as_secs()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DUMP: &str = "Thread 0x00007f3a11bff640 (most recent call first):\n  \
        File \"/usr/lib/python3.11/threading.py\", line 320 in wait\n  \
        File \"/usr/lib/python3.11/threading.py\", line 1002 in _bootstrap\n\n\
        Current thread 0x00007f3a1a5c3740 (most recent call first):\n  \
        File \"/app/train.py\", line 42 in stuck_in_loader\n  \
        File \"/app/train.py\", line 80 in main\n  \
        File \"/app/train.py\", line 90 in <module>\n";

    #[test]
    fn parses_a_faulthandler_dump_and_finds_the_main_thread() {
        let threads = parse_faulthandler(DUMP);
        assert_eq!(threads.len(), 2);
        assert_eq!(threads[0].thread_id, "0x00007f3a11bff640");
        assert!(!threads[0].main);
        assert!(threads[1].main);
        assert_eq!(
            threads[1].frames[0],
            Frame {
                function: "stuck_in_loader".into(),
                file: "/app/train.py".into(),
                line: 42
            }
        );
        let stacks = ProcessStacks {
            pid: 7,
            via: Via::Faulthandler,
            threads,
        };
        assert_eq!(
            stacks.innermost().map(ToString::to_string).as_deref(),
            Some("stuck_in_loader (/app/train.py:42)")
        );
        assert_eq!(stacks.waiting(), Waiting::Elsewhere);
        let lines = stacks.lines();
        assert_eq!(
            lines[0],
            "Thread 0x00007f3a11bff640, most recent call first:"
        );
        assert_eq!(
            lines[3],
            "Thread 0x00007f3a1a5c3740 (main), most recent call first:"
        );
        assert_eq!(lines[4], "    stuck_in_loader (/app/train.py:42)");
    }

    #[test]
    fn a_rank_inside_torch_distributed_is_waiting_for_another() {
        let dump = "Current thread 0x1 (most recent call first):\n  \
            File \"/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py\", line 2950 in all_reduce\n  \
            File \"/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py\", line 81 in wrapper\n  \
            File \"/app/train.py\", line 50 in step\n  \
            File \"/app/train.py\", line 90 in <module>\n";
        let stacks = ProcessStacks {
            pid: 1,
            via: Via::Faulthandler,
            threads: parse_faulthandler(dump),
        };
        assert_eq!(stacks.waiting(), Waiting::InCollective);
        // A DDP rank waiting in backward for its peers' gradients.
        let backward = "Current thread 0x1 (most recent call first):\n  \
            File \"/venv/lib/python3.11/site-packages/torch/autograd/graph.py\", line 1113 in _engine_run_backward\n  \
            File \"/venv/lib/python3.11/site-packages/torch/autograd/__init__.py\", line 395 in backward\n  \
            File \"/venv/lib/python3.11/site-packages/torch/_tensor.py\", line 623 in backward\n  \
            File \"/app/train.py\", line 18 in <module>\n";
        let stacks = ProcessStacks {
            pid: 1,
            via: Via::Faulthandler,
            threads: parse_faulthandler(backward),
        };
        assert_eq!(stacks.waiting(), Waiting::InCollective);
        let empty = ProcessStacks {
            pid: 1,
            via: Via::PySpy,
            threads: Vec::new(),
        };
        assert_eq!(empty.waiting(), Waiting::Unknown);
    }

    #[test]
    fn garbage_is_no_thread() {
        assert!(parse_faulthandler("Fatal Python error: x\n  File \"a\"\n").is_empty());
    }
}
