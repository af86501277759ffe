//! Real etcd servers for the tests of the coordinator's etcd store and leader election: one or
//! three members on free loopback ports, data in a temporary directory, killed and removed on
//! drop. Tests skip (with a printed reason) where no `etcd` binary is installed
//! (`scripts/install-deps.sh` installs Debian's).

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long a member may take to report itself healthy (a fresh three-member cluster elects a
/// leader in about a second).
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// One member's fixed identity: restarting it reuses all of it.
#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    /// Plain-HTTP `/health` (etcd's metrics listener), also when clients must use TLS.
    health_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    /// `None` while killed.
    child: Option<Child>,
}

/// A running etcd cluster (1 or 3 members). Dropping it kills every member and removes the
/// data.
#[derive(Debug)]
pub struct Etcd {
    bin: PathBuf,
    members: Vec<Member>,
    initial_cluster: String,
    dir: PathBuf,
    tls: Option<TlsFiles>,
}

/// The certificates of a cluster started with [`Etcd::start_tls`] (PEM files in its temporary
/// directory): clients must present `client_cert`/`client_key`, signed by `ca`, which also
/// signs the servers' certificates (for `127.0.0.1`).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The test CA's certificate.
    pub ca: PathBuf,
    /// A client certificate the members accept.
    pub client_cert: PathBuf,
    /// Its private key.
    pub client_key: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
}

impl Etcd {
    /// Starts `members` etcd servers (1 or 3) on free loopback ports, data in a temp dir;
    /// None (after printing "skipped: ...") when /usr/bin/etcd (or `etcd` on PATH) is missing.
    /// Returns once every member answers `/health` (panics with the members' logs otherwise).
    pub fn start(members: usize) -> Option<Etcd> {
        Self::start_with(members, false)
    }

    /// [`Etcd::start`] with client TLS and client-certificate authentication: certificates are
    /// made with `openssl` (None, after "skipped: ...", when it is missing) and their files
    /// are in [`Etcd::tls_files`]. Peers still talk plain HTTP.
    pub fn start_tls(members: usize) -> Option<Etcd> {
        Self::start_with(members, true)
    }

    /// The certificates, for a cluster started with [`Etcd::start_tls`].
    pub fn tls_files(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    fn start_with(members: usize, tls: bool) -> Option<Etcd> {
        assert!(
            members == 1 || members == 3,
            "an etcd test cluster has 1 or 3 members, not {members}"
        );
        let Some(bin) = find_etcd() else {
            println!(
                "skipped: no etcd binary (/usr/bin/etcd or etcd on PATH); scripts/install-deps.sh installs it"
            );
            return None;
        };
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "muster-etcd-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        let tls = if tls {
            match make_certificates(&dir) {
                Ok(files) => Some(files),
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&dir);
                    println!("skipped: cannot make test certificates with openssl: {e}");
                    return None;
                }
            }
        } else {
            None
        };
        let members: Vec<Member> = (0..members)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: crate::free_port(),
                peer_port: crate::free_port(),
                health_port: crate::free_port(),
                data_dir: dir.join(format!("m{i}.data")),
                log: dir.join(format!("m{i}.log")),
                child: None,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut etcd = Etcd {
            bin,
            members,
            initial_cluster,
            dir,
            tls,
        };
        for i in 0..etcd.members.len() {
            etcd.spawn(i);
        }
        for i in 0..etcd.members.len() {
            etcd.wait_healthy(i);
        }
        Some(etcd)
    }

    /// The members' client addresses, `127.0.0.1:port` (no scheme), in member order.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect()
    }

    /// [`Etcd::endpoints`] comma-joined, for `--etcd-endpoints`.
    pub fn endpoints_arg(&self) -> String {
        self.endpoints().join(",")
    }

    /// SIGKILLs member `member` (and reaps it). Killing a killed member does nothing.
    pub fn kill(&mut self, member: usize) {
        if let Some(mut child) = self.members[member].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts member `member` again on the same ports and data directory, and waits until it
    /// is healthy (for a member of three, until it has rejoined a cluster with a leader).
    pub fn restart(&mut self, member: usize) {
        self.kill(member);
        self.spawn(member);
        self.wait_healthy(member);
    }

    /// [`Etcd::restart`], tried up to 5 times 300 ms apart: the member's ports are in the
    /// ephemeral range, and while it is down a client reconnecting to its port can be given
    /// that very port as its source (a TCP self-connect), so the restarted member cannot bind
    /// it for a moment. Panics with the last attempt's failure.
    pub fn restart_retrying(&mut self, member: usize) {
        const ATTEMPTS: u32 = 5;
        for attempt in 1..=ATTEMPTS {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.restart(member))) {
                Ok(()) => return,
                Err(panic) if attempt == ATTEMPTS => std::panic::resume_unwind(panic),
                Err(_) => {
                    eprintln!(
                        "etcd member {member} did not restart (attempt {attempt}); trying again"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(300));
                }
            }
        }
    }

    /// The pid of member `member` (panics if it is killed).
    pub fn pid(&self, member: usize) -> u32 {
        self.members[member]
            .child
            .as_ref()
            .unwrap_or_else(|| panic!("etcd member {member} is not running"))
            .id()
    }

    /// Turns on etcd's authentication with user `root` (role `root`) and `password`, through
    /// etcd's JSON gateway on member 0; from then on every request needs the credentials.
    /// Plain clusters only (not [`Etcd::start_tls`]).
    pub fn enable_auth(&self, password: &str) {
        assert!(self.tls.is_none(), "enable_auth speaks plain HTTP");
        let port = self.members[0].client_port;
        let password = password.replace('\\', "\\\\").replace('"', "\\\"");
        for (path, body) in [
            (
                "user/add",
                format!(r#"{{"name":"root","password":"{password}"}}"#),
            ),
            ("role/add", r#"{"name":"root"}"#.to_owned()),
            ("user/grant", r#"{"user":"root","role":"root"}"#.to_owned()),
            ("enable", "{}".to_owned()),
        ] {
            let answer = crate::http(port, "POST", &format!("/v3/auth/{path}"), &body)
                .unwrap_or_else(|e| panic!("etcd auth/{path}: {e}"));
            assert!(
                answer.contains("\"header\""),
                "etcd auth/{path} failed: {answer}"
            );
        }
    }

    fn spawn(&mut self, i: usize) {
        let m = &self.members[i];
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", m.log.display()));
        let log2 = log
            .try_clone()
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", m.log.display()));
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", m.client_port);
        let health = format!("http://127.0.0.1:{}", m.health_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data_dir)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "muster-test"])
            .args(["--listen-metrics-urls", &health])
            .args(["--logger", "zap", "--log-level", "warn"])
            // A torch-sized value (8 MiB, the coordinator's max_value_bytes) in one request,
            // as docs/ha.md asks of a production etcd.
            .args(["--max-request-bytes", "16777216"])
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            // Out of the test's process group: a Ctrl-C meant for cargo does not reach etcd
            // before `Drop` does.
            .process_group(0);
        if let Some(tls) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&tls.server_cert)
                .arg("--key-file")
                .arg(&tls.server_key)
                .arg("--trusted-ca-file")
                .arg(&tls.ca)
                .arg("--client-cert-auth");
        }
        // Go's name for the architecture, where etcd needs to be told it is supported.
        if let Some(arch) = match std::env::consts::ARCH {
            "aarch64" => Some("arm64"),
            "x86_64" => None,
            other => Some(other),
        } {
            cmd.env("ETCD_UNSUPPORTED_ARCH", arch);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()));
        self.members[i].child = Some(child);
    }

    fn wait_healthy(&mut self, i: usize) {
        let deadline = Instant::now() + READY_TIMEOUT;
        let port = self.members[i].health_port;
        loop {
            if health(port) {
                return;
            }
            let exited = self.members[i]
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                panic!(
                    "etcd member {i} exited during startup ({status})\n{}",
                    self.logs()
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "etcd member {i} (client port {port}) not healthy within {READY_TIMEOUT:?}\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every member's log, for panic messages.
    fn logs(&self) -> String {
        self.members
            .iter()
            .map(|m| {
                format!(
                    "--- {} ({})\n{}",
                    m.name,
                    m.log.display(),
                    read_tail(&m.log)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate (P-256 keys), in `dir`.
fn make_certificates(dir: &Path) -> Result<TlsFiles, String> {
    let openssl = |args: &[&str]| -> Result<(), String> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("openssl: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    };
    let key = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509", "-days", "2", "-subj", "/CN=muster-test-ca"];
    ca.extend(key);
    ca.extend(["-keyout", "ca.key", "-out", "ca.pem"]);
    openssl(&ca)?;
    for (name, ext) in [
        (
            "server",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
        ),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ] {
        let ext_file = format!("{name}.ext");
        std::fs::write(dir.join(&ext_file), ext).map_err(|e| e.to_string())?;
        let subject = format!("/CN=muster-test-{name}");
        let (key_file, csr, pem) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
        );
        let mut req = vec!["req", "-subj", &subject];
        req.extend(key);
        req.extend(["-keyout", &key_file, "-out", &csr]);
        openssl(&req)?;
        openssl(&[
            "x509",
            "-req",
            "-days",
            "2",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-extfile",
            &ext_file,
            "-out",
            &pem,
        ])?;
    }
    Ok(TlsFiles {
        ca: dir.join("ca.pem"),
        client_cert: dir.join("client.pem"),
        client_key: dir.join("client.key"),
        server_cert: dir.join("server.pem"),
        server_key: dir.join("server.key"),
    })
}

/// `/usr/bin/etcd`, else `etcd` on PATH.
fn find_etcd() -> Option<PathBuf> {
    let usr = PathBuf::from("/usr/bin/etcd");
    if usr.is_file() {
        return Some(usr);
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

/// Whether etcd's `/health` on `port` says healthy (it does once the member has a leader).
fn health(port: u16) -> bool {
    crate::http(port, "GET", "/health", "").is_ok_and(|a| a.contains("\"health\":\"true\""))
}

/// The last 8 KiB of a log file.
pub(crate) fn read_tail(path: &Path) -> String {
    let mut text = String::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.read_to_string(&mut text);
    }
    let start = text.len().saturating_sub(8 << 10);
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len());
    text[start..].to_owned()
}
