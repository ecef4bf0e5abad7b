//! py-spy reading a real Python child's stack, through the agent's own reader.
//!
//! In a binary of its own: the library's unit tests run launches concurrently in one process,
//! and a launch's reaper waits for any child and its stray sweep stops any process started in its
//! scope, so a Python child spawned beside them could be reaped (its pid reused by a launch's
//! rank, which `kill` would then hit) or stopped mid-test.

use std::time::Duration;

use agent::watch::hang::Waiting;
use agent::watch::stacks::{read, Via};

#[tokio::test]
async fn py_spy_reads_a_child_python_process() {
    // Runs where a Python interpreter is installed; the suites test the launch end to end.
    let Ok(mut child) = std::process::Command::new("python3")
        .args([
            "-c",
            "import time\ndef parked_here():\n    while True: time.sleep(0.05)\nparked_here()\n",
        ])
        .spawn()
    else {
        return;
    };
    let pid = child.id();
    let mut found = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if let Ok(stacks) = read(pid, None).await {
            if stacks
                .innermost()
                .is_some_and(|f| f.function == "parked_here")
            {
                found = Some(stacks);
                break;
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let stacks = found.expect("py-spy read the child's stack");
    assert_eq!(stacks.via, Via::PySpy);
    assert_eq!(stacks.waiting(), Waiting::Elsewhere);
}
