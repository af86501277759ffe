//! An error and its sources on one line, for messages and logs: tonic's transport errors say
//! little alone ("transport error"), the cause is several sources down. Also a command-line
//! parser's usage error on one line, which both commands (agent and coordinator) print.

/// `e` and its sources, `: `-separated, skipping a source whose text the line already ends
/// with (many errors repeat their source in their own message).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.ends_with(&more) {
            text = format!("{text}: {more}");
        }
        source = s.source();
    }
    text
}

/// Clap's message on one line, without the `error: ` label, the usage block and the help
/// hint; the indented lines right under the first (a list of missing arguments, the possible
/// values) are kept. Both commands print a bad flag this way (`muster-agent` exits 2,
/// `muster-coordinator` 64).
pub fn usage_line(message: &str) -> String {
    let mut lines = message.lines();
    let first = lines.next().unwrap_or_default();
    let mut line = first
        .strip_prefix("error: ")
        .unwrap_or(first)
        .trim()
        .to_owned();
    let more: Vec<&str> = lines
        .take_while(|l| l.starts_with(char::is_whitespace) && !l.trim().is_empty())
        .map(str::trim)
        .collect();
    if !more.is_empty() {
        let separator = if line.ends_with(':') { ", " } else { " " };
        line = format!("{line} {}", more.join(separator));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt;

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);
    impl fmt::Display for Layer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }
    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    #[test]
    fn sources_join_without_repeats() {
        let inner = Layer("Connection refused", None);
        let middle = Layer(
            "tcp connect error: Connection refused",
            Some(Box::new(inner)),
        );
        let outer = Layer("transport error", Some(Box::new(middle)));
        assert_eq!(
            chain(&outer),
            "transport error: tcp connect error: Connection refused"
        );
        assert_eq!(chain(&Layer("alone", None)), "alone");
    }
}
