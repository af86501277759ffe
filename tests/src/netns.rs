//! Several hosts on one machine, for multi-node end-to-end tests: one network namespace per
//! host, each linked by a veth pair to a "switch" namespace that holds a Linux bridge, and
//! processes run inside a host with `ip netns exec`.
//!
//! ```text
//!   mt-<pid>-<n>-coord   mt-<pid>-<n>-n0   ...        (one namespace per host)
//!        eth0 10.a.b.1     eth0 10.a.b.2              (veth, host end)
//!          │                 │
//!        p0 ─────────── br0 ─ p1 ─ ...                (veth, switch end, in mt-<pid>-<n>-sw)
//! ```
//!
//! Names carry the test process's pid and a per-process counter, so parallel tests never
//! collide; each [`Net`] gets its own 10.a.b.0/24 as well. Dropping a [`Net`] kills whatever
//! still runs in its namespaces (only this test's processes can be there) and deletes them,
//! which also deletes their links; a panicking test unwinds through the same drop. Namespaces
//! that a killed test process left behind (its pid no longer alive) are swept the first time
//! a [`Net`] is made.
//!
//! Creating a namespace needs root (CAP_SYS_ADMIN). Where `ip netns add` is not permitted or
//! `ip` is missing, [`Net::setup`] prints `skipped: ...` with the reason and returns `None`;
//! any other failure panics, so a machine that can run the tests (CI runs as root) really
//! runs them.

use crate::Agent;
use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, Once};

/// Prefix of every namespace this module creates.
const PREFIX: &str = "mt-";
/// The host end of every host's veth pair.
const HOST_IF: &str = "eth0";
/// The bridge in the switch namespace.
const BRIDGE: &str = "br0";

/// One emulated host.
#[derive(Debug, Clone)]
pub struct Host {
    /// The name the test gave it.
    pub name: String,
    /// Its network namespace.
    pub ns: String,
    /// Its address on the switch.
    pub addr: Ipv4Addr,
    /// Its port (the switch end of its veth pair) in the switch namespace.
    port: String,
}

/// Hosts on one switch, each in a network namespace of its own; see the module docs.
#[derive(Debug)]
pub struct Net {
    switch: String,
    hosts: Vec<Host>,
    /// Every namespace created so far, deleted on drop (also after a failed setup).
    created: Vec<String>,
}

/// Why namespaces cannot be made here (the tests then skip).
struct Unavailable(String);

impl Net {
    /// Builds the switch and one host per name (addresses .1, .2, ... in the order given),
    /// or prints why network namespaces are unavailable and returns `None`. Panics on any
    /// other setup failure.
    pub fn setup(names: &[&str]) -> Option<Self> {
        match Self::try_setup(names) {
            Ok(net) => Some(net),
            Err(Unavailable(why)) => {
                eprintln!("skipped: network namespaces are not available here: {why}");
                None
            }
        }
    }

    fn try_setup(names: &[&str]) -> Result<Self, Unavailable> {
        static SWEEP: Once = Once::new();
        static NEXT: AtomicU32 = AtomicU32::new(0);
        // One setup at a time: the first `ip netns add` of a boot mounts /run/netns, and
        // concurrent first mounts race.
        static SETUP: Mutex<()> = Mutex::new(());
        let _one = SETUP
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        assert!(
            !names.is_empty() && names.len() < 250,
            "1 to 249 hosts, got {}",
            names.len()
        );
        SWEEP.call_once(sweep_stale);
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let id = format!("{PREFIX}{pid}-{n}");
        // A /24 per Net: unique within this process, and across concurrent test processes
        // as long as their pids differ modulo 50 (the namespaces isolate them anyway).
        let subnet = [10, 200 + (pid % 50) as u8, (n % 256) as u8];
        let mut net = Self {
            switch: format!("{id}-sw"),
            hosts: Vec::new(),
            created: Vec::new(),
        };
        // The first `ip netns add` decides whether this machine can do it at all.
        match ip(&["netns", "add", &net.switch]) {
            Ok(()) => net.created.push(net.switch.clone()),
            Err(IpError::Missing(e)) => {
                return Err(Unavailable(format!("`ip` cannot be run ({e})")));
            }
            Err(IpError::Failed(e))
                if e.contains("Operation not permitted") || e.contains("Permission denied") =>
            {
                return Err(Unavailable(format!(
                    "`ip netns add` is not permitted (needs root / CAP_SYS_ADMIN): {e}"
                )));
            }
            Err(IpError::Failed(e)) => panic!("ip netns add {}: {e}", net.switch),
        }
        let sw = net.switch.clone();
        must(&["-n", &sw, "link", "set", "lo", "up"]);
        must(&["-n", &sw, "link", "add", BRIDGE, "type", "bridge"]);
        must(&["-n", &sw, "link", "set", BRIDGE, "up"]);
        for (i, name) in names.iter().enumerate() {
            assert!(
                net.hosts.iter().all(|h| h.name != *name),
                "host {name:?} given twice"
            );
            let ns = format!("{id}-{name}");
            must(&["netns", "add", &ns]);
            net.created.push(ns.clone());
            let addr = Ipv4Addr::new(subnet[0], subnet[1], subnet[2], (i + 1) as u8);
            let port = format!("p{i}");
            must(&["-n", &ns, "link", "set", "lo", "up"]);
            // Both ends are created inside their namespaces: nothing touches the test's own.
            must(&[
                "link", "add", HOST_IF, "netns", &ns, "type", "veth", "peer", "name", &port,
                "netns", &sw,
            ]);
            must(&["-n", &sw, "link", "set", &port, "master", BRIDGE]);
            must(&["-n", &sw, "link", "set", &port, "up"]);
            must(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                HOST_IF,
            ]);
            must(&["-n", &ns, "link", "set", HOST_IF, "up"]);
            net.hosts.push(Host {
                name: (*name).to_owned(),
                ns,
                addr,
                port,
            });
        }
        Ok(net)
    }

    /// The host named `name` (panics if there is none).
    pub fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no host {name:?} in this net"))
    }

    /// The address of host `name`.
    pub fn addr(&self, name: &str) -> Ipv4Addr {
        self.host(name).addr
    }

    /// `ip netns exec <ns of host> <program> <args>`: a command that runs inside host
    /// `name`, for the caller to configure and spawn (`ip netns exec` execs the program in
    /// place, so the child's pid is the program's).
    pub fn command(
        &self,
        name: &str,
        program: impl AsRef<OsStr>,
        args: impl IntoIterator<Item = impl AsRef<OsStr>>,
    ) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.host(name).ns])
            .arg(program)
            .args(args);
        cmd
    }

    /// Starts `program args` inside host `name` with extra environment variables, in a
    /// process group of its own, its output collected line by line; stopped on drop.
    pub fn spawn(
        &self,
        name: &str,
        program: impl AsRef<OsStr>,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Agent {
        let mut cmd = self.command(name, program, args);
        cmd.envs(env.iter().copied());
        Agent::spawn(cmd, format!("{name}: {}", args.join(" ")))
    }

    /// Cuts host `name` off the switch: both ends of its veth pair go down, so its packets
    /// and the packets for it are dropped without any reset (a pulled cable).
    pub fn cut(&self, name: &str) {
        let host = self.host(name);
        must(&["-n", &host.ns, "link", "set", HOST_IF, "down"]);
        must(&["-n", &self.switch, "link", "set", &host.port, "down"]);
    }

    /// Plugs host `name` back in after [`Net::cut`] (Linux keeps a downed link's address).
    pub fn heal(&self, name: &str) {
        let host = self.host(name);
        must(&["-n", &self.switch, "link", "set", &host.port, "up"]);
        must(&["-n", &host.ns, "link", "set", HOST_IF, "up"]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.created.iter().rev() {
            remove_namespace(ns);
        }
    }
}

/// Kills what still runs in namespace `ns` and deletes it (which deletes its links).
fn remove_namespace(ns: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    if let Err(e) = ip(&["netns", "del", ns]) {
        eprintln!("muster-tests: cannot delete network namespace {ns}: {e:?}");
    }
}

/// Deletes `mt-<pid>-...` namespaces whose test process is gone.
fn sweep_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // "name" or "name (id: N)".
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !PathBuf::from(format!("/proc/{pid}")).exists() {
            eprintln!("muster-tests: removing stale network namespace {name}");
            remove_namespace(name);
        }
    }
}

#[derive(Debug)]
enum IpError {
    /// `ip` could not be started.
    Missing(std::io::Error),
    /// It ran and failed: its stderr.
    Failed(String),
}

/// Runs `ip <args>`.
fn ip(args: &[&str]) -> Result<(), IpError> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(IpError::Missing)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(IpError::Failed(format!(
            "{} ({})",
            String::from_utf8_lossy(&out.stderr).trim(),
            out.status
        )))
    }
}

/// Runs `ip <args>`; panics if it fails (the machine can make namespaces, so this is a bug).
fn must(args: &[&str]) {
    if let Err(e) = ip(args) {
        panic!("ip {}: {e:?}", args.join(" "));
    }
}
