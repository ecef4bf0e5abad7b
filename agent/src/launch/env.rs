//! The environment torchrun gives each worker, as a pure function of the configuration, the rank
//! assignment and the agent's own environment (which workers inherit underneath these values).

use std::ffi::OsString;
use std::path::Path;

use super::config::Config;
use super::RankAssignment;

/// Variables set for worker `local_rank`, on top of the inherited environment.
/// `error_file`: `TORCHELASTIC_ERROR_FILE`, unset when muster has nowhere to write (a read-only
/// root without `--log-dir`, `--tmp-dir` or a writable `/tmp`): torch's `@record` then only
/// prints the traceback.
pub fn worker_env(
    config: &Config,
    a: &RankAssignment,
    local_rank: u32,
    error_file: Option<&Path>,
    inherited: &dyn Fn(&str) -> Option<OsString>,
) -> Vec<(&'static str, OsString)> {
    let rank = a.base_global_rank + local_rank;
    let s = |v: &dyn ToString| OsString::from(v.to_string());
    let mut env = vec![
        ("LOCAL_RANK", s(&local_rank)),
        ("RANK", s(&rank)),
        ("GROUP_RANK", s(&a.node_rank)),
        // One role per job (torchrun's CLI cannot express more), so role ranks are global ranks.
        ("ROLE_RANK", s(&rank)),
        ("ROLE_NAME", s(&config.role)),
        ("LOCAL_WORLD_SIZE", s(&config.nproc_per_node)),
        ("WORLD_SIZE", s(&a.world_size)),
        ("GROUP_WORLD_SIZE", s(&a.group_world_size)),
        ("ROLE_WORLD_SIZE", s(&a.world_size)),
        ("MASTER_ADDR", s(&a.master_addr)),
        ("MASTER_PORT", s(&a.master_port)),
        ("TORCHELASTIC_RESTART_COUNT", s(&a.restart_count)),
        ("TORCHELASTIC_MAX_RESTARTS", s(&config.max_restarts)),
        ("TORCHELASTIC_RUN_ID", s(&a.run_id)),
        // The agent hosts the store the workers' `init_process_group(env://)` connects to; the
        // Python side compares against exactly "True".
        ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
        (
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            inherited("TORCH_NCCL_ASYNC_ERROR_HANDLING")
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| "1".into()),
        ),
        // torchrun's format, which torch code in the worker parses: signal names only. The
        // actions (`SIGUSR1:forward`) are muster's own syntax and stay with the agent.
        (
            "TORCHELASTIC_SIGNALS_TO_HANDLE",
            torchrun_signal_list(config).into(),
        ),
    ];
    if let Some(file) = error_file {
        env.push(("TORCHELASTIC_ERROR_FILE", file.as_os_str().to_owned()));
    }
    if inherited("PYTHONUNBUFFERED").is_none() {
        // A worker's stdout is a pipe to the agent, so Python would block-buffer it: a script
        // that prints rarely shows nothing for minutes (and the dry run's fault clock, which
        // starts at the first worker output, would wait). `-u` covers the script muster starts;
        // this also covers a wrapper's Python and the script's own Python subprocesses. Any
        // value the user set, even an empty one (Python's "buffered"), is theirs.
        env.push(("PYTHONUNBUFFERED", "1".into()));
    }
    if inherited("OMP_NUM_THREADS").is_none() && config.nproc_per_node > 1 {
        // torchrun's rule: several ranks on one node must not each start one thread per core.
        env.push(("OMP_NUM_THREADS", "1".into()));
    }
    env
}

/// The handled signals as torchrun exports them: `SIGTERM,SIGINT,SIGHUP,SIGQUIT[,...]`.
fn torchrun_signal_list(config: &Config) -> String {
    config
        .signals
        .actions
        .iter()
        .map(|(sig, _)| sig.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assignment() -> RankAssignment {
        RankAssignment {
            node_rank: 1,
            group_world_size: 2,
            base_global_rank: 4,
            world_size: 8,
            master_addr: "10.0.0.1".into(),
            master_port: 41000,
            restart_count: 2,
            run_id: "job".into(),
        }
    }

    fn get<'a>(env: &'a [(&'static str, OsString)], k: &str) -> Option<&'a str> {
        env.iter()
            .find(|(n, _)| *n == k)
            .and_then(|(_, v)| v.to_str())
    }

    #[test]
    fn ranks_and_torchelastic_values() {
        let mut c = Config::for_program("/bin/true", vec![], 4);
        c.max_restarts = 3;
        let env = worker_env(&c, &assignment(), 3, Some(Path::new("/l/e.json")), &|_| {
            None
        });
        assert_eq!(get(&env, "RANK"), Some("7"));
        assert_eq!(get(&env, "LOCAL_RANK"), Some("3"));
        assert_eq!(get(&env, "GROUP_RANK"), Some("1"));
        assert_eq!(get(&env, "ROLE_RANK"), Some("7"));
        assert_eq!(get(&env, "WORLD_SIZE"), Some("8"));
        assert_eq!(get(&env, "ROLE_WORLD_SIZE"), Some("8"));
        assert_eq!(get(&env, "GROUP_WORLD_SIZE"), Some("2"));
        assert_eq!(get(&env, "LOCAL_WORLD_SIZE"), Some("4"));
        assert_eq!(get(&env, "MASTER_PORT"), Some("41000"));
        assert_eq!(get(&env, "TORCHELASTIC_RESTART_COUNT"), Some("2"));
        assert_eq!(get(&env, "TORCHELASTIC_MAX_RESTARTS"), Some("3"));
        assert_eq!(get(&env, "TORCHELASTIC_USE_AGENT_STORE"), Some("True"));
        assert_eq!(get(&env, "TORCHELASTIC_ERROR_FILE"), Some("/l/e.json"));
        assert_eq!(
            get(&env, "TORCHELASTIC_SIGNALS_TO_HANDLE"),
            Some("SIGTERM,SIGINT,SIGHUP,SIGQUIT")
        );
        assert_eq!(get(&env, "OMP_NUM_THREADS"), Some("1"));
        assert_eq!(get(&env, "TORCH_NCCL_ASYNC_ERROR_HANDLING"), Some("1"));
    }

    #[test]
    fn workers_get_the_signal_list_in_torchruns_format() {
        let mut c = Config::for_program("/bin/true", vec![], 1);
        c.signals =
            crate::cli::hiargs::parse_signals("SIGTERM,usr1:forward,SIGUSR2:ignore,INT").unwrap();
        let env = worker_env(&c, &assignment(), 0, Some(Path::new("e")), &|_| None);
        assert_eq!(
            get(&env, "TORCHELASTIC_SIGNALS_TO_HANDLE"),
            Some("SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2")
        );
    }

    #[test]
    fn inherited_values_win_where_torchrun_lets_them() {
        let c = Config::for_program("/bin/true", vec![], 2);
        let inherited = |k: &str| match k {
            "OMP_NUM_THREADS" => Some(OsString::from("4")),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING" => Some(OsString::from("3")),
            _ => None,
        };
        let env = worker_env(&c, &assignment(), 0, Some(Path::new("e")), &inherited);
        assert_eq!(get(&env, "OMP_NUM_THREADS"), None);
        assert_eq!(get(&env, "TORCH_NCCL_ASYNC_ERROR_HANDLING"), Some("3"));
        assert_eq!(get(&env, "PYTHONUNBUFFERED"), Some("1"));
        let buffered = |k: &str| (k == "PYTHONUNBUFFERED").then(OsString::new);
        let env = worker_env(&c, &assignment(), 0, Some(Path::new("e")), &buffered);
        assert_eq!(get(&env, "PYTHONUNBUFFERED"), None);
        let one = Config::for_program("/bin/true", vec![], 1);
        let env = worker_env(&one, &assignment(), 0, Some(Path::new("e")), &|_| None);
        assert_eq!(get(&env, "OMP_NUM_THREADS"), None);
    }

    #[test]
    fn no_writable_place_means_no_error_file_variable() {
        let c = Config::for_program("/bin/true", vec![], 1);
        let env = worker_env(&c, &assignment(), 0, None, &|_| None);
        assert_eq!(get(&env, "TORCHELASTIC_ERROR_FILE"), None);
        assert_eq!(get(&env, "RANK"), Some("4"));
    }
}
