//! The command line's tests: whole command lines through [`super::parse_in`], and the
//! helpers the submodules' tests share.

use super::values::derived_job_id;
use super::*;
use crate::gpu::{Discovery, GpuInfo, GpuMapping, GpuPlan};
use std::path::PathBuf;
use std::time::Duration;

/// A machine with `gpus` GPUs (none: no driver at all), 4 CPU cores and
/// `PATH=/usr/bin:/bin`.
///
/// Its OMP_NUM_THREADS is set, so that several workers bring no warning (the one given
/// without it is tested in `cli::torchrun`).
pub(crate) fn machine(gpus: Option<u32>) -> Context<'static> {
    Context {
        path_var: Some(OsStr::new("/usr/bin:/bin")),
        gpus: Discovery {
            gpus: (0..gpus.unwrap_or(0))
                .map(|index| GpuInfo {
                    index,
                    name: None,
                    uuid: None,
                    bus: None,
                })
                .collect(),
            driver_seen: gpus.is_some(),
        },
        cuda_visible_devices: None,
        cpus: 4,
        omp_num_threads: Some("2".to_owned()),
        ..Context::default()
    }
}

/// The spec in one line: the original fields, then the others only where they differ
/// from their defaults, then the warnings.
pub(super) fn summary(s: &LaunchSpec, warnings: &[String]) -> String {
    let mut out = format!(
        "n={} nodes={}:{} rank={:?} coord={:?} job={} grace={}ms relay={} prog={} args={:?}",
        s.nproc_per_node,
        s.nodes.min,
        s.nodes.max,
        s.node_rank,
        s.coordinator,
        if s.job_id.starts_with("job-") {
            "<fresh>"
        } else {
            &s.job_id
        },
        s.grace_period.as_millis(),
        s.relay,
        s.program.name.to_string_lossy(),
        s.program.args,
    );
    let mut add = |part: String| {
        out.push(' ');
        out.push_str(&part);
    };
    if let Some(a) = &s.advertise_addr {
        add(format!("advertise={a}"));
    }
    if let Some(a) = &s.metrics_addr {
        add(format!("metrics={a}"));
    }
    if s.max_restarts > 0 {
        add(format!("restarts={}", s.max_restarts));
    }
    if s.recovery != crate::env::Recovery::Restart {
        add(format!("recovery={}", s.recovery));
    }
    if s.hang.timeout != Some(crate::cli::validate::DEFAULT_HANG_TIMEOUT) {
        add(match s.hang.timeout {
            Some(d) => format!("hang={}s", d.as_secs()),
            None => "hang=off".to_owned(),
        });
    }
    if s.hang.action != muster_core::requests::OnHang::Report {
        add(format!("on_hang={}", s.hang.action));
    }
    if s.sample_hz != crate::cli::validate::DEFAULT_SAMPLE_HZ {
        add(format!("sample={}", s.sample_hz));
    }
    if !s.flight_recorder {
        add("flight=off".to_owned());
    }
    if let Some(d) = s.join_timeout {
        add(format!("join={}ms", d.as_millis()));
    }
    if let Some(d) = s.last_call {
        add(format!("last_call={}ms", d.as_millis()));
    }
    if s.lease != Duration::from_secs(10) {
        add(format!("lease={}ms", s.lease.as_millis()));
    }
    if s.failover_timeout != Duration::from_secs(30) {
        add(format!("failover={}ms", s.failover_timeout.as_millis()));
    }
    if s.master_addr.is_some() || s.master_port.is_some() {
        add(format!("master={:?}:{:?}", s.master_addr, s.master_port));
    }
    if s.gpus != GpuPlan::cpu() {
        add(format!(
            "gpus={}{}{}",
            s.gpus.devices.join(","),
            if s.gpus.set_visible_devices {
                "/set"
            } else {
                ""
            },
            if s.gpus.mapping == GpuMapping::OnePerProcess {
                "/one-per-process"
            } else {
                ""
            }
        ));
    }
    if let Some(d) = &s.output.log_dir {
        add(format!("log_dir={}", d.display()));
    }
    if let Some(r) = &s.output.console_ranks {
        add(format!("console={r:?}"));
    }
    if let Some(mp) = &s.mixed_precision {
        add(format!("mp={mp}"));
    }
    if !s.security.is_plaintext() {
        add(format!("{:?}", s.security));
    }
    for (on, name) in [
        (s.use_cpu, "cpu"),
        (s.debug, "debug"),
        (s.cpu_affinity, "affinity"),
    ] {
        if on {
            add(name.to_owned());
        }
    }
    if s.role != crate::env::DEFAULT_ROLE {
        add(format!("role={}", s.role));
    }
    if s.virtual_local_rank {
        add("virtual-local-rank".to_owned());
    }
    if !s.agent_store {
        add("no-agent-store".to_owned());
    }
    for w in warnings {
        match w.strip_prefix(NOTE) {
            Some(n) => add(format!("| note: {n}")),
            None => add(format!("| warning: {w}")),
        }
    }
    out
}

/// Parses `args` (after `muster-agent launch`) on `ctx` and compares the outcome:
/// `Ok(summary)` of the spec, or `Err(message)`.
pub(super) fn check_on(ctx: &Context<'_>, args: &str, expected: Result<&str, &str>) {
    let argv = ["muster-agent", "launch"]
        .into_iter()
        .map(str::to_owned)
        .chain(args.split_whitespace().map(str::to_owned));
    let got = match parse_in(argv, ctx) {
        Ok((Parsed::Launch(s), warnings)) => Ok(summary(&s, &warnings)),
        Ok((Parsed::Exit(code), _)) => Ok(format!("exit {code}")),
        Ok((Parsed::Daemon(r), _)) => Ok(format!("{r:?}")),
        Ok((p @ Parsed::Certs(..), _)) => Ok(format!("{p:?}")),
        Err(e) => Err(e.to_string()),
    };
    let got = got.as_deref().map_err(String::as_str);
    assert_eq!(got, expected, "muster-agent launch {args}");
}

/// [`check`] with the arguments given one by one (for values with blanks).
fn check_args(args: &[&str], expected: Result<&str, &str>) {
    let argv = ["muster-agent", "launch"]
        .iter()
        .chain(args)
        .map(|a| (*a).to_owned());
    let got = match parse_in(argv, &machine(None)) {
        Ok((Parsed::Launch(s), warnings)) => Ok(summary(&s, &warnings)),
        Ok((other, _)) => Ok(format!("{other:?}")),
        Err(e) => Err(e.to_string()),
    };
    assert_eq!(got.as_deref().map_err(String::as_str), expected, "{args:?}");
}

/// [`check_on`] a machine without GPUs.
pub(super) fn check(args: &str, expected: Result<&str, &str>) {
    check_on(&machine(None), args, expected);
}

#[test]
fn valid_command_lines() {
    check(
        "--nproc-per-node 4 -- sh -c true",
        Ok(
            r#"n=4 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog=sh args=["-c", "true"]"#,
        ),
    );
    check(
        "--nproc_per_node=2 --grace-period-ms 10 --job-id a.b-c_1 sh",
        Ok(
            r#"n=2 nodes=1:1 rank=None coord=None job=a.b-c_1 grace=10ms relay=true prog=sh args=[]"#,
        ),
    );
    check(
        "--nproc-per-node 1 --nnodes 2:4 --node-rank 3 --coordinator 10.0.0.1:29470 --job-id j -- sh -x --flag",
        Ok(
            r#"n=1 nodes=2:4 rank=Some(3) coord=Some("10.0.0.1:29470") job=j grace=5000ms relay=true prog=sh args=["-x", "--flag"]"#,
        ),
    );
    // Coordinator replicas: a list, blanks and repeats dropped.
    check(
        "--nproc-per-node 1 --nnodes 2 --coordinator 10.0.0.1:1,10.0.0.2:1,[::1]:1,10.0.0.1:1 --job-id j -- sh",
        Ok(
            r#"n=1 nodes=2:2 rank=None coord=Some("10.0.0.1:1,10.0.0.2:1,[::1]:1") job=j grace=5000ms relay=true prog=sh args=[]"#,
        ),
    );
    check_args(
        &[
            "--nproc-per-node",
            "2",
            "--coordinator",
            "a:1, b:2",
            "--failover-timeout-ms",
            "1500",
            "--",
            "sh",
        ],
        Ok(
            r#"n=2 nodes=1:1 rank=None coord=Some("a:1,b:2") job=<fresh> grace=5000ms relay=true prog=sh args=[] failover=1500ms"#,
        ),
    );
    check(
        "--nproc-per-node 1 --nnodes 2 --coordinator [::1]:1 --job-id j -- /bin/sh",
        Ok(
            r#"n=1 nodes=2:2 rank=None coord=Some("[::1]:1") job=j grace=5000ms relay=true prog=/bin/sh args=[]"#,
        ),
    );
    check(
        "--nproc-per-node 1 --max-restarts 0 -- sh",
        Ok(
            r#"n=1 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[]"#,
        ),
    );
    check(
        "--nproc-per-node 1 --no-relay -- sh",
        Ok(
            r#"n=1 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=false prog=sh args=[]"#,
        ),
    );
    check(
        "--nproc-per-node 1 --no-agent-store -- sh",
        Ok(
            r#"n=1 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[] no-agent-store"#,
        ),
    );
    check(
        "--nproc-per-node 1 --no_agent_store -- sh",
        Ok(
            r#"n=1 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[] no-agent-store"#,
        ),
    );
    // The flag takes no value: a value is the program.
    check(
        "--nproc-per-node 1 --no-agent-store=1 -- sh",
        Err(
            "unexpected value '1' for '--no-agent-store' found; no more were expected (see `muster-agent launch --help`)",
        ),
    );
    check(
        "--nproc-per-node 1 --node-rank 0 -- sh",
        Ok(
            r#"n=1 nodes=1:1 rank=Some(0) coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[]"#,
        ),
    );
    // torchrun's default: one worker.
    check(
        "-- sh",
        Ok(
            r#"n=1 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[]"#,
        ),
    );
}

/// The common prefix of a one-node spec with `n` workers running `sh`.
pub(super) fn one_node(n: u32, rest: &str) -> String {
    format!(
        "n={n} nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[]{rest}"
    )
}

#[test]
fn supervision_and_rendezvous_flags() {
    for (args, rest) in [
        ("--max-restarts 3", " restarts=3"),
        ("--max_restarts 2", " restarts=2"),
        ("--advertise-addr 10.1.2.3", " advertise=10.1.2.3"),
        ("--host node-a.example", " advertise=node-a.example"),
        ("--advertise_addr fe80::1", " advertise=fe80::1"),
        ("--metrics-addr 0.0.0.0:29472", " metrics=0.0.0.0:29472"),
        ("--metrics_addr [::1]:9100", " metrics=[::1]:9100"),
        (
            "--join-timeout-ms 5000 --last-call-ms 0",
            " join=5000ms last_call=0ms",
        ),
        (
            "--rdzv-conf join_timeout=10,last_call_timeout=2.5",
            " join=10000ms last_call=2500ms",
        ),
        // Both forms, agreeing.
        (
            "--rdzv_conf join_timeout=10 --join-timeout-ms 10000",
            " join=10000ms",
        ),
        ("--lease-ms 2500", " lease=2500ms"),
        ("--failover-timeout-ms 5000", " failover=5000ms"),
        ("--failover_timeout_ms 0", " failover=0ms"),
        ("--failover-timeout-ms 30000", ""),
        ("--monitor-interval 0.1", ""),
        ("--monitor_interval 5", ""),
        (
            "--master-addr 10.0.0.9 --master_port 29600",
            r#" master=Some("10.0.0.9"):Some(29600)"#,
        ),
        ("--master-port 0", ""),
        (
            "--master_addr h --main_process_ip h --main_process_port 7",
            r#" master=Some("h"):Some(7)"#,
        ),
    ] {
        check(&format!("{args} -- sh"), Ok(&one_node(1, rest)));
    }
}

/// `--hang-timeout`, `--on-hang` and `--sample-stacks` (and their config-file keys): 5 min
/// and report unless asked, off when sampling is off and no timeout is given; the flags beat
/// the file; a bad value is one line naming the flag.
#[test]
fn hang_detection_and_sampling() {
    for (args, rest) in [
        ("", ""),
        (
            "--hang-timeout 90s --on-hang fail",
            " hang=90s on_hang=fail",
        ),
        (
            "--hang-timeout off --on-hang restart",
            " hang=off on_hang=restart",
        ),
        ("--hang-timeout 1m30s", " hang=90s"),
        ("--sample-stacks 0", " hang=off sample=0"),
        ("--sample-stacks 0 --hang-timeout 2m", " hang=120s sample=0"),
        ("--sample-stacks 10", " sample=10"),
    ] {
        check(&format!("{args} -- sh"), Ok(&one_node(1, rest)));
    }
    for (args, expected) in [
        (
            "--sample-stacks 500 -- sh",
            "--sample-stacks 500: expected 0 (only on demand) to 100 samples a second",
        ),
        (
            "--hang-timeout 500ms -- sh",
            "--hang-timeout 500ms: the least is 1s (or off)",
        ),
    ] {
        check(args, Err(expected));
    }
    let file = ConfigFile::new(
        "hang",
        "muster_hang_timeout: 90s\nmuster_on_hang: fail\nmuster_sample_stacks: 10\n",
    );
    let p = file.path();
    check(
        &format!("--config-file {p} -- sh"),
        Ok(&one_node(1, " hang=90s on_hang=fail sample=10")),
    );
    check(
        &format!("--config-file {p} --hang-timeout off --on-hang report --sample-stacks 2 -- sh"),
        Ok(&one_node(1, " hang=off")),
    );
    // torch's Flight Recorder: on unless the flag or the file's key turns it off.
    check(
        "--no-flight-recorder -- sh",
        Ok(&one_node(1, " flight=off")),
    );
    let off = ConfigFile::new("flight", "muster_flight_recorder: false\n");
    check(
        &format!("--config-file {} -- sh", off.path()),
        Ok(&one_node(1, " flight=off")),
    );
    let on = ConfigFile::new("flight-on", "muster_flight_recorder: true\n");
    check(
        &format!("--config-file {} --no-flight-recorder -- sh", on.path()),
        Ok(&one_node(1, " flight=off")),
    );
}

/// `--recovery` (and its config-file key): restart unless asked; the flag beats the file; a
/// value that is neither mode is one line naming it.
#[test]
fn the_recovery_mode() {
    for (args, rest) in [
        ("", ""),
        ("--recovery restart", ""),
        (
            "--recovery in-place --max-restarts 2",
            " restarts=2 recovery=in-place",
        ),
        ("--recovery=in-place", " recovery=in-place"),
        ("--recovery_mode in-place", " recovery=in-place"),
    ] {
        check(&format!("{args} -- sh"), Ok(&one_node(1, rest)));
    }
    let err = |args: &str| {
        let argv = ["muster-agent", "launch"]
            .into_iter()
            .chain(args.split_whitespace());
        parse_in(argv, &machine(None))
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let bad = err("--recovery inplace -- sh").expect_err("not a mode");
    assert!(
        bad.contains("'inplace'") && bad.contains("--recovery") && !bad.contains('\n'),
        "{bad}"
    );
    let file = ConfigFile::new("recovery", "muster_recovery: in-place\n");
    let p = file.path();
    check(
        &format!("--config-file {p} -- sh"),
        Ok(&one_node(1, " recovery=in-place")),
    );
    check(
        &format!("--config-file {p} --recovery restart -- sh"),
        Ok(&one_node(1, "")),
    );
    let bad_file = ConfigFile::new("bad-recovery", "muster_recovery: sometimes\n");
    let p = bad_file.path();
    check(
        &format!("--config-file {p} -- sh"),
        Err(&format!(
            "--config-file '{p}': muster_recovery: 'sometimes' is not a recovery mode: expected restart or in-place"
        )),
    );
}

#[test]
fn invalid_supervision_and_rendezvous_flags() {
    for (args, expected) in [
        (
            "--advertise-addr 10.0.0.1:5",
            "--advertise-addr '10.0.0.1:5' must be a host name or IP address, without a port",
        ),
        (
            "--advertise-addr [::1]",
            "--advertise-addr '[::1]' must be a host name or IP address, without a port",
        ),
        (
            "--master-addr a/b",
            "--master-addr 'a/b' is not a host name or IP address (it contains '/')",
        ),
        (
            "--join-timeout-ms 5000 --rdzv-conf join_timeout=10",
            "--join-timeout-ms 5000 conflicts with --rdzv-conf join_timeout=10",
        ),
        (
            "--last-call-ms 1 --rdzv-conf last_call_timeout=0.5",
            "--last-call-ms 1 conflicts with --rdzv-conf last_call_timeout=0.5",
        ),
        (
            "--rdzv-conf join_timeout",
            "invalid value 'join_timeout' for '--rdzv-conf <KEY=VALUE,...>': 'join_timeout' is not KEY=VALUE (see `muster-agent launch --help`)",
        ),
        (
            "--rdzv-conf join_timeout=soon",
            "invalid value 'join_timeout=soon' for '--rdzv-conf <KEY=VALUE,...>': join_timeout=soon: expected a number of seconds (see `muster-agent launch --help`)",
        ),
        (
            "--rdzv-conf last_call_timeout=1e30",
            "invalid value 'last_call_timeout=1e30' for '--rdzv-conf <KEY=VALUE,...>': last_call_timeout=1e30: expected a number of seconds (see `muster-agent launch --help`)",
        ),
        (
            "--join-timeout-ms 0",
            "--join-timeout-ms 0 is out of range: 1 ms to 24 hours",
        ),
        (
            "--rdzv-conf last_call_timeout=90000",
            "--rdzv-conf last_call_timeout=90000 is out of range: 0 to 24 hours",
        ),
        (
            "--lease-ms 0",
            "--lease-ms 0: a node needs some time to keep its workers without the coordinator",
        ),
        (
            "--failover-timeout-ms 86400001",
            "--failover-timeout-ms 86400001 is out of range: 0 to 24 hours",
        ),
        (
            "--monitor-interval NaN",
            "--monitor-interval NaN is not a number of seconds",
        ),
        (
            "--master-addr a --main_process_ip b",
            "--master-addr a conflicts with --main_process_ip b",
        ),
        (
            "--master-port 1 --main_process_port 2",
            "--master-port 1 conflicts with --main_process_port 2",
        ),
        (
            "--master-port 70000",
            "invalid value '70000' for '--master-port <PORT>': 70000 is not in 0..=65535 (see `muster-agent launch --help`)",
        ),
    ] {
        check(&format!("{args} -- sh"), Err(expected));
    }
}

#[test]
fn accelerate_flags() {
    let multi = r#"n=4 nodes=2:2 rank=Some(1) coord=Some("10.0.0.1:29470") job=muster-10.0.0.1-29501 grace=5000ms relay=true prog=sh args=[] master=Some("10.0.0.1"):Some(29501)"#;
    for (args, expected) in [
            ("--num_processes 4", one_node(4, "")),
            ("--num-processes 2 --multi_gpu", one_node(2, "")),
            ("--nproc-per-node 4 --num_processes 4", one_node(4, "")),
            (
                "--num_processes 8 --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1 --main_process_port 29501",
                multi.to_owned(),
            ),
            (
                "--nproc-per-node 4 --nnodes 2 --num_machines 2 --node-rank 1 --machine_rank 1 --master-addr 10.0.0.1 --master-port 29501",
                multi.to_owned(),
            ),
            (
                "--nproc-per-node 3 --num_processes 6 --nnodes 2 --coordinator h:1 --job-id j",
                r#"n=3 nodes=2:2 rank=None coord=Some("h:1") job=j grace=5000ms relay=true prog=sh args=[]"#.to_owned(),
            ),
            // The coordinator and job id follow from the main machine's address.
            (
                "--nnodes 2 --master-addr node0",
                r#"n=1 nodes=2:2 rank=None coord=Some("node0:29470") job=muster-node0-29500 grace=5000ms relay=true prog=sh args=[] master=Some("node0"):None"#.to_owned(),
            ),
            (
                "--nnodes 1:2 --main_process_ip fe80::1 --coordinator c:9",
                r#"n=1 nodes=1:2 rank=None coord=Some("c:9") job=muster-fe80--1-29500 grace=5000ms relay=true prog=sh args=[] master=Some("fe80::1"):None"#.to_owned(),
            ),
            (
                "--nnodes 2 --main_process_ip fe80::1",
                r#"n=1 nodes=2:2 rank=None coord=Some("[fe80::1]:29470") job=muster-fe80--1-29500 grace=5000ms relay=true prog=sh args=[] master=Some("fe80::1"):None"#.to_owned(),
            ),
            (
                "--mixed-precision BF16 --debug --enable_cpu_affinity",
                one_node(1, " mp=bf16 debug affinity"),
            ),
            ("--mixed_precision no --cpu", one_node(1, " mp=no cpu")),
            ("--use_cpu", one_node(1, " cpu")),
            ("--use-cpu --gpu-ids all", one_node(1, " cpu")),
            ("--nproc-per-node cpu", one_node(4, "")),
            ("--nproc-per-node auto", one_node(4, "")),
        ] {
            check(&format!("{args} -- sh"), Ok(&expected));
        }
}

#[test]
fn invalid_accelerate_flags() {
    for (args, expected) in [
        (
            "--num_processes 6 --num_machines 4 --coordinator h:1 --job-id j",
            "--num_processes 6 is not a multiple of --num_machines 4",
        ),
        (
            "--nproc-per-node 4 --num_processes 6",
            "--nproc-per-node 4 conflicts with --num_processes 6 (with --nnodes 1)",
        ),
        (
            "--nproc-per-node 2 --num_processes 4 --nnodes 1:2 --coordinator h:1 --job-id j",
            "--nproc-per-node 2 conflicts with --num_processes 4 (with --nnodes 1:2)",
        ),
        (
            "--num_processes 4 --nnodes 1:2 --coordinator h:1 --job-id j",
            "--num_processes 4 is a total across machines: it needs a fixed number of machines, not --nnodes 1:2",
        ),
        (
            "--num_processes 9000",
            "--num_processes 9000 over --nnodes 1 is 9000 workers per node, out of range 1..=4096",
        ),
        (
            "--num_processes 0",
            "--num_processes 0 over --nnodes 1 is 0 workers per node, out of range 1..=4096",
        ),
        (
            "--nnodes 1:2 --num_machines 2",
            "--nnodes 1:2 conflicts with --num_machines 2",
        ),
        (
            "--num_machines 0",
            "--num_machines 0 is out of range 1..=100000",
        ),
        (
            "--node-rank 0 --machine_rank 1 --nnodes 2 --coordinator h:1 --job-id j",
            "--node-rank 0 conflicts with --machine_rank 1",
        ),
        (
            "--machine_rank 2 --num_machines 2 --main_process_ip h",
            "--machine_rank 2 is out of range for --num_machines 2 (node ranks are 0..2)",
        ),
        (
            "--mixed_precision fp32",
            "invalid value 'fp32' for '--mixed-precision <MODE>': expected one of no, fp16, bf16, fp8, found \"fp32\" (see `muster-agent launch --help`)",
        ),
        ("--cpu --gpu-ids 0", "--cpu conflicts with --gpu-ids 0"),
        (
            "--nproc-per-node gpu",
            "--nproc-per-node gpu: no GPU found on this machine",
        ),
        (
            "--nproc-per-node many",
            "invalid value 'many' for '--nproc-per-node <N>': expected a number, gpu, cpu or auto (see `muster-agent launch --help`)",
        ),
    ] {
        check(&format!("{args} -- sh"), Err(expected));
    }
}

#[test]
fn gpus_and_output() {
    let two = machine(Some(2));
    for (args, expected) in [
            ("", Ok(one_node(1, " gpus=0,1"))),
            ("--nproc-per-node gpu", Ok(one_node(2, " gpus=0,1"))),
            ("--nproc-per-node auto", Ok(one_node(2, " gpus=0,1"))),
            (
                "--nproc-per-node gpu --gpu-ids 1",
                Ok(one_node(1, " gpus=1/set")),
            ),
            ("--gpu_ids 1,0", Ok(one_node(1, " gpus=1,0/set"))),
            (
                "--nproc-per-node 2 --gpu-mapping one-per-process",
                Ok(one_node(2, " gpus=0,1/set/one-per-process")),
            ),
            (
                "--nproc-per-node 3 --gpu-mapping one-per-process",
                Err(
                    "--gpu-mapping one-per-process gives each worker a GPU of its own, but there are 3 workers for 2 GPUs (0,1); run fewer workers, list more GPUs, or use --gpu-mapping local-rank".to_owned(),
                ),
            ),
            (
                "--gpu-ids 0,3",
                Err(
                    "--gpu-ids 0,3: GPU 3 does not exist: this machine has 2 GPUs (indices 0 to 1)"
                        .to_owned(),
                ),
            ),
            (
                "--gpu-ids 0,0",
                Err("--gpu-ids '0,0' lists GPU 0 twice".to_owned()),
            ),
            (
                "--gpu-mapping sideways",
                Err("invalid value 'sideways' for '--gpu-mapping <MAPPING>' [possible values: local-rank, one-per-process] (see `muster-agent launch --help`)".to_owned()),
            ),
            (
                "--nproc-per-node 2 --log-dir /tmp/muster-logs --local-ranks-filter 1",
                Ok(one_node(2, " gpus=0,1 log_dir=/tmp/muster-logs console=[1]")),
            ),
            (
                "--nproc-per-node 2 --local_ranks_filter 0,1 --log_dir rel",
                Ok(one_node(2, " gpus=0,1 log_dir=rel console=[0, 1]")),
            ),
            (
                "--nproc-per-node 2 --local-ranks-filter 2",
                Err("--local-ranks-filter '2': local rank 2 does not exist (local ranks are 0..2)".to_owned()),
            ),
            (
                "--local-ranks-filter 0,x",
                Err("--local-ranks-filter '0,x': 'x' is not a local rank".to_owned()),
            ),
            (
                "--log-dir /etc/passwd",
                Err("--log-dir '/etc/passwd' is not a directory".to_owned()),
            ),
        ] {
            let expected = expected.as_deref().map_err(String::as_str);
            check_on(&two, &format!("{args} -- sh"), expected);
        }
    // No driver: a list is trusted, with a warning; one GPU per process runs on CPU.
    check(
        "--gpu-ids 0,1 -- sh",
        Ok(&one_node(
            1,
            " gpus=0,1/set | warning: --gpu-ids 0,1: no NVIDIA GPU found on this machine (no /proc/driver/nvidia/gpus, no /dev/nvidia*); passing the list on as given",
        )),
    );
    check(
        "--gpu-mapping one-per-process -- sh",
        Ok(&one_node(
            1,
            " gpus=/one-per-process | warning: --gpu-mapping one-per-process: no GPU found on this machine; the workers run without one",
        )),
    );
    // The agent's own CUDA_VISIBLE_DEVICES is what `gpu` counts and one-per-process hands out.
    let slurm = Context {
        cuda_visible_devices: Some("2,3".to_owned()),
        ..machine(Some(4))
    };
    check_on(
        &slurm,
        "--nproc-per-node gpu --gpu-mapping one-per-process -- sh",
        Ok(&one_node(2, " gpus=2,3/set/one-per-process")),
    );
}

/// Writes an Accelerate config file for a test and removes it when dropped.
struct ConfigFile(PathBuf);

impl ConfigFile {
    fn new(name: &str, text: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "muster-cli-test-{}-{name}.yaml",
            std::process::id()
        ));
        std::fs::write(&path, text).expect("temp file");
        Self(path)
    }

    fn path(&self) -> String {
        self.0.to_string_lossy().into_owned()
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn accelerate_config_files() {
    let single = ConfigFile::new(
        "single",
        "compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
downcast_bf16: 'no'
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
",
    );
    let p = single.path();
    let single_node = |n: u32, rest: &str| {
        format!(
            "n={n} nodes=1:1 rank=Some(0) coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[] mp=fp16{rest}"
        )
    };
    check(&format!("--config-file {p} -- sh"), Ok(&single_node(2, "")));
    // Flags override the file.
    check(
        &format!("--config_file {p} --nproc-per-node 3 --mixed-precision bf16 -- sh"),
        Ok(&single_node(3, "").replace("fp16", "bf16")),
    );
    check(
        &format!("--config-file {p} --num_processes 4 --cpu -- sh"),
        Ok(&single_node(4, " cpu")),
    );

    let multi = ConfigFile::new(
        "multi",
        "distributed_type: MULTI_GPU
machine_rank: 1
main_process_ip: 10.0.0.1
main_process_port: 29501
num_machines: 2
num_processes: 16
max_restarts: 2
debug: true
enable_cpu_affinity: true
my_key: 1
",
    );
    let p = multi.path();
    let warning = format!("| warning: --config-file '{p}': unknown key my_key is ignored");
    check(
        &format!("--config-file {p} -- sh"),
        Ok(&format!(
            r#"n=8 nodes=2:2 rank=Some(1) coord=Some("10.0.0.1:29470") job=muster-10.0.0.1-29501 grace=5000ms relay=true prog=sh args=[] restarts=2 master=Some("10.0.0.1"):Some(29501) debug affinity {warning}"#
        )),
    );
    // A flag's machine count divides the file's total; its rank and address win.
    check(
        &format!(
            "--config-file {p} --num_machines 4 --machine_rank 3 --master-addr m --coordinator c:1 --job-id j --max-restarts 0 -- sh"
        ),
        Ok(&format!(
            r#"n=4 nodes=4:4 rank=Some(3) coord=Some("c:1") job=j grace=5000ms relay=true prog=sh args=[] master=Some("m"):Some(29501) debug affinity {warning}"#
        )),
    );
    check(
        &format!("--config-file {p} --nnodes 3 -- sh"),
        Err(&format!(
            "num_processes 16 in '{p}' is not a multiple of --nnodes 3"
        )),
    );
}

#[test]
fn bad_accelerate_config_files() {
    for (name, text, expected) in [
        (
            "indivisible",
            "num_processes: 6\nnum_machines: 4\nmain_process_ip: h\n",
            "num_processes 6 in '{p}' is not a multiple of num_machines 4 in '{p}'",
        ),
        (
            "rank",
            "num_machines: 2\nmachine_rank: 2\nmain_process_ip: h\n",
            "machine_rank 2 in '{p}' is out of range for num_machines 2 in '{p}' (node ranks are 0..2)",
        ),
        (
            "precision",
            "mixed_precision: fp64\n",
            "--config-file '{p}': mixed_precision: expected one of no, fp16, bf16, fp8, found \"fp64\"",
        ),
        (
            "procs",
            "num_processes: -1\n",
            "--config-file '{p}': num_processes: expected a whole number from 1 to 4294967295, found -1",
        ),
        (
            "multinode",
            "num_machines: 2\n",
            "num_machines 2 in '{p}' needs --coordinator (or --rdzv-endpoint, or the main machine's address: --master-addr, --main_process_ip): every node must name the same one",
        ),
        (
            "cpu-gpu",
            "use_cpu: true\ngpu_ids: 0\n",
            "use_cpu true in '{p}' conflicts with gpu_ids 0 in '{p}'",
        ),
        (
            "shape",
            "just text\n",
            "--config-file '{p}': the file holds \"just text\", not a mapping; expected `key: value` settings as `accelerate config` writes them",
        ),
    ] {
        let file = ConfigFile::new(name, text);
        let p = file.path();
        check(
            &format!("--config-file {p} -- sh"),
            Err(&expected.replace("{p}", &p)),
        );
    }
    let file = ConfigFile::new("gpus", "gpu_ids: 0,5\n");
    let p = file.path();
    check_on(
        &machine(Some(2)),
        &format!("--config-file {p} -- sh"),
        Err(&format!(
            "gpu_ids 0,5 in '{p}': GPU 5 does not exist: this machine has 2 GPUs (indices 0 to 1)"
        )),
    );
    check(
        "--config-file /no/such/accelerate.yaml -- sh",
        Err(
            "--config-file '/no/such/accelerate.yaml': cannot read it: No such file or directory (os error 2)",
        ),
    );
    let broken = ConfigFile::new("broken", "num_processes: [1, 2\n");
    let p = broken.path();
    let argv = ["muster-agent", "launch", "--config-file", &p, "--", "sh"];
    let Err(e) = parse_in(argv, &machine(None)) else {
        panic!("invalid YAML accepted");
    };
    let message = e.to_string();
    assert!(
        message.starts_with(&format!("--config-file '{p}': is not valid YAML: ")),
        "{message}"
    );
}

#[test]
fn invalid_command_lines() {
    check(
        "--nproc-per-node 2 --",
        Err(
            "no program to launch: give it after the flags, as in `muster-agent launch --nproc-per-node 2 train.py`",
        ),
    );
    check(
        "--nproc-per-node 2",
        Err(
            "no program to launch: give it after the flags, as in `muster-agent launch --nproc-per-node 2 train.py`",
        ),
    );
    check(
        "--nproc-per-node 0 -- sh",
        Err("--nproc-per-node 0 is out of range 1..=4096"),
    );
    check(
        "--nproc-per-node 4097 -- sh",
        Err("--nproc-per-node 4097 is out of range 1..=4096"),
    );
    check(
        "--nproc-per-node 1 -- no-such-program-muster-test",
        Err("program 'no-such-program-muster-test' was not found in PATH"),
    );
    check(
        "--nproc-per-node 1 -- /no/such/program",
        Err("program '/no/such/program' does not exist"),
    );
    check(
        "--nproc-per-node 1 -- /etc/passwd",
        Err("program '/etc/passwd' is not executable"),
    );
    check("--nproc-per-node 1 -- /", Err("program '/' is a directory"));
    for bad in ["0", "0:2", "2:1", "a", "1:", ":2", "1:2:3", "100001"] {
        let Err(err) = parse_nnodes(bad) else {
            panic!("--nnodes {bad} was accepted");
        };
        check(
            &format!("--nproc-per-node 1 --nnodes {bad} -- sh"),
            Err(&err.to_string()),
        );
    }
    check(
        "--nproc-per-node 1 --nnodes 0 -- sh",
        Err("--nnodes '0' is malformed: a job needs at least 1 node"),
    );
    check(
        "--nproc-per-node 1 --nnodes 2:1 -- sh",
        Err("--nnodes '2:1' is malformed: MAX is below MIN"),
    );
    check(
        "--nproc-per-node 1 --nnodes 1:x -- sh",
        Err("--nnodes '1:x' is malformed: expected MIN or MIN:MAX, as in 2 or 1:4"),
    );
    check(
        "--nproc-per-node 1 --node-rank 1 -- sh",
        Err("--node-rank 1 is out of range for --nnodes 1 (node ranks are 0..1)"),
    );
    check(
        "--nproc-per-node 1 --nnodes 2:3 --node-rank 3 --coordinator h:1 --job-id j -- sh",
        Err("--node-rank 3 is out of range for --nnodes 2:3 (node ranks are 0..3)"),
    );
    check(
        "--nproc-per-node 1 --job-id a/b -- sh",
        Err(r#"--job-id: job_id "a/b" contains '/'; allowed are letters, digits, '.', '_', '-'"#),
    );
    for bad in [
        "host",
        "host:",
        ":1",
        "host:0",
        "host:70000",
        "http://h:1",
        "::1:5",
        "a:1,",
        "a:1,,b:2",
        "a:1,b",
        ",a:1",
    ] {
        check(
            &format!("--nproc-per-node 1 --coordinator {bad} -- sh"),
            Err(&format!(
                "--coordinator '{bad}' is malformed: expected HOST:PORT, as in 10.0.0.1:29470, or a comma-separated list of them"
            )),
        );
    }
    check(
        "--nproc-per-node 1 --nnodes 2 -- sh",
        Err(
            "--nnodes 2 needs --coordinator (or --rdzv-endpoint, or the main machine's address: --master-addr, --main_process_ip): every node must name the same one",
        ),
    );
    check(
        "--nproc-per-node 1 --nnodes 1:2 --coordinator h:1 -- sh",
        Err(
            "--nnodes 1:2 needs --job-id (or --rdzv-id, or the main machine's address: --master-addr, --main_process_ip): every node must name the same one",
        ),
    );
    for bad in ["localhost:9100", "9100", "1.2.3.4", "1.2.3.4:99999"] {
        check(
            &format!("--metrics-addr={bad} -- sh"),
            Err(&format!(
                "invalid value '{bad}' for '--metrics-addr <IP:PORT>': invalid socket address syntax (see `muster-agent launch --help`)"
            )),
        );
    }
    check(
        "--nproc-per-node 1 --bogus -- sh",
        Err("unexpected argument '--bogus' found (see `muster-agent launch --help`)"),
    );
}

#[test]
fn derived_job_ids() {
    assert_eq!(derived_job_id("fe80::1", 29500), "muster-fe80--1-29500");
}

/// A directory with a CA, a client certificate and key (their content is read, not
/// parsed, at this stage), a good token file and a short one; removed on drop.
struct SecurityFiles(PathBuf);

impl SecurityFiles {
    const TOKEN: &str = "cli-test-cluster-token-0123456789";

    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("muster-agent-cli-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        for (file, content) in [
            ("ca.pem", "CA"),
            ("client.pem", "CERT"),
            ("client-key.pem", "KEY"),
            ("token", &format!("{}\n", Self::TOKEN)),
            ("short", "abc\n"),
        ] {
            std::fs::write(dir.join(file), content).expect("write a file");
        }
        Self(dir)
    }

    fn path(&self, file: &str) -> String {
        self.0.join(file).to_string_lossy().into_owned()
    }
}

impl Drop for SecurityFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn security_flags() {
    let f = SecurityFiles::new("launch");
    let (ca, cert, key, token) = (
        f.path("ca.pem"),
        f.path("client.pem"),
        f.path("client-key.pem"),
        f.path("token"),
    );
    let remote = "--nproc-per-node 1 --coordinator 10.0.0.1:29470";
    let base = r#"n=1 nodes=1:1 rank=None coord=Some("10.0.0.1:29470") job=<fresh> grace=5000ms relay=true prog=sh args=[]"#;
    // Mutual TLS and the token; the token is never shown.
    check(
        &format!(
            "{remote} --tls-ca {ca} --tls-cert {cert} --tls-key {key} --tls-domain coord.svc \
                 --auth-token-file {token} -- sh"
        ),
        Ok(&format!(
            r#"{base} Security {{ tls: Some(TlsFiles {{ ca: "{ca}", identity: Some(("{cert}", "{key}")), domain: Some("coord.svc") }}), token: Some(<redacted>) }}"#
        )),
    );
    // TLS without a client certificate; the token alone (snake_case spellings too).
    check(
        &format!("{remote} --tls_ca {ca} -- sh"),
        Ok(&format!(
            r#"{base} Security {{ tls: Some(TlsFiles {{ ca: "{ca}", identity: None, domain: None }}), token: None }}"#
        )),
    );
    check(
        &format!("{remote} --auth_token_file {token} -- sh"),
        Ok(&format!(
            "{base} Security {{ tls: None, token: Some(<redacted>) }}"
        )),
    );
    // The agent's own coordinator is plaintext: the flags are checked, then unused.
    check(
        &format!("--nproc-per-node 1 --tls-ca {ca} --auth-token-file {token} -- sh"),
        Ok(&one_node(
            1,
            " | warning: --tls-* and --auth-token-file have no use without --coordinator: \
                 the agent's own coordinator listens on 127.0.0.1 without TLS or authentication",
        )),
    );
    // Misuse.
    for (flags, error) in [
        (
            format!("--tls-cert {cert} --tls-key {key}"),
            "--tls-cert needs --tls-ca (the CA that signed the coordinator's certificate)"
                .to_owned(),
        ),
        (
            format!("--tls-key {key}"),
            "--tls-key needs --tls-ca (the CA that signed the coordinator's certificate)"
                .to_owned(),
        ),
        (
            "--tls-domain coord.svc".to_owned(),
            "--tls-domain needs --tls-ca (the CA that signed the coordinator's certificate)"
                .to_owned(),
        ),
        (
            format!("--tls-ca {ca} --tls-cert {cert}"),
            "--tls-cert needs --tls-key (the certificate's private key)".to_owned(),
        ),
        (
            format!("--tls-ca {ca} --tls-key {key}"),
            "--tls-key needs --tls-cert (the client certificate)".to_owned(),
        ),
        (
            format!("--tls-ca {ca} --tls-domain a:b"),
            "--tls-domain 'a:b' is not a host name".to_owned(),
        ),
        (
            "--tls-ca /nonexistent/ca.pem".to_owned(),
            "TLS: cannot read /nonexistent/ca.pem: No such file or directory (os error 2)"
                .to_owned(),
        ),
        (
            "--auth-token-file /nonexistent/token".to_owned(),
            "--auth-token-file: cannot read token file /nonexistent/token: No such file or \
                 directory (os error 2)"
                .to_owned(),
        ),
        (
            format!("--auth-token-file {}", f.path("short")),
            format!(
                "--auth-token-file: token file {}: the token is 3 characters; at least 16 \
                     are required",
                f.path("short")
            ),
        ),
    ] {
        check(&format!("{remote} {flags} -- sh"), Err(&error));
    }
    // The same checks for the daemon and the operator commands.
    for command in [
        "serve --coordinator a:1",
        "submit --coordinator a:1 --nproc-per-node 1",
        "status --coordinator a:1",
        "cancel --coordinator a:1 j",
    ] {
        let argv = |extra: &str| {
            let mut argv = vec!["muster-agent".to_owned()];
            argv.extend(command.split_whitespace().map(str::to_owned));
            argv.extend(extra.split_whitespace().map(str::to_owned));
            if command.starts_with("submit") {
                argv.extend(["--".to_owned(), "sh".to_owned()]);
            }
            argv
        };
        let Err(err) = parse_in(argv(&format!("--tls-cert {cert}")), &machine(None)) else {
            panic!("{command}: --tls-cert without --tls-ca accepted");
        };
        assert_eq!(
            err.to_string(),
            "--tls-cert needs --tls-ca (the CA that signed the coordinator's certificate)",
            "{command}"
        );
        let (parsed, _) = parse_in(
            argv(&format!("--tls-ca {ca} --auth-token-file {token}")),
            &machine(None),
        )
        .unwrap_or_else(|e| panic!("{command}: {e}"));
        let shown = format!("{parsed:?}");
        assert!(shown.contains(&token), "{shown}");
        assert!(!shown.contains(SecurityFiles::TOKEN), "{shown}");
    }
}

/// The agent store's opt-out: the flag, its variable and the config file's key all reach the
/// spec.
#[test]
fn agent_store_opt_out() {
    use clap::Args as _;
    let launch = LaunchArgs::augment_args(clap::Command::new("launch"));
    let arg = launch
        .get_arguments()
        .find(|a| a.get_long() == Some("no-agent-store"))
        .expect("--no-agent-store");
    // Read through the variable in tests/tests/agent_store_launch.rs (the opt-out test):
    // setting it here would race with every other test that parses a launch.
    assert_eq!(arg.get_env(), Some(OsStr::new("MUSTER_NO_AGENT_STORE")));

    let off = ConfigFile::new(
        "no-agent-store",
        "num_processes: 2\nmuster_agent_store: false\n",
    );
    let on = ConfigFile::new(
        "agent-store",
        "num_processes: 2\nmuster_agent_store: true\n",
    );
    let bad = ConfigFile::new("bad-agent-store", "muster_agent_store: sometimes\n");
    let parsed = |args: String| {
        let argv = ["muster-agent", "launch"]
            .into_iter()
            .map(str::to_owned)
            .chain(args.split_whitespace().map(str::to_owned));
        parse_in(argv, &machine(None)).map(|(p, _)| match p {
            Parsed::Launch(s) => s.agent_store,
            other => panic!("not a launch: {other:?}"),
        })
    };
    let spec = |args: String| parsed(args).expect("a valid launch");
    assert!(spec("-- sh".to_owned()));
    assert!(!spec("--no-agent-store -- sh".to_owned()));
    assert!(!spec(format!("--config-file {} -- sh", off.path())));
    assert!(spec(format!("--config-file {} -- sh", on.path())));
    // The key can only opt out; the flag beats a file that keeps the store.
    assert!(!spec(format!(
        "--config-file {} --no-agent-store -- sh",
        on.path()
    )));
    let err = parsed(format!("--config-file {} -- sh", bad.path()))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("muster_agent_store"), "{err}");
}

/// Accelerate's default config file (`accelerate config` writes it): read without
/// `--config_file` in Accelerate's mode, as `accelerate launch` reads it (not with `--cpu`),
/// never for a torchrun-style command line; `--config_file` names another.
#[test]
fn accelerates_default_config_file() {
    let default = ConfigFile::new("default-config", "num_processes: 3\nmax_restarts: 2\n");
    let ctx = Context {
        accelerate_default_config: Some(default.0.clone()),
        ..machine(None)
    };
    let spec = |args: &str| {
        let argv = ["muster-agent", "launch"]
            .into_iter()
            .map(str::to_owned)
            .chain(args.split_whitespace().map(str::to_owned));
        match parse_in(argv, &ctx) {
            Ok((Parsed::Launch(s), warnings)) => summary(&s, &warnings),
            other => panic!("{args}: {other:?}"),
        }
    };
    // Accelerate's mode: a flag only `accelerate launch` has.
    let read = spec("--mixed_precision no -- sh");
    assert!(
        read.starts_with("n=3 ") && read.contains(" restarts=2"),
        "{read}"
    );
    let read = spec("--same_network -- sh");
    assert!(read.starts_with("n=3 "), "{read}");
    // torchrun's form reads no file; `--cpu` skips it as `accelerate launch` does.
    assert_eq!(spec("-- sh"), one_node(1, ""));
    assert!(!spec("--cpu -- sh").contains("restarts=2"));
    // Another file given: that one.
    let other = ConfigFile::new("other-config", "num_processes: 5\n");
    let named = spec(&format!("--config_file {} -- sh", other.path()));
    assert!(named.starts_with("n=5 "), "{named}");
    // No default file: nothing read.
    let missing = Context {
        accelerate_default_config: Some(default.0.with_extension("absent")),
        ..machine(None)
    };
    let argv = [
        "muster-agent",
        "launch",
        "--mixed_precision",
        "no",
        "--",
        "sh",
    ]
    .map(str::to_owned);
    let Ok((Parsed::Launch(s), _)) = parse_in(argv, &missing) else {
        panic!("no launch");
    };
    assert_eq!(s.nproc_per_node, 1);
}
