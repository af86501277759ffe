//! The worker environment of `docs/contract.md`: muster's own `MUSTER_*` variables and the
//! torchrun-compatible set. A pure function of the node's assignment, so that it is tested
//! without spawning anything.

/// What the agent knows about its node once the rendezvous round has closed: the inputs of
/// every worker's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAssignment {
    /// The coordinator's `host:port`, as workers should dial it.
    pub coordinator: String,
    /// The job id.
    pub job_id: String,
    /// The generation (restart round), from 1.
    pub generation: u64,
    /// This node's rank.
    pub node_rank: u32,
    /// Nodes in the generation.
    pub num_nodes: u32,
    /// Global rank of this node's local rank 0.
    pub rank_offset: u32,
    /// Workers on this node.
    pub local_world_size: u32,
    /// Workers in the generation.
    pub world_size: u32,
    /// Restarts so far.
    pub restart_count: u32,
    /// `--max-restarts`.
    pub max_restarts: u32,
    /// The host this node advertised.
    pub host: String,
    /// Node rank 0's host.
    pub master_addr: String,
    /// A free port on node rank 0's host, the same for every worker of the job.
    pub master_port: u16,
    /// The node relay's socket (`MUSTER_AGENT_SOCKET`), when the agent runs one.
    pub agent_socket: Option<String>,
}

/// The variables to set for local rank `local_rank`, on top of the agent's own environment.
/// `inherited(name)` says whether the agent's environment already has `name`: the
/// "unless already set" variables are then left as they are.
pub fn worker_env(
    node: &NodeAssignment,
    local_rank: u32,
    inherited: impl Fn(&str) -> bool,
) -> Vec<(&'static str, String)> {
    let rank = node.rank_offset + local_rank;
    let mut env = vec![
        ("MUSTER_COORDINATOR", node.coordinator.clone()),
        ("MUSTER_JOB_ID", node.job_id.clone()),
        ("MUSTER_GENERATION", node.generation.to_string()),
        ("MUSTER_RANK", rank.to_string()),
        ("MUSTER_LOCAL_RANK", local_rank.to_string()),
        ("MUSTER_WORLD_SIZE", node.world_size.to_string()),
        ("MUSTER_LOCAL_WORLD_SIZE", node.local_world_size.to_string()),
        ("MUSTER_NODE_RANK", node.node_rank.to_string()),
        ("MUSTER_NUM_NODES", node.num_nodes.to_string()),
        ("MUSTER_RESTART_COUNT", node.restart_count.to_string()),
        ("MUSTER_HOST", node.host.clone()),
    ];
    if let Some(socket) = &node.agent_socket {
        env.push((crate::relay::SOCKET_ENV, socket.clone()));
    }
    env.extend([
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("WORLD_SIZE", node.world_size.to_string()),
        ("LOCAL_WORLD_SIZE", node.local_world_size.to_string()),
        ("GROUP_RANK", node.node_rank.to_string()),
        ("GROUP_WORLD_SIZE", node.num_nodes.to_string()),
        ("ROLE_RANK", rank.to_string()),
        ("ROLE_NAME", "default".to_owned()),
        ("ROLE_WORLD_SIZE", node.world_size.to_string()),
        ("MASTER_ADDR", node.master_addr.clone()),
        ("MASTER_PORT", node.master_port.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", node.restart_count.to_string()),
        ("TORCHELASTIC_MAX_RESTARTS", node.max_restarts.to_string()),
        ("TORCHELASTIC_RUN_ID", node.job_id.clone()),
        ("TORCHELASTIC_USE_AGENT_STORE", "False".to_owned()),
    ]);
    for (name, default) in [
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        ("OMP_NUM_THREADS", "1"),
    ] {
        if !inherited(name) {
            env.push((name, default.to_owned()));
        }
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> NodeAssignment {
        NodeAssignment {
            coordinator: "10.0.0.1:29470".into(),
            job_id: "job7".into(),
            generation: 3,
            node_rank: 1,
            num_nodes: 2,
            rank_offset: 4,
            local_world_size: 2,
            world_size: 6,
            restart_count: 2,
            max_restarts: 0,
            host: "node-b".into(),
            master_addr: "node-a".into(),
            master_port: 29500,
            agent_socket: Some("/tmp/muster-1-2/relay.sock".into()),
        }
    }

    /// `expected` lists `NAME=value` lines in the order the function returns them.
    fn check(node: &NodeAssignment, local_rank: u32, inherited: &[&str], expected: &str) {
        let got: Vec<String> = worker_env(node, local_rank, |n| inherited.contains(&n))
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let expected: Vec<&str> = expected.split_whitespace().collect();
        assert_eq!(
            got, expected,
            "local rank {local_rank}, inherited {inherited:?}"
        );
    }

    #[test]
    fn second_node_second_worker() {
        check(
            &node(),
            1,
            &[],
            "MUSTER_COORDINATOR=10.0.0.1:29470 MUSTER_JOB_ID=job7 MUSTER_GENERATION=3 MUSTER_RANK=5
             MUSTER_LOCAL_RANK=1 MUSTER_WORLD_SIZE=6 MUSTER_LOCAL_WORLD_SIZE=2 MUSTER_NODE_RANK=1
             MUSTER_NUM_NODES=2 MUSTER_RESTART_COUNT=2 MUSTER_HOST=node-b
             MUSTER_AGENT_SOCKET=/tmp/muster-1-2/relay.sock
             RANK=5 LOCAL_RANK=1 WORLD_SIZE=6 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 GROUP_WORLD_SIZE=2
             ROLE_RANK=5 ROLE_NAME=default ROLE_WORLD_SIZE=6 MASTER_ADDR=node-a MASTER_PORT=29500
             TORCHELASTIC_RESTART_COUNT=2 TORCHELASTIC_MAX_RESTARTS=0 TORCHELASTIC_RUN_ID=job7
             TORCHELASTIC_USE_AGENT_STORE=False TORCH_NCCL_ASYNC_ERROR_HANDLING=1 OMP_NUM_THREADS=1",
        );
    }

    #[test]
    fn single_node_and_inherited_defaults() {
        let single = NodeAssignment {
            coordinator: "127.0.0.1:40000".into(),
            job_id: "j".into(),
            generation: 1,
            node_rank: 0,
            num_nodes: 1,
            rank_offset: 0,
            local_world_size: 1,
            world_size: 1,
            restart_count: 0,
            max_restarts: 0,
            host: "127.0.0.1".into(),
            master_addr: "127.0.0.1".into(),
            master_port: 1234,
            agent_socket: None,
        };
        let common = "MUSTER_COORDINATOR=127.0.0.1:40000 MUSTER_JOB_ID=j MUSTER_GENERATION=1
             MUSTER_RANK=0 MUSTER_LOCAL_RANK=0 MUSTER_WORLD_SIZE=1 MUSTER_LOCAL_WORLD_SIZE=1
             MUSTER_NODE_RANK=0 MUSTER_NUM_NODES=1 MUSTER_RESTART_COUNT=0 MUSTER_HOST=127.0.0.1
             RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 GROUP_RANK=0 GROUP_WORLD_SIZE=1
             ROLE_RANK=0 ROLE_NAME=default ROLE_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
             MASTER_PORT=1234 TORCHELASTIC_RESTART_COUNT=0 TORCHELASTIC_MAX_RESTARTS=0
             TORCHELASTIC_RUN_ID=j TORCHELASTIC_USE_AGENT_STORE=False";
        for (inherited, tail) in [
            (
                &[][..],
                "TORCH_NCCL_ASYNC_ERROR_HANDLING=1 OMP_NUM_THREADS=1",
            ),
            (
                &["OMP_NUM_THREADS"][..],
                "TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
            ),
            (
                &["TORCH_NCCL_ASYNC_ERROR_HANDLING"][..],
                "OMP_NUM_THREADS=1",
            ),
            (
                &["OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "RANK"][..],
                "",
            ),
        ] {
            check(&single, 0, inherited, &format!("{common} {tail}"));
        }
    }

    #[test]
    fn ranks_are_offset_per_node() {
        let n = node();
        for local in 0..n.local_world_size {
            let env = worker_env(&n, local, |_| false);
            let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
            assert_eq!(get("RANK"), Some((4 + local).to_string()));
            assert_eq!(get("MUSTER_RANK"), get("RANK"));
            assert_eq!(get("ROLE_RANK"), get("RANK"));
            assert_eq!(get("LOCAL_RANK"), Some(local.to_string()));
        }
    }
}
