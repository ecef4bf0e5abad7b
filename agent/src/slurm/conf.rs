//! Slurm's own address for a node, read from `slurm.conf` (the `NodeAddr` of its `NodeName`
//! line, else its `NodeHostname`): what `slurmctld` itself uses to reach the node, and the
//! fallback for a node name that DNS does not know. No Slurm release exports a node's address to
//! a step (`SLURM_LAUNCH_NODE_IPADDR` is the host `srun` ran on; `SLURM_NODE_ALIASES` only names
//! cloud nodes), and `scontrol show node` would be shelling out; `slurmd` does put the path of
//! the configuration it runs with in every task's `SLURM_CONF`.

use super::hostlist;

/// Where `slurm.conf` lives when `SLURM_CONF` does not say (Debian's and upstream's default).
pub const DEFAULT_PATH: &str = "/etc/slurm/slurm.conf";

/// The address `conf` (the text of a `slurm.conf`) gives `node`: its `NodeAddr`, else its
/// `NodeHostname`; `None` when no `NodeName` line names it or the line gives neither (Slurm then
/// reaches the node by its name, which is what DNS already said no to).
pub fn node_addr(conf: &str, node: &str) -> Option<String> {
    for line in conf.lines() {
        let line = line.split('#').next().unwrap_or_default();
        let mut names = None;
        let mut addrs = None;
        let mut hostnames = None;
        for token in line.split_whitespace() {
            let Some((key, value)) = token.split_once('=') else {
                continue;
            };
            match key.to_ascii_lowercase().as_str() {
                "nodename" => names = Some(value),
                "nodeaddr" => addrs = Some(value),
                "nodehostname" => hostnames = Some(value),
                _ => {}
            }
        }
        let Some(names) = names.filter(|n| !n.eq_ignore_ascii_case("DEFAULT")) else {
            continue;
        };
        let Ok(names) = hostlist::expand(names) else {
            continue;
        };
        let Some(at) = names.iter().position(|n| n == node) else {
            continue;
        };
        // NodeAddr and NodeHostname pair with NodeName position by position, as in Slurm.
        let pick = |list: Option<&str>| {
            list.and_then(|l| hostlist::expand(l).ok())
                .and_then(|v| v.get(at).cloned())
        };
        return pick(addrs).or_else(|| pick(hostnames));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONF: &str = "\
ClusterName=c   # a comment
NodeName=DEFAULT CPUs=4
NodeName=mnode[1-2] NodeAddr=127.0.0.1,127.0.0.2 Port=7001
nodename=gpu[001-002] nodehostname=g-[1-2].lan
NodeName=plain CPUs=2
PartitionName=p Nodes=ALL
";

    #[test]
    fn node_addr_pairs_by_position_and_falls_back_to_the_hostname() {
        assert_eq!(node_addr(CONF, "mnode1").as_deref(), Some("127.0.0.1"));
        assert_eq!(node_addr(CONF, "mnode2").as_deref(), Some("127.0.0.2"));
        assert_eq!(node_addr(CONF, "gpu002").as_deref(), Some("g-2.lan"));
        assert_eq!(node_addr(CONF, "plain"), None);
        assert_eq!(node_addr(CONF, "other"), None);
        assert_eq!(node_addr("", "mnode1"), None);
    }
}
