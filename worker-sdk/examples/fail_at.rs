//! Failure propagation, for end-to-end tests: every rank passes a first barrier, then rank
//! `R` exits with code `C` while the others wait at a second barrier and print the error they
//! get (which names the failed rank, its node and host).
//!
//! Usage: `fail_at --rank R --code C`. Ranks other than `R` exit with 1 when the second
//! barrier fails, 0 if it unexpectedly succeeds.

use std::process::ExitCode;

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("fail_at: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let mut fail_rank: Option<usize> = None;
    let mut code: i32 = 3;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().ok_or(format!("{arg} needs a value"))?;
        match arg.as_str() {
            "--rank" => {
                fail_rank = Some(
                    value
                        .parse()
                        .map_err(|e| format!("--rank {value:?}: {e}"))?,
                )
            }
            "--code" => {
                code = value
                    .parse()
                    .map_err(|e| format!("--code {value:?}: {e}"))?
            }
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: fail_at --rank R --code C"
                )
                .into());
            }
        }
    }
    let fail_rank = fail_rank.ok_or("usage: fail_at --rank R --code C")?;

    let accelerator = muster::Accelerator::from_env()?;
    let rank = accelerator.process_index();
    accelerator.wait_for_everyone()?;
    println!("rank={rank} passed the first barrier");
    if rank == fail_rank {
        println!("rank={rank} exiting with code {code}");
        // No destructors: the session ends without `leave`, as in a crash.
        std::process::exit(code);
    }
    match accelerator.wait_for_everyone() {
        Ok(()) => {
            println!("rank={rank} passed the second barrier (rank {fail_rank} did not fail?)");
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            println!("rank={rank} error: {e}");
            Ok(ExitCode::FAILURE)
        }
    }
}
