//! The `muster-agent` command: parses the command line and runs the launch or the daemon
//! command. `src/main.rs` and the Python package's `muster-agent` entry point both call
//! [`main`].

use crate::{LAUNCH_ERROR_EXIT, Parsed, USAGE_EXIT, cli, launch};
use std::ffi::OsString;
use std::time::Duration;

/// Warnings, but not the embedded coordinator's (the agent reports failures itself) nor
/// py-spy's (a worker that cannot be read is named in its stack's line).
const DEFAULT_LOG_FILTER: &str = "warn,muster_coordinator=error,py_spy=error,remoteprocess=error";

/// Runs the command with `args` (the program name first) and returns its exit status.
pub fn main(args: Vec<OsString>) -> u8 {
    // `muster-agent __guard PID` is the agent's guardian process (guard.rs), not a command.
    if let Some(code) = crate::guard::dispatch(&args) {
        return code;
    }
    // Before any thread or child: a stdout or stderr whose reader goes away (`| head -1`)
    // must not make a print panic (console.rs).
    let console = crate::console::protect();
    let code = run(args);
    console.finish();
    code
}

/// Everything but the console: the telemetry guard drops (and flushes) before `finish`.
fn run(args: Vec<OsString>) -> u8 {
    // Stderr logging, plus OTLP traces when OTEL_EXPORTER_OTLP_ENDPOINT is set; the guard
    // flushes them when main returns.
    let _telemetry = muster_telemetry::traces::init(
        "muster-agent",
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER)),
    );

    let path = std::env::var_os("PATH");
    let spec = match cli::parse(args, path.as_deref()) {
        Ok(Parsed::Launch(spec)) => spec,
        Ok(Parsed::Daemon(request)) => {
            let Some(runtime) = runtime() else {
                return LAUNCH_ERROR_EXIT;
            };
            // `serve` under systemd (Type=notify): READY=1 and watchdog pings once the
            // coordinator accepted the registration (daemon.rs), STOPPING=1 once it returned.
            // No-ops outside systemd and for the other commands.
            let serving = matches!(&request, crate::daemon::Request::Serve(_));
            let code = match runtime.block_on(crate::daemon::run(request)) {
                Ok(code) => code,
                Err(e) => {
                    eprintln!("muster-agent: {e}");
                    LAUNCH_ERROR_EXIT
                }
            };
            if serving {
                crate::systemd::stopped(code);
            }
            runtime.shutdown_timeout(Duration::from_millis(200));
            return code;
        }
        Ok(Parsed::Certs(plan)) => {
            return match crate::certs::run(&plan) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("muster-agent: {e}");
                    LAUNCH_ERROR_EXIT
                }
            };
        }
        Ok(Parsed::Exit(code)) => return u8::try_from(code).unwrap_or(USAGE_EXIT),
        Err(e) => {
            eprintln!("muster-agent: {e}");
            return USAGE_EXIT;
        }
    };

    let Some(runtime) = runtime() else {
        return LAUNCH_ERROR_EXIT;
    };
    let code = match runtime.block_on(launch::run(spec)) {
        Ok(outcome) => outcome.exit_code(),
        Err(e) => {
            eprintln!("muster-agent: {e}");
            LAUNCH_ERROR_EXIT
        }
    };
    // Dropping the runtime drops the remaining tasks (the embedded coordinator, and any
    // worker still held, which kills its process group); do not wait on stragglers.
    runtime.shutdown_timeout(Duration::from_millis(200));
    code
}

/// tokio's variable for its worker thread count, which overrides [`WORKER_THREADS`].
const WORKER_THREADS_ENV: &str = "TOKIO_WORKER_THREADS";

/// The runtime's worker threads, unless [`WORKER_THREADS_ENV`] says otherwise. The command's
/// own future (the launch's supervisor, the daemon's loop) runs on the main thread, and every
/// task (the gateway, the agent store, the embedded coordinator, the output pumps, the node's
/// watch) on this one thread: a worker's store call crosses the agent as one thread's work
/// instead of waking a second thread at each hand-off between tasks (a Python store `get`,
/// p50: 337 us with two threads, 236 us with one, on a 2-vCPU VM; docs/benchmarks.md). The agent's tasks are light, and
/// its long blocking work runs on tokio's blocking threads and its own threads (the relay, the
/// stack sampler); the longest a task holds the thread is a daemon job's `posix_spawn` of a
/// worker, until the child execs. tokio would otherwise start one thread per core, 96 on a
/// large GPU host.
const WORKER_THREADS: usize = 1;

/// The runtime the launch and the daemon commands run on, or `None` after saying why it could
/// not start.
fn runtime() -> Option<tokio::runtime::Runtime> {
    build_runtime(std::env::var_os(WORKER_THREADS_ENV).is_some())
        .inspect_err(|e| eprintln!("muster-agent: cannot start the async runtime: {e}"))
        .ok()
}

/// The runtime, with [`WORKER_THREADS`] worker threads unless `overridden` ([`WORKER_THREADS_ENV`]
/// is set, and tokio reads it).
fn build_runtime(overridden: bool) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if !overridden {
        builder.worker_threads(WORKER_THREADS);
    }
    builder.enable_all().build()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_runtime_has_one_worker_thread_unless_tokio_is_told_otherwise() {
        let runtime = build_runtime(false).unwrap();
        assert_eq!(runtime.metrics().num_workers(), WORKER_THREADS);
        assert_eq!(WORKER_THREADS, 1);
        // Told otherwise, tokio decides: its variable's value, else one thread per core.
        let told = build_runtime(true).unwrap();
        let expected = std::env::var(WORKER_THREADS_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().unwrap().get());
        assert_eq!(told.metrics().num_workers(), expected);
    }
}
