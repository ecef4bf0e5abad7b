use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::Path;

use super::*;
use crate::cli::lowargs;

/// The environment of task 1 of `srun -N2 --ntasks-per-node=1` on a real Slurm 22.05 (trimmed).
const STEP: &[(&str, &str)] = &[
    ("SLURM_JOB_ID", "12"),
    ("SLURM_STEP_ID", "0"),
    ("SLURM_NODEID", "1"),
    ("SLURM_LOCALID", "0"),
    ("SLURM_JOB_NUM_NODES", "2"),
    ("SLURM_NNODES", "2"),
    ("SLURM_STEP_NUM_NODES", "2"),
    ("SLURM_JOB_NODELIST", "mnode[1-2]"),
    ("SLURM_STEP_NODELIST", "mnode[1-2]"),
    ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
    ("SLURM_NTASKS_PER_NODE", "1"),
    ("SLURMD_NODENAME", "mnode2"),
    ("SLURM_CONF", "/etc/slurm-test/slurm.conf"),
];

const CONF: &str = "NodeName=mnode[1-2] NodeAddr=10.9.0.[1-2] Port=7001\n";

struct World {
    env: BTreeMap<String, String>,
    dns: BTreeSet<String>,
}

impl World {
    fn step() -> Self {
        Self {
            env: STEP
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            dns: BTreeSet::new(),
        }
    }

    fn set(mut self, k: &str, v: &str) -> Self {
        self.env.insert(k.to_owned(), v.to_owned());
        self
    }

    fn unset(mut self, k: &str) -> Self {
        self.env.remove(k);
        self
    }

    fn run(&self, args: &[&str]) -> (LowArgs, Result<Option<Applied>, SlurmError>) {
        let env = |name: &str| self.env.get(name).map(OsString::from);
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        let mut low = lowargs::parse(&args, &env).expect("parse");
        let resolves = |name: &str| self.dns.contains(name);
        let read =
            |p: &Path| (p == Path::new("/etc/slurm-test/slurm.conf")).then(|| CONF.to_owned());
        let lookup = Lookup {
            resolves: &resolves,
            read: &read,
        };
        let applied = apply(&mut low, &env, &lookup);
        (low, applied)
    }
}

fn value(low: &LowArgs, key: &str) -> Option<(String, String)> {
    low.values
        .get(key)
        .map(|r| (r.value.clone(), r.source.to_string()))
}

#[test]
fn outside_slurm_nothing_changes() {
    let world = World {
        env: BTreeMap::new(),
        dns: BTreeSet::new(),
    };
    let (low, applied) = world.run(&["t.py"]);
    assert_eq!(applied, Ok(None));
    assert!(low.values.is_empty());
}

#[test]
fn a_step_gives_the_whole_shape_with_its_sources() {
    let (low, applied) = World::step().run(&["--nproc-per-node", "2", "t.py"]);
    let applied = applied.expect("ok").expect("slurm");
    assert_eq!(
        value(&low, "nnodes"),
        Some(("2".into(), "Slurm (SLURM_STEP_NUM_NODES)".into()))
    );
    assert_eq!(
        value(&low, "node-rank"),
        Some(("1".into(), "Slurm (SLURM_NODEID)".into()))
    );
    assert_eq!(
        value(&low, "rdzv-backend").map(|v| v.0),
        Some("c10d".into())
    );
    // mnode1 is unknown to DNS: Slurm's own address for it, and torchrun's c10d port.
    assert_eq!(
        value(&low, "rdzv-endpoint").map(|v| v.0),
        Some("10.9.0.1:29400".into())
    );
    assert_eq!(value(&low, "rdzv-id").map(|v| v.0), Some("12.0".into()));
    let s = &applied.summary;
    assert!(s.starts_with("Slurm job 12 step 0 on mnode2: "), "{s}");
    assert!(
        s.contains("--nnodes 2 (Slurm (SLURM_STEP_NUM_NODES))"),
        "{s}"
    );
    assert!(
        s.contains("which DNS does not know: its NodeAddr in /etc/slurm-test/slurm.conf; port from the c10d default"),
        "{s}"
    );
}

#[test]
fn dns_first_then_master_addr_and_master_port_win() {
    let mut world = World::step();
    world.dns.insert("mnode1".to_owned());
    let (low, _) = world.run(&["t.py"]);
    assert_eq!(
        value(&low, "rdzv-endpoint").map(|v| v.0),
        Some("mnode1:29400".into())
    );
    let (low, applied) = World::step()
        .set("MASTER_ADDR", "10.0.0.7")
        .set("MASTER_PORT", "6000")
        .run(&["t.py"]);
    assert_eq!(
        value(&low, "rdzv-endpoint").map(|v| v.0),
        Some("10.0.0.7:6000".into())
    );
    let s = applied.expect("ok").expect("slurm").summary;
    assert!(
        s.contains("host from MASTER_ADDR; port from MASTER_PORT"),
        "{s}"
    );
    let (_, err) = World::step().set("MASTER_PORT", "x").run(&["t.py"]);
    assert!(matches!(
        err,
        Err(SlurmError::Bad {
            var: "MASTER_PORT",
            ..
        })
    ));
}

#[test]
fn a_name_slurm_cannot_place_stays_a_name_and_says_what_to_do() {
    let (low, applied) = World::step()
        .set("SLURM_STEP_NODELIST", "other[1-2]")
        .run(&["t.py"]);
    assert_eq!(
        value(&low, "rdzv-endpoint").map(|v| v.0),
        Some("other1:29400".into())
    );
    let s = applied.expect("ok").expect("slurm").summary;
    assert!(s.contains("export MASTER_ADDR"), "{s}");
}

#[test]
fn the_command_line_and_the_environment_stay_above_slurm() {
    let (low, applied) = World::step().set("PET_NNODES", "4").run(&[
        "--node-rank",
        "3",
        "--rdzv-endpoint",
        "h:1",
        "t.py",
    ]);
    assert_eq!(
        value(&low, "nnodes"),
        Some(("4".into(), "environment variable PET_NNODES".into()))
    );
    assert_eq!(
        value(&low, "node-rank"),
        Some(("3".into(), "command line".into()))
    );
    // Naming any part of the rendezvous keeps all of it the user's.
    assert_eq!(
        value(&low, "rdzv-endpoint").map(|v| v.0),
        Some("h:1".into())
    );
    assert_eq!(value(&low, "rdzv-backend"), None);
    let s = applied.expect("ok").expect("slurm").summary;
    assert!(s.contains("--node-rank 3 (command line)"), "{s}");
}

#[test]
fn one_node_steps_stay_standalone_and_standalone_ignores_slurm() {
    let (low, _) = World::step()
        .set("SLURM_STEP_NUM_NODES", "1")
        .set("SLURM_NODEID", "0")
        .run(&["t.py"]);
    assert_eq!(value(&low, "nnodes").map(|v| v.0), Some("1".into()));
    assert_eq!(value(&low, "rdzv-endpoint"), None);
    let (low, applied) = World::step().run(&["--standalone", "t.py"]);
    assert_eq!(value(&low, "nnodes"), None);
    assert!(applied
        .expect("ok")
        .expect("slurm")
        .summary
        .contains("--standalone"));
}

#[test]
fn the_batch_script_takes_nothing_and_says_to_use_srun() {
    let (low, applied) = World::step()
        .unset("SLURM_STEP_ID")
        .set("SLURM_NODEID", "0")
        .run(&["t.py"]);
    assert!(low.values.is_empty());
    let s = applied.expect("ok").expect("slurm").summary;
    assert!(s.contains("srun --ntasks-per-node=1"), "{s}");
}

#[test]
fn more_than_one_task_per_node_is_a_clear_error() {
    let (_, err) = World::step()
        .set("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
        .run(&["t.py"]);
    let err = err.expect_err("two tasks per node");
    assert!(
        err.to_string().contains("srun --ntasks-per-node=1"),
        "{err}"
    );
    let (_, err) = World::step()
        .unset("SLURM_STEP_TASKS_PER_NODE")
        .set("SLURM_LOCALID", "1")
        .run(&["t.py"]);
    assert!(matches!(
        err,
        Err(SlurmError::TasksPerNode { tasks: 2, .. })
    ));
    assert_eq!(max_tasks_per_node("2(x3),1"), Some(2));
    assert_eq!(max_tasks_per_node("1,3"), Some(3));
    assert_eq!(max_tasks_per_node("x"), None);
}

#[test]
fn gpus_counted_from_what_slurm_gave_the_step() {
    let (_, applied) = World::step()
        .set("SLURM_STEP_GPUS", "2,3")
        .set("CUDA_VISIBLE_DEVICES", "0,1,2,3")
        .run(&["t.py"]);
    let applied = applied.expect("ok").expect("slurm");
    assert_eq!(applied.gpus, Some((2, "SLURM_STEP_GPUS")));
    assert!(applied
        .summary
        .contains("2 GPU(s) for gpu|auto (SLURM_STEP_GPUS)"));
    let (_, applied) = World::step().set("SLURM_GPUS_ON_NODE", "8").run(&["t.py"]);
    assert_eq!(
        applied.expect("ok").expect("slurm").gpus,
        Some((8, "SLURM_GPUS_ON_NODE"))
    );
    let (_, applied) = World::step().run(&["t.py"]);
    assert_eq!(applied.expect("ok").expect("slurm").gpus, None);
}

#[test]
fn bad_slurm_values_are_errors_naming_the_variable() {
    let (_, err) = World::step().set("SLURM_NODEID", "one").run(&["t.py"]);
    assert!(err
        .expect_err("bad")
        .to_string()
        .contains("SLURM_NODEID=`one`"));
    let (_, err) = World::step()
        .set("SLURM_STEP_NODELIST", "mnode[2-1]")
        .run(&["t.py"]);
    assert!(matches!(err, Err(SlurmError::Hostlist(_))));
}
