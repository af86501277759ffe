//! The worker program: resolved on `PATH` before anything is spawned, so that a typo is a
//! one-line usage error instead of N failed workers.

use std::ffi::{OsStr, OsString};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The program every worker of the node runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    /// As the user wrote it; becomes the worker's `argv[0]`.
    pub name: OsString,
    /// The executable file it resolved to.
    pub path: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment for every worker (a submitted job's `env`), on top of the agent's
    /// own; muster's variables (`docs/contract.md`) are set after these and win.
    pub env: Vec<(String, String)>,
}

/// Why a program cannot be run.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ProgramError {
    /// A bare name found in no `PATH` directory (as an executable file).
    #[error("program '{0}' was not found in PATH")]
    NotInPath(String),
    /// A path (with a `/`) that does not exist.
    #[error("program '{0}' does not exist")]
    Missing(String),
    /// A path to a directory.
    #[error("program '{0}' is a directory")]
    Directory(String),
    /// A path to a file without execute permission.
    #[error("program '{0}' is not executable")]
    NotExecutable(String),
    /// An empty program name.
    #[error("the program name is empty")]
    Empty,
}

impl Program {
    /// Resolves `name` the way `execvp` would: a name with a `/` is a path (relative to the
    /// current directory), any other name is looked up in the directories of `path_var`.
    pub fn resolve(
        name: OsString,
        args: Vec<OsString>,
        path_var: Option<&OsStr>,
    ) -> Result<Self, ProgramError> {
        let shown = name.to_string_lossy().into_owned();
        if name.is_empty() {
            return Err(ProgramError::Empty);
        }
        let path = if name.as_encoded_bytes().contains(&b'/') {
            let path = PathBuf::from(&name);
            match std::fs::metadata(&path) {
                Err(_) => return Err(ProgramError::Missing(shown)),
                Ok(m) if m.is_dir() => return Err(ProgramError::Directory(shown)),
                Ok(_) if !is_executable(&path) => return Err(ProgramError::NotExecutable(shown)),
                Ok(_) => path,
            }
        } else {
            let dirs = path_var.map(std::env::split_paths).into_iter().flatten();
            dirs.map(|dir| {
                // An empty PATH entry means the current directory.
                if dir.as_os_str().is_empty() {
                    PathBuf::from(".").join(&name)
                } else {
                    dir.join(&name)
                }
            })
            .find(|candidate| is_executable(candidate))
            .ok_or(ProgramError::NotInPath(shown))?
        };
        Ok(Self {
            name,
            path,
            args,
            env: Vec::new(),
        })
    }
}

/// A regular file (after following links) with an execute bit set.
fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(name: &str, path_var: Option<&str>, expected: Result<&str, ProgramError>) {
        let got = Program::resolve(name.into(), vec![], path_var.map(OsStr::new));
        let got = got.map(|p| p.path.to_string_lossy().into_owned());
        assert_eq!(
            got.as_deref().map_err(Clone::clone),
            expected,
            "{name} with PATH={path_var:?}"
        );
    }

    #[test]
    fn resolution() {
        check("sh", Some("/nonexistent:/bin"), Ok("/bin/sh"));
        check("sh", Some("/bin:/usr/bin"), Ok("/bin/sh"));
        check("sh", None, Err(ProgramError::NotInPath("sh".into())));
        check("sh", Some(""), Err(ProgramError::NotInPath("sh".into())));
        // A non-executable file on PATH is skipped like execvp does.
        check(
            "passwd",
            Some("/etc"),
            Err(ProgramError::NotInPath("passwd".into())),
        );
        check("/bin/sh", None, Ok("/bin/sh"));
        check(
            "/etc/passwd",
            None,
            Err(ProgramError::NotExecutable("/etc/passwd".into())),
        );
        check("/etc", None, Err(ProgramError::Directory("/etc".into())));
        check(
            "./no-such",
            None,
            Err(ProgramError::Missing("./no-such".into())),
        );
        check("", Some("/bin"), Err(ProgramError::Empty));
    }
}
