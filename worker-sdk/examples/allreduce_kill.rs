//! A peer lost in the middle of a collective, for end-to-end tests: every rank runs a loop of
//! large f32 all_reduces on the CPU communicator; at iteration `N`, rank `R` dies partway into
//! the all_reduce (a thread ends the process while the main thread is exchanging data), and
//! the others print the error they get, which names rank `R`.
//!
//! Usage: `allreduce_kill --rank R [--at N] [--mib M] [--how exit|abort|stop]` (defaults:
//! N = 3, M = 32 MiB per rank). `exit` is `std::process::exit(3)`, `abort` is
//! `std::process::abort()`, `stop` sends the process SIGSTOP, so that only the coordinator's
//! heartbeat timeout can notice it.
//!
//! Lines: `rank=R dying at_ms=<unix ms>` from the victim; from the others
//! `rank=r error at_ms=<unix ms>: <error>` (exit status 1) and, if the coordinator's failure
//! report arrives within 400 ms after that, `rank=r coordinator at_ms=<unix ms>: <report>`; or
//! `rank=r done` if nothing failed.

use std::{
    process::ExitCode,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use muster::comm::{BackendKind, Communicator, ReduceOp};

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("allreduce_kill: {e}");
            ExitCode::from(2)
        }
    }
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

fn run() -> Result<ExitCode, Box<dyn std::error::Error>> {
    const USAGE: &str = "usage: allreduce_kill --rank R [--at N] [--mib M] [--how exit|abort|stop]";
    let (mut victim, mut at, mut mib, mut how) =
        (None::<usize>, 3usize, 32usize, "exit".to_owned());
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().ok_or(format!("{arg} needs a value; {USAGE}"))?;
        match arg.as_str() {
            "--rank" => victim = Some(value.parse()?),
            "--at" => at = value.parse()?,
            "--mib" => mib = value.parse()?,
            "--how" if ["exit", "abort", "stop"].contains(&value.as_str()) => how = value,
            _ => return Err(format!("bad argument {arg} {value}; {USAGE}").into()),
        }
    }
    let victim = victim.ok_or(USAGE)?;

    let accelerator = muster::Accelerator::from_env()?;
    let comm = Communicator::with_backend(&accelerator, BackendKind::Cpu)?;
    let rank = comm.rank();
    let mut buf = vec![1.0f32; mib << 18];
    for iteration in 0..at + 100 {
        if iteration == at && rank == victim {
            let how = how.clone();
            std::thread::spawn(move || {
                // Partway into the all_reduce below.
                std::thread::sleep(Duration::from_millis(20));
                println!("rank={rank} dying at_ms={}", now_ms());
                match how.as_str() {
                    "abort" => std::process::abort(),
                    "stop" => {
                        let pid = std::process::id().to_string();
                        let _ = std::process::Command::new("kill")
                            .args(["-STOP", &pid])
                            .status();
                    }
                    _ => std::process::exit(3),
                }
            });
        }
        buf.fill(1.0);
        if let Err(e) = comm.all_reduce(&mut buf, ReduceOp::Sum) {
            println!("rank={rank} error at_ms={}: {e}", now_ms());
            // When the coordinator's own report comes (before the agent stops this worker).
            if let Some(report) = accelerator
                .failure_watch()
                .wait_timeout(Duration::from_millis(400))
            {
                println!("rank={rank} coordinator at_ms={}: {report}", now_ms());
            }
            return Ok(ExitCode::from(1));
        }
        if iteration == 0 {
            println!("rank={rank} running");
        }
    }
    println!("rank={rank} done");
    Ok(ExitCode::SUCCESS)
}
