//! Job tokens: the credential an agent derives for its workers (`MUSTER_TOKEN`) and the
//! coordinator verifies, in one place so that minting and checking cannot drift apart.
//!
//! A job token is `mj1.<hex job id>.<hex HMAC-SHA256(cluster token, context ‖ job id)>`. It is
//! derived, not stored: nothing to persist, replicate or fail over, and any replica verifies
//! any job's token. Verification is constant-time (`hmac`'s `verify_slice`).

use hmac::{Hmac, Mac};
use muster_proto::security::JOB_TOKEN_PREFIX;
use sha2::Sha256;

/// What a job token's MAC covers besides the job id, so that the cluster token's MAC of some
/// other message can never pass for a job token.
const CONTEXT: &[u8] = b"muster job credential v1\0";

/// The job token for `job` under `cluster_token`, as an agent hands it to its workers.
pub fn mint(cluster_token: &str, job: &str) -> String {
    let mac = mac(cluster_token, job).finalize().into_bytes();
    format!(
        "{JOB_TOKEN_PREFIX}{}.{}",
        hex::encode(job.as_bytes()),
        hex::encode(mac)
    )
}

/// Whether `token` is meant as a job token (has the job-token prefix), valid or not: such a
/// token is never compared with the cluster token.
pub fn is_job_token(token: &str) -> bool {
    token.starts_with(JOB_TOKEN_PREFIX)
}

/// The job `token` is for, if it is a job token whose MAC under `cluster_token` is right.
pub fn verify(cluster_token: &str, token: &str) -> Option<String> {
    let rest = token.strip_prefix(JOB_TOKEN_PREFIX)?;
    let (job_hex, mac_hex) = rest.split_once('.')?;
    let job = String::from_utf8(hex::decode(job_hex).ok()?).ok()?;
    let tag = hex::decode(mac_hex).ok()?;
    mac(cluster_token, &job).verify_slice(&tag).ok()?;
    Some(job)
}

fn mac(cluster_token: &str, job: &str) -> Hmac<Sha256> {
    // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(cluster_token.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    mac.update(CONTEXT);
    mac.update(job.as_bytes());
    mac
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLUSTER: &str = "cluster-token-0123456789";

    #[test]
    fn minted_tokens_verify_only_for_their_job_and_cluster() {
        let token = mint(CLUSTER, "job-a");
        assert!(token.starts_with("mj1."), "{token}");
        assert!(is_job_token(&token));
        assert_eq!(verify(CLUSTER, &token).as_deref(), Some("job-a"));
        assert_eq!(verify("other-cluster-token-xyz", &token), None);
        let mac = token.rsplit('.').next().unwrap_or_default();
        assert_eq!(
            verify(CLUSTER, &format!("mj1.{}.{mac}", hex::encode("job-b"))),
            None
        );
        assert_eq!(verify(CLUSTER, "mj1.zz.zz"), None);
        assert_eq!(verify(CLUSTER, CLUSTER), None);
        assert!(!is_job_token(CLUSTER));
    }
}
