//! Names that could disguise themselves in the ops output are refused (issue 14, finding 7):
//! control characters and Unicode's bidirectional formatting characters (U+202E "right-to-left
//! override" and its kin) in job ids, node ids, keys, barrier names and shared value names get
//! INVALID_ARGUMENT naming the field and the character, escaped, and change nothing.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use muster_proto::v1 as pb;
use pb::key_value_client::KeyValueClient;
use tonic::Code;

/// Every character the coordinator must refuse in a name, with its escaped form.
const REFUSED: &[(char, &str)] = &[
    ('\u{202A}', "\\u{202a}"),
    ('\u{202B}', "\\u{202b}"),
    ('\u{202C}', "\\u{202c}"),
    ('\u{202D}', "\\u{202d}"),
    ('\u{202E}', "\\u{202e}"),
    ('\u{2066}', "\\u{2066}"),
    ('\u{2067}', "\\u{2067}"),
    ('\u{2068}', "\\u{2068}"),
    ('\u{2069}', "\\u{2069}"),
    ('\u{200E}', "\\u{200e}"),
    ('\u{200F}', "\\u{200f}"),
    ('\u{061C}', "\\u{61c}"),
    ('\u{0007}', "\\u{7}"),
    ('\n', "\\n"),
];

/// Asserts that `message` names `field` and shows `escaped`, and carries no raw control or
/// bidirectional character itself (so that it cannot spoof a terminal either).
fn check_message(message: &str, field: &str, escaped: &str) {
    assert!(message.contains(field), "{field}: {message}");
    assert!(message.contains(escaped), "{field} {escaped}: {message}");
    assert!(
        !message
            .chars()
            .any(|c| c.is_control() || muster_core::model::is_bidi_control(c)),
        "{message:?}"
    );
}

#[tokio::test]
async fn job_and_node_ids_with_bidi_or_control_characters_are_refused() {
    let server = common::start_default().await;
    for &(c, escaped) in REFUSED {
        let spoof = format!("train{c}lave");
        let err = common::spawn_join(&server.channel, common::join_req(&spoof, "n0", 1, 1, 1))
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        check_message(err.message(), "job_id", escaped);
        let err = common::spawn_join(&server.channel, common::join_req("ok", &spoof, 1, 1, 1))
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        check_message(err.message(), "node_id", escaped);
    }
    // Nothing was created.
    let jobs = pb::ops_client::OpsClient::new(server.channel.clone())
        .list_jobs(pb::ListJobsRequest {})
        .await
        .unwrap()
        .into_inner()
        .jobs;
    assert!(jobs.is_empty(), "{jobs:?}");
}

#[tokio::test]
async fn keys_barrier_names_and_shared_value_names_with_bidi_characters_are_refused() {
    let server = common::start_default().await;
    let answers = common::form(&server.channel, "names", 1, 1).await;
    let generation = answers[0].generation;
    let mut kv = KeyValueClient::new(server.channel.clone());
    let mut rank = common::Raw::attach(&server.channel, "names", generation, 0)
        .await
        .unwrap();
    for &(c, escaped) in REFUSED {
        let spoof = format!("config{c}gpj.exe");
        let err = kv
            .set(pb::SetRequest {
                job_id: "names".into(),
                key: spoof.clone(),
                value: b"v".to_vec(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        check_message(err.message(), "key", escaped);
        let err = pb::shared_values_client::SharedValuesClient::new(server.channel.clone())
            .publish(pb::PublishValueRequest {
                job_id: "names".into(),
                generation,
                rank: 0,
                name: spoof.clone(),
                value: b"v".to_vec(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        check_message(err.message(), "name", escaped);
        // Always seq 1: a refused entry does not advance the rank's barrier sequence.
        rank.enter_seq(pb::BarrierScope::Global, 1, &spoof, 0).await;
        let err = rank.result().await.expect("a barrier with a spoofing name");
        check_message(&err.message, "barrier name", escaped);
    }
    // Nothing was stored, and the session still works with a plain name.
    let items = kv
        .list(pb::ListRequest {
            job_id: "names".into(),
            prefix: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .items;
    assert!(items.is_empty(), "{items:?}");
    assert!(rank.barrier("plain").await.is_none());
}
