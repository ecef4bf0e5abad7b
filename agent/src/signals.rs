//! Termination signals for the simple subcommands: SIGTERM or SIGINT cancels one token.

use tokio::signal::unix::{signal, SignalKind};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Cancels `token` on the first SIGTERM or SIGINT. Handlers are installed before this returns,
/// so no signal can slip through between the call and the first await.
pub fn cancel_on_termination(token: CancellationToken) -> std::io::Result<JoinHandle<()>> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        token.cancel();
    }))
}
