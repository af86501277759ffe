//! What a muster client presents to the coordinator: TLS settings and a bearer credential.
//!
//! The one piece of logic in this crate beyond generated code: the worker SDK and the agent
//! must connect identically (scheme, trust roots, client identity, `authorization` header), and
//! this crate is the only one both depend on. The coordinator checks what is sent here in its
//! `auth` module.

#[cfg(feature = "client")]
pub use client::*;
use std::path::Path;

/// The metadata key every authenticated call carries: `authorization: Bearer <token>`.
pub const AUTHORIZATION: &str = "authorization";

/// A job credential names its job; the cluster credential is any other token. The form is
/// `mj1.<job id as lowercase hex>.<HMAC-SHA256 as lowercase hex>` (the coordinator's `auth`).
pub const JOB_TOKEN_PREFIX: &str = "mj1.";

/// Environment variables the agent sets for its workers and the worker SDK reads.
pub mod env {
    /// The worker's job credential (`mj1.…`), or the cluster token for tools run by hand.
    pub const TOKEN: &str = "MUSTER_TOKEN";
    /// PEM file of the CA that signed the coordinator's certificate; set means TLS.
    pub const TLS_CA: &str = "MUSTER_TLS_CA";
    /// PEM certificate chain of the client, for coordinators that require mutual TLS.
    pub const TLS_CERT: &str = "MUSTER_TLS_CERT";
    /// PEM private key of `MUSTER_TLS_CERT`.
    pub const TLS_KEY: &str = "MUSTER_TLS_KEY";
    /// The name to verify the coordinator's certificate against, when it is not the host
    /// part of the address (a Kubernetes Service name, say).
    pub const TLS_DOMAIN: &str = "MUSTER_TLS_DOMAIN";
}

/// The shortest cluster token accepted: 16 characters (about 96 bits if random base64).
pub const MIN_TOKEN_LEN: usize = 16;

/// Checks that `token` can be sent as a header and is long enough to be a secret. Errors never
/// include the token.
pub fn check_token(token: &str) -> Result<(), String> {
    if token.len() < MIN_TOKEN_LEN {
        return Err(format!(
            "the token is {} characters; at least {MIN_TOKEN_LEN} are required",
            token.len()
        ));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the token must be printable ASCII without spaces".to_owned());
    }
    Ok(())
}

/// Reads a token file: its content less surrounding whitespace, checked by [`check_token`].
/// Errors name the file, never its content.
pub fn read_token_file(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read token file {}: {e}", path.display()))?;
    let token = text.trim();
    check_token(token).map_err(|why| format!("token file {}: {why}", path.display()))?;
    Ok(token.to_owned())
}

/// The client half: TLS settings, credentials, channels that carry them.
#[cfg(feature = "client")]
mod client {
    use super::AUTHORIZATION;
    use super::check_token;
    use std::fmt;
    use std::path::Path;
    use tonic::metadata::{Ascii, MetadataValue};
    use tonic::service::interceptor::InterceptedService;
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

    /// The `authorization` header a client adds to every call; nothing when it has no token.
    /// Its `Debug` never shows the token.
    #[derive(Clone, Default)]
    pub struct Credentials(Option<MetadataValue<Ascii>>);

    impl Credentials {
        /// Sends `Bearer <token>`.
        pub fn bearer(token: &str) -> Result<Self, String> {
            check_token(token)?;
            let mut value: MetadataValue<Ascii> = format!("Bearer {token}")
                .parse()
                .map_err(|_| "the token cannot be sent as a header".to_owned())?;
            value.set_sensitive(true);
            Ok(Credentials(Some(value)))
        }

        /// Sends nothing (a coordinator without authentication).
        pub fn none() -> Self {
            Credentials(None)
        }

        /// Whether a token is sent.
        pub fn is_set(&self) -> bool {
            self.0.is_some()
        }
    }

    impl fmt::Debug for Credentials {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(if self.0.is_some() {
                "Credentials(<redacted>)"
            } else {
                "Credentials(none)"
            })
        }
    }

    impl tonic::service::Interceptor for Credentials {
        fn call(
            &mut self,
            mut request: tonic::Request<()>,
        ) -> Result<tonic::Request<()>, tonic::Status> {
            if let Some(value) = &self.0 {
                request.metadata_mut().insert(AUTHORIZATION, value.clone());
            }
            Ok(request)
        }
    }

    /// A channel that adds the client's credentials to every call.
    pub type AuthChannel = InterceptedService<Channel, Credentials>;

    /// How a client connects: plaintext or TLS (optionally with a client certificate), and with
    /// which credentials. Cheap to clone.
    #[derive(Clone, Default)]
    pub struct ClientSecurity {
        tls: Option<ClientTlsConfig>,
        credentials: Credentials,
    }

    // By hand: tonic's `Identity` prints the private key's bytes.
    impl fmt::Debug for ClientSecurity {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("ClientSecurity")
                .field("tls", &self.tls.is_some())
                .field("credentials", &self.credentials)
                .finish()
        }
    }

    impl ClientSecurity {
        /// Plaintext, no credentials: what every client did before TLS and authentication.
        pub fn plaintext() -> Self {
            ClientSecurity::default()
        }

        /// Loads TLS settings from PEM files: `ca` turns TLS on; `identity` (certificate chain,
        /// key) is presented for mutual TLS; `domain` overrides the name verified. Errors name the
        /// file that could not be read.
        pub fn with_tls(
            mut self,
            ca: &Path,
            identity: Option<(&Path, &Path)>,
            domain: Option<&str>,
        ) -> Result<Self, String> {
            let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca)?));
            if let Some((cert, key)) = identity {
                tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
            }
            if let Some(domain) = domain {
                tls = tls.domain_name(domain);
            }
            self.tls = Some(tls);
            Ok(self)
        }

        /// Sends `credentials` with every call.
        pub fn with_credentials(mut self, credentials: Credentials) -> Self {
            self.credentials = credentials;
            self
        }

        /// Whether connections use TLS.
        pub fn is_tls(&self) -> bool {
            self.tls.is_some()
        }

        /// The credentials sent.
        pub fn credentials(&self) -> &Credentials {
            &self.credentials
        }

        /// An endpoint for `addr` (`host:port`): `https://` with the TLS settings, else `http://`.
        pub fn endpoint(&self, addr: &str) -> Result<Endpoint, String> {
            let scheme = if self.tls.is_some() { "https" } else { "http" };
            let endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
                .map_err(|e| format!("coordinator address {addr:?} is invalid: {e}"))?;
            match &self.tls {
                Some(tls) => endpoint
                    .tls_config(tls.clone())
                    .map_err(|e| format!("TLS settings for {addr:?} are invalid: {e}")),
                None => Ok(endpoint),
            }
        }

        /// Wraps `channel` so that every call carries the credentials.
        pub fn wrap(&self, channel: Channel) -> AuthChannel {
            InterceptedService::new(channel, self.credentials.clone())
        }
    }

    fn read(path: &Path) -> Result<Vec<u8>, String> {
        std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
    }
}

#[cfg(all(test, feature = "client"))]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn tokens_are_checked_and_never_shown() {
        assert!(check_token("short").unwrap_err().contains("at least 16"));
        assert!(check_token("has a space in it!!").is_err());
        assert!(check_token("é-not-ascii-0123456789").is_err());
        let c = Credentials::bearer("0123456789abcdefXYZ").expect("valid");
        assert!(c.is_set());
        assert_eq!(format!("{c:?}"), "Credentials(<redacted>)");
        assert!(!format!("{:?}", ClientSecurity::plaintext().with_credentials(c)).contains("XYZ"));
    }

    #[test]
    fn the_scheme_follows_tls() {
        let plain = ClientSecurity::plaintext()
            .endpoint("127.0.0.1:1")
            .expect("endpoint");
        assert_eq!(plain.uri().scheme_str(), Some("http"));
        assert!(ClientSecurity::plaintext().endpoint("bad addr").is_err());
    }

    #[test]
    fn missing_files_are_named() {
        let e = ClientSecurity::plaintext()
            .with_tls(Path::new("/nonexistent/ca.pem"), None, None)
            .unwrap_err();
        assert!(e.contains("/nonexistent/ca.pem"), "{e}");
    }
}
