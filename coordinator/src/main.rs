//! `muster-coordinator`: the command, in the library's [`muster_coordinator::cli`].

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(muster_coordinator::cli::main(std::env::args_os()))
}
