//! Single-process mode (no `MUSTER_COORDINATOR`): every call succeeds at once without any
//! network, and whatever could only come from another process fails instead of hanging.
#![allow(clippy::unwrap_used)]

use std::{cell::Cell, time::Duration};

use muster::{Accelerator, Error, RankInfo};

fn single() -> Accelerator {
    Accelerator::new(RankInfo::single_process()).unwrap()
}

#[test]
fn ranks_are_those_of_one_process() {
    let accelerator = single();
    assert!(!accelerator.is_distributed());
    assert!(accelerator.session().is_none());
    assert_eq!(
        (
            accelerator.process_index(),
            accelerator.num_processes(),
            accelerator.local_process_index(),
            accelerator.local_num_processes(),
            accelerator.node_rank(),
            accelerator.num_nodes(),
        ),
        (0, 1, 0, 1, 0, 1)
    );
    assert!(accelerator.is_main_process());
    assert!(accelerator.is_local_main_process());
    assert!(accelerator.is_last_process());
    assert_eq!(
        (accelerator.generation(), accelerator.restart_count()),
        (1, 0)
    );
    assert_eq!(accelerator.job_id(), "local");
}

#[test]
fn barriers_and_main_first_run_everything_locally() {
    let accelerator = single();
    for _ in 0..3 {
        accelerator.wait_for_everyone().unwrap();
    }
    accelerator.wait_for_everyone_named("x").unwrap();
    accelerator
        .wait_for_everyone_timeout(Duration::from_millis(1))
        .unwrap();
    accelerator.wait_for_local().unwrap();

    let calls = Cell::new(0);
    let run = || {
        calls.set(calls.get() + 1);
        calls.get()
    };
    assert_eq!(accelerator.main_process_first(run).unwrap(), 1);
    assert_eq!(accelerator.local_main_process_first(run).unwrap(), 2);
    assert_eq!(accelerator.main_process_first_share(run).unwrap(), 3);
    assert_eq!(accelerator.local_main_process_first_share(run).unwrap(), 4);

    assert_eq!(accelerator.on_main_process(|| 1), Some(1));
    assert_eq!(accelerator.on_local_main_process(|| 2), Some(2));
    assert_eq!(accelerator.on_last_process(|| 3), Some(3));
    assert_eq!(accelerator.on_process(0, || 4), Some(4));
    assert_eq!(accelerator.on_process(1, || 5), None);
    assert_eq!(accelerator.on_local_process(1, || 6), None);
    muster::print!(accelerator, "printed once per machine: {}", 42);
    accelerator.finish().unwrap();
}

#[test]
fn unique_ids_are_kept_in_process_and_missing_ones_fail_at_once() {
    let accelerator = single();
    let error = accelerator.fetch_nccl_unique_id("world").unwrap_err();
    assert!(matches!(error, Error::NotFound { .. }), "{error:?}");
    assert!(error.to_string().contains("'world'"), "{error}");
    accelerator
        .publish_nccl_unique_id("world", &[1; 128])
        .unwrap();
    accelerator
        .publish_nccl_unique_id("world", &[1; 128])
        .unwrap();
    assert_eq!(accelerator.fetch_nccl_unique_id("world").unwrap(), [1; 128]);
    let error = accelerator
        .publish_nccl_unique_id("world", &[2; 128])
        .unwrap_err();
    assert!(matches!(&error, Error::Rpc(s) if s.code() == tonic::Code::AlreadyExists));
}

#[test]
fn the_key_value_store_is_an_in_memory_map() {
    let accelerator = single();
    let kv = accelerator.kv();
    assert_eq!(kv.get("a").unwrap(), None);
    let error = kv.get_wait("a", Duration::from_secs(3600)).unwrap_err();
    assert!(matches!(error, Error::NotFound { .. }), "{error:?}");
    kv.set("a", "1").unwrap();
    assert_eq!(kv.get("a").unwrap(), Some(b"1".to_vec()));
    assert_eq!(kv.get_wait("a", Duration::ZERO).unwrap(), b"1");
    let keys = ["a".to_owned(), "a".to_owned()];
    assert_eq!(
        kv.get_wait_many(&keys, Duration::ZERO).unwrap(),
        [b"1", b"1"]
    );
    let error = kv
        .get_wait_many(&["a".to_owned(), "b".to_owned()], Duration::from_secs(3600))
        .unwrap_err();
    assert!(
        matches!(&error, Error::NotFound { what } if what.contains("'b'")),
        "{error:?}"
    );
    assert_eq!(kv.add("a", 4).unwrap(), 5);
    assert_eq!(kv.add("n", -1).unwrap(), -1);
    kv.set("text", "abc").unwrap();
    assert!(kv.add("text", 1).is_err());
    let cas = kv.compare_and_set("c", None, "x").unwrap();
    assert!(cas.swapped && cas.current.as_deref() == Some(&b"x"[..]));
    let cas = kv.compare_and_set("c", None, "y").unwrap();
    assert!(!cas.swapped && cas.current.as_deref() == Some(&b"x"[..]));
    let cas = kv.compare_and_set("c", Some(b"x"), "z").unwrap();
    assert!(cas.swapped && cas.current.as_deref() == Some(&b"z"[..]));
    assert!(kv.delete("c").unwrap());
    assert!(!kv.delete("c").unwrap());
    kv.set("p/2", "b").unwrap();
    kv.set("p/1", "a").unwrap();
    kv.set("q", "c").unwrap();
    assert_eq!(
        kv.list("p/").unwrap(),
        [
            ("p/1".to_owned(), b"a".to_vec()),
            ("p/2".to_owned(), b"b".to_vec())
        ]
    );
}

#[test]
fn an_invalid_rank_info_is_a_config_error() {
    let info = RankInfo {
        rank: 3,
        ..RankInfo::single_process()
    };
    let error = Accelerator::new(info).unwrap_err();
    assert!(
        matches!(&error, Error::Config(text) if text.contains("MUSTER_RANK=3")),
        "{error:?}"
    );
}

#[tokio::test]
async fn a_distributed_accelerator_is_refused_inside_async_code() {
    let info = RankInfo {
        coordinator: Some("127.0.0.1:1".to_owned()),
        ..RankInfo::single_process()
    };
    let error = Accelerator::new(info).unwrap_err();
    assert!(
        matches!(&error, Error::Usage(text) if text.contains("Session")),
        "{error:?}"
    );
    // Single-process mode needs no runtime, so it works anywhere.
    single().wait_for_everyone().unwrap();
}
