//! Who may use the agent store: this agent's own workers and their descendants (and the agent
//! itself), nobody else on the machine. A connection's client is found by its socket: the
//! kernel's sock_diag (netlink, an exact lookup by the connection's addresses, about 13 µs)
//! gives the client end's inode and uid, `/proc/net/tcp{,6}` where netlink is not allowed
//! (about 10 ms: the kernel walks every hash bucket); and a descendant's `/proc/<pid>/fd`
//! holding that inode admits it. Anything else is refused with the pid and uid that hold the
//! socket, where this agent can see them.

use std::net::SocketAddr;

use crate::procfs;

/// Whether the client at `peer`, connected to the store at `store`, is this process or one of
/// its descendants; `Err` says who it is instead, in words.
pub(super) fn admit(store: SocketAddr, peer: SocketAddr) -> Result<(), String> {
    let Some(client) = diag(peer, store).or_else(|| listed(peer, store)) else {
        return Err(format!(
            "no socket of this network namespace connects from {peer} (a client in another namespace)"
        ));
    };
    let me = std::process::id();
    // The workers first: the agent itself holds many more sockets and is rarely the client.
    if procfs::descendants(me)
        .into_iter()
        .chain(std::iter::once(me))
        .any(|pid| procfs::socket_inodes(pid).contains(&client.inode))
    {
        return Ok(());
    }
    let owners: Vec<String> = procfs::processes()
        .into_iter()
        .filter(|&pid| procfs::socket_inodes(pid).contains(&client.inode))
        .map(|pid| pid.to_string())
        .collect();
    Err(match owners.as_slice() {
        [] => format!(
            "a process of uid {} that this agent cannot see, not one of its workers",
            client.uid
        ),
        [pid] => format!(
            "pid {pid} (uid {}), not one of this agent's workers or their children",
            client.uid
        ),
        pids => format!(
            "pids {} (uid {}), none of them one of this agent's workers or their children",
            pids.join(","),
            client.uid
        ),
    })
}

/// The client end of the connection from `client` to `server`, its (inode, uid), by the
/// kernel's sock_diag; `None` when netlink is refused or the socket is gone. An IPv6 client
/// on a v4-mapped address is found by its IPv4 addresses too.
fn diag(client: SocketAddr, server: SocketAddr) -> Option<Client> {
    use netlink_packet_core::{NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload};
    use netlink_packet_sock_diag::SockDiagMessage;
    use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP};
    use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
    use netlink_sys::protocols::NETLINK_SOCK_DIAG;

    let (client_ip, server_ip) = (client.ip().to_canonical(), server.ip().to_canonical());
    let mut socket = netlink_sys::Socket::new(NETLINK_SOCK_DIAG).ok()?;
    socket.bind_auto().ok()?;
    socket.connect(&netlink_sys::SocketAddr::new(0, 0)).ok()?;
    let mut header = NetlinkHeader::default();
    // Not a dump: one socket, looked up by its addresses.
    header.flags = NLM_F_REQUEST;
    let request = InetRequest {
        family: if client_ip.is_ipv4() {
            AF_INET
        } else {
            AF_INET6
        },
        protocol: IPPROTO_TCP,
        extensions: ExtensionFlags::empty(),
        states: StateFlags::all(),
        socket_id: SocketId {
            source_port: client.port(),
            destination_port: server.port(),
            source_address: client_ip,
            destination_address: server_ip,
            interface_id: 0,
            // INET_DIAG_NOCOOKIE: any socket with these addresses.
            cookie: [0xff; 8],
        },
    };
    let mut packet = NetlinkMessage::new(header, SockDiagMessage::InetRequest(request).into());
    packet.finalize();
    let mut out = vec![0; packet.buffer_len()];
    packet.serialize(&mut out);
    socket.send(&out, 0).ok()?;
    let mut reply = vec![0; 8192];
    let n = socket.recv(&mut &mut reply[..], 0).ok()?;
    let message = <NetlinkMessage<SockDiagMessage>>::deserialize(reply.get(..n)?).ok()?;
    match message.payload {
        NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => Some(Client {
            inode: u64::from(r.header.inode),
            uid: r.header.uid,
        }),
        _ => None,
    }
}

/// As [`diag`], from `/proc/net/tcp{,6}`.
fn listed(client: SocketAddr, server: SocketAddr) -> Option<Client> {
    let loopback = |a: &SocketAddr| a.ip().to_canonical().is_loopback();
    procfs::tcp_sockets("self")
        .into_iter()
        .find(|s| {
            !s.listening
                && s.local.port() == client.port()
                && s.remote.port() == server.port()
                && loopback(&s.local)
                && loopback(&s.remote)
        })
        .map(|s| Client {
            inode: s.inode,
            uid: s.uid,
        })
}

/// A connection's client end.
struct Client {
    inode: u64,
    uid: u32,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A connection from this process's own child is admitted, as is one from this process
    /// itself; an address no socket of this namespace has is refused, saying so. (Outsiders,
    /// of this user and another: `agent/tests/tcpstore.rs`.)
    #[test]
    fn a_childs_connection_is_admitted() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let store = listener.local_addr().unwrap();
        let mine = std::net::TcpStream::connect(store).unwrap();
        let (_, peer) = listener.accept().unwrap();
        admit(store, peer).unwrap();
        drop(mine);
        // A child connects (bash's /dev/tcp) and holds the connection open.
        let mut child = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!(
                "exec 3<>/dev/tcp/127.0.0.1/{}; sleep 10",
                store.port()
            ))
            .spawn()
            .unwrap();
        let (_, peer) = listener.accept().unwrap();
        let admitted = admit(store, peer);
        let _ = child.kill();
        let _ = child.wait();
        admitted.unwrap();
        let nobody = "127.0.0.1:1".parse().unwrap();
        let why = admit(store, nobody).unwrap_err();
        assert!(
            why.starts_with("no socket of this network namespace"),
            "{why}"
        );
    }

    /// sock_diag and /proc/net/tcp find the same client end, for an IPv4 client and for an
    /// IPv6 one on a v4-mapped address (torch's client).
    #[test]
    fn netlink_and_proc_agree() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let server = listener.local_addr().unwrap();
        let port = server.port();
        for to in [
            format!("127.0.0.1:{port}"),
            format!("[::ffff:127.0.0.1]:{port}"),
        ] {
            let _client = std::net::TcpStream::connect(&to).unwrap();
            let (_, peer) = listener.accept().unwrap();
            let by_diag = diag(peer, server).expect("sock_diag");
            let by_proc = listed(peer, server).expect("/proc/net/tcp");
            assert_eq!(
                (by_diag.inode, by_diag.uid),
                (by_proc.inode, by_proc.uid),
                "{to}"
            );
        }
    }
}
