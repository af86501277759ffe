//! A coordinator leader that gets SIGTERM resigns: it revokes its election lease before it
//! exits, so that a standby leads at once instead of after the lease TTL; and a stuck etcd
//! does not hold the exit beyond the drain's 2 s. Real etcd and `muster-coordinator`
//! processes (`muster_tests::replicas`); skips, printing why, without etcd.
#![allow(clippy::unwrap_used, missing_docs)]

use muster_tests::etcd::Etcd;
use muster_tests::replicas::Replicas;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
use nix::unistd::Pid;
use std::time::{Duration, Instant};

/// Long, so that a takeover well within it can only come from a resignation.
const TTL: Duration = Duration::from_secs(10);
/// How soon after the leader's SIGTERM a standby must lead.
const TAKEOVER: Duration = Duration::from_secs(3);
/// How soon after SIGTERM a leader must have exited, also with etcd stuck (the 2 s drain and
/// some slack for a loaded machine).
const EXIT: Duration = Duration::from_secs(3);

/// One test at a time: each runs etcd and two coordinators against a deadline.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn pid(p: u32) -> Pid {
    Pid::from_raw(i32::try_from(p).unwrap())
}

/// Waits up to `limit` for process `p` (a child of this test) to exit, without reaping it
/// (the `Replicas` owning it reaps it on drop); returns its status and how long it took.
fn wait_exit(p: u32, limit: Duration) -> Option<(WaitStatus, Duration)> {
    let t = Instant::now();
    loop {
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT | WaitPidFlag::WNOHANG;
        match waitid(Id::Pid(pid(p)), flags) {
            Ok(WaitStatus::StillAlive) => {}
            Ok(status) => return Some((status, t.elapsed())),
            Err(e) => panic!("waitid({p}): {e}"),
        }
        if t.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_leader_resigns_and_a_standby_leads_at_once() {
    let _serial = SERIAL.lock().await;
    let Some(etcd) = Etcd::start(1) else { return };
    let replicas = Replicas::start(&etcd, 2, TTL, &[]);
    let leader = replicas.wait_leader(Duration::from_secs(30), &[]).await;
    let leader_pid = replicas.pid(leader);

    let t = Instant::now();
    kill(pid(leader_pid), Signal::SIGTERM).unwrap();
    let standby = replicas.wait_leader(TAKEOVER, &[leader]).await;
    let takeover = t.elapsed();
    eprintln!("SIGTERM to the leader -> replica {standby} leads: {takeover:?} (lease TTL {TTL:?})");
    assert!(
        takeover < TAKEOVER,
        "the standby led {takeover:?} after the leader's SIGTERM\n{}",
        replicas.logs()
    );

    let exited = wait_exit(leader_pid, EXIT);
    let logs = replicas.logs();
    let Some((status, took)) = exited else {
        panic!("the old leader still runs {EXIT:?} after SIGTERM\n{logs}");
    };
    eprintln!("old leader exited within {took:?} of the takeover: {status:?}");
    assert!(
        matches!(status, WaitStatus::Exited(_, 0)),
        "old leader: {status:?}\n{logs}"
    );
    assert!(
        logs.contains("resigned: the leader key is released"),
        "the old leader did not log its resignation\n{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_leader_exits_in_time_when_etcd_is_stuck() {
    let _serial = SERIAL.lock().await;
    let Some(etcd) = Etcd::start(1) else { return };
    let replicas = Replicas::start(&etcd, 1, TTL, &[]);
    let leader = replicas.wait_leader(Duration::from_secs(30), &[]).await;
    let leader_pid = replicas.pid(leader);

    // etcd answers nothing from now on: the resignation cannot reach it.
    let etcd_pid = pid(etcd.pid(0));
    kill(etcd_pid, Signal::SIGSTOP).unwrap();
    kill(pid(leader_pid), Signal::SIGTERM).unwrap();
    let exited = wait_exit(leader_pid, EXIT);
    kill(etcd_pid, Signal::SIGCONT).unwrap();
    let logs = replicas.logs();
    let Some((status, took)) = exited else {
        panic!("the leader still runs {EXIT:?} after SIGTERM with etcd stopped\n{logs}");
    };
    eprintln!("SIGTERM to exit with etcd stopped: {took:?} ({status:?})");
    assert!(
        matches!(status, WaitStatus::Exited(_, 0)),
        "leader: {status:?}\n{logs}"
    );
}
