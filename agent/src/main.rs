//! `muster-agent`: the command, in the library's [`muster_agent::entry`].

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(muster_agent::entry::main(std::env::args_os().collect()))
}
