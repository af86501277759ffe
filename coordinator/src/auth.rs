//! Authentication and authorization of every call except health (reflection takes any valid credential).
//!
//! Two credentials, both sent as `authorization: Bearer <token>`:
//! - the **cluster token**, from `--auth-token-file`: agents and operators, every service;
//! - a **job token**, `mj1.<hex job id>.<hex HMAC-SHA256(cluster token, job id)>`, which an agent
//!   derives for its workers and hands them in `MUSTER_TOKEN`. It opens only the worker
//!   services (Session, KeyValue, UniqueIds, SharedValues), and only for its own job.
//!
//! Job tokens are minted and verified by `muster_core::job_token` (the agent mints them with
//! the same function). Comparisons are constant-time (`subtle` for the cluster token, `hmac`'s
//! `verify_slice` for job tokens); tokens are never logged, and `Debug` of [`Auth`] hides them.

use muster_core::job_token;
use muster_proto::security::AUTHORIZATION;
use std::fmt;
use subtle::ConstantTimeEq;
use tonic::{Request, Status};

/// Who made a call, as the interceptor established it; read by handlers that serve one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// The cluster token, or any caller when authentication is off.
    Cluster,
    /// A worker of this job.
    Job(String),
}

/// Which credentials a service accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Only the cluster token (Relay, Agents, Ops; Rendezvous but its `Quorum`, which its
    /// handlers check with [`cluster_only`]).
    Cluster,
    /// The cluster token, or a job token for the job named in each request.
    Job,
}

/// The coordinator's credential check: off (every caller is [`Principal::Cluster`]) or on with
/// the cluster token.
#[derive(Clone, Default)]
pub struct Auth {
    cluster: Option<String>,
}

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.cluster.is_some() {
            "Auth(on)"
        } else {
            "Auth(off)"
        })
    }
}

impl Auth {
    /// No authentication: every caller may do everything.
    pub fn off() -> Self {
        Auth::default()
    }

    /// Authentication with `cluster_token` (checked by `muster_proto::security::check_token`).
    pub fn with_cluster_token(cluster_token: String) -> Self {
        Auth {
            cluster: Some(cluster_token),
        }
    }

    /// Whether callers must present credentials.
    pub fn is_on(&self) -> bool {
        self.cluster.is_some()
    }

    /// Authenticates `request` for `service` (its gRPC name, for messages) under `scope`, and
    /// records the [`Principal`] in the request's extensions for the handler.
    pub fn check(
        &self,
        mut request: Request<()>,
        service: &str,
        scope: Scope,
    ) -> Result<Request<()>, Status> {
        let principal = self.principal(&request, service, scope)?;
        request.extensions_mut().insert(principal);
        Ok(request)
    }

    fn principal(
        &self,
        request: &Request<()>,
        service: &str,
        scope: Scope,
    ) -> Result<Principal, Status> {
        let Some(cluster) = &self.cluster else {
            return Ok(Principal::Cluster);
        };
        let Some(header) = request.metadata().get(AUTHORIZATION) else {
            return Err(Status::unauthenticated(format!(
                "{service} needs credentials: send 'authorization: Bearer <token>' with the \
                 cluster token, or the job token muster-agent gives its workers in MUSTER_TOKEN"
            )));
        };
        let token = header
            .to_str()
            .ok()
            .and_then(|h| h.strip_prefix("Bearer "))
            .ok_or_else(|| {
                Status::unauthenticated("the authorization header is not 'Bearer <token>'")
            })?;
        if job_token::is_job_token(token) {
            let job = job_token::verify(cluster, token)
                .ok_or_else(|| Status::unauthenticated("the job token is not valid"))?;
            if scope == Scope::Cluster {
                return Err(Status::permission_denied(format!(
                    "a job token (job '{job}') cannot call {service}; it needs the cluster token"
                )));
            }
            return Ok(Principal::Job(job));
        }
        if bool::from(token.as_bytes().ct_eq(cluster.as_bytes())) {
            Ok(Principal::Cluster)
        } else {
            Err(Status::unauthenticated("the token is not valid"))
        }
    }
}

/// Allows a call only with the cluster token (or with authentication off), in a service
/// whose other methods take a job token too (`Rendezvous`: only `Quorum` is a worker's):
/// `method` names the call in the refusal.
pub fn cluster_only<T>(request: &Request<T>, method: &str) -> Result<(), Status> {
    match request.extensions().get::<Principal>() {
        Some(Principal::Job(own)) => Err(Status::permission_denied(format!(
            "a job token (job '{own}') cannot call {method}; it needs the cluster token"
        ))),
        _ => Ok(()),
    }
}

/// Allows a call about `job` by the request's principal: the cluster, or that job's workers.
/// A request that never passed the interceptor (in-process callers) counts as the cluster.
pub fn authorize_job<T>(request: &Request<T>, job: &str) -> Result<(), Status> {
    match request.extensions().get::<Principal>() {
        Some(Principal::Job(own)) if own != job => Err(Status::permission_denied(format!(
            "the job token is for job '{own}', not job '{job}'"
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const CLUSTER: &str = "cluster-token-0123456789";

    fn call(auth: &Auth, token: Option<&str>, scope: Scope) -> Result<Principal, Status> {
        let mut request = Request::new(());
        if let Some(t) = token {
            request
                .metadata_mut()
                .insert(AUTHORIZATION, t.parse().expect("ascii"));
        }
        let request = auth.check(request, "muster.v1.KeyValue", scope)?;
        Ok(request
            .extensions()
            .get::<Principal>()
            .cloned()
            .expect("principal"))
    }

    #[test]
    fn credentials_map_to_principals_or_errors() {
        use tonic::Code::{PermissionDenied, Unauthenticated};
        let auth = Auth::with_cluster_token(CLUSTER.to_owned());
        let job_a = format!("Bearer {}", job_token::mint(CLUSTER, "job-a"));
        let cluster = format!("Bearer {CLUSTER}");
        assert_eq!(
            call(&auth, Some(&cluster), Scope::Cluster).ok(),
            Some(Principal::Cluster)
        );
        assert_eq!(
            call(&auth, Some(&job_a), Scope::Job).ok(),
            Some(Principal::Job("job-a".into()))
        );
        let code = |t: Option<&str>, s| call(&auth, t, s).unwrap_err().code();
        assert_eq!(code(None, Scope::Job), Unauthenticated);
        assert_eq!(
            code(Some(CLUSTER), Scope::Job),
            Unauthenticated,
            "no Bearer"
        );
        assert_eq!(
            code(Some("Bearer wrong-token-0123456789"), Scope::Job),
            Unauthenticated
        );
        assert_eq!(code(Some(&job_a), Scope::Cluster), PermissionDenied);
        // A token for job-a under another cluster token, and one with its job swapped.
        let foreign = format!(
            "Bearer {}",
            job_token::mint("other-cluster-token-xyz", "job-a")
        );
        assert_eq!(code(Some(&foreign), Scope::Job), Unauthenticated);
        let mac = job_a.rsplit('.').next().expect("mac");
        let swapped = format!("Bearer mj1.{}.{mac}", hex::encode("job-b"));
        assert_eq!(code(Some(&swapped), Scope::Job), Unauthenticated);
        assert_eq!(code(Some("Bearer mj1.zz.zz"), Scope::Job), Unauthenticated);
        // Off: anyone is the cluster.
        assert_eq!(
            call(&Auth::off(), None, Scope::Cluster).ok(),
            Some(Principal::Cluster)
        );
    }

    #[test]
    fn handlers_admit_only_their_job() {
        let mut request = Request::new(());
        request.extensions_mut().insert(Principal::Job("a".into()));
        assert!(authorize_job(&request, "a").is_ok());
        let e = authorize_job(&request, "b").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("'a'") && e.message().contains("'b'"),
            "{e}"
        );
        assert!(authorize_job(&Request::new(()), "b").is_ok());
        // A Rendezvous method other than Quorum refuses a job token, naming itself.
        let e = cluster_only(&request, "muster.v1.Rendezvous.Join").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message()
                .contains("job 'a') cannot call muster.v1.Rendezvous.Join"),
            "{e}"
        );
        let mut cluster = Request::new(());
        cluster.extensions_mut().insert(Principal::Cluster);
        assert!(cluster_only(&cluster, "muster.v1.Rendezvous.Join").is_ok());
        assert!(cluster_only(&Request::new(()), "muster.v1.Rendezvous.Join").is_ok());
    }

    #[test]
    fn debug_hides_the_token() {
        let auth = Auth::with_cluster_token(CLUSTER.to_owned());
        assert_eq!(format!("{auth:?}"), "Auth(on)");
    }
}
