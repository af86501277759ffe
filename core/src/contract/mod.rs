//! The worker-agent contract (`docs/contract.md`): what `muster-agent` and the worker SDK must
//! agree on without talking to the coordinator. The agent writes it, the SDK reads it, and both
//! take it from here so that a name or a byte of framing cannot drift between the two sides.
//!
//! - [`env`]: the environment a worker is started with (`MUSTER_*`, torchrun's and
//!   Accelerate's names).
//! - [`frame`]: the framing of the node relay's Unix socket (length-prefixed protobuf
//!   messages), as pure functions over byte buffers; the sockets stay with each side.
//! - [`agent_coordinator`]: where a worker under an agent reaches the coordinator's services
//!   (the agent's gateway socket, beside the relay's).

pub mod env;
pub mod frame;

use std::path::Path;

/// The file name of an agent's gateway socket, in the directory of its relay socket
/// (`MUSTER_AGENT_SOCKET`): the agent serves every coordinator service there to its workers,
/// which then need no coordinator address and hold no connection to it.
pub const AGENT_GATEWAY_SOCKET: &str = "coordinator.sock";

/// The file name of an agent's step socket, beside its relay socket: a Unix datagram socket
/// where global rank 0's worker sends each training step as decimal text (the agent's Python
/// start-up hook does, for a script that never imports muster), passed on as rank 0's step
/// marker. Its path is the worker's `MUSTER_STEP_SOCKET`.
pub const STEP_SOCKET: &str = "steps.sock";

/// How a coordinator address names a Unix socket rather than `host:port`.
pub const UNIX_ADDR_PREFIX: &str = "unix:";

/// The coordinator address of the agent whose relay socket is `relay_socket`: its gateway
/// socket, as `unix:<dir>/coordinator.sock`.
pub fn agent_coordinator(relay_socket: &Path) -> String {
    format!(
        "{UNIX_ADDR_PREFIX}{}",
        relay_socket.with_file_name(AGENT_GATEWAY_SOCKET).display()
    )
}

/// The socket path of a `unix:` coordinator address; `None` for `host:port` addresses.
pub fn unix_socket(addr: &str) -> Option<&Path> {
    addr.strip_prefix(UNIX_ADDR_PREFIX)
        .filter(|path| !path.is_empty())
        .map(Path::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_coordinator_is_the_gateway_beside_its_agents_relay_socket() {
        let addr = agent_coordinator(Path::new("/tmp/muster-1-2/relay.sock"));
        assert_eq!(addr, "unix:/tmp/muster-1-2/coordinator.sock");
        assert_eq!(
            unix_socket(&addr),
            Some(Path::new("/tmp/muster-1-2/coordinator.sock"))
        );
        assert_eq!(unix_socket("127.0.0.1:29470"), None);
        assert_eq!(unix_socket("unix:"), None);
    }
}
