//! Daemon mode: `muster-agent serve` registers this machine with the coordinator (host name,
//! address, CPU count, GPUs found, labels), keeps a lease on its `Agents.Serve` stream, and
//! runs the jobs the coordinator places here, each exactly as `muster-agent launch` would
//! (joining the job's rendezvous as one node, restarting with it, stopping on cancel). Also the
//! operator's side: `muster-agent submit`, `status` and `cancel`, thin clients of `Ops`.
//!
//! Tasks:
//! - "serve-job" (one per job placed here): runs the launch; when it ends, its outcome goes to
//!   the coordinator as a `JobUpdate`. On shutdown, cancelled (workers stopped gracefully) and
//!   awaited, bounded by the grace period.
//! - The stream to the coordinator is driven by [`serve`] itself; when it breaks, the agent
//!   registers again with backoff, following the leader among the replicas of a
//!   `--coordinator` list (the `muster-leader` a follower names, else the next address), and
//!   the jobs it runs go on (their own watches carry their leases and follow the leader too).
//!
//! Every `--coordinator` here takes one `HOST:PORT` or a comma-separated list of replicas.

pub use crate::cli::daemon_args::Request;
use crate::cli::daemon_args::{CancelArgs, ServeArgs, StatusArgs, SubmitArgs, pairs};
use crate::failover;
use crate::launch::{self, Outcome, Stops};
use crate::operator::{CONNECT_WINDOW, connect, describe};
use crate::spec::LaunchSpec;
use muster_proto::v1 as pb;
use muster_proto::v1::agents_client::AgentsClient;
use muster_proto::v1::ops_client::OpsClient;
use std::collections::HashMap;
use std::time::Duration;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Runs a daemon-mode or operator command; returns the exit status, or a one-line error.
pub async fn run(request: Request) -> Result<u8, String> {
    match request {
        Request::Serve(a) => serve(a).await,
        Request::Submit(a) => submit(a).await,
        Request::Status(a) => status(a).await,
        Request::Cancel(a) => cancel(a).await,
        Request::Describe(a) => crate::describe::run(a).await,
    }
}

/// After the grace period, how long a job the coordinator ordered stopped may take to end on
/// its own (through its watch) before the agent stops it itself.
const STOP_BACKSTOP: Duration = Duration::from_secs(3);

/// `muster-agent submit`: prints the job id and where it runs; with `--wait`, follows it to
/// its end. Returns the exit status.
pub async fn submit(args: SubmitArgs) -> Result<u8, String> {
    let spec = args.job_spec()?;
    let coordinators = connect(&args.coordinator, &args.security).await?;
    // Not idempotent: sent again only when a refusal proves it was not applied.
    let request = pb::SubmitJobRequest { spec: Some(spec) };
    let answer = failover::call_if(
        &coordinators,
        "Ops.SubmitJob",
        failover::not_applied,
        |ch| {
            let request = request.clone();
            async move { OpsClient::new(ch).submit_job(request).await }
        },
    )
    .await
    .map_err(|s| format!("submit refused: {}", crate::security::explain(&s)))?
    .into_inner();
    println!(
        "job {} submitted to {}",
        answer.job_id,
        answer.agents.join(", ")
    );
    if !args.wait {
        return Ok(0);
    }
    // Only states come back here: the workers' lines never pass through the coordinator.
    println!("{OUTPUT_NOTE}");
    let mut last = String::new();
    let mut seen: Option<pb::JobSummary> = None;
    loop {
        // A long poll: the coordinator answers when the job's summary changes, so the
        // outcome is printed as it happens (bounded, so a failover is noticed).
        let d = describe(&coordinators, &answer.job_id, seen.take())
            .await
            .map_err(|s| {
                format!(
                    "cannot follow job {}: {}",
                    answer.job_id,
                    crate::security::explain(&s)
                )
            })?;
        let line = status_line(&d);
        if line != last {
            println!("{line}");
            last = line;
        }
        let summary = d.summary.unwrap_or_default();
        let state = pb::RoundState::try_from(summary.state).unwrap_or_default();
        if summary.done {
            return Ok(match state {
                pb::RoundState::Finished => 0,
                pb::RoundState::Cancelled => {
                    println!("job {}: {}", summary.job_id, summary.reason);
                    launch::CANCELLED_EXIT
                }
                _ if d.failure.as_ref().is_some_and(|f| f.hang) => launch::HUNG_EXIT,
                _ => 1,
            });
        }
        seen = Some(summary);
    }
}

/// What `submit --wait` says about the workers' output, which it does not show.
const OUTPUT_NOTE: &str = "worker output is not shown here: each agent prints its workers' lines, prefixed [rank R], on its own stdout and stderr (its terminal, or its service's log: journalctl -u muster-agent, kubectl logs)";

/// One line for a job: state, generation, nodes and restarts, and its failure if any.
fn status_line(d: &pb::DescribeJobResponse) -> String {
    let s = d.summary.clone().unwrap_or_default();
    let mut line = crate::operator::job_headline(&s, "workers");
    if s.state == pb::RoundState::Open as i32 {
        line.push_str(&format!(", {} nodes waiting", s.nodes_waiting));
    }
    if let Some(f) = &d.failure {
        line.push_str(&format!(
            "; failure: rank {} (node {}, host {}) {}",
            f.rank(),
            f.node_rank(),
            f.host,
            f.reason
        ));
    } else if s.done && !s.reason.is_empty() {
        // Why it is over (the failure above says it better when there is one).
        line.push_str(&format!("; {}", s.reason));
    }
    line
}

/// How `status` names a node: by its node rank, or as not ranked yet (a joiner of an open
/// round that asked for no rank). Takes the wire value either as sent today (`u32::MAX` for
/// none) or as an optional rank (field presence), so that both read the same.
fn node_label(node_rank: impl Into<Option<u32>>) -> String {
    match node_rank.into() {
        Some(r) if r != u32::MAX => format!("node {r}"),
        _ => "node (not yet ranked)".to_owned(),
    }
}

/// `muster-agent status`.
pub async fn status(args: StatusArgs) -> Result<u8, String> {
    let coordinators = connect(&args.coordinator, &args.security).await?;
    if let Some(job) = args.job_id {
        let d = describe(&coordinators, &job, None)
            .await
            .map_err(|s| crate::security::explain(&s))?;
        println!("{}", status_line(&d));
        for n in &d.nodes {
            let place = if n.state == pb::NodeState::Joining as i32 {
                format!("{} workers, joining the open round", n.local_world_size)
            } else {
                format!("{} workers from rank {}", n.local_world_size, n.rank_offset)
            };
            println!(
                "  {} {} ({}): {place}",
                node_label(n.node_rank),
                n.node_id,
                n.host
            );
        }
        return Ok(0);
    }
    let jobs = failover::call(&coordinators, "Ops.ListJobs", |ch| async move {
        OpsClient::new(ch).list_jobs(pb::ListJobsRequest {}).await
    })
    .await
    .map_err(|s| crate::security::explain(&s))?
    .into_inner();
    for s in jobs.jobs {
        println!(
            "{}",
            status_line(&pb::DescribeJobResponse {
                summary: Some(s),
                ..Default::default()
            })
        );
    }
    let agents = failover::call(&coordinators, "Ops.ListAgents", |ch| async move {
        OpsClient::new(ch)
            .list_agents(pb::ListAgentsRequest {})
            .await
    })
    .await
    .map_err(|s| crate::security::explain(&s))?
    .into_inner();
    for a in agents.agents {
        let m = a.machine.unwrap_or_default();
        let mut labels: Vec<String> = m.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        let spare = if a.spare_for.is_empty() {
            String::new()
        } else {
            format!(", spare for [{}]", a.spare_for.join(","))
        };
        println!(
            "agent {} on {} ({}): {} cpus, {} gpus, labels [{}], jobs [{}]{spare}, seen {} ms ago",
            m.agent_id,
            m.hostname,
            m.address,
            m.cpus,
            m.gpus.len(),
            labels.join(","),
            a.jobs.join(","),
            a.last_seen_ms_ago
        );
    }
    Ok(0)
}

/// `muster-agent cancel`.
pub async fn cancel(args: CancelArgs) -> Result<u8, String> {
    let coordinators = connect(&args.coordinator, &args.security).await?;
    // Idempotent: a second cancel of a cancelled job answers "already over".
    let request = pb::CancelJobRequest {
        job_id: args.job_id.clone(),
        reason: args.reason,
    };
    let answer = failover::call(&coordinators, "Ops.CancelJob", |ch| {
        let request = request.clone();
        async move { OpsClient::new(ch).cancel_job(request).await }
    })
    .await
    .map_err(|s| format!("cancel refused: {}", crate::security::explain(&s)))?
    .into_inner();
    if answer.cancelled {
        println!("job {} cancelled", args.job_id);
    } else {
        println!("job {} was already over", args.job_id);
    }
    Ok(0)
}

/// The spec of a job placed here: its flags ([`ServeArgs::launch_args`], `--spare` when it is
/// placed as a spare) through the command line's validation, then the job's own environment
/// for the workers.
fn launch_spec(
    args: &ServeArgs,
    agent_id: &str,
    spec: &pb::JobSpec,
    spare: bool,
    path: Option<&std::ffi::OsStr>,
) -> Result<LaunchSpec, String> {
    let mut flags = args.launch_args(spec)?;
    flags.spare = spare;
    let mut launch = flags.validate(path).map_err(|e| e.to_string())?;
    let mut env: Vec<(String, String)> = spec.env.clone().into_iter().collect();
    env.sort();
    launch.program.env = env;
    launch.node_id = Some(agent_id.to_owned());
    Ok(launch)
}

/// What a finished job tells the coordinator.
fn update(job_id: &str, result: &Result<Outcome, String>) -> pb::AgentMessage {
    let (outcome, message) = match result {
        Ok(Outcome::Succeeded) => (
            pb::JobOutcome::Succeeded,
            "every worker exited 0".to_owned(),
        ),
        Ok(Outcome::Cancelled) => (pb::JobOutcome::Cancelled, "cancelled".to_owned()),
        Ok(Outcome::Drained) => (
            pb::JobOutcome::Drained,
            "this node was drained; the job goes on without it".to_owned(),
        ),
        Ok(Outcome::Failed) => (pb::JobOutcome::Failed, "failed".to_owned()),
        Ok(Outcome::Hung) => (
            pb::JobOutcome::Failed,
            "failed: the job hung (--on-hang)".to_owned(),
        ),
        Ok(Outcome::Interrupted(sig)) => (
            pb::JobOutcome::Cancelled,
            format!("stopped by {}", sig.as_str()),
        ),
        Err(e) => (pb::JobOutcome::Failed, e.clone()),
    };
    pb::AgentMessage {
        kind: Some(pb::agent_message::Kind::Update(pb::JobUpdate {
            job_id: job_id.to_owned(),
            outcome: outcome as i32,
            message,
        })),
    }
}

/// `muster-agent serve`: runs until SIGTERM or SIGINT, then stops its jobs' workers
/// gracefully and exits 0.
pub async fn serve(args: ServeArgs) -> Result<u8, String> {
    let labels = pairs("--labels", &args.labels)?;
    let hostname = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "localhost".to_owned());
    let agent_id = args
        .agent_id
        .clone()
        .unwrap_or_else(|| format!("{hostname}-{}", std::process::id()));
    let list = crate::cli::coordinator_list(&args.coordinator).map_err(|e| e.to_string())?;
    // Served for as long as the agent runs.
    let _metrics = match args.metrics_addr {
        Some(addr) => Some(crate::metrics::Endpoint::start(addr).await?),
        None => None,
    };
    let security = args.security.resolve()?;
    let coordinators = failover::from_list(&list, failover::DEFAULT_BUDGET)
        .with_security(security.client().clone());
    let address = match &args.advertise_addr {
        Some(a) => a.clone(),
        None => launch::advertise_default(&coordinators.leader_addr()).await,
    };
    let info = pb::MachineInfo {
        agent_id: agent_id.clone(),
        hostname,
        address,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        gpus: crate::gpu::discover()
            .into_iter()
            .map(|g| pb::GpuInfo {
                index: g.index,
                name: g.name.unwrap_or_default(),
            })
            .collect(),
        labels,
    };
    let mut term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
    let path = std::env::var_os("PATH");
    let shutdown = CancellationToken::new();
    // Each job's stop token, its launch task, and its grace period.
    let mut jobs: HashMap<String, (CancellationToken, tokio::task::JoinHandle<()>, Duration)> =
        HashMap::new();
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(String, Result<Outcome, String>)>();
    // Updates not yet delivered (the stream may be down when a job ends).
    let mut pending: Vec<pb::AgentMessage> = vec![];
    let mut backoff = Duration::from_millis(100);
    let mut announced = false;
    'connect: loop {
        let opened = async {
            let (addr, channel) = failover::connect(&coordinators, CONNECT_WINDOW)
                .await
                .map_err(|e| e.to_string())?;
            let (out, out_rx) = mpsc::channel::<pb::AgentMessage>(64);
            let _ = out
                .send(pb::AgentMessage {
                    kind: Some(pb::agent_message::Kind::Register(info.clone())),
                })
                .await;
            let stream = AgentsClient::new(channel)
                .serve(tokio_stream::wrappers::ReceiverStream::new(out_rx))
                .await
                .map_err(|s| {
                    // A follower refuses and may name the leader: go there next.
                    if failover::retryable(&s) {
                        coordinators.failed(&addr, failover::leader_hint(&s).as_deref());
                    }
                    format!(
                        "registration refused by {addr}: {}",
                        crate::security::explain(&s)
                    )
                })?
                .into_inner();
            Ok::<_, String>((addr, out, stream))
        };
        let (addr, out, mut stream) = tokio::select! {
            r = opened => match r {
                Ok(opened) => opened,
                Err(e) => {
                    eprintln!("muster-agent: {e}; retrying in {} ms", backoff.as_millis());
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        _ = term.recv() => break 'connect,
                        _ = int.recv() => break 'connect,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            },
            _ = term.recv() => break 'connect,
            _ = int.recv() => break 'connect,
        };
        backoff = Duration::from_millis(100);
        if announced {
            // Registered again after losing the coordinator.
            crate::metrics::failover(crate::metrics::Stream::Registration);
        } else {
            eprintln!(
                "muster-agent: serving as {} ({}, {} cpus, {} gpus) for coordinator {}",
                agent_id,
                info.address,
                info.cpus,
                info.gpus.len(),
                list
            );
            announced = true;
            // The coordinator read and accepted the registration before opening the stream.
            crate::systemd::registered(&addr);
        }
        for msg in pending.drain(..) {
            let _ = out.send(msg).await;
        }
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                msg = stream.message() => match msg {
                    Ok(Some(cmd)) => match cmd.kind {
                        Some(pb::agent_command::Kind::Registered(r)) => {
                            let every = Duration::from_millis(r.heartbeat_interval_ms.max(50));
                            tick = tokio::time::interval(every);
                        }
                        Some(pb::agent_command::Kind::Start(s)) => {
                            let Some(spec) = s.spec else { continue };
                            let job_id = spec.job_id.clone();
                            if jobs.contains_key(&job_id) {
                                continue;
                            }
                            eprintln!("muster-agent: starting job {job_id}: {} {}", spec.program, spec.args.join(" "));
                            match launch_spec(&args, &agent_id, &spec, s.spare, path.as_deref()) {
                                Ok(launch_spec) => {
                                    let grace = launch_spec.grace_period;
                                    let token = shutdown.child_token();
                                    let stops = Stops::token(token.clone());
                                    let tx = done_tx.clone();
                                    let id = job_id.clone();
                                    // Task "serve-job": see the module doc.
                                    let handle = tokio::spawn(async move {
                                        let result = launch::run_with(launch_spec, stops)
                                            .await
                                            .map_err(|e| e.to_string());
                                        let _ = tx.send((id, result));
                                    });
                                    jobs.insert(job_id, (token, handle, grace));
                                }
                                Err(e) => {
                                    eprintln!("muster-agent: job {job_id} cannot start here: {e}");
                                    let _ = out.send(update(&job_id, &Err(e))).await;
                                }
                            }
                        }
                        Some(pb::agent_command::Kind::Stop(s)) => {
                            if let Some((token, _, grace)) = jobs.get(&s.job_id) {
                                // The cancel reaches the launch through its own watch (or its
                                // join's refusal) with the operator's reason, and ends it as
                                // cancelled; stopping it here at once would race that and end
                                // it as if by SIGTERM. The token is the backstop for a launch
                                // that has not heard the cancel once its workers could have
                                // been stopped.
                                let token = token.clone();
                                let after = *grace + STOP_BACKSTOP;
                                // Task "stop-backstop", one per stop order: sleeps, then
                                // cancels the job's token (a no-op once the launch ended).
                                tokio::spawn(async move {
                                    tokio::time::sleep(after).await;
                                    token.cancel();
                                });
                            }
                        }
                        Some(pb::agent_command::Kind::Heartbeat(_)) | None => {}
                    },
                    Ok(None) | Err(_) => {
                        let from = coordinators.leader_addr();
                        let hint = match &msg {
                            Err(s) => failover::leader_hint(s),
                            Ok(_) => None,
                        };
                        coordinators.failed(&from, hint.as_deref());
                        eprintln!("muster-agent: lost the coordinator at {from}; registering again");
                        continue 'connect;
                    }
                },
                Some((job_id, result)) = done_rx.recv() => {
                    jobs.remove(&job_id);
                    let msg = update(&job_id, &result);
                    if out.send(msg.clone()).await.is_err() {
                        pending.push(msg);
                    }
                }
                _ = tick.tick() => {
                    let _ = out.try_send(pb::AgentMessage {
                        kind: Some(pb::agent_message::Kind::Heartbeat(pb::Heartbeat {})),
                    });
                }
                _ = term.recv() => break 'connect,
                _ = int.recv() => break 'connect,
            }
        }
    }
    // Shutdown: stop every job's workers gracefully and wait for them (bounded).
    shutdown.cancel();
    let wait = Duration::from_millis(args.grace_period_ms) + Duration::from_secs(3);
    for (job_id, (_, handle, _)) in jobs {
        if tokio::time::timeout(wait, handle).await.is_err() {
            eprintln!(
                "muster-agent: job {job_id} did not stop within {} ms",
                wait.as_millis()
            );
        }
    }
    eprintln!("muster-agent: agent {agent_id} stopped");
    Ok(0)
}
