//! The coordinator's configuration: defaults, then a TOML file, then `MUSTER_*` environment
//! variables, then flags; validated once before anything starts.

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

/// Everything the coordinator can be told. Built with [`Config::default`] and [`Layer`]s.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where to serve gRPC.
    pub listen: SocketAddr,
    /// A worker session silent for this long is marked failed.
    pub heartbeat_timeout: Duration,
    /// Default last-call window of a rendezvous round (when the join does not say).
    pub last_call: Duration,
    /// Default join timeout of a rendezvous round (when the join does not say).
    pub join_timeout: Duration,
    /// Largest value in the key-value store, a shared value included.
    pub max_value_bytes: usize,
    /// Largest total of a job's key-value store.
    pub max_job_bytes: usize,
    /// Largest gRPC message the coordinator accepts.
    pub max_message_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], muster_proto::DEFAULT_COORDINATOR_PORT)),
            heartbeat_timeout: Duration::from_secs(10),
            last_call: Duration::from_secs(30),
            join_timeout: Duration::from_secs(600),
            max_value_bytes: 1 << 20,
            max_job_bytes: 64 << 20,
            max_message_bytes: 4 << 20,
        }
    }
}

/// One layer of settings (a file, the environment or the flags): only what it sets.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layer {
    /// `listen = "0.0.0.0:29470"`.
    pub listen: Option<SocketAddr>,
    /// `heartbeat_timeout_ms = 10000`.
    pub heartbeat_timeout_ms: Option<u64>,
    /// `last_call_ms = 30000`.
    pub last_call_ms: Option<u64>,
    /// `join_timeout_ms = 600000`.
    pub join_timeout_ms: Option<u64>,
    /// `max_value_bytes = 1048576`.
    pub max_value_bytes: Option<usize>,
    /// `max_job_bytes = 67108864`.
    pub max_job_bytes: Option<usize>,
    /// `max_message_bytes = 4194304`.
    pub max_message_bytes: Option<usize>,
}

impl Layer {
    /// Reads a TOML file; errors name the file and the problem.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read config file {}: {e}", path.display()))?;
        toml::from_str(&text)
            .map_err(|e| format!("config file {}: {}", path.display(), e.message().trim_end()))
    }

    /// Reads `MUSTER_COORDINATOR_<FIELD>` variables through `get` (the process environment in
    /// production, a map in tests).
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        fn parse<T: std::str::FromStr>(
            get: &impl Fn(&str) -> Option<String>,
            name: &str,
        ) -> Result<Option<T>, String>
        where
            T::Err: std::fmt::Display,
        {
            match get(name) {
                None => Ok(None),
                Some(v) => v
                    .parse()
                    .map(Some)
                    .map_err(|e| format!("environment variable {name}={v:?}: {e}")),
            }
        }
        Ok(Self {
            listen: parse(&get, "MUSTER_COORDINATOR_LISTEN")?,
            heartbeat_timeout_ms: parse(&get, "MUSTER_COORDINATOR_HEARTBEAT_TIMEOUT_MS")?,
            last_call_ms: parse(&get, "MUSTER_COORDINATOR_LAST_CALL_MS")?,
            join_timeout_ms: parse(&get, "MUSTER_COORDINATOR_JOIN_TIMEOUT_MS")?,
            max_value_bytes: parse(&get, "MUSTER_COORDINATOR_MAX_VALUE_BYTES")?,
            max_job_bytes: parse(&get, "MUSTER_COORDINATOR_MAX_JOB_BYTES")?,
            max_message_bytes: parse(&get, "MUSTER_COORDINATOR_MAX_MESSAGE_BYTES")?,
        })
    }
}

impl Config {
    /// Applies a layer on top of this configuration.
    pub fn apply(mut self, l: &Layer) -> Self {
        let ms = Duration::from_millis;
        if let Some(v) = l.listen {
            self.listen = v;
        }
        if let Some(v) = l.heartbeat_timeout_ms {
            self.heartbeat_timeout = ms(v);
        }
        if let Some(v) = l.last_call_ms {
            self.last_call = ms(v);
        }
        if let Some(v) = l.join_timeout_ms {
            self.join_timeout = ms(v);
        }
        if let Some(v) = l.max_value_bytes {
            self.max_value_bytes = v;
        }
        if let Some(v) = l.max_job_bytes {
            self.max_job_bytes = v;
        }
        if let Some(v) = l.max_message_bytes {
            self.max_message_bytes = v;
        }
        self
    }

    /// Checks the whole configuration; the error is one line naming the setting.
    pub fn validate(&self) -> Result<(), String> {
        if self.heartbeat_timeout < Duration::from_millis(100) {
            return Err(format!(
                "heartbeat_timeout_ms must be at least 100 (got {})",
                self.heartbeat_timeout.as_millis()
            ));
        }
        if self.join_timeout.is_zero() {
            return Err("join_timeout_ms must be greater than 0".into());
        }
        if self.max_value_bytes == 0 || self.max_value_bytes > self.max_job_bytes {
            return Err(format!(
                "max_value_bytes ({}) must be between 1 and max_job_bytes ({})",
                self.max_value_bytes, self.max_job_bytes
            ));
        }
        if self.max_message_bytes < 64 << 10 {
            return Err(format!(
                "max_message_bytes must be at least 65536 (got {})",
                self.max_message_bytes
            ));
        }
        Ok(())
    }

    /// How often workers should send heartbeats: a third of the timeout.
    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat_timeout / 3
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn layers_apply_in_order() {
        let file: Layer =
            toml::from_str("listen = \"0.0.0.0:1\"\nheartbeat_timeout_ms = 5000").unwrap();
        let env: HashMap<&str, &str> = [("MUSTER_COORDINATOR_HEARTBEAT_TIMEOUT_MS", "2000")].into();
        let env = Layer::from_env(|k| env.get(k).map(|v| v.to_string())).unwrap();
        let c = Config::default().apply(&file).apply(&env);
        assert_eq!(c.listen.port(), 1);
        assert_eq!(c.heartbeat_timeout, Duration::from_secs(2));
        c.validate().unwrap();
    }

    #[test]
    fn bad_settings_are_named() {
        assert!(toml::from_str::<Layer>("nonsense = 1").is_err());
        let env = Layer::from_env(|k| (k == "MUSTER_COORDINATOR_LISTEN").then(|| "x".into()));
        assert!(env.unwrap_err().contains("MUSTER_COORDINATOR_LISTEN"));
        let c = Config::default().apply(&Layer {
            heartbeat_timeout_ms: Some(1),
            ..Layer::default()
        });
        assert!(c.validate().unwrap_err().contains("heartbeat_timeout_ms"));
    }
}
