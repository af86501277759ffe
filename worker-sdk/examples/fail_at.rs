//! Failure propagation, for end-to-end tests: every rank passes a first barrier, then rank
//! `R` exits with code `C` while the others wait at a second barrier and print the error they
//! get (which names the failed rank, its node and host). With `--at 0`, rank `R` exits before
//! the first barrier instead, once every rank has registered (each says so in the key-value
//! store), and the others fail in the first.
//!
//! Usage: `fail_at --rank R --code C [--at 0|1]`. Ranks other than `R` exit with 1 when the
//! barrier after the death fails, 0 if it unexpectedly succeeds.

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
    let mut at = 1;
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
            "--at" if value == "0" || value == "1" => at = usize::from(value == "1"),
            other => {
                return Err(format!(
                    "unknown argument {other:?} {value:?}; usage: fail_at --rank R --code C [--at 0|1]"
                )
                .into());
            }
        }
    }
    let fail_rank = fail_rank.ok_or("usage: fail_at --rank R --code C")?;

    let accelerator = muster::Accelerator::from_env()?;
    let rank = accelerator.process_index();
    if at == 0 {
        // The death comes after every rank registered, so that what fails for the others is
        // their first barrier, not their registration.
        let key = |r: usize| format!("fail_at/registered/{r}");
        if rank == fail_rank {
            for other in (0..accelerator.num_processes()).filter(|&r| r != rank) {
                accelerator
                    .kv()
                    .get_wait(&key(other), std::time::Duration::from_secs(30))?;
            }
        } else {
            accelerator.kv().set(&key(rank), b"1".to_vec())?;
        }
    }
    if at == 1 {
        accelerator.wait_for_everyone()?;
        println!("rank={rank} passed the first barrier");
    }
    if rank == fail_rank {
        println!("rank={rank} exiting with code {code}");
        // No destructors: the session ends without `leave`, as in a crash.
        std::process::exit(code);
    }
    match accelerator.wait_for_everyone() {
        Ok(()) => {
            println!(
                "rank={rank} passed the barrier after rank {fail_rank}'s exit (did it not fail?)"
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            println!("rank={rank} error: {e}");
            Ok(ExitCode::FAILURE)
        }
    }
}
