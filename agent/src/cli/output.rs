//! `muster-agent launch`'s output flags, torchrun's among them (`--log-dir`,
//! `--local-ranks-filter`, `--redirects`, `--tee`, `--log-line-prefix-template`, the duplicate
//! filters, `--logs-specs`) and muster's `--no-prefix`: their clap definitions and their
//! validation into an [`OutputSpec`].

use super::UsageError;
use crate::worker::{OutputSpec, PerRank, PrefixTemplate, Streams};
use clap::Args;
use clap::builder::TypedValueParser as _;
use std::path::PathBuf;

/// Where the workers' output goes. torchrun's flags are also read from its `PET_<NAME>`
/// variables (a flag beats the variable).
#[derive(Debug, Clone, Default, Args)]
pub struct OutputArgs {
    /// Also write each rank's output to DIR/<job>/attempt_<restart>/rank_<R>/stdout.log and
    /// stderr.log (R: the global rank), every stream of every rank.
    #[arg(
        long,
        value_name = "DIR",
        alias = "log_dir",
        env = "PET_LOG_DIR",
        // Takes an empty value (an empty PET_LOG_DIR), which means none.
        value_parser = clap::builder::OsStringValueParser::new().map(PathBuf::from),
        help_heading = "Output"
    )]
    pub log_dir: Option<PathBuf>,

    /// Only these local ranks' output reaches the console (as 0 or 0,1); log files still get
    /// every rank's.
    #[arg(
        long,
        value_name = "R,...",
        alias = "local_ranks_filter",
        env = "PET_LOCAL_RANKS_FILTER",
        help_heading = "Output"
    )]
    pub local_ranks_filter: Option<String>,

    /// torchrun's: these streams go to the log files only, not the console: 0 none, 1 stdout,
    /// 2 stderr, 3 both, for every local rank, or per local rank as 0:1,1:2. Without
    /// --log-dir, the files go to a folder under $TMPDIR (printed).
    #[arg(
        short = 'r',
        long,
        value_name = "STD",
        env = "PET_REDIRECTS",
        help_heading = "Output"
    )]
    pub redirects: Option<String>,

    /// torchrun's: these streams go to the log files and the console (same values as
    /// --redirects, which it overrides). Without --log-dir, the files go to a folder under
    /// $TMPDIR (printed).
    #[arg(
        short = 't',
        long,
        value_name = "STD",
        env = "PET_TEE",
        help_heading = "Output"
    )]
    pub tee: Option<String>,

    /// The prefix of each console line, with ${rank}, ${local_rank}, ${role_name} and
    /// ${hostname} (torchrun's placeholders); empty: none. Default: '[rank ${rank}] ', or
    /// $PET_LOG_LINE_PREFIX_TEMPLATE, then $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, when set
    /// and not empty (as torchrun).
    #[arg(
        long,
        value_name = "TEMPLATE",
        alias = "log_line_prefix_template",
        help_heading = "Output"
    )]
    pub log_line_prefix_template: Option<String>,

    /// Print the workers' console lines as they are, without the '[rank N] ' prefix (wins over
    /// --log-line-prefix-template).
    #[arg(long, alias = "no_prefix", help_heading = "Output")]
    pub no_prefix: bool,

    /// torchrun's: console stdout lines that contain any of these strings (comma-separated,
    /// ',,' for a comma) are also written, prefixed, to
    /// <log dir>/<job>/attempt_<restart>/filtered_stdout.log, all ranks together.
    #[arg(
        long,
        value_name = "S,...",
        alias = "duplicate_stdout_filters",
        env = "PET_DUPLICATE_STDOUT_FILTERS",
        help_heading = "Output"
    )]
    pub duplicate_stdout_filters: Option<String>,

    /// The same for stderr lines, into filtered_stderr.log.
    #[arg(
        long,
        value_name = "S,...",
        alias = "duplicate_stderr_filters",
        env = "PET_DUPLICATE_STDERR_FILTERS",
        help_heading = "Output"
    )]
    pub duplicate_stderr_filters: Option<String>,

    /// Accepted for torchrun's command lines; no effect: it names a Python LogsSpecs class,
    /// and muster's agent writes the log files itself.
    #[arg(
        long,
        value_name = "NAME",
        alias = "logs_specs",
        help_heading = "Output (accepted, no effect under muster)"
    )]
    pub logs_specs: Option<String>,
}

/// torchrun's environment variables for the prefix template, read in this order when the flag
/// is not given (an empty one counts as unset, as in torchrun).
const PREFIX_TEMPLATE_ENV: [&str; 2] = [
    "PET_LOG_LINE_PREFIX_TEMPLATE",
    "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
];

impl OutputArgs {
    /// Checks the flags against the node's worker count (`nproc`). `--redirects`, `--tee` or a
    /// duplicate filter without `--log-dir` puts the logs under the system's temporary folder,
    /// in a folder of this process (torchrun makes a `torchelastic_*` one).
    pub fn validate(&self, nproc: u32) -> Result<OutputSpec, UsageError> {
        // Empty values (as from an empty PET_* variable) count as unset, as in torchrun.
        let log_dir = self.log_dir.clone().filter(|d| !d.as_os_str().is_empty());
        if let Some(dir) = &log_dir
            && dir.exists()
            && !dir.is_dir()
        {
            return Err(UsageError::Invalid(format!(
                "--log-dir '{}' is not a directory",
                dir.display()
            )));
        }
        let console_ranks = match self.local_ranks_filter.as_deref().filter(|s| !s.is_empty()) {
            None => None,
            Some(s) => Some(
                s.split(',')
                    .map(|item| local_rank("--local-ranks-filter", s, item.trim(), nproc))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let redirects = per_rank("--redirects", self.redirects.as_deref(), nproc)?;
        let tee = per_rank("--tee", self.tee.as_deref(), nproc)?;
        // torchrun: `args.log_line_prefix_template or os.getenv(...)`, so an empty variable
        // counts as unset (an empty flag, though, means no prefix here).
        let template = self.log_line_prefix_template.clone().or_else(|| {
            PREFIX_TEMPLATE_ENV
                .iter()
                .find_map(|name| std::env::var(name).ok().filter(|t| !t.is_empty()))
        });
        let prefix = match (&template, self.no_prefix) {
            (_, true) => PrefixTemplate::none(),
            (Some(t), false) => PrefixTemplate::parse(t).map_err(|e| {
                UsageError::Invalid(format!("--log-line-prefix-template '{t}': {e}"))
            })?,
            (None, false) => PrefixTemplate::default(),
        };
        let duplicate_stdout_filters = filters(self.duplicate_stdout_filters.as_deref());
        let duplicate_stderr_filters = filters(self.duplicate_stderr_filters.as_deref());
        let wants_files = !redirects.is_none()
            || !tee.is_none()
            || !duplicate_stdout_filters.is_empty()
            || !duplicate_stderr_filters.is_empty();
        let log_dir = log_dir.or_else(|| {
            wants_files
                .then(|| std::env::temp_dir().join(format!("muster-logs-{}", std::process::id())))
        });
        Ok(OutputSpec {
            log_dir,
            console_ranks,
            redirects,
            tee,
            prefix,
            duplicate_stdout_filters,
            duplicate_stderr_filters,
        })
    }

    /// A note (for the warnings list, see [`super::note`]) for each flag given that has no
    /// effect under muster.
    pub fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if let Some(name) = &self.logs_specs {
            notes.push(super::note(&format!(
                "--logs-specs {name} has no effect under muster: it selects a Python LogsSpecs class of torchrun's, and muster's agent writes the log files itself (see --log-dir, --redirects, --tee)"
            )));
        }
        notes
    }
}

/// One local rank of `flag`'s value `value`.
fn local_rank(flag: &str, value: &str, item: &str, nproc: u32) -> Result<u32, UsageError> {
    let rank = item.parse::<u32>().map_err(|_| {
        UsageError::Invalid(format!("{flag} '{value}': '{item}' is not a local rank"))
    })?;
    if rank >= nproc {
        return Err(UsageError::Invalid(format!(
            "{flag} '{value}': local rank {rank} does not exist (local ranks are 0..{nproc})"
        )));
    }
    Ok(rank)
}

/// torchrun's `Std.from_str`: `3`, or `0:1,1:2` (an unlisted local rank gets 0). Local ranks
/// may have more than one digit here (torchrun's pattern takes one).
fn per_rank(flag: &str, value: Option<&str>, nproc: u32) -> Result<PerRank, UsageError> {
    let Some(value) = value else {
        return Ok(PerRank::default());
    };
    let streams = |v: &str| {
        Streams::from_digit(v).ok_or_else(|| {
            UsageError::Invalid(format!(
                "{flag} '{value}': '{v}' is not 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"
            ))
        })
    };
    if !value.contains(':') {
        return streams(value.trim()).map(PerRank::All);
    }
    let mut pairs: Vec<(u32, Streams)> = Vec::new();
    for item in value.split(',').map(str::trim) {
        let Some((rank, v)) = item.split_once(':') else {
            return Err(UsageError::Invalid(format!(
                "{flag} '{value}': '{item}' is not LOCAL_RANK:STD (as 0:3)"
            )));
        };
        let rank = local_rank(flag, value, rank.trim(), nproc)?;
        if pairs.iter().any(|(r, _)| *r == rank) {
            return Err(UsageError::Invalid(format!(
                "{flag} '{value}' lists local rank {rank} twice"
            )));
        }
        pairs.push((rank, streams(v.trim())?));
    }
    Ok(PerRank::Each(pairs))
}

/// torchrun's comma-separated list, where `,,` is a comma. Empty items are dropped (torchrun
/// keeps them, and an empty string then matches every line).
fn filters(value: Option<&str>) -> Vec<String> {
    const COMMA: &str = "\u{0}";
    value.map_or_else(Vec::new, |v| {
        v.replace(",,", COMMA)
            .split(',')
            .map(|item| item.replace(COMMA, ","))
            .filter(|item| !item.is_empty())
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::fmt::Write as _;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        output: OutputArgs,
    }

    /// What `args` (with `nproc` local ranks) turns into: for each local rank, which streams
    /// reach the console (o, e) and its prefix, then the log folder and the filters.
    fn check(nproc: u32, args: &str, expected: Result<&str, &str>) {
        let argv = std::iter::once("t").chain(args.split_whitespace());
        let got = Cli::try_parse_from(argv)
            .map_err(|e| e.kind().to_string())
            .and_then(|cli| {
                let notes = cli.output.notes();
                let spec = cli.output.validate(nproc).map_err(|e| e.to_string())?;
                let mut s = String::new();
                for lr in 0..nproc {
                    let on = |st| spec.console(lr, st);
                    let prefix = spec.prefix.render("trainer", 10 + lr, lr, || "h".into());
                    let _ = write!(
                        s,
                        "{lr}:{}{}{prefix:?} ",
                        if on(crate::worker::Stream::Stdout) {
                            "o"
                        } else {
                            "-"
                        },
                        if on(crate::worker::Stream::Stderr) {
                            "e"
                        } else {
                            "-"
                        },
                    );
                }
                match &spec.log_dir {
                    None => s.push_str("nolog"),
                    Some(d)
                        if d == &std::env::temp_dir()
                            .join(format!("muster-logs-{}", std::process::id())) =>
                    {
                        s.push_str("tmplog");
                    }
                    Some(d) => {
                        let _ = write!(s, "log={}", d.display());
                    }
                }
                if !spec.duplicate_stdout_filters.is_empty() {
                    let _ = write!(s, " out~{:?}", spec.duplicate_stdout_filters);
                }
                if !spec.duplicate_stderr_filters.is_empty() {
                    let _ = write!(s, " err~{:?}", spec.duplicate_stderr_filters);
                }
                for n in notes {
                    let _ = write!(s, " {}", n.split(": it").next().unwrap_or(""));
                }
                Ok(s)
            });
        assert_eq!(
            got.as_deref(),
            expected.map_err(str::to_owned).as_deref(),
            "args: {args}"
        );
    }

    #[test]
    fn output_flags() {
        for (nproc, args, expected) in [
            (2, "", Ok(r#"0:oe"[rank 10] " 1:oe"[rank 11] " nolog"#)),
            (1, "--log-dir /x", Ok(r#"0:oe"[rank 10] " log=/x"#)),
            (
                2,
                "--redirects 3",
                Ok(r#"0:--"[rank 10] " 1:--"[rank 11] " tmplog"#),
            ),
            (
                2,
                "-r 1 --log_dir /x",
                Ok(r#"0:-e"[rank 10] " 1:-e"[rank 11] " log=/x"#),
            ),
            (
                2,
                "-r 0:1,1:2",
                Ok(r#"0:-e"[rank 10] " 1:o-"[rank 11] " tmplog"#),
            ),
            (
                3,
                "-r 1:3",
                Ok(r#"0:oe"[rank 10] " 1:--"[rank 11] " 2:oe"[rank 12] " tmplog"#),
            ),
            (2, "-r 0", Ok(r#"0:oe"[rank 10] " 1:oe"[rank 11] " nolog"#)),
            (1, "--tee 3", Ok(r#"0:oe"[rank 10] " tmplog"#)),
            (1, "-t 2 -r 3", Ok(r#"0:-e"[rank 10] " tmplog"#)),
            (
                2,
                "-t 3 --local-ranks-filter 1",
                Ok(r#"0:--"[rank 10] " 1:oe"[rank 11] " tmplog"#),
            ),
            (
                2,
                "--local-ranks-filter= --log-dir=",
                Ok(r#"0:oe"[rank 10] " 1:oe"[rank 11] " nolog"#),
            ),
            (1, "--no-prefix", Ok(r#"0:oe"" nolog"#)),
            (1, "--no_prefix", Ok(r#"0:oe"" nolog"#)),
            (1, "--log-line-prefix-template=", Ok(r#"0:oe"" nolog"#)),
            (
                2,
                "--log-line-prefix-template [${role_name}${local_rank}]:",
                Ok(r#"0:oe"[trainer0]:" 1:oe"[trainer1]:" nolog"#),
            ),
            (
                1,
                "--log_line_prefix_template ${hostname}:$rank:$$:",
                Ok(r#"0:oe"h:10:$:" nolog"#),
            ),
            (
                1,
                "--log-line-prefix-template ${RANK}|",
                Err(
                    "--log-line-prefix-template '${RANK}|': unknown placeholder '${RANK}' (known: ${role_name}, ${rank}, ${local_rank}, ${hostname})",
                ),
            ),
            (
                1,
                "--duplicate-stdout-filters apple,orange --duplicate_stderr_filters a,,b,",
                Ok(r#"0:oe"[rank 10] " tmplog out~["apple", "orange"] err~["a,b"]"#),
            ),
            (
                1,
                "--duplicate-stdout-filters= --log-dir /x",
                Ok(r#"0:oe"[rank 10] " log=/x"#),
            ),
            (
                1,
                "--logs-specs custom",
                Ok(
                    r#"0:oe"[rank 10] " nolog note: --logs-specs custom has no effect under muster"#,
                ),
            ),
            (
                1,
                "--logs_specs custom --no-prefix",
                Ok(r#"0:oe"" nolog note: --logs-specs custom has no effect under muster"#),
            ),
            (
                1,
                "-r 4",
                Err("--redirects '4': '4' is not 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
            ),
            (
                2,
                "--tee 0:1,2:3",
                Err("--tee '0:1,2:3': local rank 2 does not exist (local ranks are 0..2)"),
            ),
            (
                2,
                "--tee 0:1,0:3",
                Err("--tee '0:1,0:3' lists local rank 0 twice"),
            ),
            (
                2,
                "--tee 0:1,1",
                Err("--tee '0:1,1': '1' is not LOCAL_RANK:STD (as 0:3)"),
            ),
            (
                2,
                "-r x:1",
                Err("--redirects 'x:1': 'x' is not a local rank"),
            ),
            (
                1,
                "--log-line-prefix-template ${host}",
                Err(
                    "--log-line-prefix-template '${host}': unknown placeholder '${host}' (known: ${role_name}, ${rank}, ${local_rank}, ${hostname})",
                ),
            ),
            (
                1,
                "--log-line-prefix-template ${rank}:$",
                Err(
                    "--log-line-prefix-template '${rank}:$': '$' at byte 8 starts no placeholder (write $$ for a dollar sign)",
                ),
            ),
            (
                1,
                "--log-line-prefix-template a$",
                Err(
                    "--log-line-prefix-template 'a$': '$' at byte 1 starts no placeholder (write $$ for a dollar sign)",
                ),
            ),
            (
                1,
                "--log-line-prefix-template ${rank",
                Err("--log-line-prefix-template '${rank': '${' at byte 0 is not closed"),
            ),
            (
                1,
                "--no-prefix --log-line-prefix-template x",
                Ok(r#"0:oe"" nolog"#),
            ),
            (
                2,
                "--local-ranks-filter 2",
                Err("--local-ranks-filter '2': local rank 2 does not exist (local ranks are 0..2)"),
            ),
        ] {
            check(nproc, args, expected);
        }
    }
}
