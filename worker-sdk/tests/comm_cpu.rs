//! The communicator's CPU backend against the real coordinator (in-process on 127.0.0.1:0),
//! ranks as threads: every collective for every element type and reduce op against a reference
//! computed locally, world sizes 1 to 8, small and large paths (shared memory, cross-memory
//! attach, socket rings), uneven lengths, a large all_reduce, shape mismatches, argument errors
//! and a lost peer.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Instant;

use half::{bf16, f16};
use muster::{
    Accelerator, Error, RankInfo,
    comm::{Communicator, Element, ReduceOp},
};
use rand::{RngCore, SeedableRng, rngs::StdRng};
use support::with_comms;
const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Product,
];

/// Test values: small integers, so that every reduction order gives exactly the same result
/// and the comparison can be exact.
trait Value: Element + Copy {
    /// The value for a random byte (a small integer).
    fn from_byte(b: u8) -> Self;
    /// The value for a random word: for floats a fraction with every mantissa bit in use, so
    /// that sums depend on their order (a reduction in another order than the reference's
    /// shows as a difference).
    fn from_word(w: u32) -> Self;
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self;
    fn avg(sum: Self, n: usize) -> Self;
}

macro_rules! float_value {
    ($t:ty) => {
        impl Value for $t {
            fn from_byte(b: u8) -> Self {
                (i32::from(b % 5) - 2) as $t
            }
            fn from_word(w: u32) -> Self {
                (f64::from(w) / f64::from(u32::MAX) * 2.0 - 1.0) as $t
            }
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Product => a * b,
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            fn avg(sum: Self, n: usize) -> Self {
                sum / n as $t
            }
        }
    };
}
float_value!(f32);
float_value!(f64);

macro_rules! half_value {
    ($t:ty) => {
        impl Value for $t {
            fn from_byte(b: u8) -> Self {
                <$t>::from_f32((i32::from(b % 5) - 2) as f32)
            }
            fn from_word(w: u32) -> Self {
                <$t>::from_f32((f64::from(w) / f64::from(u32::MAX) * 2.0 - 1.0) as f32)
            }
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                let (a, b) = (a.to_f32(), b.to_f32());
                <$t>::from_f32(match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Product => a * b,
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                })
            }
            fn avg(sum: Self, n: usize) -> Self {
                <$t>::from_f32(sum.to_f32() / n as f32)
            }
        }
    };
}
half_value!(f16);
half_value!(bf16);

macro_rules! int_value {
    ($t:ty, $lo:expr) => {
        impl Value for $t {
            fn from_byte(b: u8) -> Self {
                (b % 9) as $t + $lo
            }
            fn from_word(w: u32) -> Self {
                w as $t
            }
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Product => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            fn avg(sum: Self, n: usize) -> Self {
                sum / n as $t
            }
        }
    };
}
int_value!(i32, -4);
int_value!(i64, -4);
int_value!(u8, 0);

/// Every rank's input for case `case` (each rank can compute every other rank's).
fn inputs<T: Value>(case: u64, n: usize, len: impl Fn(usize) -> usize) -> Vec<Vec<T>> {
    (0..n)
        .map(|rank| {
            let mut rng = StdRng::seed_from_u64(case * 1000 + rank as u64);
            let mut bytes = vec![0u8; len(rank)];
            rng.fill_bytes(&mut bytes);
            bytes.into_iter().map(T::from_byte).collect()
        })
        .collect()
}

/// Like [`inputs`], with [`Value::from_word`] values.
fn wide_inputs<T: Value>(case: u64, n: usize, len: usize) -> Vec<Vec<T>> {
    (0..n)
        .map(|rank| {
            let mut rng = StdRng::seed_from_u64(case * 1000 + rank as u64);
            (0..len).map(|_| T::from_word(rng.next_u32())).collect()
        })
        .collect()
}

fn reference<T: Value>(all: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let mut out = all[0].clone();
    for other in &all[1..] {
        for (o, x) in out.iter_mut().zip(other) {
            *o = T::combine(*o, *x, op);
        }
    }
    if op == ReduceOp::Avg {
        out.iter_mut().for_each(|o| *o = T::avg(*o, all.len()));
    }
    out
}

/// Every collective for one element type, small and large sizes.
fn check_type<T: Value>(comm: &Communicator, salt: u64) {
    let (rank, n) = (comm.rank(), comm.world_size());
    let large = 64 * 1024 / std::mem::size_of::<T>() + 777;
    for (i, &len) in [0usize, 1, 13, large].iter().enumerate() {
        let case = salt * 100 + i as u64 * 10;
        for (j, &op) in OPS.iter().enumerate() {
            let all = inputs::<T>(case + j as u64, n, |_| len);
            let expected = reference(&all, op);
            let what = format!("{} x {len} {op:?} on {n} ranks", std::any::type_name::<T>());

            let mut buf = all[rank].clone();
            comm.all_reduce(&mut buf, op).unwrap();
            assert_eq!(buf, expected, "all_reduce {what}");

            let root = (j + i) % n;
            let mut buf = all[rank].clone();
            comm.reduce(&mut buf, op, root).unwrap();
            if rank == root {
                assert_eq!(buf, expected, "reduce to {root} {what}");
            }

            let scattered = comm.reduce_scatter(&all[rank][..len / n * n], op).unwrap();
            let per = len / n;
            let cut: Vec<Vec<T>> = all.iter().map(|v| v[..per * n].to_vec()).collect();
            let full = reference(&cut, op);
            assert_eq!(
                scattered,
                full[rank * per..(rank + 1) * per],
                "reduce_scatter {what}"
            );
        }
        let all = inputs::<T>(case + 7, n, |_| len);
        let root = i % n;
        let mut buf = all[rank].clone();
        comm.broadcast(&mut buf, root).unwrap();
        assert_eq!(buf, all[root], "broadcast from {root}: {len} on {n}");

        let gathered = comm.all_gather(&all[rank]).unwrap();
        assert_eq!(gathered, all.concat(), "all_gather {len} on {n}");

        // Uneven lengths.
        let uneven = |r: usize| (len + r * 5) % (large + 3);
        let all = inputs::<T>(case + 8, n, uneven);
        let got = comm.all_gather_varlen(&all[rank]).unwrap();
        assert_eq!(got, all, "all_gather_varlen {len} on {n}");
        let got = comm.gather(&all[rank], root).unwrap();
        if rank == root {
            assert_eq!(got.as_ref(), Some(&all), "gather to {root} {len} on {n}");
        } else {
            assert!(got.is_none());
        }
        let longest = (0..n).map(uneven).max().unwrap();
        let pad = all[rank].first().copied().unwrap_or_else(T::zeroed);
        for pad_first in [false, true] {
            let got = comm
                .pad_across_processes(&all[rank], pad, pad_first)
                .unwrap();
            let mut expected = vec![pad; longest - all[rank].len()];
            if pad_first {
                expected.extend_from_slice(&all[rank]);
            } else {
                expected.splice(0..0, all[rank].iter().copied());
            }
            assert_eq!(got, expected, "pad_across_processes {len} on {n}");
        }

        // Point to point around the ring (even ranks send first: no cycle of blocked sends).
        if n > 1 {
            let all = inputs::<T>(case + 9, n, |_| len);
            let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
            let mut got = vec![T::zeroed(); len];
            if rank % 2 == 0 {
                comm.send(&all[rank], next).unwrap();
                comm.recv(&mut got, prev).unwrap();
            } else {
                comm.recv(&mut got, prev).unwrap();
                comm.send(&all[rank], next).unwrap();
            }
            assert_eq!(got, all[prev], "send/recv {len} on {n}");
        }
        comm.barrier().unwrap();
    }
}

/// The large-message paths of every collective, with values whose reductions depend on the
/// order: the cross-memory attach path reduces in rank order, as [`reference`] does, so the
/// results must be exactly the reference's (on the socket rings they may differ in the last
/// bits; `exact` says which to expect).
fn check_large<T: Value>(comm: &Communicator, salt: u64, exact: bool) {
    let (rank, n) = (comm.rank(), comm.world_size());
    // Per-rank blocks above the small-message bound, and a length that does not divide.
    let block = 64 * 1024 / std::mem::size_of::<T>() + 5;
    let len = block * n + 3;
    let what = |op: &str| format!("{op} of {len} {} on {n}", std::any::type_name::<T>());
    let close = |got: &[T], expected: &[T], op: &str| {
        if exact {
            assert!(got == expected, "{}: not bit-identical", what(op));
        } else {
            assert_eq!(got.len(), expected.len(), "{}", what(op));
        }
    };
    for (j, &op) in OPS.iter().enumerate() {
        let all = wide_inputs::<T>(salt * 100 + j as u64, n, len);
        let expected = reference(&all, op);
        let mut buf = all[rank].clone();
        comm.all_reduce(&mut buf, op).unwrap();
        close(&buf, &expected, &format!("all_reduce {op:?}"));
        // Every rank ends with the same bits, whatever the path.
        let everyone = comm.all_gather(&buf).unwrap();
        for (r, theirs) in everyone.chunks(len).enumerate() {
            assert!(
                theirs == &buf[..],
                "{}: rank {r} differs",
                what("all_reduce")
            );
        }

        let root = j % n;
        let mut buf = all[rank].clone();
        comm.reduce(&mut buf, op, root).unwrap();
        if rank == root {
            close(&buf, &expected, &format!("reduce {op:?} to {root}"));
        }

        let cut: Vec<Vec<T>> = all.iter().map(|v| v[..block * n].to_vec()).collect();
        let full = reference(&cut, op);
        let got = comm.reduce_scatter(&cut[rank], op).unwrap();
        close(
            &got,
            &full[rank * block..(rank + 1) * block],
            &format!("reduce_scatter {op:?}"),
        );
    }
    let all = wide_inputs::<T>(salt * 100 + 50, n, len);
    for root in 0..n {
        let mut buf = all[rank].clone();
        comm.broadcast(&mut buf, root).unwrap();
        assert!(
            buf == all[root],
            "{}",
            what(&format!("broadcast from {root}"))
        );
    }
    let gathered = comm.all_gather(&all[rank]).unwrap();
    assert!(gathered == all.concat(), "{}", what("all_gather"));
}

/// [`check_large`] for every type.
fn check_large_all_types(comm: &Communicator, exact: bool) {
    check_large::<f32>(comm, 11, exact);
    check_large::<f64>(comm, 12, exact);
    check_large::<f16>(comm, 13, exact);
    check_large::<bf16>(comm, 14, exact);
    check_large::<i32>(comm, 15, exact);
    check_large::<i64>(comm, 16, exact);
    check_large::<u8>(comm, 17, exact);
}

/// The variable that picks the same-node transport (see `comm/cpu.rs`).
const TRANSPORT_ENV: &str = "MUSTER_COMM_TRANSPORT";

/// Runs test `name` of this binary again in a child process with `MUSTER_COMM_TRANSPORT` set
/// to `transport`: the environment is shared by the tests of a process, and setting it is not
/// safe while other tests run.
fn in_child_with_transport(name: &str, transport: &str) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(TRANSPORT_ENV, transport)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} with {TRANSPORT_ENV}={transport}:\n{stdout}\n{stderr}"
    );
}

fn check_all_types(local_sizes: &[u32]) {
    let job = format!(
        "all-types-{}",
        local_sizes
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("-")
    );
    with_comms(&job, local_sizes, |_, comm| {
        check_type::<f32>(&comm, 1);
        check_type::<f64>(&comm, 2);
        check_type::<f16>(&comm, 3);
        check_type::<bf16>(&comm, 4);
        check_type::<i32>(&comm, 5);
        check_type::<i64>(&comm, 6);
        check_type::<u8>(&comm, 7);
    });
}

#[test]
fn world_of_one_needs_no_network() {
    check_all_types(&[1]);
}

#[test]
fn two_ranks_every_op_and_type() {
    check_all_types(&[2]);
}

#[test]
fn three_ranks_on_two_nodes_use_tcp_and_unix_sockets() {
    check_all_types(&[2, 1]);
}

#[test]
fn four_ranks_every_op_and_type() {
    check_all_types(&[4]);
}

#[test]
fn eight_ranks_on_two_nodes() {
    check_all_types(&[4, 4]);
}

#[test]
fn cross_memory_attach_every_op_and_type() {
    // `cma` makes creating the communicator fail unless cross-memory attach is used (ranks are
    // threads here, so each reads its own process's memory: the same system call and code).
    if std::env::var(TRANSPORT_ENV).as_deref() != Ok("cma") {
        return in_child_with_transport("cross_memory_attach_every_op_and_type", "cma");
    }
    check_all_types(&[3]);
    with_comms("cma-mismatch", &[3], |_, comm| check_mismatch(&comm));
    for sizes in [&[2][..], &[3]] {
        with_comms(&format!("cma-large-{}", sizes[0]), sizes, |_, comm| {
            check_large_all_types(&comm, true);
        });
    }
}

#[test]
fn cross_memory_attach_is_refused_across_nodes() {
    if std::env::var(TRANSPORT_ENV).as_deref() != Ok("cma") {
        return in_child_with_transport("cross_memory_attach_is_refused_across_nodes", "cma");
    }
    let errors = support::with_accelerators("cma-nodes", &[1, 1], |accelerator| {
        Communicator::with_backend(&accelerator, muster::comm::BackendKind::Cpu).unwrap_err()
    });
    for error in errors {
        assert!(error.to_string().contains("several nodes"), "{error}");
    }
}

/// Like [`wide_inputs`], from xorshift (StdRng is slow in debug builds, and these are MiBs).
fn cheap_wide_inputs<T: Value>(case: u64, n: usize, len: usize) -> Vec<Vec<T>> {
    (0..n)
        .map(|rank| {
            let mut x = (case * 1000 + rank as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    T::from_word((x >> 32) as u32)
                })
                .collect()
        })
        .collect()
}

/// all_reduce (every op) and all_gather on the shared-memory path, whose results must be
/// bit-identical to the rank-order reference: one piece, several pieces with a short last one
/// (a half segment is 1 MiB), and lengths that are no multiple of a cache line.
fn check_shm_exact<T: Value>(comm: &Communicator, salt: u64) {
    let (rank, n) = (comm.rank(), comm.world_size());
    let size = std::mem::size_of::<T>();
    for (i, len) in [(64 << 10) / size + 5, (5 << 18) / size + 17]
        .into_iter()
        .enumerate()
    {
        let what = |op: &str| format!("{op} of {len} {} on {n}", std::any::type_name::<T>());
        for (j, &op) in OPS.iter().enumerate() {
            let all = cheap_wide_inputs::<T>(salt * 100 + 10 * i as u64 + j as u64, n, len);
            let expected = reference(&all, op);
            let mut buf = all[rank].clone();
            comm.all_reduce(&mut buf, op).unwrap();
            assert!(
                buf == expected,
                "{}: not bit-identical",
                what(&format!("{op:?}"))
            );
        }
        let all = cheap_wide_inputs::<T>(salt * 100 + 10 * i as u64 + 9, n, len);
        let gathered = comm.all_gather(&all[rank]).unwrap();
        assert!(gathered == all.concat(), "{}", what("all_gather"));
    }
}

/// FNV-1a, as the CPU backend hashes job ids into the names of its shared-memory segments
/// (`muster-<job hash>-...` in `/dev/shm`).
fn job_hash(job: &str) -> u64 {
    job.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Fails if a shared-memory segment of `job` is left in `/dev/shm` (or the temporary
/// directory where there is none).
fn assert_no_segments_left(job: &str) {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let prefix = format!("muster-{:016x}-", job_hash(job));
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| name.starts_with(&prefix))
        .collect();
    assert!(
        left.is_empty(),
        "{job}: left in {}: {left:?}",
        dir.display()
    );
}

#[test]
fn shared_memory_every_op_and_type() {
    // `shm` makes creating the communicator fail unless the shared-memory arena is set up.
    if std::env::var(TRANSPORT_ENV).as_deref() != Ok("shm") {
        return in_child_with_transport("shared_memory_every_op_and_type", "shm");
    }
    check_all_types(&[3]);
    assert_no_segments_left("all-types-3");
    with_comms("shm-mismatch", &[3], |_, comm| check_mismatch(&comm));
    for n in [2, 3, 4] {
        let job = format!("shm-exact-{n}");
        with_comms(&job, &[n], move |_, comm| {
            check_shm_exact::<f32>(&comm, 21);
            check_shm_exact::<f64>(&comm, 22);
            check_shm_exact::<f16>(&comm, 23);
            check_shm_exact::<bf16>(&comm, 24);
            check_shm_exact::<i32>(&comm, 25);
            check_shm_exact::<i64>(&comm, 26);
            check_shm_exact::<u8>(&comm, 27);
            // The other collectives (cross-memory attach or the rings) between shared-memory
            // ones, on the same communicator.
            if n == 3 {
                check_large_all_types(&comm, false);
            }
        });
        assert_no_segments_left(&job);
    }
}

#[test]
fn shared_memory_is_refused_across_nodes() {
    if std::env::var(TRANSPORT_ENV).as_deref() != Ok("shm") {
        return in_child_with_transport("shared_memory_is_refused_across_nodes", "shm");
    }
    let errors = support::with_accelerators("shm-nodes", &[2, 1], |accelerator| {
        Communicator::with_backend(&accelerator, muster::comm::BackendKind::Cpu).unwrap_err()
    });
    for error in errors {
        assert!(error.to_string().contains("several nodes"), "{error}");
    }
    assert_no_segments_left("shm-nodes");
}

#[test]
fn shared_memory_segments_are_gone_once_set_up() {
    // The default transport on one node: the names are removed right after setup, while the
    // communicators live, and nothing is left after they are dropped.
    let job = "shm-cleanup";
    with_comms(job, &[4], |_, comm| {
        let mut buf = vec![comm.rank() as f32; 1 << 20];
        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        assert!(buf.iter().all(|&x| x == 6.0));
        comm.barrier().unwrap();
        assert_no_segments_left(job);
    });
    assert_no_segments_left(job);
}

#[test]
fn unix_sockets_on_one_node_every_op_and_type() {
    // The socket rings between ranks of one node, as when cross-memory attach is not allowed.
    if std::env::var(TRANSPORT_ENV).as_deref() != Ok("unix") {
        return in_child_with_transport("unix_sockets_on_one_node_every_op_and_type", "unix");
    }
    check_all_types(&[3]);
    with_comms("unix-large", &[3], |_, comm| {
        check_large_all_types(&comm, false)
    });
}

#[test]
fn large_all_reduce_of_256_mib() {
    // 2 ranks x 128 MiB of f32, then 4 ranks x 16 MiB of bf16.
    let times = with_comms("large", &[2], |_, comm| {
        let rank = comm.rank();
        let len = 32 << 20;
        let mut buf: Vec<f32> = (0..len).map(|i| (i % 1024) as f32 + rank as f32).collect();
        let start = Instant::now();
        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        let took = start.elapsed();
        assert!(
            buf.iter()
                .enumerate()
                .all(|(i, &x)| x == 2.0 * (i % 1024) as f32 + 1.0),
            "wrong sum"
        );
        took
    });
    eprintln!("2 x 128 MiB f32 all_reduce took {:?}", times[0]);
    with_comms("large-bf16", &[4], |_, comm| {
        let rank = comm.rank();
        let len = 8 << 20;
        let mut buf: Vec<bf16> = (0..len)
            .map(|i| bf16::from_f32((i % 7) as f32 + rank as f32))
            .collect();
        comm.all_reduce(&mut buf, ReduceOp::Max).unwrap();
        assert!(
            buf.iter()
                .enumerate()
                .all(|(i, &x)| x.to_f32() == (i % 7) as f32 + 3.0)
        );
    });
}

#[test]
fn shape_mismatch_names_every_rank_and_leaves_the_communicator_usable() {
    with_comms("mismatch", &[2, 1], |_, comm| check_mismatch(&comm));
}

/// Three ranks that disagree on shapes, on the small path and the large one.
fn check_mismatch(comm: &Communicator) {
    let rank = comm.rank();
    // Rank 1 disagrees on the length, on the small path and on the large one.
    for (mine, odd) in [(4usize, 5usize), (100_000, 7)] {
        let mut buf = vec![1.0f32; if rank == 1 { odd } else { mine }];
        let error = comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
        let Error::ShapeMismatch { op, shapes } = &error else {
            panic!("{error}");
        };
        assert_eq!(op, "all_reduce");
        let expected: Vec<(u32, String)> = (0..3)
            .map(|r| (r, format!("{} f32", if r == 1 { odd } else { mine })))
            .collect();
        assert_eq!(shapes, &expected, "{error}");
    }
    // A dtype that differs.
    let error = if rank == 2 {
        comm.broadcast(&mut [0f64; 3], 0).unwrap_err()
    } else {
        comm.broadcast(&mut [0f32; 3], 0).unwrap_err()
    };
    assert!(error.to_string().contains("rank 2: 3 f64"), "{error}");
    // Still in step afterwards.
    let mut buf = vec![rank as i32; 10];
    comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    assert_eq!(buf, vec![3; 10]);
    let mut buf = vec![rank as i32; 100_000];
    comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    assert_eq!(buf, vec![3; 100_000]);
}

#[test]
fn argument_errors_come_before_any_communication() {
    with_comms("arguments", &[2], |_, comm| {
        let rank = comm.rank();
        let check = |error: Error, needle: &str| {
            assert!(
                matches!(error, Error::Backend { backend: "cpu", .. }),
                "{error}"
            );
            assert!(error.to_string().contains(needle), "{error}");
        };
        check(comm.broadcast(&mut [1u8], 2).unwrap_err(), "root 2");
        check(
            comm.reduce(&mut [1u8], ReduceOp::Sum, 5).unwrap_err(),
            "root 5",
        );
        check(comm.gather(&[1u8], 9).unwrap_err(), "root 9");
        check(comm.send(&[1u8], rank).unwrap_err(), "this rank itself");
        check(comm.recv(&mut [1u8], 3).unwrap_err(), "peer 3");
        check(
            comm.reduce_scatter(&[1u8; 3], ReduceOp::Sum).unwrap_err(),
            "3 elements",
        );
        let mut buf = [1u8; 3];
        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        assert_eq!(buf, [2; 3]);
    });
}

#[test]
fn a_lost_peer_is_named_instead_of_hanging() {
    let results = with_comms("lost", &[3], |accelerator, comm| {
        let rank = comm.rank();
        let mut buf = vec![1.0f32; 1 << 20];
        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        if rank == 2 {
            // Gone without a word (its sockets close).
            drop(comm);
            accelerator.wait_for_everyone().ok();
            return None;
        }
        let start = Instant::now();
        let error = loop {
            if let Err(e) = comm.all_reduce(&mut buf, ReduceOp::Sum) {
                break e;
            }
        };
        accelerator.wait_for_everyone().ok();
        // Later calls fail at once with the same cause.
        let again = comm.barrier().unwrap_err();
        Some((error, start.elapsed(), again))
    });
    for (rank, result) in results.into_iter().enumerate().take(2) {
        let (error, took, again) = result.unwrap();
        let Error::PeerLost { rank: lost, op, .. } = &error else {
            panic!("rank {rank}: {error}");
        };
        assert_eq!(*lost, 2, "rank {rank}: {error}");
        assert!(op.starts_with("all_reduce of 1048576 f32"), "{op}");
        assert!(took.as_secs() < 5, "{took:?}");
        assert!(again.to_string().contains("rank 2"), "{again}");
    }
}

#[test]
fn new_picks_a_working_backend() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Communicator>();
    // The automatic choice (NCCL only where it can run; `MUSTER_COMM_BACKEND` is not set here,
    // since tests share the process environment).
    let accelerator = Accelerator::new(RankInfo::single_process()).unwrap();
    let comm = Communicator::new(&accelerator).unwrap();
    assert_eq!(comm.world_size(), 1);
    let mut buf = [3i64, 4];
    comm.all_reduce(&mut buf, ReduceOp::Avg).unwrap();
    assert_eq!(buf, [3, 4]);
}

#[test]
#[ignore = "a measurement, not a test"]
fn latency_probe() {
    for n in [2u32, 4] {
        let times = with_comms(&format!("probe{n}"), &[n], |_, comm| {
            let mut buf = [1.0f32];
            for _ in 0..100 {
                comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            }
            let start = Instant::now();
            for _ in 0..2000 {
                comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            }
            start.elapsed() / 2000
        });
        eprintln!("{n} ranks: 4-byte all_reduce {:?}", times[0]);
    }
}
