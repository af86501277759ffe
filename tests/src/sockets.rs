//! Who listens where: every listening TCP socket of a network namespace, read from
//! `/proc/<pid>/net/tcp{,6}` (the sockets and their inodes), with the processes that hold each
//! one, found through `/proc/<pid>/fd` (inodes are unique across namespaces). The agent store
//! tests use it to check that only the agent listens on `MASTER_PORT`, on loopback, and that no
//! worker opens a store server; and the `ready` line their scripts print about their store.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

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
    let mut by_inode: BTreeMap<u64, (IpAddr, u16)> = BTreeMap::new();
    for (file, v6) in [("tcp", false), ("tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{proc_entry}/net/{file}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if cols.len() < 10 || cols[3] != "0A" {
                continue;
            }
            let (Some((addr, port)), Ok(inode)) = (local_address(cols[1], v6), cols[9].parse())
            else {
                continue;
            };
            by_inode.insert(inode, (addr, port));
        }
    }
    let mut pids: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let inode = target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:["))
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse::<u64>().ok());
            if let Some(inode) = inode
                && by_inode.contains_key(&inode)
            {
                pids.entry(inode).or_default().push(pid);
            }
        }
    }
    by_inode
        .into_iter()
        .map(|(inode, (addr, port))| Listener {
            addr,
            port,
            pids: pids.remove(&inode).unwrap_or_default(),
        })
        .collect()
}

/// `0100007F:1F90` (IPv4) or 32 hex digits and a port (IPv6): the kernel prints the address
/// as 32-bit words in host (little-endian) byte order.
fn local_address(text: &str, v6: bool) -> Option<(IpAddr, u16)> {
    let (addr, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Vec<[u8; 4]> = (0..addr.len() / 8)
        .map(|i| {
            u32::from_str_radix(addr.get(i * 8..i * 8 + 8)?, 16)
                .ok()
                .map(u32::to_le_bytes)
        })
        .collect::<Option<_>>()?;
    let ip = match (v6, words.as_slice()) {
        (false, [w]) => IpAddr::V4(Ipv4Addr::from(*w)),
        (true, [a, b, c, d]) => {
            let mut bytes = [0u8; 16];
            for (i, w) in [a, b, c, d].into_iter().enumerate() {
                bytes[i * 4..i * 4 + 4].copy_from_slice(w);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some((ip, port))
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
