//! A check of the NCCL backend on a GPU machine: every rank all-reduces known values of several
//! types and compares them with the expected result, then times a large f32 all-reduce; with
//! `--kill-rank R`, rank R crashes after the checks while the others are in a loop of
//! all-reduces, which must fail within seconds naming rank R (the NCCL communicator is
//! aborted) instead of hanging.
//!
//! Usage, one process per GPU: `muster-agent launch --nproc-per-node N -- nccl_check
//! [--mib M] [--iters I] [--kill-rank R]`; alone (`cargo run --example nccl_check`) it runs as
//! a single rank. Exits 0 when every check passed (and, with `--kill-rank`, when the surviving
//! ranks got the expected error), 1 when a check failed, 2 on a usage or setup error.

use std::{
    process::ExitCode,
    time::{Duration, Instant},
};

use half::bf16;
use muster::{
    Accelerator, Error,
    comm::{BackendKind, Communicator, ReduceOp},
};

struct Options {
    mib: usize,
    iters: usize,
    kill_rank: Option<usize>,
}

fn main() -> ExitCode {
    let options = match parse() {
        Ok(options) => options,
        Err(e) => {
            eprintln!("nccl_check: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("nccl_check: {e}");
            ExitCode::from(2)
        }
    }
}

fn parse() -> Result<Options, String> {
    let usage = "usage: nccl_check [--mib M] [--iters I] [--kill-rank R]";
    let mut options = Options {
        mib: 64,
        iters: 20,
        kill_rank: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().ok_or(format!("{arg} needs a value; {usage}"))?;
        let number: usize = value.parse().map_err(|e| format!("{arg} {value:?}: {e}"))?;
        match arg.as_str() {
            "--mib" => options.mib = number,
            "--iters" => options.iters = number.max(1),
            "--kill-rank" => options.kill_rank = Some(number),
            other => return Err(format!("unknown argument {other:?}; {usage}")),
        }
    }
    Ok(options)
}

fn run(options: &Options) -> Result<bool, Error> {
    let accelerator = Accelerator::from_env()?;
    let rank = accelerator.process_index();
    let world = accelerator.num_processes();
    let comm = Communicator::with_backend(&accelerator, BackendKind::Nccl)?;
    let ok = std::cell::Cell::new(true);
    let check = |what: &str, passed: bool| {
        if !passed {
            println!("rank={rank} FAILED {what}");
            ok.set(false);
        }
    };

    // Rank r contributes r + 1 (+ i, element-wise): sums, means, extremes and products are
    // known in closed form and exact in every type at these sizes.
    let n = 1000;
    let expected_sum = |i: usize| (world * (world + 1) / 2 + world * i) as f64;
    let mut f = vec![0f32; n];
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
        for (i, v) in f.iter_mut().enumerate() {
            *v = (rank + 1 + i % 7) as f32;
        }
        comm.all_reduce(&mut f, op)?;
        let passed = f.iter().enumerate().all(|(i, &v)| {
            let i = i % 7;
            let want = match op {
                ReduceOp::Sum => expected_sum(i),
                ReduceOp::Avg => expected_sum(i) / world as f64,
                ReduceOp::Max => (world + i) as f64,
                _ => (1 + i) as f64,
            };
            (f64::from(v) - want).abs() < 1e-3
        });
        check(&format!("f32 all_reduce {op:?}"), passed);
    }
    let mut b: Vec<bf16> = (0..n).map(|_| bf16::from_f32((rank + 1) as f32)).collect();
    comm.all_reduce(&mut b, ReduceOp::Sum)?;
    check(
        "bf16 all_reduce Sum",
        b.iter().all(|v| f64::from(v.to_f32()) == expected_sum(0)),
    );
    let mut l: Vec<i64> = (0..n).map(|_| (rank + 1) as i64).collect();
    comm.all_reduce(&mut l, ReduceOp::Avg)?;
    let mean = (world * (world + 1) / 2 / world) as i64;
    check("i64 all_reduce Avg", l.iter().all(|&v| v == mean));
    let mut u: Vec<u8> = vec![(rank % 200) as u8 + 1; n];
    comm.all_reduce(&mut u, ReduceOp::Max)?;
    check(
        "u8 all_reduce Max",
        u.iter().all(|&v| usize::from(v) == (world - 1) % 200 + 1),
    );
    println!(
        "rank={rank} correctness checks {}",
        if ok.get() { "passed" } else { "FAILED" }
    );

    let mut big = vec![1f32; options.mib * 1024 * 1024 / 4];
    comm.all_reduce(&mut big, ReduceOp::Sum)?;
    let started = Instant::now();
    for _ in 0..options.iters {
        comm.all_reduce(&mut big, ReduceOp::Sum)?;
    }
    let per_call = started.elapsed() / options.iters as u32;
    let bytes = (big.len() * 4) as f64;
    // The bus bandwidth convention of nccl-tests: 2 (n - 1) / n of the buffer crosses each link.
    let bus = bytes * 2.0 * (world as f64 - 1.0) / world as f64 / per_call.as_secs_f64() / 1e9;
    println!(
        "rank={rank} all_reduce of {} MiB f32 (host buffers): {per_call:?} per call, bus \
         bandwidth {bus:.1} GB/s",
        options.mib
    );

    if let Some(kill) = options.kill_rank {
        if rank == kill {
            println!("rank={rank} crashing now");
            // No destructors: the session ends without `leave`, as in a crash.
            std::process::exit(3);
        }
        let started = Instant::now();
        let mut small = vec![1f32; 1024];
        let error = loop {
            if let Err(e) = comm.all_reduce(&mut small, ReduceOp::Sum) {
                break e;
            }
            if started.elapsed() > Duration::from_secs(120) {
                check("the dead rank is noticed within 120 s", false);
                return Ok(false);
            }
        };
        println!("rank={rank} after {:?}: {error}", started.elapsed());
        let named = matches!(
            &error,
            Error::PeerLost { rank: r, .. } | Error::RankFailed { rank: r, .. } if *r as usize == kill
        );
        check(&format!("the error names rank {kill}"), named);
        return Ok(ok.get());
    }
    accelerator.finish()?;
    Ok(ok.get())
}
