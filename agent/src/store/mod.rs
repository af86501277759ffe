//! The agent's TCPStore: PyTorch's `TCPStore` wire protocol served on a loopback port of the
//! node, backed by the job's key-value store at the coordinator, so torch's `env://` path
//! (with `TORCHELASTIC_USE_AGENT_STORE=True`) connects as a client, no worker opens a store
//! server, and the store is authenticated (the job token), shared by every node and survives
//! rank 0 and a coordinator failover.
//!
//! `protocol.rs` is the wire format (pure), `backend.rs` maps each operation onto the SDK's
//! [`Kv`] client (one home for the key-value protocol and its failover), `server.rs` is the
//! listener and one task per connection.

mod backend;
mod peers;
mod protocol;
mod server;

use std::{io, net::SocketAddr};

use backend::Backend;
pub use muster::client::Kv;
use tokio_util::sync::CancellationToken;

/// A running agent store. Stops (listener and every connection) when dropped or on
/// [`AgentStore::shutdown`].
#[derive(Debug)]
pub struct AgentStore {
    addr: SocketAddr,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl AgentStore {
    /// Starts serving on `127.0.0.1:0` (loopback only: the store is for this node's workers;
    /// other nodes share its keys through the coordinator). `backend` is the job's store at
    /// the coordinator, authenticated with the job token; `generation` scopes the keys
    /// (`torch/g<generation>/`, as the Python SDK's `muster.torch.Store`), so a restarted
    /// generation never reads the keys of the one before. Must be called inside a tokio
    /// runtime.
    pub fn start(backend: Kv, generation: u64) -> io::Result<AgentStore> {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let stop = CancellationToken::new();
        let backend = Backend::new(backend, generation);
        // Policy: runs until stopped; a failed accept is logged and the loop goes on.
        let task = tokio::spawn(server::serve(listener, backend, stop.clone()));
        tracing::info!(%addr, generation, "agent store (TCPStore protocol) listening");
        Ok(AgentStore {
            addr,
            stop,
            task: Some(task),
        })
    }

    /// The port workers get as `MASTER_PORT`.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The address the store listens on (always loopback).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, closes every connection and waits for the listener task to end.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for AgentStore {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
