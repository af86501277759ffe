//! The worker SDK against a coordinator with mutual TLS and authentication, in-process on
//! 127.0.0.1:0 with a throwaway PKI: a worker configured as `muster-agent` configures it
//! (`MUSTER_TOKEN` with its job token, `MUSTER_TLS_*`) runs its session, barriers and key-value
//! calls; another job's keys, a missing token and an untrusted coordinator certificate fail
//! fast with errors that say so.
#![allow(clippy::unwrap_used)]

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use muster::{
    Accelerator, Error, RankInfo,
    client::{ClientSecurity, Coordinator, Credentials, Kv, Scope, Session, SessionConfig},
    env::security_from_lookup,
};
use muster_coordinator::{Config, auth::Auth, config::TlsConfig};
use muster_core::job_token::mint as job_token;
use muster_proto::v1::{self as pb, rendezvous_client::RendezvousClient};
use muster_tests::pki::Pki;
use tokio::runtime::Runtime;

const HOST: &str = "127.0.0.1";
/// Every test ends well within this; a hang fails instead of stalling the suite.
const LIMIT: Duration = Duration::from_secs(20);

/// A coordinator with mutual TLS (clients need a certificate from the test CA) and
/// authentication (the test cluster token), on its own runtime, with its PKI.
struct Secured {
    addr: String,
    pki: Pki,
    runtime: Option<Runtime>,
}

impl Secured {
    fn start(name: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "muster-sdk-security-{}-{name}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let pki = Pki::generate(&dir, &[]);
        let config = Config {
            tls: TlsConfig {
                cert: Some(pki.server_cert.clone()),
                key: Some(pki.server_key.clone()),
                client_ca: Some(pki.ca.clone()),
            },
            auth: Auth::with_cluster_token(Pki::TOKEN.to_owned()),
            ..Config::default()
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            muster_coordinator::serve(listener, config, std::future::pending())
                .await
                .unwrap();
        });
        Self {
            addr,
            pki,
            runtime: Some(runtime),
        }
    }

    /// The environment `muster-agent` gives a worker of `job`: its job token and the TLS files
    /// (`None` entries are left out).
    fn worker_env(&self, token: Option<String>, ca: Option<&PathBuf>) -> HashMap<String, String> {
        let mut env = HashMap::new();
        let path = |p: &PathBuf| p.to_str().unwrap().to_owned();
        if let Some(token) = token {
            env.insert("MUSTER_TOKEN".to_owned(), token);
        }
        if let Some(ca) = ca {
            env.insert("MUSTER_TLS_CA".to_owned(), path(ca));
            env.insert("MUSTER_TLS_CERT".to_owned(), path(&self.pki.client_cert));
            env.insert("MUSTER_TLS_KEY".to_owned(), path(&self.pki.client_key));
        }
        env
    }

    /// What a worker of `job` reads from its environment.
    fn worker_security(&self, job: &str) -> ClientSecurity {
        let env = self.worker_env(Some(job_token(Pki::TOKEN, job)), Some(&self.pki.ca));
        security_from_lookup(|name| env.get(name).cloned()).unwrap()
    }

    /// The agent's view: the cluster token and the client certificate.
    fn cluster_security(&self) -> ClientSecurity {
        ClientSecurity::plaintext()
            .with_tls(
                &self.pki.ca,
                Some((&self.pki.client_cert, &self.pki.client_key)),
                None,
            )
            .unwrap()
            .with_credentials(Credentials::bearer(Pki::TOKEN).unwrap())
    }

    /// Forms one generation of `job` with one node of `ranks` ranks, as an agent would (the
    /// cluster token; workers cannot join).
    async fn join(&self, job: &str, ranks: u32) -> pb::JoinResponse {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let agent = Coordinator::connect_with(&self.addr, self.cluster_security())
            .await
            .unwrap();
        let request = pb::JoinRequest {
            job_id: job.to_owned(),
            node_id: "node-0".to_owned(),
            host: HOST.to_owned(),
            local_world_size: ranks,
            requested_node_rank: Some(0),
            config: Some(pb::RendezvousConfig {
                min_nodes: 1,
                max_nodes: 1,
                ..Default::default()
            }),
            request_id: format!(
                "{job}-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ),
            watches: false,
            spare: false,
        };
        RendezvousClient::new(agent.channel())
            .join(request)
            .await
            .unwrap()
            .into_inner()
    }
}

impl Drop for Secured {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
        let _ = std::fs::remove_dir_all(&self.pki.dir);
    }
}

fn session_config(job: &str, generation: u64, rank: u32) -> SessionConfig {
    SessionConfig {
        job_id: job.to_owned(),
        generation,
        rank,
        pid: std::process::id(),
        host: HOST.to_owned(),
    }
}

fn client_runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// (a) Two ranks, each an `Accelerator` configured from its worker environment (job token,
/// mutual TLS): registration, global and node barriers, the key-value store and a shared value
/// all work over TLS with the job token.
#[test]
fn a_worker_with_its_job_token_runs_over_mutual_tls() {
    let coordinator = Secured::start("worker");
    let joined = client_runtime().block_on(coordinator.join("job-a", 2));
    let security = coordinator.worker_security("job-a");
    assert!(security.is_tls() && security.credentials().is_set());
    let threads: Vec<_> = (0..2)
        .map(|rank| {
            let info = RankInfo {
                coordinator: Some(coordinator.addr.clone()),
                job_id: "job-a".to_owned(),
                generation: joined.generation,
                rank,
                local_rank: rank,
                world_size: 2,
                local_world_size: 2,
                node_rank: 0,
                num_nodes: 1,
                restart_count: 0,
                host: HOST.to_owned(),
                agent_socket: None,
            };
            let security = security.clone();
            std::thread::spawn(move || {
                let accelerator = Accelerator::with_security(info, security).unwrap();
                accelerator
                    .kv()
                    .set(&format!("rank-{rank}"), format!("hello from {rank}"))
                    .unwrap();
                accelerator.wait_for_everyone().unwrap();
                accelerator.wait_for_local().unwrap();
                let other = accelerator
                    .kv()
                    .get(&format!("rank-{}", 1 - rank))
                    .unwrap()
                    .unwrap();
                let shared: String = accelerator
                    .main_process_first_share(|| "computed once".to_owned())
                    .unwrap();
                accelerator.finish().unwrap();
                (String::from_utf8(other).unwrap(), shared)
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(
        results,
        vec![
            ("hello from 1".to_owned(), "computed once".to_owned()),
            ("hello from 0".to_owned(), "computed once".to_owned()),
        ]
    );
}

/// (a) The async API with explicit settings: a session registers and passes a barrier, and
/// unary calls go through with the job token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_and_kv_calls_carry_the_job_token() {
    let coordinator = Secured::start("async");
    let joined = coordinator.join("job-a", 1).await;
    let connection =
        Coordinator::connect_with(&coordinator.addr, coordinator.worker_security("job-a"))
            .await
            .unwrap();
    let session = tokio::time::timeout(
        LIMIT,
        Session::attach(&connection, session_config("job-a", joined.generation, 0)),
    )
    .await
    .unwrap()
    .unwrap();
    session.barrier(Scope::Global, "start", None).await.unwrap();
    let kv = session.kv();
    kv.set("k", "v").await.unwrap();
    assert_eq!(kv.get("k").await.unwrap().as_deref(), Some(&b"v"[..]));
    assert_eq!(kv.add("n", 2).await.unwrap(), 2);
    session.leave().await.unwrap();
}

/// (b) A job token opens only its own job: reading, writing or registering in another job is
/// PERMISSION_DENIED, surfaced as `Error::Unauthorized` naming both jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_token_cannot_touch_another_job() {
    let coordinator = Secured::start("other-job");
    let joined_b = coordinator.join("job-b", 1).await;
    let owner = Kv::new(
        Coordinator::connect_with(&coordinator.addr, coordinator.worker_security("job-b"))
            .await
            .unwrap(),
        "job-b",
    );
    owner.set("secret", "b's value").await.unwrap();

    let intruder =
        Coordinator::connect_with(&coordinator.addr, coordinator.worker_security("job-a"))
            .await
            .unwrap();
    let kv = Kv::new(intruder.clone(), "job-b");
    let started = Instant::now();
    let error = kv.get("secret").await.unwrap_err();
    let denied = |error: &Error| {
        matches!(error, Error::Unauthorized { status, .. }
            if status.code() == tonic::Code::PermissionDenied)
    };
    assert!(denied(&error), "{error:?}");
    let text = error.to_string();
    assert!(
        text.contains("refused the credentials (PermissionDenied)")
            && text.contains("'job-a'")
            && text.contains("'job-b'"),
        "{text}"
    );
    // A deliberate answer: not retried for the failover budget.
    assert!(started.elapsed() < Duration::from_secs(5));
    let error = kv.set("secret", "overwritten").await.unwrap_err();
    assert!(denied(&error), "{error:?}");
    assert_eq!(
        owner.get("secret").await.unwrap().as_deref(),
        Some(&b"b's value"[..])
    );

    // Nor can it register as a rank of job-b.
    let error = tokio::time::timeout(
        LIMIT,
        Session::attach(&intruder, session_config("job-b", joined_b.generation, 0)),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert!(denied(&error), "{error:?}");

    // Nor join a job (cluster-only): the raw channel carries the job token too.
    let error = RendezvousClient::new(intruder.channel())
        .join(pb::JoinRequest {
            job_id: "job-a".to_owned(),
            node_id: "node-x".to_owned(),
            host: HOST.to_owned(),
            local_world_size: 1,
            request_id: "intruder-join".to_owned(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(error.code(), tonic::Code::PermissionDenied, "{error:?}");
}

/// (c) Without `MUSTER_TOKEN` the TLS connection is made, but every call is UNAUTHENTICATED,
/// at once and with a message that points at `MUSTER_TOKEN`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_is_unauthenticated() {
    let coordinator = Secured::start("no-token");
    let joined = coordinator.join("job-a", 1).await;
    let env = coordinator.worker_env(None, Some(&coordinator.pki.ca));
    let security = security_from_lookup(|name| env.get(name).cloned()).unwrap();
    assert!(security.is_tls() && !security.credentials().is_set());
    let connection = Coordinator::connect_with(&coordinator.addr, security)
        .await
        .unwrap();
    let unauthenticated = |error: &Error| {
        matches!(error, Error::Unauthorized { status, .. }
            if status.code() == tonic::Code::Unauthenticated)
    };
    let started = Instant::now();
    let error = Kv::new(connection.clone(), "job-a")
        .get("k")
        .await
        .unwrap_err();
    assert!(unauthenticated(&error), "{error:?}");
    let text = error.to_string();
    assert!(
        text.contains("refused the credentials (Unauthenticated)") && text.contains("MUSTER_TOKEN"),
        "{text}"
    );
    let error = tokio::time::timeout(
        LIMIT,
        Session::attach(&connection, session_config("job-a", joined.generation, 0)),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert!(unauthenticated(&error), "{error:?}");
    assert!(started.elapsed() < Duration::from_secs(5));

    // A token that is not the cluster's and not a valid job token: the same.
    let forged = job_token("some-other-cluster-token", "job-a");
    let env = coordinator.worker_env(Some(forged.clone()), Some(&coordinator.pki.ca));
    let security = security_from_lookup(|name| env.get(name).cloned()).unwrap();
    let connection = Coordinator::connect_with(&coordinator.addr, security)
        .await
        .unwrap();
    let error = Kv::new(connection, "job-a").get("k").await.unwrap_err();
    assert!(unauthenticated(&error), "{error:?}");
    assert!(!error.to_string().contains(&forged), "{error}");
}

/// (d) A coordinator certificate from another CA fails the TLS handshake: `connect` fails at
/// once with the certificate error as its cause, and a lazy connection fails its first call
/// once the (short) failover budget is spent, instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_ca_fails_the_handshake_instead_of_hanging() {
    let coordinator = Secured::start("foreign-ca");
    let env = coordinator.worker_env(
        Some(job_token(Pki::TOKEN, "job-a")),
        Some(&coordinator.pki.foreign_ca),
    );
    let security = security_from_lookup(|name| env.get(name).cloned()).unwrap();

    let started = Instant::now();
    let error = tokio::time::timeout(
        LIMIT,
        Coordinator::connect_with(&coordinator.addr, security.clone()),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert!(matches!(error, Error::Connection { .. }), "{error:?}");
    let text = error.to_string();
    assert!(
        text.contains(&coordinator.addr) && text.to_lowercase().contains("certificate"),
        "{text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );

    eprintln!("foreign CA: {error}");

    let lazy = Coordinator::connect_lazy_with(&coordinator.addr, security).unwrap();
    lazy.set_failover_timeout(Duration::from_millis(300));
    let started = Instant::now();
    let error = tokio::time::timeout(LIMIT, Kv::new(lazy, "job-a").get("k"))
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(error, Error::Connection { .. }), "{error:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    eprintln!("foreign CA, lazily: {error}");
}

/// Plaintext against the TLS listener, and TLS without the client certificate mutual TLS
/// requires: both fail (at connect or at the first call) rather than hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_or_no_client_certificate_fail_fast() {
    let coordinator = Secured::start("mismatch");
    let token = Credentials::bearer(&job_token(Pki::TOKEN, "job-a")).unwrap();
    let plaintext = ClientSecurity::plaintext().with_credentials(token.clone());
    let no_cert = ClientSecurity::plaintext()
        .with_tls(&coordinator.pki.ca, None, None)
        .unwrap()
        .with_credentials(token);
    for (what, security) in [("plaintext", plaintext), ("no client certificate", no_cert)] {
        let started = Instant::now();
        let outcome = tokio::time::timeout(LIMIT, async {
            let connection = Coordinator::connect_with(&coordinator.addr, security).await?;
            connection.set_failover_timeout(Duration::from_millis(300));
            Kv::new(connection, "job-a").get("k").await
        })
        .await
        .unwrap_or_else(|_| panic!("{what}: hung"));
        let error = outcome.expect_err(what);
        assert!(
            matches!(error, Error::Connection { .. }),
            "{what}: {error:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{what}: {:?}",
            started.elapsed()
        );
        eprintln!("{what}: {error}");
    }
}
