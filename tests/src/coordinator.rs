//! A real `muster-coordinator` process on a free loopback port, for tests whose agents need a
//! coordinator of their own (several agents of one job, daemon mode). Killed on drop; its log
//! goes to a file that a failing test prints the end of (why a replica stepped down, say).

use std::process::{Child, Command, Stdio};

/// A running coordinator process.
#[derive(Debug)]
pub struct Coordinator {
    child: Child,
    /// Its `127.0.0.1:PORT`.
    pub addr: String,
    /// Its stderr (the log), removed on drop.
    log: std::path::PathBuf,
}

impl Coordinator {
    /// Starts `muster-coordinator --listen 127.0.0.1:<free port> <extra>`, and waits until it
    /// accepts connections.
    pub fn start(extra: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let addr = format!("127.0.0.1:{port}");
        let bin = crate::coordinator_bin();
        let log = std::env::temp_dir().join(format!(
            "muster-coordinator-{}-{port}.log",
            std::process::id()
        ));
        let stderr = std::fs::File::create(&log).map_or_else(|_| Stdio::null(), Stdio::from);
        let child = Command::new(&bin)
            .arg("--listen")
            .arg(&addr)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        for _ in 0..200 {
            if std::net::TcpStream::connect(&addr).is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        Self { child, addr, log }
    }
}

impl Coordinator {
    /// The coordinator's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(60)..].join("\n");
            eprintln!(
                "--- coordinator {} (pid {}), the end of its log:\n{tail}",
                self.addr,
                self.child.id()
            );
        }
        let _ = std::fs::remove_file(&self.log);
    }
}
