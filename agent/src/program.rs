//! The worker program: resolved on `PATH` before anything is spawned, so that a typo is a
//! one-line usage error instead of N failed workers. A Python script is run with a Python
//! interpreter, as torchrun and `accelerate launch` do ([`Program::for_launch`]).

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
    /// A Python script or module, and no interpreter to run it with.
    #[error(
        "{0} needs a Python interpreter, and no python3 or python was found in PATH (activate the environment, or set MUSTER_PYTHON to the interpreter)"
    )]
    NoPython(String),
    /// `MUSTER_PYTHON` or `PYTHON_EXEC` names no interpreter.
    #[error("{var} '{value}': {why}")]
    BadPython {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it (the program error, without "program 'x'").
        why: String,
    },
}

/// How the command after the flags is run: torchrun's `-m`, `--no-python` and `--run-path`,
/// or (none of them) muster's reading of the command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Form {
    /// A Python script (`train.py`, a `python` shebang, a folder or zip with `__main__.py`)
    /// runs as `python -u SCRIPT ARGS`; anything else runs directly, as `execvp` would.
    #[default]
    Implied,
    /// `-m`: `python -u -m MODULE ARGS`.
    Module,
    /// `--no-python`: run the program directly, whatever it is.
    NoPython,
    /// `--run-path`: `python -u FILE ARGS`. (torchrun calls `runpy.run_path` in a Python
    /// process of its own; a fresh interpreter running FILE gives the script the same
    /// `sys.argv` and `__name__ == "__main__"`.)
    RunPath,
}

/// Where the interpreter comes from: a variable that names it (`MUSTER_PYTHON`, or torchrun's
/// `PYTHON_EXEC`), else the first `python3` or `python` in `PATH`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PythonChoice {
    /// The variable that names the interpreter and its value, when one does.
    pub from_env: Option<(&'static str, OsString)>,
}

impl PythonChoice {
    /// `MUSTER_PYTHON`, else `PYTHON_EXEC`, as `var` reads them.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Self {
        let from_env = ["MUSTER_PYTHON", "PYTHON_EXEC"]
            .into_iter()
            .find_map(|name| var(name).filter(|v| !v.is_empty()).map(|v| (name, v)));
        Self { from_env }
    }

    /// The interpreter as `(argv[0], file)`: the path found, never canonicalized, so that a
    /// virtual environment's `bin/python` link still finds its `pyvenv.cfg`.
    fn resolve(&self, needed_by: &str, path_var: Option<&OsStr>) -> Result<PathBuf, ProgramError> {
        if let Some((var, value)) = &self.from_env {
            return Program::resolve(value.clone(), Vec::new(), path_var)
                .map(|p| p.path)
                .map_err(|e| ProgramError::BadPython {
                    var,
                    value: value.to_string_lossy().into_owned(),
                    why: e.reason(),
                });
        }
        let dirs = path_var.map(std::env::split_paths).into_iter().flatten();
        for dir in dirs {
            let dir = if dir.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                dir
            };
            for name in ["python3", "python"] {
                let candidate = dir.join(name);
                if is_executable(&candidate) {
                    return Ok(candidate);
                }
            }
        }
        Err(ProgramError::NoPython(needed_by.to_owned()))
    }
}

impl ProgramError {
    /// The message without the leading "program 'x' ".
    fn reason(&self) -> String {
        let message = self.to_string();
        match message.split_once("' ") {
            Some((head, rest)) if head.starts_with("program '") => rest.to_owned(),
            _ => message,
        }
    }
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

    /// The program of a launch: `command` (the program, then its arguments) run in `form`,
    /// with the interpreter `python` chooses where one is needed. The interpreter gets `-u`
    /// (unbuffered output) as under torchrun; the script's `sys.argv` is the one torchrun gives
    /// it: the script as written, then its arguments.
    pub fn for_launch(
        form: Form,
        command: Vec<OsString>,
        python: &PythonChoice,
        path_var: Option<&OsStr>,
    ) -> Result<Self, ProgramError> {
        let mut command = command.into_iter();
        let Some(name) = command.next() else {
            return Err(ProgramError::Empty);
        };
        let args: Vec<OsString> = command.collect();
        if name.is_empty() {
            return Err(ProgramError::Empty);
        }
        let shown = name.to_string_lossy().into_owned();
        let interpreted = |flags: &[&str], needed_by: String| -> Result<Self, ProgramError> {
            let path = python.resolve(&needed_by, path_var)?;
            let mut full: Vec<OsString> = flags.iter().map(OsString::from).collect();
            full.push(name.clone());
            full.extend(args.iter().cloned());
            Ok(Self {
                name: path.clone().into_os_string(),
                path,
                args: full,
                env: Vec::new(),
            })
        };
        match form {
            Form::Module => interpreted(&["-u", "-m"], format!("module '{shown}'")),
            Form::NoPython => Self::resolve(name, args, path_var),
            Form::RunPath => {
                if std::fs::metadata(&name).is_err() {
                    return Err(ProgramError::Missing(shown));
                }
                interpreted(&["-u"], format!("script '{shown}'"))
            }
            Form::Implied => {
                let path = Path::new(&name);
                if has_python_suffix(path) && std::fs::metadata(path).is_ok() {
                    return interpreted(&["-u"], format!("script '{shown}'"));
                }
                match Self::resolve(name.clone(), args.clone(), path_var) {
                    Ok(program) => Ok(program),
                    // Not an executable: a Python script all the same (not yet executable,
                    // or a bare name in the current folder), or a Python package folder.
                    Err(
                        e @ (ProgramError::NotInPath(_)
                        | ProgramError::NotExecutable(_)
                        | ProgramError::Directory(_)),
                    ) => {
                        if looks_like_python(path) {
                            interpreted(&["-u"], format!("script '{shown}'"))
                        } else if has_python_suffix(path) {
                            Err(ProgramError::Missing(shown))
                        } else {
                            Err(e)
                        }
                    }
                    Err(e) => Err(e),
                }
            }
        }
    }
}

/// `.py`, `.pyw`, `.pyc` or `.pyz`: what `python FILE` runs.
fn has_python_suffix(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| ["py", "pyw", "pyc", "pyz"].iter().any(|s| e == *s))
}

/// A file (relative to the current folder) that Python runs: a `.py`-like name, a first line
/// `#!...python...`, or a folder with `__main__.py`.
fn looks_like_python(path: &Path) -> bool {
    let Ok(meta) = std::fs::metadata(path) else {
        return false;
    };
    if meta.is_dir() {
        return path.join("__main__.py").is_file();
    }
    if has_python_suffix(path) {
        return true;
    }
    use std::io::Read;
    let mut head = [0u8; 128];
    let n = std::fs::File::open(path)
        .and_then(|mut f| f.read(&mut head))
        .unwrap_or(0);
    let first_line = head[..n].split(|b| *b == b'\n').next().unwrap_or_default();
    first_line.starts_with(b"#!") && first_line.windows(6).any(|w| w == b"python")
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
