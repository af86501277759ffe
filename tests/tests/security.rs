//! The coordinator's security, over real TLS on loopback: no credentials means UNAUTHENTICATED
//! and no state change; a job token opens only its own job; wrong CAs, expired certificates
//! and missing client certificates fail the handshake; a non-loopback listener without TLS
//! and authentication is refused; and tokens never reach the logs.

#![allow(clippy::unwrap_used)]

use muster_coordinator::{Config, config::TlsConfig};
use muster_proto::security::{AuthChannel, ClientSecurity, Credentials};
use muster_proto::v1 as pb;
use muster_tests::pki::Pki;
use pb::{
    key_value_client::KeyValueClient, ops_client::OpsClient, rendezvous_client::RendezvousClient,
    session_client::SessionClient, unique_ids_client::UniqueIdsClient,
};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;
use tonic::Code;

fn pki(name: &str) -> Pki {
    let dir = std::env::temp_dir().join(format!("muster-security-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    Pki::generate(&dir, &[])
}

/// A coordinator on 127.0.0.1:0 with TLS (mutual when `mtls`) and the PKI's cluster token;
/// returns its address.
async fn serve(pki: &Pki, mtls: bool, cert: (&Path, &Path)) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let config = Config {
        tls: TlsConfig {
            cert: Some(cert.0.to_owned()),
            key: Some(cert.1.to_owned()),
            client_ca: mtls.then(|| pki.ca.clone()),
        },
        auth_token_file: Some(pki.token_file.clone()),
        ..Config::default()
    };
    tokio::spawn(async move {
        if let Err(e) = muster_coordinator::serve(listener, config, std::future::pending()).await {
            panic!("coordinator failed: {e:#}");
        }
    });
    addr
}

/// A client of `addr` trusting `ca`, presenting `identity`, sending `token`.
async fn client(
    addr: &str,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    token: Option<&str>,
) -> Result<AuthChannel, String> {
    let credentials = match token {
        Some(t) => Credentials::bearer(t)?,
        None => Credentials::none(),
    };
    let security = ClientSecurity::plaintext()
        .with_tls(ca, identity, None)?
        .with_credentials(credentials);
    let channel = security
        .endpoint(addr)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(security.wrap(channel))
}

fn join(job: &str) -> pb::JoinRequest {
    pb::JoinRequest {
        job_id: job.into(),
        node_id: "n0".into(),
        host: "host-n0".into(),
        local_world_size: 1,
        requested_node_rank: None,
        config: Some(pb::RendezvousConfig {
            min_nodes: 1,
            max_nodes: 1,
            last_call_ms: 0,
            join_timeout_ms: 10_000,
            max_restarts: None,
            recovery: 0,
            ..Default::default()
        }),
        request_id: String::new(),
        watches: false,
        spare: false,
    }
}

fn set(job: &str, key: &str, value: &str) -> pb::SetRequest {
    pb::SetRequest {
        job_id: job.into(),
        key: key.into(),
        value: value.into(),
        ..Default::default()
    }
}

fn get(job: &str, key: &str) -> pb::GetRequest {
    pb::GetRequest {
        job_id: job.into(),
        key: key.into(),
        wait_ms: 0,
    }
}

async fn job_count(admin: &AuthChannel) -> usize {
    OpsClient::new(admin.clone())
        .list_jobs(pb::ListJobsRequest {})
        .await
        .expect("list jobs")
        .into_inner()
        .jobs
        .len()
}

/// Lists the services through `grpc.reflection.v1`; the error code if the call is refused.
async fn list_services(channel: &AuthChannel) -> Result<Vec<String>, Code> {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let request = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = ServerReflectionClient::new(channel.clone())
        .server_reflection_info(tokio_stream::iter(vec![request]))
        .await
        .map_err(|s| s.code())?
        .into_inner();
    match stream.message().await.map_err(|s| s.code())? {
        Some(response) => match response.message_response {
            Some(MessageResponse::ListServicesResponse(list)) => {
                Ok(list.service.into_iter().map(|s| s.name).collect())
            }
            other => panic!("unexpected reflection answer {other:?}"),
        },
        None => Ok(Vec::new()),
    }
}

#[tokio::test]
async fn calls_without_valid_credentials_are_unauthenticated_and_change_nothing() {
    let pki = pki("unauth");
    let addr = serve(&pki, true, (&pki.server_cert, &pki.server_key)).await;
    let identity = Some((pki.client_cert.as_path(), pki.client_key.as_path()));
    let admin = client(&addr, &pki.ca, identity, Some(Pki::TOKEN))
        .await
        .expect("admin");
    let anonymous = client(&addr, &pki.ca, identity, None)
        .await
        .expect("anonymous");
    let forger = client(&addr, &pki.ca, identity, Some("not-the-cluster-token-0000"))
        .await
        .expect("forger");
    // A job token minted under another cluster token.
    let foreign_job = muster_core::job_token::mint("some-other-cluster-token", "a");
    let foreigner = client(&addr, &pki.ca, identity, Some(&foreign_job))
        .await
        .expect("c");

    for (who, channel) in [
        ("anonymous", &anonymous),
        ("forger", &forger),
        ("foreigner", &foreigner),
    ] {
        let status = RendezvousClient::new(channel.clone())
            .join(join("a"))
            .await
            .expect_err("join without credentials");
        assert_eq!(status.code(), Code::Unauthenticated, "{who}: {status:?}");
        let status = OpsClient::new(channel.clone())
            .list_jobs(pb::ListJobsRequest {})
            .await
            .expect_err("ops without credentials");
        assert_eq!(status.code(), Code::Unauthenticated, "{who}: {status:?}");
    }
    // Reflection needs a credential too (grpcurl sends one with -H); health does not.
    for (channel, code) in [(&anonymous, Some(Code::Unauthenticated)), (&admin, None)] {
        assert_eq!(list_services(channel).await.err(), code);
    }
    let status = RendezvousClient::new(anonymous.clone())
        .join(join("a"))
        .await
        .expect_err("anonymous join");
    assert!(status.message().contains("credentials"), "{status:?}");
    assert_eq!(job_count(&admin).await, 0, "no job was created");

    // The cluster token creates job a and writes a key; strangers can neither read, write
    // nor cancel it.
    RendezvousClient::new(admin.clone())
        .join(join("a"))
        .await
        .expect("admin join");
    KeyValueClient::new(admin.clone())
        .set(set("a", "k", "v1"))
        .await
        .expect("admin set");
    for channel in [&anonymous, &forger, &foreigner] {
        let mut kv = KeyValueClient::new(channel.clone());
        assert_eq!(
            kv.set(set("a", "k", "evil")).await.unwrap_err().code(),
            Code::Unauthenticated
        );
        assert_eq!(
            kv.get(get("a", "k")).await.unwrap_err().code(),
            Code::Unauthenticated
        );
        let cancel = OpsClient::new(channel.clone())
            .cancel_job(pb::CancelJobRequest {
                job_id: "a".into(),
                reason: "x".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(cancel.code(), Code::Unauthenticated);
        // Stacks hold file paths: no credential, no stacks.
        let stacks = OpsClient::new(channel.clone())
            .dump_stacks(pb::DumpStacksRequest {
                job_id: "a".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(stacks.code(), Code::Unauthenticated);
    }
    let value = KeyValueClient::new(admin.clone())
        .get(get("a", "k"))
        .await
        .expect("get");
    assert_eq!(value.into_inner().value, b"v1", "the key is unchanged");
    let described = OpsClient::new(admin.clone())
        .describe_job(pb::DescribeJobRequest {
            job_id: "a".into(),
            ..Default::default()
        })
        .await
        .expect("the job is still there")
        .into_inner();
    assert_eq!(described.nodes.len(), 1, "{described:?}");
    assert_eq!(job_count(&admin).await, 1);
}

#[tokio::test]
async fn a_job_token_opens_its_own_job_only() {
    let pki = pki("jobs");
    let addr = serve(&pki, false, (&pki.server_cert, &pki.server_key)).await;
    let admin = client(&addr, &pki.ca, None, Some(Pki::TOKEN))
        .await
        .expect("admin");
    for job in ["a", "b"] {
        let joined = RendezvousClient::new(admin.clone())
            .join(join(job))
            .await
            .expect("join");
        assert_eq!(joined.into_inner().world_size, 1);
        KeyValueClient::new(admin.clone())
            .set(set(job, "k", job))
            .await
            .expect("set");
    }
    let token_a = muster_core::job_token::mint(Pki::TOKEN, "a");
    let worker_a = client(&addr, &pki.ca, None, Some(&token_a))
        .await
        .expect("worker");

    // Its own job: reads and writes.
    let mut kv = KeyValueClient::new(worker_a.clone());
    kv.set(set("a", "mine", "1")).await.expect("own set");
    assert_eq!(
        kv.get(get("a", "k"))
            .await
            .expect("own get")
            .into_inner()
            .value,
        b"a"
    );

    // Job b: every worker service refuses, naming both jobs, and b is unchanged.
    let denied = kv.get(get("b", "k")).await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    assert!(
        denied.message().contains("'a'") && denied.message().contains("'b'"),
        "{denied:?}"
    );
    assert_eq!(
        kv.set(set("b", "k", "evil")).await.unwrap_err().code(),
        Code::PermissionDenied
    );
    let list = kv
        .list(pb::ListRequest {
            job_id: "b".into(),
            prefix: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(list.code(), Code::PermissionDenied);
    let unique = UniqueIdsClient::new(worker_a.clone())
        .fetch(pb::FetchUniqueIdRequest {
            job_id: "b".into(),
            generation: 1,
            rank: 0,
            communicator: "world".into(),
            wait_ms: 0,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(unique.code(), Code::PermissionDenied, "{unique:?}");
    // Not even a job that does not exist is told apart from a foreign one.
    let ghost = kv.get(get("ghost", "k")).await.unwrap_err();
    assert_eq!(ghost.code(), Code::PermissionDenied);
    let b = KeyValueClient::new(admin.clone())
        .get(get("b", "k"))
        .await
        .expect("b");
    assert_eq!(b.into_inner().value, b"b", "job b's key is unchanged");

    // A session registered for job b is refused before it registers.
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(pb::WorkerMessage {
        kind: Some(pb::worker_message::Kind::Register(pb::Register {
            job_id: "b".into(),
            generation: 1,
            rank: 0,
            pid: 1,
            ..Default::default()
        })),
    })
    .await
    .expect("queue register");
    let session = SessionClient::new(worker_a.clone())
        .attach(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await;
    let status = match session {
        Err(status) => status,
        Ok(stream) => stream.into_inner().message().await.expect_err("refused"),
    };
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");

    // Admin services need the cluster token.
    let ops = OpsClient::new(worker_a.clone())
        .cancel_job(pb::CancelJobRequest {
            job_id: "a".into(),
            reason: "worker".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(ops.code(), Code::PermissionDenied, "{ops:?}");
    assert!(ops.message().contains("muster.v1.Ops"), "{ops:?}");
    // Not even its own job's stacks: they are the cluster's (an operator's) to read.
    let stacks = OpsClient::new(worker_a.clone())
        .dump_stacks(pb::DumpStacksRequest {
            job_id: "a".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(stacks.code(), Code::PermissionDenied, "{stacks:?}");
    let rdzv = RendezvousClient::new(worker_a)
        .join(join("a"))
        .await
        .unwrap_err();
    assert_eq!(rdzv.code(), Code::PermissionDenied);
    assert_eq!(job_count(&admin).await, 2, "nothing was cancelled");
}

/// Whether a call over a fresh connection with these TLS settings fails before reaching any
/// handler (the handshake, or the connection right after it, is refused).
async fn handshake_fails(addr: &str, ca: &Path, identity: Option<(&Path, &Path)>) -> String {
    let channel = match client(addr, ca, identity, Some(Pki::TOKEN)).await {
        Err(e) => return e,
        Ok(c) => c,
    };
    // TLS 1.3 finishes the client's side of the handshake before the server has checked the
    // client's certificate: the refusal then arrives with the first call.
    match OpsClient::new(channel)
        .list_jobs(pb::ListJobsRequest {})
        .await
    {
        Ok(_) => panic!("a call succeeded over a connection that should have been refused"),
        Err(status) => {
            // Refused by the transport (tonic reports it as Unavailable or Unknown with the
            // TLS alert as source), never by a handler.
            let text = format!("{status:?}");
            assert!(
                matches!(status.code(), Code::Unavailable | Code::Unknown)
                    && text.contains("transport error"),
                "{text}"
            );
            text
        }
    }
}

#[tokio::test]
async fn wrong_ca_expired_or_missing_certificates_fail_the_handshake() {
    let pki = pki("handshake");
    let addr = serve(&pki, true, (&pki.server_cert, &pki.server_key)).await;
    let own = Some((pki.client_cert.as_path(), pki.client_key.as_path()));
    let foreign = Some((
        pki.foreign_client_cert.as_path(),
        pki.foreign_client_key.as_path(),
    ));

    // The control: the right CA and a client certificate from it work.
    let ok = client(&addr, &pki.ca, own, Some(Pki::TOKEN))
        .await
        .expect("trusted client");
    OpsClient::new(ok)
        .list_jobs(pb::ListJobsRequest {})
        .await
        .expect("list");

    let e = handshake_fails(&addr, &pki.foreign_ca, own).await;
    assert!(
        e.to_lowercase().contains("certificate") || e.contains("UnknownIssuer"),
        "{e}"
    );
    let e = handshake_fails(&addr, &pki.ca, None).await;
    assert!(e.contains("CertificateRequired"), "{e}");
    let e = handshake_fails(&addr, &pki.ca, foreign).await;
    assert!(e.contains("alert"), "{e}");

    // Plaintext against TLS fails too, and does not hang.
    let plain = ClientSecurity::plaintext()
        .endpoint(&addr)
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5))
        .connect()
        .await;
    if let Ok(channel) = plain {
        let r = OpsClient::new(channel)
            .list_jobs(pb::ListJobsRequest {})
            .await;
        assert!(r.is_err(), "plaintext call to a TLS listener succeeded");
    }

    // A server whose certificate has expired is refused by the client.
    let expired = serve(
        &pki,
        false,
        (&pki.expired_server_cert, &pki.expired_server_key),
    )
    .await;
    let e = handshake_fails(&expired, &pki.ca, None).await;
    assert!(e.to_lowercase().contains("expired"), "{e}");
}

#[test]
fn a_non_loopback_listener_needs_tls_and_authentication_or_insecure() {
    let pki = pki("exposure");
    let port = muster_tests::free_port();
    let listen = format!("0.0.0.0:{port}");
    let run = |extra: &[&str]| {
        Command::new(muster_tests::coordinator_bin())
            .args(["--listen", &listen])
            .args(extra)
            .stdin(Stdio::null())
            .output()
            .expect("run the coordinator")
    };
    for (extra, missing) in [
        (
            &[][..],
            "TLS (--tls-cert, --tls-key) and authentication (--auth-token-file)",
        ),
        (
            &["--auth-token-file", pki.token_file.to_str().expect("utf-8")][..],
            "TLS",
        ),
        (
            &[
                "--tls-cert",
                pki.server_cert.to_str().expect("utf-8"),
                "--tls-key",
                pki.server_key.to_str().expect("utf-8"),
            ][..],
            "authentication (--auth-token-file)",
        ),
    ] {
        let out = run(extra);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{extra:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
        assert!(
            stderr.contains("refusing to serve")
                && stderr.contains(missing)
                && stderr.contains("--insecure"),
            "{extra:?}: {stderr}"
        );
    }
    // A weak token file is refused with a line that names the file, not its content.
    let weak = pki.dir.join("weak-token");
    std::fs::write(&weak, "hunter2\n").expect("write");
    let out = run(&[
        "--insecure",
        "--auth-token-file",
        weak.to_str().expect("utf-8"),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("weak-token") && !stderr.contains("hunter2"),
        "{stderr}"
    );

    // In-process embedders are held to the same rule, by the address actually bound.
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let refused = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("0.0.0.0:0")
            .await
            .expect("bind");
        muster_coordinator::serve(listener, Config::default(), async {}).await
    });
    let e = refused.expect_err("refused");
    assert!(e.to_string().contains("refusing to serve 0.0.0.0:"), "{e}");

    // --insecure serves, with a warning.
    let mut child = Command::new(muster_tests::coordinator_bin())
        .args(["--listen", &listen, "--insecure"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let addr = format!("127.0.0.1:{port}");
    let up = (0..300).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        std::net::TcpStream::connect(&addr).is_ok()
    });
    let _ = child.kill();
    let out = child.wait_with_output().expect("output");
    let logs = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(up, "--insecure did not serve: {logs}");
    assert!(
        logs.contains("WARN") && logs.contains("--insecure"),
        "{logs}"
    );
}

#[test]
fn tokens_never_reach_the_logs() {
    let pki = pki("logs");
    let port = muster_tests::free_port();
    let addr = format!("127.0.0.1:{port}");
    let path = |p: &Path| p.to_str().expect("utf-8").to_owned();
    // Into a file: trace output would fill a pipe nobody reads while the calls run.
    let log_path = pki.dir.join("coordinator.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let mut child = Command::new(muster_tests::coordinator_bin())
        .args(["--listen", &addr, "--log", "trace"])
        .args([
            "--tls-cert",
            &path(&pki.server_cert),
            "--tls-key",
            &path(&pki.server_key),
        ])
        .args([
            "--tls-client-ca",
            &path(&pki.ca),
            "--auth-token-file",
            &path(&pki.token_file),
        ])
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log file"))
        .stderr(log)
        .spawn()
        .expect("spawn");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let job_token = muster_core::job_token::mint(Pki::TOKEN, "logged");
    runtime.block_on(async {
        let identity = Some((pki.client_cert.as_path(), pki.client_key.as_path()));
        let admin = loop {
            match client(&addr, &pki.ca, identity, Some(Pki::TOKEN)).await {
                Ok(c) => break c,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        RendezvousClient::new(admin.clone())
            .join(join("logged"))
            .await
            .expect("join");
        let worker = client(&addr, &pki.ca, identity, Some(&job_token))
            .await
            .expect("worker");
        let mut kv = KeyValueClient::new(worker.clone());
        kv.set(set("logged", "k", "v")).await.expect("set");
        let _ = kv.get(get("other", "k")).await.expect_err("denied");
        let _ = OpsClient::new(worker)
            .list_jobs(pb::ListJobsRequest {})
            .await
            .expect_err("denied");
        let wrong = client(
            &addr,
            &pki.ca,
            identity,
            Some("wrong-but-long-enough-token"),
        )
        .await
        .expect("c");
        let _ = KeyValueClient::new(wrong)
            .get(get("logged", "k"))
            .await
            .expect_err("denied");
    });
    let _ = child.kill();
    let _ = child.wait();
    let logs = std::fs::read_to_string(&log_path).expect("read the log");
    assert!(
        logs.lines().count() > 20,
        "trace logging captured little: {logs}"
    );
    let mac = job_token.rsplit('.').next().expect("mac");
    for secret in [Pki::TOKEN, mac, "wrong-but-long-enough-token"] {
        assert!(!logs.contains(secret), "a secret reached the logs");
    }
}

#[tokio::test]
async fn the_plaintext_health_listener_serves_health_only() {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let pki = pki("health");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let health_addr: std::net::SocketAddr = format!("127.0.0.1:{}", muster_tests::free_port())
        .parse()
        .expect("addr");
    let config = Config {
        tls: TlsConfig {
            cert: Some(pki.server_cert.clone()),
            key: Some(pki.server_key.clone()),
            client_ca: None,
        },
        auth_token_file: Some(pki.token_file.clone()),
        health_addr: Some(health_addr),
        ..Config::default()
    };
    tokio::spawn(muster_coordinator::serve(
        listener,
        config,
        std::future::pending(),
    ));
    let plain = ClientSecurity::plaintext();
    let channel = loop {
        match plain
            .endpoint(&health_addr.to_string())
            .expect("endpoint")
            .connect()
            .await
        {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    };
    for service in ["", "muster.v1.Session"] {
        let status = HealthClient::new(channel.clone())
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .expect("health over plaintext")
            .into_inner()
            .status;
        assert_eq!(status, 1, "SERVING for {service:?}");
    }
    // No muster service answers there, with or without credentials.
    let refused = OpsClient::new(plain.wrap(channel))
        .list_jobs(pb::ListJobsRequest {})
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unimplemented, "{refused:?}");
    // The main port is TLS.
    let admin = client(&addr, &pki.ca, None, Some(Pki::TOKEN))
        .await
        .expect("admin");
    assert_eq!(job_count(&admin).await, 0);
}
