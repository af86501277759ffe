//! Where a launch's coordinator is: `--coordinator`'s, the one this agent hosts at the
//! rendezvous endpoint when its machine can bind it (torchrun's c10d: the agent that binds
//! hosts), or the agent's own on 127.0.0.1; and how a hosted one is served and ended.

use super::{LaunchError, Stops, Waited, waiting};
use crate::failover::{self, Coordinators};
use crate::spec::LaunchSpec;
use muster_proto::v1 as pb;
use muster_proto::v1::ops_client::OpsClient;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::{TcpListener, TcpSocket};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Where the launch's coordinator is, and the one this agent serves, if any.
pub(super) struct Place {
    /// The address (or replica list) the agent and its workers dial.
    pub(super) addr: String,
    /// The agent's own coordinator on 127.0.0.1 (single-node jobs).
    pub(super) embedded: bool,
    /// Set when this agent hosts the job's coordinator at the rendezvous endpoint.
    pub(super) hosted: Option<Hosted>,
}

/// Finds or starts the coordinator: `--coordinator`'s; else, with a rendezvous endpoint
/// (`--rdzv-endpoint`, or the main machine's address, port 29470), the one this agent serves
/// there when its machine can bind it (torchrun's c10d: the agent that binds hosts), else the
/// one another agent serves there; else the agent's own on 127.0.0.1.
///
/// Two agents racing for the endpoint cannot both bind it: the loser (address in use), and
/// every agent whose machine does not own the address (not available), dials.
pub(super) fn place_coordinator(spec: &LaunchSpec) -> Result<Place, LaunchError> {
    let Some(addr) = &spec.coordinator else {
        return Ok(Place {
            addr: start_embedded()?,
            embedded: true,
            hosted: None,
        });
    };
    let dial = || Place {
        addr: addr.clone(),
        embedded: false,
        hosted: None,
    };
    let Some(host) = &spec.self_host else {
        return Ok(dial());
    };
    let listener = match bind_endpoint(addr) {
        Ok(Some(listener)) => listener,
        Ok(None) if !host.must => return Ok(dial()),
        Ok(None) => {
            return Err(LaunchError::Embedded(std::io::Error::new(
                std::io::ErrorKind::AddrNotAvailable,
                format!("--rdzv-conf is_host=1, but this machine cannot bind {addr}"),
            )));
        }
        Err(e) => return Err(LaunchError::Embedded(e)),
    };
    let bound = listener.local_addr().map_err(LaunchError::Embedded)?;
    let mut config = muster_coordinator::Config::default();
    match &host.secured {
        Some(s) => {
            config.tls = muster_coordinator::config::TlsConfig {
                cert: Some(s.cert.clone()),
                key: Some(s.key.clone()),
                client_ca: Some(s.client_ca.clone()),
            };
            config.auth_token_file = Some(s.token_file.clone());
        }
        None => {
            // torchrun's TCPStore has no authentication either; say so once, loudly.
            config.insecure = true;
            if !bound.ip().is_loopback() {
                eprintln!(
                    "muster-agent: warning: this agent serves job {}'s rendezvous at {addr} without TLS or authentication: anyone who can reach {addr} can join the job and read its NCCL unique ids; give every node --tls-ca, --tls-cert, --tls-key (a certificate for the endpoint's host) and --auth-token-file to secure it",
                    spec.job_id
                );
            }
        }
    }
    if !spec.quiet {
        eprintln!(
            "muster-agent: job {}: this agent hosts the rendezvous at {addr}",
            spec.job_id
        );
    }
    let stop = CancellationToken::new();
    let task = serve_here(listener, config, stop.clone());
    Ok(Place {
        addr: addr.clone(),
        embedded: false,
        hosted: Some(Hosted {
            addr: addr.clone(),
            stop,
            task,
        }),
    })
}

/// Binds `addr` (`HOST:PORT`) if this machine can: `Ok(None)` when none of HOST's addresses
/// is this machine's, when another process holds the port (another agent won the race), or
/// when HOST does not resolve (dialing then says why).
fn bind_endpoint(addr: &str) -> std::io::Result<Option<TcpListener>> {
    use std::net::ToSocketAddrs as _;
    let Ok(candidates) = addr.to_socket_addrs() else {
        return Ok(None);
    };
    for candidate in candidates.filter(|a| !a.ip().is_unspecified()) {
        match nodelay_listener(candidate) {
            Ok(listener) => return Ok(Some(listener)),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::AddrNotAvailable | std::io::ErrorKind::AddrInUse
                ) =>
            {
                tracing::debug!(%candidate, %e, "not hosting the rendezvous here");
            }
            Err(e) => {
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("cannot bind the rendezvous endpoint {candidate}: {e}"),
                ));
            }
        }
    }
    Ok(None)
}

/// The coordinator this agent serves for the whole job at the rendezvous endpoint.
pub(super) struct Hosted {
    addr: String,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Hosted {
    /// With `serve_on`, keeps serving after this node's end until the job is over on every
    /// node (finished, failed for good or cancelled; a node whose agent falls silent is failed
    /// by the coordinator after its lease, so this ends), then stops accepting and lets the
    /// other agents' in-flight calls end (they hear the job's end and hang up), for at most
    /// `lease`. Without `serve_on` (this agent was stopped, or failed to run) or on a stop
    /// request while serving, the coordinator ends at once.
    pub(super) async fn finish(
        self,
        serve_on: bool,
        job: &str,
        coordinators: &Coordinators,
        lease: Duration,
        stops: &mut Stops,
    ) {
        let mut drain = false;
        if serve_on {
            let over = job_over(coordinators, job);
            let addr = &self.addr;
            let waited = waiting(over, stops, || {
                format!(
                    "muster-agent: job {job}: this node is done; serving the rendezvous at {addr} until every node is"
                )
            })
            .await;
            drain = matches!(waited, Waited::Done(()));
        }
        self.stop.cancel();
        if !drain {
            self.task.abort();
        } else if tokio::time::timeout(lease, self.task).await.is_err() {
            tracing::warn!(
                job,
                "the hosted coordinator's calls did not end within the lease"
            );
        }
    }
}

/// Returns once the coordinator says `job` is over on every node, or cannot say (the job is
/// gone, the coordinator unreachable). Long polls: no timer.
async fn job_over(coordinators: &Coordinators, job: &str) {
    let mut seen: Option<pb::JobSummary> = None;
    loop {
        let request = pb::DescribeJobRequest {
            job_id: job.to_owned(),
            wait_ms: if seen.is_some() { 30_000 } else { 0 },
            unless: seen.clone(),
        };
        let answer = failover::call(coordinators, "Ops.DescribeJob", |channel| {
            let request = request.clone();
            async move { OpsClient::new(channel).describe_job(request).await }
        })
        .await;
        let Ok(answer) = answer else {
            return;
        };
        let summary = answer.into_inner().summary.unwrap_or_default();
        let state = pb::RoundState::try_from(summary.state).unwrap_or_default();
        if summary.done || matches!(state, pb::RoundState::Finished | pb::RoundState::Cancelled) {
            return;
        }
        seen = Some(summary);
    }
}

/// Binds 127.0.0.1:0 and serves a coordinator there for as long as the agent runs; returns
/// its address.
fn start_embedded() -> Result<String, LaunchError> {
    let listener =
        nodelay_listener(SocketAddr::from(([127, 0, 0, 1], 0))).map_err(LaunchError::Embedded)?;
    let addr = listener.local_addr().map_err(LaunchError::Embedded)?;
    // Every client of a loopback coordinator is this agent or one of its workers, all from
    // one address: the per-peer cap (which keeps one host from taking every slot of a shared
    // coordinator) would only cap the workers this node can run.
    let config = muster_coordinator::Config {
        max_connections_per_peer: muster_coordinator::Config::default().max_connections,
        ..muster_coordinator::Config::default()
    };
    // Never stopped: dropped with the runtime when the agent exits (its only clients are this
    // agent and its workers, which are gone by then).
    serve_here(listener, config, CancellationToken::new());
    Ok(addr.to_string())
}

/// Serves a coordinator on `listener` in this process until `stop` is cancelled.
fn serve_here(
    listener: TcpListener,
    config: muster_coordinator::Config,
    stop: CancellationToken,
) -> JoinHandle<()> {
    // Task "embedded-coordinator": on error, log and print it (the rendezvous then fails and
    // says so); on shutdown, in-flight calls drain (see `Hosted::finish`), or the task is
    // dropped with the runtime.
    tokio::spawn(async move {
        let addr = listener.local_addr().ok();
        if let Err(e) = muster_coordinator::serve(listener, config, stop.cancelled_owned()).await {
            tracing::error!(%e, "embedded coordinator failed");
            if let Some(addr) = addr {
                eprintln!("muster-agent: the coordinator this agent serves at {addr} failed: {e}");
            }
        }
    })
}

/// A listener on `addr` with TCP_NODELAY set, which Linux passes on to every accepted
/// connection. `muster_coordinator::serve` does not set it on the connections it accepts, and
/// without it each answer of more than one write waits ~40 ms for a delayed ACK. A fixed port
/// (a rendezvous endpoint) is bound with SO_REUSEADDR, so that the last job's connections in
/// TIME_WAIT do not keep it; two listeners still cannot share it.
fn nodelay_listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_nodelay(true)?;
    socket.set_reuseaddr(addr.port() != 0)?;
    socket.bind(addr)?;
    socket.listen(1024)
}
