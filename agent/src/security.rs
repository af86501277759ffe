//! The agent's side of TLS and authentication: the `--tls-*` and `--auth-token-file` flags
//! (shared by `launch`, `serve` and the operator commands), checked once into a [`Security`]:
//! how the agent's own calls connect (TLS, the cluster token as credentials) and what its
//! workers get (`MUSTER_TOKEN` = a job token derived from the cluster token, and
//! `MUSTER_TLS_*` as absolute paths).
//!
//! Secrets stay out of sight: the cluster token lives only inside [`Security`] and
//! `muster_proto`'s `Credentials`, whose `Debug` print `<redacted>`; the parsed flags hold the
//! token file's path, never its content. Nothing in the agent logs or prints a worker's
//! environment, so `MUSTER_TOKEN`'s value stays between the agent and the worker.

use clap::Args;
use muster_proto::security::{self as wire, ClientSecurity, Credentials};
use std::fmt;
use std::path::{Path, PathBuf};

/// `--tls-ca`, `--tls-cert`, `--tls-key`, `--tls-domain` and `--auth-token-file`, as given.
#[derive(Debug, Clone, Default, Args)]
pub struct SecurityArgs {
    /// PEM file of the CA that signed the coordinator's certificate: the agent (and its
    /// workers, as MUSTER_TLS_CA) connect with TLS and trust only this CA. Default: plaintext.
    #[arg(long, value_name = "FILE", alias = "tls_ca", help_heading = "Security")]
    pub tls_ca: Option<PathBuf>,

    /// PEM certificate chain presented to a coordinator that requires mutual TLS (needs
    /// --tls-key and --tls-ca). The workers get it as MUSTER_TLS_CERT.
    #[arg(
        long,
        value_name = "FILE",
        alias = "tls_cert",
        help_heading = "Security"
    )]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert. The workers get its path as MUSTER_TLS_KEY.
    #[arg(
        long,
        value_name = "FILE",
        alias = "tls_key",
        help_heading = "Security"
    )]
    pub tls_key: Option<PathBuf>,

    /// The name to verify the coordinator's certificate against, when it is not the host of
    /// --coordinator (needs --tls-ca). The workers get it as MUSTER_TLS_DOMAIN.
    #[arg(
        long,
        value_name = "NAME",
        alias = "tls_domain",
        help_heading = "Security"
    )]
    pub tls_domain: Option<String>,

    /// File holding the cluster token (the coordinator's --auth-token-file): the agent sends
    /// it with every call, and each worker gets a token for its job only (MUSTER_TOKEN).
    #[arg(
        long,
        value_name = "FILE",
        alias = "auth_token_file",
        help_heading = "Security"
    )]
    pub auth_token_file: Option<PathBuf>,
}

impl SecurityArgs {
    /// Whether any of the flags was given.
    pub fn any(&self) -> bool {
        self.tls_ca.is_some()
            || self.tls_cert.is_some()
            || self.tls_key.is_some()
            || self.tls_domain.is_some()
            || self.auth_token_file.is_some()
    }

    /// Checks the combination and reads the files (CA, certificate, key, token). The error is
    /// one line naming the flag, never the token.
    pub fn resolve(&self) -> Result<Security, String> {
        let needs_ca = [
            ("--tls-cert", self.tls_cert.is_some()),
            ("--tls-key", self.tls_key.is_some()),
            ("--tls-domain", self.tls_domain.is_some()),
        ];
        if self.tls_ca.is_none()
            && let Some((flag, _)) = needs_ca.iter().find(|(_, given)| *given)
        {
            return Err(format!(
                "{flag} needs --tls-ca (the CA that signed the coordinator's certificate)"
            ));
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => {
                return Err("--tls-cert needs --tls-key (the certificate's private key)".into());
            }
            (None, Some(_)) => {
                return Err("--tls-key needs --tls-cert (the client certificate)".into());
            }
            _ => {}
        }
        if let Some(domain) = &self.tls_domain
            && crate::net::plain_host(domain).is_err()
        {
            return Err(format!("--tls-domain '{domain}' is not a host name"));
        }
        let mut client = ClientSecurity::plaintext();
        let mut tls = None;
        if let Some(ca) = &self.tls_ca {
            let files = TlsFiles {
                ca: absolute("--tls-ca", ca)?,
                identity: match (&self.tls_cert, &self.tls_key) {
                    (Some(cert), Some(key)) => {
                        Some((absolute("--tls-cert", cert)?, absolute("--tls-key", key)?))
                    }
                    _ => None,
                },
                domain: self.tls_domain.clone(),
            };
            client = client
                .with_tls(
                    &files.ca,
                    files
                        .identity
                        .as_ref()
                        .map(|(c, k)| (c.as_path(), k.as_path())),
                    files.domain.as_deref(),
                )
                .map_err(|e| format!("TLS: {e}"))?;
            tls = Some(files);
        }
        let token = match &self.auth_token_file {
            Some(path) => {
                let token =
                    wire::read_token_file(path).map_err(|e| format!("--auth-token-file: {e}"))?;
                client = client.with_credentials(
                    Credentials::bearer(&token).map_err(|e| format!("--auth-token-file: {e}"))?,
                );
                Some(Secret(token))
            }
            None => None,
        };
        Ok(Security { client, token, tls })
    }
}

fn absolute(flag: &str, path: &Path) -> Result<PathBuf, String> {
    std::path::absolute(path).map_err(|e| format!("{flag} '{}': {e}", path.display()))
}

/// A secret string whose `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
struct Secret(String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// The TLS files as absolute paths (what the workers get).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// `--tls-ca`.
    pub ca: PathBuf,
    /// `--tls-cert` and `--tls-key`.
    pub identity: Option<(PathBuf, PathBuf)>,
    /// `--tls-domain`.
    pub domain: Option<String>,
}

/// How the agent and its workers reach the coordinator: checked flags, files read. Its `Debug`
/// shows the TLS file names and whether a token is set, never the token or key material.
#[derive(Clone, Default)]
pub struct Security {
    client: ClientSecurity,
    token: Option<Secret>,
    tls: Option<TlsFiles>,
}

impl fmt::Debug for Security {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Security")
            .field("tls", &self.tls)
            .field("token", &self.token)
            .finish()
    }
}

impl Security {
    /// Plaintext without credentials: the embedded coordinator, and coordinators without TLS
    /// or authentication.
    pub fn plaintext() -> Self {
        Self::default()
    }

    /// Whether nothing is configured.
    pub fn is_plaintext(&self) -> bool {
        self.tls.is_none() && self.token.is_none()
    }

    /// What the agent's own connections use: TLS settings and the cluster token.
    pub fn client(&self) -> &ClientSecurity {
        &self.client
    }

    /// The TLS files, when TLS is on.
    pub fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    /// Whether the agent has a cluster token.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// The variables a worker of `job_id` gets: `MUSTER_TOKEN` (its job token, derived from
    /// the cluster token) when the agent has a token, `MUSTER_TLS_*` when TLS is on.
    pub fn worker_env(&self, job_id: &str) -> Vec<(&'static str, String)> {
        let mut env = Vec::new();
        if let Some(token) = &self.token {
            env.push((
                wire::env::TOKEN,
                muster_core::job_token::mint(&token.0, job_id),
            ));
        }
        if let Some(tls) = &self.tls {
            let shown = |p: &Path| p.to_string_lossy().into_owned();
            env.push((wire::env::TLS_CA, shown(&tls.ca)));
            if let Some((cert, key)) = &tls.identity {
                env.push((wire::env::TLS_CERT, shown(cert)));
                env.push((wire::env::TLS_KEY, shown(key)));
            }
            if let Some(domain) = &tls.domain {
                env.push((wire::env::TLS_DOMAIN, domain.clone()));
            }
        }
        env
    }
}

/// A coordinator's answer or a transport failure in one line for the user: the message, with
/// the code named and a hint for refused credentials, and the causes of a transport error
/// (tonic's own message, "transport error" or "operation was canceled", says little alone).
pub fn explain(status: &tonic::Status) -> String {
    use tonic::Code;
    let mut text = status.message().to_owned();
    let mut source = std::error::Error::source(status);
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        source = s.source();
    }
    match status.code() {
        Code::Unauthenticated => format!(
            "UNAUTHENTICATED: {text} (the agent's --auth-token-file must hold the coordinator's \
             cluster token)"
        ),
        Code::PermissionDenied => format!("PERMISSION_DENIED: {text}"),
        _ if is_tls_failure(&text) => format!("TLS handshake failed: {text}"),
        _ => text,
    }
}

/// Whether a connection error (its text with its causes) is a TLS failure: a certificate that
/// is not trusted, a client certificate the coordinator rejected, a failed handshake. Those do
/// not heal by retrying, so the agent reports them at once.
pub fn is_tls_failure(error: &str) -> bool {
    let e = error.to_ascii_lowercase();
    [
        "certificate",
        "fatal alert",
        "handshake",
        "peer is incompatible",
        "peer misbehaved",
        "invalidcontenttype",
        "corrupt message",
    ]
    .iter()
    .any(|needle| e.contains(needle))
}
