//! Processes and TCP sockets as Linux's `/proc` shows them: a process's status fields
//! (`/proc/<pid>/stat`), its children and descendants (`/proc/<pid>/task/<tid>/children`), the
//! TCP sockets of a network namespace
//! (`/proc/<pid>/net/tcp` and `tcp6`: addresses, state, owner uid, inode) and the socket
//! inodes a process holds (`/proc/<pid>/fd`). The agent store tells its own workers'
//! connections from outsiders' with them, the stack sampler finds a wrapper's Python child,
//! and the end-to-end tests see who listens where.
//!
//! Every read is of files that can vanish at any moment (a process exits): a missing one
//! reads as empty, never as an error.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Process `pid`'s `/proc/<pid>/stat` line, if it still exists.
pub fn stat(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()
}

/// The fields of a `/proc/<pid>/stat` line after the command name, the state first (field 3),
/// then the parent's pid and so on. The command is in parentheses and may hold spaces and
/// parentheses itself, so the fields start after the last `)`.
pub fn stat_fields(stat: &str) -> Option<std::str::SplitWhitespace<'_>> {
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_whitespace())
}

/// One TCP socket of a network namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSocket {
    /// Its own address.
    pub local: SocketAddr,
    /// Its peer's (unspecified for a listener).
    pub remote: SocketAddr,
    /// In the `LISTEN` state.
    pub listening: bool,
    /// The uid of the process that created it.
    pub uid: u32,
    /// Its inode, unique across network namespaces: what `/proc/<pid>/fd` links name.
    pub inode: u64,
}

/// Every TCP socket (IPv4 and IPv6) of the network namespace that the process `/proc/{entry}`
/// runs in (`"self"`, or a pid).
pub fn tcp_sockets(entry: &str) -> Vec<TcpSocket> {
    let mut out = Vec::new();
    for (file, v6) in [("tcp", false), ("tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{entry}/net/{file}")) else {
            continue;
        };
        out.extend(text.lines().skip(1).filter_map(|line| socket(line, v6)));
    }
    out
}

/// One line of `/proc/net/tcp{,6}`:
/// `sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...`.
fn socket(line: &str, v6: bool) -> Option<TcpSocket> {
    let cols: Vec<&str> = line.split_whitespace().collect();
    if cols.len() < 10 {
        return None;
    }
    Some(TcpSocket {
        local: address(cols[1], v6)?,
        remote: address(cols[2], v6)?,
        listening: cols[3] == "0A",
        uid: cols[7].parse().ok()?,
        inode: cols[9].parse().ok()?,
    })
}

/// `0100007F:1F90` (IPv4) or 32 hex digits and a port (IPv6): the kernel prints the address
/// as 32-bit words in host (little-endian) byte order.
fn address(text: &str, v6: bool) -> Option<SocketAddr> {
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
    Some(SocketAddr::new(ip, port))
}

/// The socket inodes process `pid` holds open.
pub fn socket_inodes(pid: u32) -> HashSet<u64> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return HashSet::new();
    };
    fds.flatten()
        .filter_map(|fd| {
            let target = std::fs::read_link(fd.path()).ok()?;
            target
                .to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

/// Every process of this PID namespace (that `/proc` shows).
pub fn processes() -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// The children of process `pid` (of every one of its threads).
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .flat_map(|task| {
            std::fs::read_to_string(task.path().join("children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|c| c.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// Every descendant of process `pid` (children first, then theirs), `pid` left out.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut seen = HashSet::from([pid]);
    let mut level = vec![pid];
    while !level.is_empty() {
        let next: Vec<u32> = level
            .iter()
            .flat_map(|&p| children(p))
            .filter(|c| seen.insert(*c))
            .collect();
        out.extend(&next);
        level = next;
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn lines_of_proc_net_tcp_parse() {
        let v4 = "   0: 0100007F:1F90 0100007F:D5A6 01 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0000000000000000 20 4 30 10 -1";
        let s = socket(v4, false).unwrap();
        assert_eq!(s.local, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(s.remote, "127.0.0.1:54694".parse().unwrap());
        assert_eq!((s.listening, s.uid, s.inode), (false, 1000, 4242));
        let v6 = "   1: 0000000000000000FFFF00000100007F:D5A6 0000000000000000FFFF00000100007F:1F90 0A 00000000:00000000 00:00000000 00000000     0        0 7 1 0000000000000000 100 0 0 10 0";
        let s = socket(v6, true).unwrap();
        assert_eq!(s.local, "[::ffff:127.0.0.1]:54694".parse().unwrap());
        assert!(s.listening);
        assert_eq!(socket("  sl  local_address", false), None);
    }

    #[test]
    fn this_process_sees_its_own_socket_and_child() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mine = tcp_sockets("self")
            .into_iter()
            .find(|s| s.listening && s.local.port() == port)
            .expect("the listener");
        assert!(socket_inodes(std::process::id()).contains(&mine.inode));
        let mut child = std::process::Command::new("sleep")
            .arg("10")
            .spawn()
            .unwrap();
        let found = descendants(std::process::id()).contains(&child.id());
        let _ = child.kill();
        let _ = child.wait();
        assert!(found);
        assert!(processes().contains(&std::process::id()));
    }
}
