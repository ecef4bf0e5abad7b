//! The worker's start against what std's `Command` gives a child. The tests never `waitpid`: a
//! reaper of another test in this process may reap any child outside its session (every worker
//! is), so each worker reports through its pipes, and its death shows as their end.

use std::io::Read as _;
use std::os::fd::AsRawFd as _;
use std::time::{Duration, Instant};

use nix::unistd::Pid;

use super::{search_candidates, StartedWorker, WorkerCommand};

fn ours() -> Pid {
    nix::unistd::getpid()
}

fn sh(script: &str) -> WorkerCommand {
    let mut cmd = WorkerCommand::new("/bin/sh", ours());
    cmd.args(["-c", script]);
    cmd
}

/// Everything the worker writes to stdout and stderr, read until both close.
fn output(mut worker: StartedWorker) -> (String, String) {
    let err_reader = std::thread::spawn(move || {
        let mut err = String::new();
        worker.stderr.read_to_string(&mut err).map(|_| err)
    });
    let mut out = String::new();
    worker.stdout.read_to_string(&mut out).expect("stdout");
    (out, err_reader.join().expect("reader").expect("stderr"))
}

/// The value of `field` in the worker's `/proc/self/status`.
fn status_field(mut cmd: WorkerCommand, field: &str) -> String {
    cmd.args(["-c", "cat /proc/self/status"]);
    let (out, _) = output(cmd.spawn().expect("sh starts"));
    out.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in {out}"))
        .trim()
        .to_string()
}

#[test]
fn stdout_and_stderr_are_piped_apart() {
    let worker = sh("echo to-out; echo to-err >&2; exit 3").spawn().unwrap();
    assert!(worker.pid > 0);
    assert_eq!(output(worker), ("to-out\n".into(), "to-err\n".into()));
}

#[test]
fn the_worker_leads_its_own_session() {
    let (out, _) = output(sh("cut -d' ' -f6 /proc/$$/stat; echo $$").spawn().unwrap());
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert_eq!(lines[0], lines[1], "session id = own pid: {out}");
    let own_session = nix::unistd::getsid(None).unwrap().as_raw().to_string();
    assert_ne!(lines[0], own_session);
}

#[test]
fn the_environment_is_the_agents_with_later_values_winning_and_removals() {
    let mut cmd = sh("echo \"$MUSTER_SPAWN_A|${HOME-unset}|$PATH\"");
    cmd.envs([("MUSTER_SPAWN_A", "first")])
        .envs([("MUSTER_SPAWN_A", "second")])
        .env_remove("HOME");
    let (out, _) = output(cmd.spawn().unwrap());
    let path = std::env::var("PATH").unwrap_or_default();
    assert_eq!(out, format!("second|unset|{path}\n"));
}

#[test]
fn the_signal_mask_is_empty_and_sigpipe_is_back_to_its_default() {
    // The test binary, like the agent, ignores SIGPIPE (std does); the spawn blocks every signal
    // around the clone. `cat` is exec'd by `sh` with what it inherited.
    let blocked = status_field(WorkerCommand::new("/bin/sh", ours()), "SigBlk");
    assert_eq!(u64::from_str_radix(&blocked, 16), Ok(0), "SigBlk {blocked}");
    let ignored = status_field(WorkerCommand::new("/bin/sh", ours()), "SigIgn");
    let ignored = u64::from_str_radix(&ignored, 16).unwrap();
    assert_eq!(
        ignored & (1 << (libc::SIGPIPE - 1)),
        0,
        "SigIgn {ignored:x}"
    );
}

#[test]
fn cpus_pin_the_worker() {
    let mut cmd = WorkerCommand::new("/bin/sh", ours());
    let mut cpus = nix::sched::CpuSet::new();
    cpus.set(0).unwrap();
    cmd.cpus(Some(cpus));
    assert_eq!(status_field(cmd, "Cpus_allowed_list"), "0");
}

#[test]
fn an_inherited_descriptor_stays_open_and_no_other_does() {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    let (mut read, write) = (std::fs::File::from(read), write);
    // Through /proc: dash's `>&N` takes one digit, and tests running beside this one hold more.
    let script = format!(
        "echo through-fd > /proc/self/fd/{w}; \
         if [ -e /proc/$$/fd/{r} ]; then echo read-end-leaked; fi",
        w = write.as_raw_fd(),
        r = read.as_raw_fd()
    );
    let mut cmd = sh(&script);
    cmd.inherit_fd(write.as_raw_fd());
    let worker = cmd.spawn().unwrap();
    drop(write);
    let (out, err) = output(worker);
    assert_eq!((out.as_str(), err.as_str()), ("", ""));
    let mut through = String::new();
    read.read_to_string(&mut through).unwrap();
    assert_eq!(through, "through-fd\n");
}

#[test]
fn a_program_is_found_on_the_workers_path() {
    let mut cmd = WorkerCommand::new("sh", ours());
    cmd.args(["-c", "echo found"])
        .envs([("PATH", "/nonexistent-dir::/bin:/usr/bin")]);
    assert_eq!(output(cmd.spawn().unwrap()).0, "found\n");
}

#[test]
fn a_missing_program_is_not_found_like_std_says_it() {
    for program in ["muster-no-such-program", "/nonexistent-dir/prog", ""] {
        let err = WorkerCommand::new(program, ours()).spawn().unwrap_err();
        let std_err = std::process::Command::new(program).spawn().unwrap_err();
        assert_eq!(
            err.kind(),
            std::io::ErrorKind::NotFound,
            "{program:?}: {err}"
        );
        assert_eq!(err.to_string(), std_err.to_string(), "{program:?}");
    }
}

#[test]
fn a_file_that_is_not_executable_is_denied_unless_another_is_found() {
    let dir = TestDir::new("denied");
    let file = dir.path().join("muster-spawn-tool");
    std::fs::write(&file, "echo never\n").unwrap();
    let mut cmd = WorkerCommand::new("muster-spawn-tool", ours());
    cmd.envs([("PATH", dir.path())]);
    let err = cmd.spawn().unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");

    let other = TestDir::new("denied-other");
    let runnable = other.path().join("muster-spawn-tool");
    std::fs::write(&runnable, "#!/bin/sh\necho the-second\n").unwrap();
    make_executable(&runnable);
    let path = std::env::join_paths([dir.path(), other.path()]).unwrap();
    let mut cmd = WorkerCommand::new("muster-spawn-tool", ours());
    cmd.envs([("PATH", path)]);
    assert_eq!(output(cmd.spawn().unwrap()).0, "the-second\n");
}

#[test]
fn a_script_without_a_shebang_runs_under_sh() {
    let dir = TestDir::new("script");
    let script = dir.path().join("plain");
    std::fs::write(&script, "echo plain \"$1\"\n").unwrap();
    make_executable(&script);
    let mut cmd = WorkerCommand::new(&script, ours());
    cmd.args(["arg1"]);
    assert_eq!(output(cmd.spawn().unwrap()).0, "plain arg1\n");
}

#[test]
fn a_nul_byte_is_an_invalid_input() {
    let mut cmd = WorkerCommand::new("/bin/sh", ours());
    cmd.args(["-c", "a\0b"]);
    let err = cmd.spawn().unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
}

#[test]
fn a_worker_whose_agent_is_not_its_parent_does_not_start() {
    let err = WorkerCommand::new("/bin/sh", Pid::from_raw(1))
        .spawn()
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ESRCH), "{err}");
}

#[test]
fn a_worker_dies_with_the_thread_that_started_it() {
    // PR_SET_PDEATHSIG follows the cloning thread: a thread that exits stands in for a SIGKILLed
    // agent. The worker would sleep a minute; its pipes close when it is killed.
    let worker = std::thread::spawn(|| sh("exec sleep 60").spawn())
        .join()
        .expect("the spawning thread ran")
        .expect("sleep starts");
    let started = Instant::now();
    let _ = output(worker);
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn candidates_follow_execvp() {
    let found = |program: &str, path: Option<&str>| -> Vec<String> {
        search_candidates(program.as_bytes(), path.map(str::as_bytes))
            .into_iter()
            .map(|c| String::from_utf8(c).unwrap())
            .collect()
    };
    assert_eq!(found("./run", Some("/bin")), ["./run"]);
    assert_eq!(
        found("python", Some("/a/:/b::")),
        ["/a/python", "/b/python", "python", "python"]
    );
    assert_eq!(found("python", None), ["/bin/python", "/usr/bin/python"]);
    assert!(found("", Some("/bin")).is_empty());
}

fn make_executable(path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A directory of this test process, removed when dropped.
struct TestDir(std::path::PathBuf);

impl TestDir {
    fn new(name: &str) -> TestDir {
        let dir = std::env::temp_dir().join(format!("muster-spawn-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TestDir(dir)
    }

    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
