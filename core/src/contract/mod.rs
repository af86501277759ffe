//! The worker-agent contract (`docs/contract.md`): what `muster-agent` and the worker SDK must
//! agree on without talking to the coordinator. The agent writes it, the SDK reads it, and both
//! take it from here so that a name or a byte of framing cannot drift between the two sides.
//!
//! - [`env`]: the environment a worker is started with (`MUSTER_*`, torchrun's and
//!   Accelerate's names).
//! - [`frame`]: the framing of the node relay's Unix socket (length-prefixed protobuf
//!   messages), as pure functions over byte buffers; the sockets stay with each side.

pub mod env;
pub mod frame;
