//! A cluster of emulated hosts for multi-node end-to-end tests: a coordinator in a host of its
//! own on a [`Net`], listening on its veth address as a cluster should (mutual TLS and the
//! cluster token), and `muster-agent launch` on the other hosts with the flags that reach it.

use crate::netns::Net;
use crate::pki::Pki;
use crate::{Agent, SLOW, Stream, agent_bin, coordinator_bin};

/// The coordinator's port, inside its own namespace.
const PORT: u16 = 29470;

/// The coordinator in host `coord` and hosts `n0`.. for the nodes, on one switch.
pub struct Cluster {
    /// The hosts.
    pub net: Net,
    /// `addr:port` of the coordinator.
    pub coordinator: String,
    /// Kept for its drop (and its output, on failure).
    pub coordinator_process: Agent,
    /// The agents' TLS and token flags.
    pub security: Vec<String>,
}

impl Cluster {
    /// Starts the coordinator (with `coordinator_flags` besides its listener, TLS and token)
    /// in host `coord`, with hosts `n0`..`n<nodes-1>` for the agents; `None` (after printing
    /// why) where network namespaces are unavailable.
    pub fn start(nodes: usize, coordinator_flags: &[&str]) -> Option<Self> {
        let mut names = vec!["coord".to_owned()];
        names.extend((0..nodes).map(|i| format!("n{i}")));
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let net = Net::setup(&names)?;
        let coord_ip = net.addr("coord");
        let listen = format!("{coord_ip}:{PORT}");
        // One PKI per cluster: the tests run in parallel, and workers read the files when
        // they start.
        static CLUSTERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = CLUSTERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pki = Pki::generate(
            &std::env::temp_dir().join(format!("muster-multinode-pki-{}-{n}", std::process::id())),
            &[&coord_ip.to_string()],
        );
        let path = |p: &std::path::Path| p.to_str().expect("a UTF-8 temp path").to_owned();
        let mut args = vec![
            "--listen".to_owned(),
            listen.clone(),
            "--tls-cert".to_owned(),
            path(&pki.server_cert),
            "--tls-key".to_owned(),
            path(&pki.server_key),
            "--tls-client-ca".to_owned(),
            path(&pki.ca),
            "--auth-token-file".to_owned(),
            path(&pki.token_file),
        ];
        args.extend(coordinator_flags.iter().map(|f| (*f).to_owned()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let coordinator_process =
            net.spawn("coord", coordinator_bin(), &args, &[("NO_COLOR", "1")]);
        let security = vec![
            "--tls-ca".to_owned(),
            path(&pki.ca),
            "--tls-cert".to_owned(),
            path(&pki.client_cert),
            "--tls-key".to_owned(),
            path(&pki.client_key),
            "--auth-token-file".to_owned(),
            path(&pki.token_file),
        ];
        coordinator_process.wait_for_lines(Stream::Stderr, 1, SLOW, |l| {
            l.contains("coordinator serving")
        });
        Some(Self {
            net,
            coordinator: listen,
            coordinator_process,
            security,
        })
    }

    /// `muster-agent launch --coordinator <it> --job-id JOB <security> FLAGS -- COMMAND` on
    /// host `host`, with `env` besides `NO_COLOR=1`. No `--advertise-addr`: the agent must
    /// find its veth address by itself (the local address that routes to the coordinator;
    /// the host name would resolve to 127.0.0.1 here).
    pub fn agent(
        &self,
        host: &str,
        job: &str,
        flags: &[&str],
        command: &[&str],
        env: &[(&str, &str)],
    ) -> Agent {
        let mut args = vec![
            "launch",
            "--coordinator",
            &self.coordinator,
            "--job-id",
            job,
        ];
        args.extend(self.security.iter().map(String::as_str));
        args.extend_from_slice(flags);
        args.push("--");
        args.extend_from_slice(command);
        let mut env = env.to_vec();
        env.push(("NO_COLOR", "1"));
        self.net.spawn(host, agent_bin(), &args, &env)
    }
}
