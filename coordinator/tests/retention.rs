//! Bounds on what all jobs together hold (issue 14, finding 6), on a real server: stored bytes
//! over all jobs (`max_total_bytes`), the number of jobs (`max_jobs`), and the expiry of jobs
//! in a final state after `finished_job_ttl`, after which calls naming the job hear that it
//! expired, and when.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use muster_coordinator::Config;
use muster_proto::v1 as pb;
use pb::key_value_client::KeyValueClient;
use pb::ops_client::OpsClient;
use std::time::Duration;
use tonic::transport::Channel;
use tonic::{Code, Status};

fn set(job: &str, key: &str, len: usize) -> pb::SetRequest {
    pb::SetRequest {
        job_id: job.into(),
        key: key.into(),
        value: vec![7; len],
        ..Default::default()
    }
}

async fn describe(ch: &Channel, job: &str) -> Result<pb::DescribeJobResponse, Status> {
    OpsClient::new(ch.clone())
        .describe_job(pb::DescribeJobRequest {
            job_id: job.into(),
            ..Default::default()
        })
        .await
        .map(tonic::Response::into_inner)
}

/// Waits (at most `within`) until DescribeJob of `job` fails, and returns that status.
async fn gone(ch: &Channel, job: &str, within: Duration) -> Status {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Err(status) = describe(ch, job).await {
            return status;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "job '{job}' still there after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Forms one-node, one-rank job `job` and attaches its rank.
async fn running(ch: &Channel, job: &str) -> common::Raw {
    let answer = common::form(ch, job, 1, 1).await;
    common::Raw::attach(ch, job, answer[0].generation, 0)
        .await
        .unwrap()
}

#[tokio::test]
async fn jobs_in_a_final_state_expire_and_say_so() {
    let ttl = Duration::from_millis(400);
    let server = common::start(Config {
        finished_job_ttl: ttl,
        ..Config::default()
    })
    .await;
    let ch = &server.channel;
    let mut kv = KeyValueClient::new(ch.clone());
    // Finished: its one rank leaves. Cancelled: an operator cancels it. Running: stays.
    let done = running(ch, "done").await;
    kv.set(set("done", "k", 100)).await.unwrap();
    done.leave().await;
    let state = describe(ch, "done").await.unwrap().summary.unwrap().state;
    assert_eq!(state, pb::RoundState::Finished as i32);
    let _cancelled_rank = running(ch, "cancelled").await;
    OpsClient::new(ch.clone())
        .cancel_job(pb::CancelJobRequest {
            job_id: "cancelled".into(),
            reason: String::new(),
        })
        .await
        .unwrap();
    let alive = running(ch, "alive").await;
    let finished_at = tokio::time::Instant::now();

    let status = gone(ch, "done", Duration::from_secs(10)).await;
    assert!(finished_at.elapsed() >= ttl, "expired before its TTL");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    let m = status.message();
    assert!(
        m.contains("job 'done' expired at 20")
            && m.contains("it was finished at")
            && m.contains("--finished-job-ttl-ms"),
        "{m}"
    );
    let status = gone(ch, "cancelled", Duration::from_secs(10)).await;
    assert!(
        status.message().contains("it was cancelled at"),
        "{status:?}"
    );
    // Its key-value data went with it: a call naming it hears that it expired.
    let err = kv
        .get(pb::GetRequest {
            job_id: "done".into(),
            key: "k".into(),
            wait_ms: 0,
        })
        .await
        .unwrap_err();
    assert!(err.message().contains("job 'done' expired"), "{err:?}");
    // A running job is kept, however long it runs.
    tokio::time::sleep(ttl * 2).await;
    let jobs = OpsClient::new(ch.clone())
        .list_jobs(pb::ListJobsRequest {})
        .await
        .unwrap()
        .into_inner()
        .jobs;
    let ids: Vec<&str> = jobs.iter().map(|j| j.job_id.as_str()).collect();
    assert_eq!(ids, ["alive"]);
    alive.leave().await;
    // The id can be used again: a new job, with none of the old one's data.
    let again = running(ch, "done").await;
    let err = kv
        .get(pb::GetRequest {
            job_id: "done".into(),
            key: "k".into(),
            wait_ms: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert!(!err.message().contains("expired"), "{err:?}");
    again.leave().await;
}

#[tokio::test]
async fn stored_bytes_over_all_jobs_are_bounded() {
    let server = common::start(Config {
        max_value_bytes: 40_000,
        max_job_bytes: 64 << 10,
        max_total_bytes: 100_000,
        finished_job_ttl: Duration::from_millis(300),
        ..Config::default()
    })
    .await;
    let ch = &server.channel;
    let mut kv = KeyValueClient::new(ch.clone());
    let a = running(ch, "a").await;
    let _b = running(ch, "b").await;
    let _c = running(ch, "c").await;
    kv.set(set("a", "x", 40_000)).await.unwrap();
    kv.set(set("b", "x", 40_000)).await.unwrap();
    // Each job is far below its own limit, but together they would pass 100 000 bytes.
    let err = kv.set(set("c", "x", 40_000)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let m = err.message();
    assert!(
        m.contains("job 'c'")
            && m.contains("the limit is 100000")
            && m.contains("max_total_bytes")
            && m.contains("--max-total-bytes"),
        "{m}"
    );
    // Nothing was written.
    let missing = kv
        .get(pb::GetRequest {
            job_id: "c".into(),
            key: "x".into(),
            wait_ms: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    // Published values count too.
    let err = pb::shared_values_client::SharedValuesClient::new(ch.clone())
        .publish(pb::PublishValueRequest {
            job_id: "c".into(),
            generation: 1,
            rank: 0,
            name: "weights".into(),
            value: vec![1; 30_000],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("publishing shared 'weights'"),
        "{err:?}"
    );
    // Overwriting with a smaller value, or deleting, gives bytes back.
    kv.set(set("b", "x", 10_000)).await.unwrap();
    kv.set(set("c", "x", 25_000)).await.unwrap();
    // So does a job's expiry: once finished job 'a' expires, its 40 000 bytes are free.
    let err = kv.set(set("c", "y", 30_000)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    a.leave().await;
    gone(ch, "a", Duration::from_secs(10)).await;
    kv.set(set("c", "y", 30_000)).await.unwrap();
}

#[tokio::test]
async fn the_number_of_jobs_is_bounded() {
    let server = common::start(Config {
        max_jobs: 3,
        finished_job_ttl: Duration::from_millis(300),
        ..Config::default()
    })
    .await;
    let ch = &server.channel;
    let first = running(ch, "j0").await;
    // Kept attached: a dropped session would fail its job, which would then expire.
    let _others = [running(ch, "j1").await, running(ch, "j2").await];
    let err = common::spawn_join(ch, common::join_req("j3", "n0", 1, 1, 1))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let m = err.message();
    assert!(
        m.contains("job 'j3'")
            && m.contains("holds 3 jobs; the limit is 3")
            && m.contains("--max-jobs"),
        "{m}"
    );
    // Once a job is over and expired, a new one fits.
    first.leave().await;
    gone(ch, "j0", Duration::from_secs(10)).await;
    running(ch, "j3").await;
}

#[tokio::test]
async fn an_abandoned_round_expires() {
    let ttl = Duration::from_millis(300);
    let server = common::start(Config {
        finished_job_ttl: ttl,
        ..Config::default()
    })
    .await;
    let ch = &server.channel;
    // Its only joiner gives up (its join timeout passes with 1 of 2 nodes).
    let mut lonely = common::join_req("lonely", "n0", 1, 2, 2);
    lonely.config.as_mut().unwrap().join_timeout_ms = 100;
    let err = common::spawn_join(ch, lonely).await.unwrap().unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    let summary = describe(ch, "lonely").await.unwrap().summary.unwrap();
    assert_eq!(
        (summary.state, summary.nodes_waiting),
        (pb::RoundState::Open as i32, 0)
    );
    // A round a node waits in is not abandoned, however long it waits.
    let waiting = common::spawn_join(ch, common::join_req("patient", "n0", 1, 2, 2));
    let status = gone(ch, "lonely", Duration::from_secs(10)).await;
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(status.message().contains("it was abandoned"), "{status:?}");
    tokio::time::sleep(ttl * 2).await;
    describe(ch, "patient").await.unwrap();
    assert!(!waiting.is_finished());
    waiting.abort();
}
