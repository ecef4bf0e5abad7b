//! `muster`: the container ENTRYPOINT of a distributed PyTorch training pod.
//!
//! All logic lives in the `agent` library; this only hands it the command line and turns its
//! outcome into the process exit code.

fn main() -> std::process::ExitCode {
    agent::main(&std::env::args_os().collect::<Vec<_>>())
}
