//! The command line: the subcommands, their parsing, and clap's help and usage messages. The
//! `launch` flags are in [`launch_args`] and validated into a [`LaunchSpec`] by [`validate`];
//! the daemon-mode subcommands' arguments are in [`daemon_args`]. torchrun's flags without a
//! muster spelling are in [`torchrun`], Accelerate's in [`accelerate_flags`].

pub mod accelerate_flags;
pub mod daemon_args;
pub mod error;
pub mod launch_args;
pub mod output;
pub mod rdzv;
pub mod slurm;
#[cfg(test)]
pub(crate) mod tests;
pub mod torchrun;
pub mod validate;
pub mod values;

pub use crate::spec::{LaunchSpec, NodeRange};
use clap::{Parser, Subcommand};
use daemon_args::{CancelArgs, Request, ServeArgs, StatusArgs, SubmitArgs, pairs};
pub use error::UsageError;
pub use launch_args::{LaunchArgs, Nproc};
use std::ffi::{OsStr, OsString};
pub use validate::{Context, DEFAULT_COORDINATOR_PORT};
pub(crate) use values::job_id_chars;
pub use values::{coordinator_list, parse_nnodes};

/// `muster-agent`: one per machine; joins a job's rendezvous and runs the machine's workers.
#[derive(Debug, Parser)]
#[command(name = "muster-agent", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The agent's subcommands.
// Parsed once per process: boxing the big flag sets would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Join a job's rendezvous and run this node's workers until they finish (exit 0), fail
    /// with no restart left (1) or are cancelled by an operator (3).
    Launch(LaunchArgs),
    /// Run as this machine's daemon agent: register with the coordinator and run the jobs it
    /// places here.
    Serve(ServeArgs),
    /// Submit a job to the coordinator's daemon agents.
    Submit(SubmitArgs),
    /// Show the coordinator's jobs and agents, or one job.
    Status(StatusArgs),
    /// Cancel a job: its workers are stopped on every node, and it ends cancelled with the
    /// reason; its agents (and `submit --wait`) exit 3.
    Cancel(CancelArgs),
    /// Write a CA, server and client certificates and a cluster token, for trying TLS.
    #[command(long_about = crate::certs::LONG_ABOUT)]
    Certs(crate::certs::CertsArgs),
    /// Show who a job waits for: each pending barrier's missing ranks and what they are
    /// doing, its nodes and ranks, its last failure (`--watch` to follow it).
    Describe(daemon_args::DescribeArgs),
}

/// What the command line asks for.
// Made once per process and matched right away: boxing the spec would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Parsed {
    /// Launch a job.
    Launch(LaunchSpec),
    /// A daemon-mode or operator command (`serve`, `submit`, `status`, `cancel`).
    Daemon(Request),
    /// Write a trial PKI (`certs`).
    Certs(crate::certs::Plan),
    /// Help or version was asked for (and printed); exit with this status.
    Exit(i32),
}

/// Parses and validates the command line (`args` includes the program name) against the
/// `PATH` given and this machine. Help and version requests are printed here, and so are
/// warnings (`muster-agent: warning: ...` on stderr) when the command line is valid.
pub fn parse<I, T>(args: I, path_var: Option<&OsStr>) -> Result<Parsed, UsageError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let (parsed, warnings) = parse_in(args, &Context::of_process(path_var))?;
    print_messages(&warnings);
    Ok(parsed)
}

/// Marks a message of the warnings list as a note: something accepted that has no effect, or
/// a default taken from the environment; printed as `muster-agent: note: ...`.
pub const NOTE: &str = "note: ";

/// `text` as a note for the warnings list.
pub fn note(text: &str) -> String {
    format!("{NOTE}{text}")
}

/// Prints warnings (`muster-agent: warning: ...`) and notes (`muster-agent: note: ...`).
fn print_messages(messages: &[String]) {
    for m in messages {
        match m.strip_prefix(NOTE) {
            Some(n) => eprintln!("muster-agent: note: {n}"),
            None => eprintln!("muster-agent: warning: {m}"),
        }
    }
}

/// argparse drops a `--` right after torchrun's script when none came before it
/// (`torchrun train.py -- --lr 1` gives `sys.argv == ["train.py", "--lr", "1"]`); clap keeps
/// it. `raw` is the whole command line, which ends with `command`.
fn drop_argparse_separator(raw: &[OsString], command: &mut Vec<OsString>) {
    let before = raw
        .len()
        .checked_sub(command.len() + 1)
        .and_then(|i| raw.get(i));
    if before.is_some_and(|a| a != "--") && command.get(1).is_some_and(|a| a == "--") {
        command.remove(1);
    }
}

/// [`parse`] in a given context, returning the warnings instead of printing them.
pub fn parse_in<I, T>(args: I, ctx: &Context<'_>) -> Result<(Parsed, Vec<String>), UsageError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let raw: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let cli = match Cli::try_parse_from(&raw) {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            return match e.kind() {
                ErrorKind::DisplayHelp
                | ErrorKind::DisplayVersion
                | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    let code = e.exit_code();
                    // Nothing useful to do when stdout is gone.
                    let _ = e.print();
                    Ok((Parsed::Exit(code), Vec::new()))
                }
                _ => Err(UsageError::Parse(first_line(&e.to_string()))),
            };
        }
    };
    match cli.command {
        Command::Launch(mut args) => {
            if let Some(note) = args.torchrun.completion_note() {
                return Ok((Parsed::Exit(1), vec![note]));
            }
            drop_argparse_separator(&raw, &mut args.command);
            args.validate_in(ctx)
                .map(|(spec, warnings)| (Parsed::Launch(spec), warnings))
        }
        Command::Serve(a) => {
            pairs("--labels", &a.labels).map_err(UsageError::Invalid)?;
            a.security.resolve().map_err(UsageError::Invalid)?;
            Ok((Parsed::Daemon(Request::Serve(a)), vec![]))
        }
        Command::Submit(a) => {
            a.check().map_err(UsageError::Invalid)?;
            a.security.resolve().map_err(UsageError::Invalid)?;
            Ok((Parsed::Daemon(Request::Submit(a)), vec![]))
        }
        Command::Status(a) => {
            a.security.resolve().map_err(UsageError::Invalid)?;
            Ok((Parsed::Daemon(Request::Status(a)), vec![]))
        }
        Command::Cancel(a) => {
            a.security.resolve().map_err(UsageError::Invalid)?;
            Ok((Parsed::Daemon(Request::Cancel(a)), vec![]))
        }
        Command::Certs(a) => {
            let plan = a.check().map_err(|e| UsageError::Invalid(e.to_string()))?;
            Ok((Parsed::Certs(plan), vec![]))
        }
        Command::Describe(a) => {
            a.security.resolve().map_err(UsageError::Invalid)?;
            Ok((Parsed::Daemon(Request::Describe(a)), vec![]))
        }
    }
}

/// Clap's message on one line (shared with the coordinator's command).
pub(crate) fn first_line(message: &str) -> String {
    muster_core::error_chain::usage_line(message)
}
