//! The training utilities over a real communicator (ranks as threads against an in-process
//! coordinator): bucketed gradient averaging in f32, bf16 and f16, the global gradient norm of
//! sharded gradients, and the loss scaler's "any rank overflowed" decision.
#![allow(clippy::unwrap_used)]

mod support;

use muster::train::{
    CommPrecision, GradientSync, LossScaler, clip_grad_norm, clip_grad_norm_across,
};
use support::with_comms;

/// Rank r's gradient buffers: three tensors of different lengths, values depending on r.
fn grads(rank: usize) -> Vec<Vec<f32>> {
    [5usize, 1, 300]
        .iter()
        .enumerate()
        .map(|(t, &n)| {
            (0..n)
                .map(|i| ((rank * 7 + t * 3 + i) % 11) as f32 * 0.25 - 1.0)
                .collect()
        })
        .collect()
}

#[test]
fn gradients_are_averaged_in_buckets_in_every_precision() {
    let world = 3;
    let expected: Vec<Vec<f32>> = {
        let all: Vec<_> = (0..world).map(grads).collect();
        (0..all[0].len())
            .map(|t| {
                (0..all[0][t].len())
                    .map(|i| all.iter().map(|g| g[t][i]).sum::<f32>() / world as f32)
                    .collect()
            })
            .collect()
    };
    for (precision, tolerance) in [
        (CommPrecision::F32, 1e-6),
        (CommPrecision::BF16, 1e-2),
        (CommPrecision::F16, 1e-3),
    ] {
        // Buckets of 64 bytes: the first two tensors share one, the large one is alone.
        let sync = GradientSync::new().bucket_bytes(64).precision(precision);
        assert_eq!(sync.plan(&[5, 1, 300]), vec![0..2, 2..3]);
        let results = with_comms("avg", &[2, 1], move |acc, comm| {
            let mut g = grads(acc.process_index());
            let mut views: Vec<&mut [f32]> = g.iter_mut().map(Vec::as_mut_slice).collect();
            sync.average(&comm, &mut views).unwrap();
            g
        });
        for (rank, got) in results.iter().enumerate() {
            for (t, (got, want)) in got.iter().zip(&expected).enumerate() {
                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                    assert!(
                        (g - w).abs() <= tolerance,
                        "{precision:?} rank {rank} tensor {t}[{i}]: {g} vs {w}"
                    );
                }
            }
        }
        // Every rank holds the same averaged values, bit for bit.
        assert!(results.iter().all(|r| r == &results[0]), "{precision:?}");
    }
}

#[test]
fn the_norm_of_sharded_gradients_is_global() {
    // The gradient [3, 4, 12] split over three ranks has norm 13.
    let results = with_comms("norm", &[3], |acc, comm| {
        let mut part = [[3.0f32], [4.0], [12.0]][acc.process_index()];
        let norm = clip_grad_norm_across(&comm, &mut [&mut part], 6.5).unwrap();
        (norm, part[0])
    });
    for (rank, (norm, value)) in results.iter().enumerate() {
        assert!((norm - 13.0).abs() < 1e-5, "rank {rank}: {norm}");
        // Every part was halved by the same factor.
        let want = [1.5f32, 2.0, 6.0][rank];
        assert!((value - want).abs() < 1e-4, "rank {rank}: {value}");
    }
    // Synchronised gradients need no communication: the local norm is the global one.
    let mut g = [3.0f32, 4.0];
    let norm = clip_grad_norm(&mut [&mut g], 10.0, Ok::<_, muster::Error>).unwrap();
    assert!((norm - 5.0).abs() < 1e-6);
}

#[test]
fn one_ranks_overflow_skips_the_step_on_every_rank() {
    let results = with_comms("scaler", &[2, 2], |acc, comm| {
        let mut scaler = LossScaler::new(1024.0, 2.0, 0.5, 1);
        let overflow = if acc.process_index() == 2 {
            f32::INFINITY
        } else {
            1.0
        };
        let skipped = scaler.update_across(&comm, &[&[0.5, overflow]]).unwrap();
        let after_overflow = scaler.scale();
        let clean = scaler.update_across(&comm, &[&[0.5, 1.0]]).unwrap();
        (skipped, after_overflow, clean, scaler.scale())
    });
    for (rank, result) in results.iter().enumerate() {
        assert_eq!(*result, (true, 512.0, false, 1024.0), "rank {rank}");
    }
}
