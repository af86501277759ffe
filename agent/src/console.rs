//! Keeps a closed stdout or stderr from crashing the agent: `muster-agent launch ... | head -1`
//! must run its job to the end, not panic in the next `eprintln!`.
//!
//! Rust ignores SIGPIPE, so a write to a pipe whose reader is gone fails with EPIPE, and
//! `print!`, `eprintln!` and the `tracing` writer panic on a failed write. Rather than guard
//! every print (the agent has many, in many modules), [`protect`] puts a pipe of the agent's
//! own in place of descriptors 1 and 2 when they are pipes or sockets (the streams whose reader
//! can go away; a terminal or a file is left alone), and a relay thread per stream copies that
//! pipe to the real destination. The agent's pipe always has its reader, so no write in the
//! agent fails; when the real destination fails, its relay drops what follows (the workers'
//! log files, written apart, keep everything) and the job goes on. torchrun differs: its
//! workers write to the closed pipe themselves and fail with BrokenPipeError.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::process::Stdio;
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long [`Console::finish`] waits for the relays to pass on what is left (they end at once
/// unless a child process still holds the agent's pipe open).
const FINISH_WAIT: Duration = Duration::from_millis(100);

/// The real stderr, for child processes that outlive the agent (the guardian).
static ORIGINAL_STDERR: OnceLock<OwnedFd> = OnceLock::new();

/// The relays started by [`protect`]; [`Console::finish`] lets them pass on the last output.
#[derive(Debug, Default)]
#[must_use = "call finish() before exiting, or the last output may be lost"]
pub struct Console {
    relays: Vec<Relay>,
}

#[derive(Debug)]
struct Relay {
    stream: Stream,
    done: mpsc::Receiver<()>,
}

/// One of the agent's own output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    /// A duplicate of this stream's descriptor.
    fn dup(self) -> std::io::Result<OwnedFd> {
        match self {
            Self::Stdout => std::io::stdout().as_fd().try_clone_to_owned(),
            Self::Stderr => std::io::stderr().as_fd().try_clone_to_owned(),
        }
    }

    /// Puts `fd` in place of this stream's descriptor.
    fn replace_with(self, fd: impl AsFd) -> nix::Result<()> {
        match self {
            Self::Stdout => nix::unistd::dup2_stdout(fd),
            Self::Stderr => nix::unistd::dup2_stderr(fd),
        }
    }
}

/// Interposes the agent's own pipe and a relay thread on stdout and on stderr where they are
/// pipes or sockets. Call it first in `main`, before any thread starts or any child is
/// spawned. A step that fails leaves that stream as it was.
pub fn protect() -> Console {
    let mut console = Console::default();
    for stream in [Stream::Stdout, Stream::Stderr] {
        if let Some(relay) = interpose(stream) {
            console.relays.push(relay);
        }
    }
    console
}

/// What a long-lived child should get as its stderr: the agent's real stderr, so that its
/// messages after the agent has exited still reach the user and it does not hold the
/// agent's pipe open (which would delay [`Console::finish`]).
pub fn child_stderr() -> Stdio {
    ORIGINAL_STDERR
        .get()
        .and_then(|fd| fd.try_clone().ok())
        .map_or_else(Stdio::inherit, Stdio::from)
}

fn interpose(stream: Stream) -> Option<Relay> {
    // A closed descriptor (EBADF) is left alone: Rust already treats writes to it as done.
    let original = stream.dup().ok()?;
    let kind = File::from(original.try_clone().ok()?)
        .metadata()
        .ok()?
        .file_type();
    if !(kind.is_fifo() || kind.is_socket()) {
        return None;
    }
    let (reader, writer) = std::io::pipe().ok()?;
    let keep = if stream == Stream::Stderr {
        Some(original.try_clone().ok()?)
    } else {
        None
    };
    let (tx, done) = mpsc::channel();
    let name = match stream {
        Stream::Stdout => "muster-console-out",
        Stream::Stderr => "muster-console-err",
    };
    let mut target = File::from(original);
    // Thread "muster-console-*": on a failed write, drop the rest; ends at end of file (the
    // agent's descriptors closed by `finish`); detached, `finish` waits for it (bounded).
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            relay(reader, &mut target);
            let _ = tx.send(());
        })
        .ok()?;
    if stream.replace_with(&writer).is_err() {
        // The thread sees end of file when `writer` drops here, and ends.
        return None;
    }
    if let Some(fd) = keep {
        let _ = ORIGINAL_STDERR.set(fd);
    }
    Some(Relay { stream, done })
}

/// Copies `src` to `dst` until end of file; after `dst` fails once, reads and drops.
fn relay(mut src: impl Read, dst: &mut impl Write) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut open = true;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        if open && dst.write_all(&buf[..n]).is_err() {
            open = false;
        }
    }
}

impl Console {
    /// Flushes stdout, closes the agent's ends of its pipes (later writes go to /dev/null)
    /// and waits, at most [`FINISH_WAIT`], for the relays to pass on what is left. Call it
    /// last in `main`, when nothing else writes.
    pub fn finish(self) {
        if self.relays.is_empty() {
            return;
        }
        let _ = std::io::stdout().flush();
        let Ok(null) = File::options().write(true).open("/dev/null") else {
            return;
        };
        for relay in &self.relays {
            let _ = relay.stream.replace_with(&null);
        }
        let deadline = Instant::now() + FINISH_WAIT;
        for relay in self.relays {
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = relay.done.recv_timeout(left);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A destination that takes `ok` writes and then fails like a closed pipe.
    struct Closing {
        ok: usize,
        got: Vec<u8>,
    }

    impl Write for Closing {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.ok == 0 {
                return Err(std::io::ErrorKind::BrokenPipe.into());
            }
            self.ok -= 1;
            self.got.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn relay_drains_its_source_after_the_destination_fails() {
        let (reader, mut writer) = std::io::pipe().expect("pipe");
        let feeder = std::thread::spawn(move || {
            // Far more than a pipe holds: this only ends if the relay keeps reading.
            for i in 0..20_000 {
                writeln!(writer, "line {i:08}").expect("the relay keeps reading");
            }
        });
        let mut dst = Closing {
            ok: 1,
            got: Vec::new(),
        };
        relay(reader, &mut dst);
        feeder.join().expect("feeder");
        // One write reached the destination before it failed: a prefix of the stream (the
        // first read may return less than a whole line).
        let stream: Vec<u8> = (0..20_000)
            .flat_map(|i| format!("line {i:08}\n").into_bytes())
            .collect();
        assert!(
            !dst.got.is_empty() && stream.starts_with(&dst.got),
            "{:?}",
            dst.got
        );
        assert!(dst.got.len() < 20_000 * 14);
    }
}
