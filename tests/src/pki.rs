//! A throwaway PKI for the TLS tests and benchmarks, generated at run time with rcgen so that
//! no key material is ever committed: a cluster CA, a server certificate for the given names,
//! a client certificate, a second ("foreign") CA with its own server and client certificates,
//! and an expired server certificate from the cluster CA. Also a cluster token file.

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};
use std::path::{Path, PathBuf};

/// Where each PEM file of a [`Pki`] was written.
#[derive(Debug, Clone)]
pub struct Pki {
    /// The directory holding everything.
    pub dir: PathBuf,
    /// The cluster CA's certificate (what clients trust, and what verifies client certs).
    pub ca: PathBuf,
    /// The coordinator's certificate, for `localhost`, `127.0.0.1` and the extra names.
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// A client certificate signed by the cluster CA.
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    /// Another CA, which signed none of the above.
    pub foreign_ca: PathBuf,
    /// A client certificate signed by the foreign CA.
    pub foreign_client_cert: PathBuf,
    /// Its key.
    pub foreign_client_key: PathBuf,
    /// A server certificate from the cluster CA that expired in 2020.
    pub expired_server_cert: PathBuf,
    /// Its key.
    pub expired_server_key: PathBuf,
    /// A file holding [`Pki::TOKEN`].
    pub token_file: PathBuf,
}

impl Pki {
    /// The cluster token in [`Pki::token_file`]: long and recognisable, so that a test can grep
    /// logs for it.
    pub const TOKEN: &str = "muster-test-cluster-token-7f3a9c1e5b2d";

    /// Writes a fresh PKI into `dir` (created if missing). The server certificate names
    /// `localhost`, `127.0.0.1` and every entry of `extra_names` (host names or IPs).
    pub fn generate(dir: &Path, extra_names: &[&str]) -> Pki {
        std::fs::create_dir_all(dir).expect("create the PKI directory");
        let write = |name: &str, pem: String| {
            let path = dir.join(name);
            std::fs::write(&path, pem).expect("write a PEM file");
            path
        };
        let ca = authority("muster test CA");
        let foreign = authority("someone else's CA");
        let mut names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
        names.extend(extra_names.iter().map(|s| (*s).to_owned()));

        let (server_cert, server_key) = leaf(
            &ca,
            names.clone(),
            ExtendedKeyUsagePurpose::ServerAuth,
            false,
        );
        let (client_cert, client_key) = leaf(
            &ca,
            vec!["muster-agent".into()],
            ExtendedKeyUsagePurpose::ClientAuth,
            false,
        );
        let (foreign_client_cert, foreign_client_key) = leaf(
            &foreign,
            vec!["muster-agent".into()],
            ExtendedKeyUsagePurpose::ClientAuth,
            false,
        );
        let (expired_cert, expired_key) =
            leaf(&ca, names, ExtendedKeyUsagePurpose::ServerAuth, true);

        let token_file = write("cluster-token", format!("{}\n", Pki::TOKEN));
        Pki {
            dir: dir.to_owned(),
            ca: write("ca.pem", ca.pem()),
            server_cert: write("server.pem", server_cert),
            server_key: write("server-key.pem", server_key),
            client_cert: write("client.pem", client_cert),
            client_key: write("client-key.pem", client_key),
            foreign_ca: write("foreign-ca.pem", foreign.pem()),
            foreign_client_cert: write("foreign-client.pem", foreign_client_cert),
            foreign_client_key: write("foreign-client-key.pem", foreign_client_key),
            expired_server_cert: write("expired-server.pem", expired_cert),
            expired_server_key: write("expired-server-key.pem", expired_key),
            token_file,
        }
    }
}

fn authority(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().expect("CA key");
    CertifiedIssuer::self_signed(params, key).expect("self-signed CA")
}

/// A certificate and key (both PEM) for `names`, signed by `issuer`.
fn leaf(
    issuer: &CertifiedIssuer<'static, KeyPair>,
    names: Vec<String>,
    usage: ExtendedKeyUsagePurpose,
    expired: bool,
) -> (String, String) {
    let mut params = CertificateParams::new(names.clone()).expect("leaf parameters");
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, names[0].clone());
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![usage];
    if expired {
        params.not_before = rcgen::date_time_ymd(2019, 1, 1);
        params.not_after = rcgen::date_time_ymd(2020, 1, 1);
    }
    let key = KeyPair::generate().expect("leaf key");
    let cert = params.signed_by(&key, issuer).expect("signed leaf");
    (cert.pem(), key.serialize_pem())
}
