//! Who listens where and who is connected to whom: the kernel's TCP socket table of a network
//! namespace, read from `/proc/<pid>/net/tcp{,6}` (the sockets and their inodes), with the
//! processes that hold each one, found through `/proc/<pid>/fd` (inodes are unique across
//! namespaces); both read with the agent's own `muster_agent::procfs`. The agent store tests
//! use it to check that only the agent listens on `MASTER_PORT`, on loopback, and that no
//! worker opens a store server; the launch tests, that workers hold no connection to the
//! coordinator ([`connected_to`]); and the `ready` line the store scripts print.

use muster_agent::procfs;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

/// One listening TCP socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    /// The address it is bound to.
    pub addr: IpAddr,
    /// Its port.
    pub port: u16,
    /// The processes holding it (a socket can be inherited).
    pub pids: Vec<u32>,
}

/// Every listening TCP socket (IPv4 and IPv6) of this process's network namespace.
pub fn listeners() -> Vec<Listener> {
    listeners_in("self")
}

/// Every listening TCP socket of the network namespace process `pid` runs in (a host of a
/// [`crate::netns::Net`], say).
pub fn listeners_of(pid: u32) -> Vec<Listener> {
    listeners_in(&pid.to_string())
}

fn listeners_in(proc_entry: &str) -> Vec<Listener> {
    let listening: Vec<procfs::TcpSocket> = procfs::tcp_sockets(proc_entry)
        .into_iter()
        .filter(|s| s.listening)
        .collect();
    let mut pids: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for pid in procfs::processes() {
        for inode in procfs::socket_inodes(pid) {
            if listening.iter().any(|s| s.inode == inode) {
                pids.entry(inode).or_default().push(pid);
            }
        }
    }
    let mut by_inode: BTreeMap<u64, SocketAddr> = BTreeMap::new();
    for s in listening {
        by_inode.insert(s.inode, s.local);
    }
    by_inode
        .into_iter()
        .map(|(inode, local)| Listener {
            addr: local.ip(),
            port: local.port(),
            pids: pids.remove(&inode).unwrap_or_default(),
        })
        .collect()
}

/// This process's network namespace's TCP connections to `port` (of any address), each as the
/// processes that hold it: one entry per connection.
pub fn connected_to(port: u16) -> Vec<Vec<u32>> {
    let connections: Vec<u64> = procfs::tcp_sockets("self")
        .into_iter()
        .filter(|s| !s.listening && s.remote.port() == port)
        .map(|s| s.inode)
        .collect();
    let mut pids: BTreeMap<u64, Vec<u32>> = connections.iter().map(|&i| (i, Vec::new())).collect();
    for pid in procfs::processes() {
        for inode in procfs::socket_inodes(pid) {
            if let Some(holders) = pids.get_mut(&inode) {
                holders.push(pid);
            }
        }
    }
    pids.into_values().collect()
}

/// The listening sockets held by `pid`.
pub fn held_by(all: &[Listener], pid: u32) -> Vec<&Listener> {
    all.iter().filter(|l| l.pids.contains(&pid)).collect()
}

/// What a rank of the agent store's test scripts (`tests/python/agent_store_job.py`,
/// `ddp_store_failover.py`) printed once its process group was up.
#[derive(Debug)]
pub struct Ready {
    /// `RANK`.
    pub rank: u32,
    /// The worker's pid.
    pub pid: u32,
    /// `MASTER_ADDR`.
    pub master_addr: String,
    /// `MASTER_PORT`.
    pub master_port: u16,
    /// `TORCHELASTIC_USE_AGENT_STORE`.
    pub agent_store: String,
}

/// Parses `[rank R] ready rank=R pid=P master=ADDR:PORT agent_store=V`.
pub fn ready(line: &str) -> Option<Ready> {
    let rest = line.split_once("] ready ")?.1;
    let field = |name: &str| {
        rest.split(' ')
            .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
    };
    let (master_addr, master_port) = field("master")?.rsplit_once(':')?;
    Some(Ready {
        rank: field("rank")?.parse().ok()?,
        pid: field("pid")?.parse().ok()?,
        master_addr: master_addr.to_owned(),
        master_port: master_port.parse().ok()?,
        agent_store: field("agent_store")?.to_owned(),
    })
}
