//! `muster-agent`: parses the command line and runs the launch; all logic is in the library.

use muster_agent::{LAUNCH_ERROR_EXIT, Parsed, USAGE_EXIT, cli, launch};
use std::process::ExitCode;
use std::time::Duration;

/// Warnings, but not the embedded coordinator's: the agent reports failures itself.
const DEFAULT_LOG_FILTER: &str = "warn,muster_coordinator=error";

fn main() -> ExitCode {
    // `muster-agent __guard PID` is the agent's guardian process (guard.rs), not a command.
    if let Some(code) = muster_agent::guard::dispatch() {
        return code;
    }
    // Before any thread or child: a stdout or stderr whose reader goes away (`| head -1`)
    // must not make a print panic (console.rs).
    let console = muster_agent::console::protect();
    let code = run();
    console.finish();
    code
}

/// Everything but the console: the telemetry guard drops (and flushes) before `finish`.
fn run() -> ExitCode {
    // Stderr logging, plus OTLP traces when OTEL_EXPORTER_OTLP_ENDPOINT is set; the guard
    // flushes them when main returns.
    let _telemetry = muster_coordinator::telemetry::init(
        "muster-agent",
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER)),
    );

    let path = std::env::var_os("PATH");
    let spec = match cli::parse(std::env::args_os(), path.as_deref()) {
        Ok(Parsed::Launch(spec)) => spec,
        Ok(Parsed::Daemon(request)) => {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("muster-agent: cannot start the async runtime: {e}");
                    return ExitCode::from(LAUNCH_ERROR_EXIT);
                }
            };
            // `serve` under systemd (Type=notify): READY=1 and watchdog pings once the
            // coordinator accepted the registration (daemon.rs), STOPPING=1 once it returned.
            // No-ops outside systemd and for the other commands.
            let serving = matches!(&request, muster_agent::daemon::Request::Serve(_));
            let code = match runtime.block_on(muster_agent::daemon::run(request)) {
                Ok(code) => code,
                Err(e) => {
                    eprintln!("muster-agent: {e}");
                    LAUNCH_ERROR_EXIT
                }
            };
            if serving {
                muster_agent::systemd::stopped(code);
            }
            runtime.shutdown_timeout(Duration::from_millis(200));
            return ExitCode::from(code);
        }
        Ok(Parsed::Exit(code)) => return ExitCode::from(u8::try_from(code).unwrap_or(USAGE_EXIT)),
        Err(e) => {
            eprintln!("muster-agent: {e}");
            return ExitCode::from(USAGE_EXIT);
        }
    };

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("muster-agent: cannot start the async runtime: {e}");
            return ExitCode::from(LAUNCH_ERROR_EXIT);
        }
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
    ExitCode::from(code)
}
