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

/// The multi-threaded runtime the launch and the daemon commands run on, or `None` after saying
/// why it could not start.
fn runtime() -> Option<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .inspect_err(|e| eprintln!("muster-agent: cannot start the async runtime: {e}"))
        .ok()
}
