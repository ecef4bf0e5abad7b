//! Worker output: pipes read directly, split into lines, progress-bar updates coalesced, prefixed
//! (or JSON-encoded in the one schema of [`record`]) and written to the console by one writer
//! thread, plus torchrun's per-rank log files.
//!
//! The pieces: [`split`] cuts bytes into segments, [`ansi`] reduces terminal escapes,
//! [`progress`] keeps one progress update per interval, [`reader`] is the per-pipe task that
//! drives them, [`stats`] counts what each rank wrote, [`file`] is a rank's log file and what
//! happens when it cannot be written.
//!
//! Why one writer: every line reaches the agent's stdout/stderr in a single `write_all` from a
//! single thread, so two ranks (or a rank and the agent's own messages) can never interleave
//! mid-line, whatever the pipe buffer does. The writer is an OS thread, not a task, so a blocked
//! console (nobody reading the container log pipe) never stalls the agent's event loop: readers
//! wait on a byte budget ([`MAX_BUFFERED_BYTES`]) instead, which pushes back on the workers just
//! as a pipe would without a launcher, while signals and exits keep being handled.

mod ansi;
pub mod exception;
pub mod file;
mod prefix;
mod progress;
mod reader;
pub mod record;
mod split;
pub mod stats;

use std::io::Write;
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::sync::{mpsc, Semaphore};

pub use exception::ExceptionLine;
pub use file::LogFile;
pub use prefix::{render_template, utc_timestamp};
pub use reader::{pump, LineTarget, PumpConfig};
pub use stats::{OutputStats, StreamCounters};

/// A line longer than this without a newline is emitted in pieces of this size.
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// Worker bytes that may wait for the console writer before readers stop reading their pipes.
pub const MAX_BUFFERED_BYTES: usize = 4 * 1024 * 1024;
/// Default `--progress-interval`: a bar's state every 10 s is plenty in a pod log.
pub const DEFAULT_PROGRESS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// How lines are written to the console: worker lines and the agent's own diagnostics alike
/// (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// `<prefix><line>` for workers; plain text for the agent.
    #[default]
    Text,
    /// One JSON object per line, every record in the schema of [`record`].
    Json,
}

/// Where the agent's own diagnostics go.
pub enum Diagnostics {
    /// Through the console writer, so they never split a worker line (a launch, a dry run);
    /// without timestamps, like the worker lines around them.
    Console(LogSink),
    /// Straight to stderr, with timestamps (`muster store`, a server with no workers).
    Stderr,
}

/// The one tracing set-up of every command: `MUSTER_LOG` (else `RUST_LOG`, else
/// `default_filter`) chooses what is shown, `format` how, `to` where. Colour only when stderr is
/// a terminal, so `2>file` holds plain text. A second call is a no-op (tests start several
/// agents in one process).
pub fn init_tracing(format: LogFormat, to: Diagnostics, default_filter: &str) {
    use std::io::IsTerminal;
    let filter = ["MUSTER_LOG", "RUST_LOG"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
        .and_then(|spec| tracing_subscriber::EnvFilter::try_new(spec).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new(default_filter));
    let (writer, timestamps) = match to {
        Diagnostics::Console(sink) => (
            tracing_subscriber::fmt::writer::BoxMakeWriter::new(TracingWriter::new(sink)),
            false,
        ),
        Diagnostics::Stderr => (
            tracing_subscriber::fmt::writer::BoxMakeWriter::new(std::io::stderr),
            true,
        ),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false);
    let _already_set = match format {
        LogFormat::Text if timestamps => builder.try_init(),
        LogFormat::Text => builder.without_time().try_init(),
        LogFormat::Json => builder
            .event_format(record::JsonEvents::new(crate::host::short_name()))
            .try_init(),
    };
}

/// Which of the agent's streams a line goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Console {
    Stdout,
    Stderr,
}

enum Msg {
    /// Bytes that end at a line boundary; `budget` bytes are returned to the semaphore once
    /// written.
    Write {
        console: Console,
        bytes: Vec<u8>,
        budget: u32,
    },
    /// Raw bytes for a per-rank log file.
    File {
        file: Arc<LogFile>,
        bytes: Vec<u8>,
        budget: u32,
    },
    Shutdown,
}

/// A handle to the console writer; cheap to clone.
#[derive(Clone)]
pub struct LogSink {
    tx: mpsc::UnboundedSender<Msg>,
    budget: Arc<Semaphore>,
    stats: Arc<OutputStats>,
}

/// The writer thread; [`LogWriter::finish`] drains and stops it.
pub struct LogWriter {
    sink: LogSink,
    thread: Option<JoinHandle<()>>,
}

/// Starts the writer thread.
pub fn start() -> std::io::Result<LogWriter> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Msg>();
    let budget = Arc::new(Semaphore::new(MAX_BUFFERED_BYTES));
    let thread_budget = budget.clone();
    let thread = std::thread::Builder::new()
        .name("muster-log".into())
        .spawn(move || {
            let stdout = std::io::stdout();
            let stderr = std::io::stderr();
            while let Some(msg) = rx.blocking_recv() {
                // Errors writing the console (EPIPE when the reader went away) must not stop the
                // agent from supervising; the bytes are dropped. A log file that cannot be
                // written says so itself (see `file`).
                match msg {
                    Msg::Write {
                        console,
                        bytes,
                        budget,
                    } => {
                        let _ = match console {
                            Console::Stdout => stdout.lock().write_all(&bytes),
                            Console::Stderr => stderr.lock().write_all(&bytes),
                        };
                        thread_budget.add_permits(budget as usize);
                    }
                    Msg::File {
                        file,
                        bytes,
                        budget,
                    } => {
                        file.write(&bytes);
                        thread_budget.add_permits(budget as usize);
                    }
                    // Closing makes later senders write directly (see `agent_line`); what is
                    // already queued is still written, such as a log file's warning that came
                    // while the writer was handling that file's last bytes.
                    Msg::Shutdown => rx.close(),
                }
            }
            let _ = stdout.lock().flush();
        })?;
    Ok(LogWriter {
        sink: LogSink {
            tx,
            budget,
            stats: Arc::default(),
        },
        thread: Some(thread),
    })
}

impl LogWriter {
    pub fn sink(&self) -> LogSink {
        self.sink.clone()
    }

    /// Writes everything queued so far, then stops the thread. Later messages go straight to
    /// the console (see [`LogSink::agent_line`]). Dropping the writer does the same, so every
    /// way out of a command (an early error included) flushes the console.
    pub fn finish(self) {
        drop(self);
    }
}

impl Drop for LogWriter {
    fn drop(&mut self) {
        let _ = self.sink.tx.send(Msg::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl LogSink {
    /// What every rank wrote through this sink, for the metrics.
    pub fn stats(&self) -> Arc<OutputStats> {
        Arc::clone(&self.stats)
    }

    async fn reserve(&self, len: usize) -> u32 {
        let n = len.min(MAX_BUFFERED_BYTES) as u32;
        if let Ok(permit) = self.budget.acquire_many(n).await {
            permit.forget();
        }
        n
    }

    /// Queues worker bytes (whole lines) for the console, waiting for budget.
    pub async fn write(&self, console: Console, bytes: Vec<u8>) {
        let budget = self.reserve(bytes.len()).await;
        let _ = self.tx.send(Msg::Write {
            console,
            bytes,
            budget,
        });
    }

    /// Queues raw worker bytes for a log file, waiting for budget.
    pub async fn write_file(&self, file: Arc<LogFile>, bytes: Vec<u8>) {
        let budget = self.reserve(bytes.len()).await;
        let _ = self.tx.send(Msg::File {
            file,
            bytes,
            budget,
        });
    }

    /// The agent's own output: never waits (it must not block on a full console), and falls back
    /// to a direct write once the writer has stopped.
    pub fn agent_line(&self, console: Console, bytes: Vec<u8>) {
        if let Err(mpsc::error::SendError(Msg::Write { bytes, .. })) = self.tx.send(Msg::Write {
            console,
            bytes,
            budget: 0,
        }) {
            let _ = match console {
                Console::Stdout => std::io::stdout().lock().write_all(&bytes),
                Console::Stderr => std::io::stderr().lock().write_all(&bytes),
            };
        }
    }
}

/// A `tracing` writer that sends each formatted event through the sink as one message, so the
/// agent's messages obey the same no-interleaving rule as worker lines.
#[derive(Clone)]
pub struct TracingWriter {
    sink: LogSink,
}

impl TracingWriter {
    pub fn new(sink: LogSink) -> Self {
        Self { sink }
    }
}

/// One event's bytes, sent when the formatter is done with it.
pub struct EventBuffer {
    sink: LogSink,
    buf: Vec<u8>,
}

impl Write for EventBuffer {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for EventBuffer {
    fn drop(&mut self) {
        if !self.buf.is_empty() {
            self.sink
                .agent_line(Console::Stderr, std::mem::take(&mut self.buf));
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for TracingWriter {
    type Writer = EventBuffer;

    fn make_writer(&'a self) -> Self::Writer {
        EventBuffer {
            sink: self.sink.clone(),
            buf: Vec::with_capacity(256),
        }
    }
}
