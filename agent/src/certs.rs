//! `muster-agent certs`: a throwaway PKI for trying a secured cluster in minutes. One command
//! writes a CA, a server certificate for the coordinator's names, a client certificate for the
//! agents and a cluster token into a directory, and prints the flags that use them.
//!
//! It is for trying TLS, not for running it: the CA key sits next to what it signed, nothing
//! can revoke a certificate, and every certificate expires after [`VALID_DAYS`]. Production
//! keeps its own PKI (and the help says so).
//!
//! Nothing is written unless everything can be: all names are checked first, everything is
//! generated in memory, existing files are refused (without `--force`) before the first write,
//! and each file goes to a temporary name in the directory with its final mode before being
//! renamed into place, so a failure part-way leaves the directory as it was.

use clap::Args;
use rand::TryRngCore;
use rand::rngs::OsRng;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SerialNumber,
};
use std::fmt::Write as _;
use std::fs::{DirBuilder, OpenOptions, Permissions};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// `muster-agent certs --help`: what the command is for, and what it is not for.
pub const LONG_ABOUT: &str = "Write a throwaway PKI for trying a secured cluster in minutes: a \
CA (ca.pem, ca-key.pem), a certificate for the coordinator valid for every --host (server.pem, \
server-key.pem), a client certificate for the agents (client.pem, client-key.pem) and a cluster \
token (token), then print the muster-coordinator and muster-agent flags that use them.\n\n\
This is for trying TLS, not for production: the CA key lies next to what it signed, nothing can \
revoke a certificate, and they expire after a year. Production keeps its own PKI (your \
organisation's CA, cert-manager, Vault...) and passes its files with the same flags.";

/// `muster-agent certs --out DIR --host NAME...`, as given. Both flags are checked by
/// [`CertsArgs::check`] rather than by clap, so that a missing one gets a message about
/// `certs`.
#[derive(Debug, Clone, Args)]
#[command(override_usage = "muster-agent certs --out DIR --host NAME [--host NAME...] [--force]")]
pub struct CertsArgs {
    /// Directory to write into; created (mode 0700) if missing. Keys and the token are
    /// written 0600, certificates 0644.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,

    /// A host name or IP address the agents reach the coordinator at; the server certificate
    /// is valid for each. Repeat for every name (at least one).
    #[arg(long = "host", value_name = "NAME")]
    pub hosts: Vec<String>,

    /// Replace files of the same names in DIR (otherwise they are left alone and nothing is
    /// written).
    #[arg(long)]
    pub force: bool,
}

/// How long the certificates are valid, from an hour before they were made (clocks of
/// different machines disagree a little).
pub const VALID_DAYS: u64 = 365;

/// The CA's certificate: what agents trust (`--tls-ca`) and what the coordinator checks
/// client certificates against (`--tls-client-ca`).
pub const CA: &str = "ca.pem";
/// The CA's key: signs more certificates; needed by no process.
pub const CA_KEY: &str = "ca-key.pem";
/// The coordinator's certificate (`--tls-cert` of `muster-coordinator`).
pub const SERVER: &str = "server.pem";
/// Its key.
pub const SERVER_KEY: &str = "server-key.pem";
/// The agents' certificate (`--tls-cert` of `muster-agent`).
pub const CLIENT: &str = "client.pem";
/// Its key.
pub const CLIENT_KEY: &str = "client-key.pem";
/// The cluster token (`--auth-token-file` of both).
pub const TOKEN: &str = "token";

/// Mode of the certificates: public, readable by all.
const PUBLIC: u32 = 0o644;
/// Mode of the keys, the token and a directory made here.
const PRIVATE: u32 = 0o600;
const PRIVATE_DIR: u32 = 0o700;

/// What [`CertsArgs::check`] found to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// `--out`.
    pub out: PathBuf,
    /// The `--host` names without repeats, in the order given; never empty.
    pub hosts: Vec<String>,
    /// `--force`.
    pub force: bool,
}

/// Why `certs` wrote nothing (or, with `--force`, may have replaced part of the files).
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    /// No `--out`.
    #[error("certs needs --out DIR: the directory to write the files into")]
    NoOut,
    /// No `--host`.
    #[error(
        "certs needs at least one --host: the name or IP address agents reach the coordinator at, as in --host node1.example.com --host 10.0.0.1"
    )]
    NoHost,
    /// A `--host` that is not a host name or IP address.
    #[error("--host {0}")]
    BadHost(String),
    /// Files that would be overwritten.
    #[error("{dir} already holds {names}; nothing was written (pass --force to replace them)")]
    Exists {
        /// The directory.
        dir: String,
        /// The files found, comma-separated.
        names: String,
    },
    /// `--out` names something that is not a directory.
    #[error("--out {0} is not a directory")]
    NotADirectory(String),
    /// A file-system call failed.
    #[error("{what} {path}: {source}; nothing was written")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: String,
        /// The system's reason.
        source: std::io::Error,
    },
    /// With `--force`, renaming into place failed part-way.
    #[error("cannot replace {path}: {source}; the files in {dir} may now be from two runs")]
    PartlyReplaced {
        /// The file that could not be replaced.
        path: String,
        /// The directory.
        dir: String,
        /// The system's reason.
        source: std::io::Error,
    },
    /// rcgen refused the parameters or the system's random source failed.
    #[error("cannot generate the certificates: {0}")]
    Generate(String),
}

impl CertsArgs {
    /// Checks the flags before anything is generated: `--out`, and at least one `--host`,
    /// each a host name or IP address.
    pub fn check(&self) -> Result<Plan, CertsError> {
        let out = self.out.clone().ok_or(CertsError::NoOut)?;
        if self.hosts.is_empty() {
            return Err(CertsError::NoHost);
        }
        let mut names: Vec<String> = Vec::new();
        for host in &self.hosts {
            crate::net::plain_host(host).map_err(CertsError::BadHost)?;
            if !names.iter().any(|n| n.eq_ignore_ascii_case(host)) {
                names.push(host.clone());
            }
        }
        Ok(Plan {
            out,
            hosts: names,
            force: self.force,
        })
    }
}

/// One file of the bundle, in memory.
#[derive(Debug)]
pub struct Output {
    /// Its name in the directory.
    pub name: &'static str,
    /// What it holds (PEM, or the token and a newline).
    pub contents: String,
    /// Its mode.
    pub mode: u32,
}

/// Generates the bundle for `hosts` (already checked): the CA, the server and client
/// certificates with their keys, and a token, valid from an hour before `now`.
pub fn generate(hosts: &[String], now: SystemTime) -> Result<Vec<Output>, CertsError> {
    let first = hosts.first().ok_or(CertsError::NoHost)?;
    let bad = |e: rcgen::Error| CertsError::Generate(e.to_string());
    let since_epoch = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_err(|e| CertsError::Generate(format!("the clock is before 1970: {e}")))?;
    // rcgen takes `time`'s dates; adding to its epoch spares a dependency on `time` itself.
    let not_before = rcgen::date_time_ymd(1970, 1, 1) + since_epoch - Duration::from_secs(60 * 60);
    let not_after = not_before + Duration::from_secs(VALID_DAYS * 24 * 60 * 60);
    let params = |names: Vec<String>, cn: &str| -> Result<CertificateParams, CertsError> {
        let mut p = CertificateParams::new(names).map_err(bad)?;
        p.distinguished_name = DistinguishedName::new();
        p.distinguished_name
            .push(DnType::OrganizationName, "muster (trial)");
        p.distinguished_name.push(DnType::CommonName, cn);
        p.not_before = not_before;
        p.not_after = not_after;
        p.serial_number = Some(SerialNumber::from_slice(&random::<16>()?));
        Ok(p)
    };

    let ca_key = KeyPair::generate().map_err(bad)?;
    // A name of its own: a CA from another run, with the same name, would otherwise be
    // taken for this one's issuer and fail on its signature rather than as unknown.
    let ca_name = format!("muster trial CA {}", hex::encode(random::<4>()?));
    let mut ca = params(Vec::new(), &ca_name)?;
    // Signs leaf certificates only: an intermediate CA under it would be refused.
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).map_err(bad)?;
    let issuer = Issuer::from_params(&ca, &ca_key);

    let leaf = |names: Vec<String>,
                cn: &str,
                usage: ExtendedKeyUsagePurpose|
     -> Result<(String, String), CertsError> {
        let mut p = params(names, cn)?;
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![usage];
        p.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().map_err(bad)?;
        let cert = p.signed_by(&key, &issuer).map_err(bad)?;
        Ok((cert.pem(), key.serialize_pem()))
    };
    let (server, server_key) = leaf(hosts.to_vec(), first, ExtendedKeyUsagePurpose::ServerAuth)?;
    let (client, client_key) = leaf(
        Vec::new(),
        "muster-agent",
        ExtendedKeyUsagePurpose::ClientAuth,
    )?;
    let file = |name, contents, mode| Output {
        name,
        contents,
        mode,
    };
    Ok(vec![
        file(CA, ca_cert.pem(), PUBLIC),
        file(CA_KEY, ca_key.serialize_pem(), PRIVATE),
        file(SERVER, server, PUBLIC),
        file(SERVER_KEY, server_key, PRIVATE),
        file(CLIENT, client, PUBLIC),
        file(CLIENT_KEY, client_key, PRIVATE),
        file(TOKEN, format!("{}\n", token()?), PRIVATE),
    ])
}

/// `N` bytes from the operating system's random source.
fn random<const N: usize>() -> Result<[u8; N], CertsError> {
    let mut bytes = [0u8; N];
    OsRng
        .try_fill_bytes(&mut bytes)
        .map_err(|e| CertsError::Generate(format!("the system's random source: {e}")))?;
    Ok(bytes)
}

/// A cluster token: 256 random bits as hex, well above the coordinator's minimum length.
fn token() -> Result<String, CertsError> {
    Ok(hex::encode(random::<32>()?))
}

/// Writes `files` into `dir` (see the module's doc for what happens on failure); `dir` is
/// created 0700 if missing. Without `force`, a file of the same name fails the whole write.
pub fn write(dir: &Path, files: &[Output], force: bool) -> Result<(), CertsError> {
    let io = |what, path: &Path| {
        let path = path.display().to_string();
        move |source| CertsError::Io { what, path, source }
    };
    let created = match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Vec::new(),
        Ok(_) => return Err(CertsError::NotADirectory(dir.display().to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // Every missing level, deepest first, to remove them again if a write fails.
            let missing: Vec<PathBuf> = dir
                .ancestors()
                .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
                .map(Path::to_path_buf)
                .collect();
            DirBuilder::new()
                .recursive(true)
                .mode(PRIVATE_DIR)
                .create(dir)
                .map_err(io("cannot create", dir))?;
            missing
        }
        Err(e) => return Err(io("cannot use", dir)(e)),
    };
    let undo_dirs = || {
        for d in &created {
            let _ = std::fs::remove_dir(d);
        }
    };
    if !force {
        let existing: Vec<&str> = files
            .iter()
            .filter(|f| dir.join(f.name).symlink_metadata().is_ok())
            .map(|f| f.name)
            .collect();
        if !existing.is_empty() {
            return Err(CertsError::Exists {
                dir: dir.display().to_string(),
                names: existing.join(", "),
            });
        }
    }
    if !created.is_empty() {
        // The umask may have taken bits from the mode given at creation; set it exactly.
        std::fs::set_permissions(dir, Permissions::from_mode(PRIVATE_DIR))
            .map_err(io("cannot set the mode of", dir))
            .inspect_err(|_| undo_dirs())?;
    }

    let mut temporary: Vec<(PathBuf, PathBuf)> = Vec::new();
    let undo = |temporary: &[(PathBuf, PathBuf)]| {
        for (tmp, _) in temporary {
            let _ = std::fs::remove_file(tmp);
        }
        undo_dirs();
    };
    for f in files {
        let tmp = dir.join(format!(".{}.{}.tmp", f.name, std::process::id()));
        if let Err(e) = write_file(&tmp, f) {
            let _ = std::fs::remove_file(&tmp);
            undo(&temporary);
            return Err(io("cannot write", &dir.join(f.name))(e));
        }
        temporary.push((tmp, dir.join(f.name)));
    }
    for (i, (tmp, path)) in temporary.iter().enumerate() {
        if let Err(source) = std::fs::rename(tmp, path) {
            if !force {
                // None of these names existed: what was renamed is this run's, and goes.
                for (_, done) in &temporary[..i] {
                    let _ = std::fs::remove_file(done);
                }
            }
            undo(&temporary[i..]);
            return Err(if i == 0 || !force {
                io("cannot write", path)(source)
            } else {
                CertsError::PartlyReplaced {
                    path: path.display().to_string(),
                    dir: dir.display().to_string(),
                    source,
                }
            });
        }
    }
    Ok(())
}

/// Creates `path` (which must not exist) with `f`'s mode and contents, on disk before it
/// returns.
fn write_file(path: &Path, f: &Output) -> std::io::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(f.mode)
        .open(path)?;
    file.set_permissions(Permissions::from_mode(f.mode))?;
    file.write_all(f.contents.as_bytes())?;
    file.sync_all()
}

/// What to run next, with `dir`'s files: the coordinator's command and the agents' flags, for
/// the first host name (`hosts` is never empty).
pub fn next_steps(dir: &Path, hosts: &[String]) -> String {
    let file = |name: &str| quoted(&dir.join(name));
    let first = hosts.first().map_or("localhost", String::as_str);
    let coordinator = crate::net::host_port(first, muster_proto::DEFAULT_COORDINATOR_PORT);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Wrote a CA, a server certificate for {}, a client certificate and a cluster token to {}.",
        hosts.join(", "),
        quoted(dir)
    );
    let _ = writeln!(
        s,
        "These are for trying TLS; production keeps its own PKI. {CA_KEY} signs more \
         certificates: keep it off the cluster.\n"
    );
    let _ = writeln!(s, "On the coordinator's machine ({first}):");
    let _ = writeln!(
        s,
        "  muster-coordinator --listen 0.0.0.0:{port} --tls-cert {} --tls-key {} --tls-client-ca {} --auth-token-file {}\n",
        file(SERVER),
        file(SERVER_KEY),
        file(CA),
        file(TOKEN),
        port = muster_proto::DEFAULT_COORDINATOR_PORT,
    );
    let _ = writeln!(
        s,
        "On every agent's machine, with {CA}, {CLIENT}, {CLIENT_KEY} and {TOKEN} copied to the same \
         paths, add these flags to muster-agent launch, serve, submit, status and cancel:"
    );
    let _ = writeln!(
        s,
        "  --coordinator {coordinator} --tls-ca {} --tls-cert {} --tls-key {} --auth-token-file {}",
        file(CA),
        file(CLIENT),
        file(CLIENT_KEY),
        file(TOKEN),
    );
    s
}

/// `path` as one shell word.
fn quoted(path: &Path) -> String {
    let shown = path.to_string_lossy();
    shlex::try_quote(&shown).map_or_else(|_| shown.to_string(), |q| q.into_owned())
}

/// Runs `muster-agent certs`: writes the files, prints what to run next.
pub fn run(plan: &Plan) -> Result<(), CertsError> {
    let dir = std::path::absolute(&plan.out).map_err(|source| CertsError::Io {
        what: "cannot use",
        path: plan.out.display().to_string(),
        source,
    })?;
    let files = generate(&plan.hosts, SystemTime::now())?;
    write(&dir, &files, plan.force)?;
    print!("{}", next_steps(&dir, &plan.hosts));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::PublicKeyData;
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, ServerName, UnixTime};
    use std::os::unix::fs::MetadataExt;
    use webpki::{EndEntityCert, KeyUsage};

    /// A directory of this test's own under the system's temporary directory, removed on drop;
    /// the directory itself is not created.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("muster-certs-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn hosts(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    fn args(out: &Path, names: &[&str]) -> CertsArgs {
        CertsArgs {
            out: Some(out.to_owned()),
            hosts: hosts(names),
            force: false,
        }
    }

    /// The names in `dir`, sorted.
    fn listing(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("list the directory")
            .map(|e| {
                e.expect("an entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        names.sort();
        names
    }

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).expect("stat").mode() & 0o7777
    }

    fn cert(dir: &Path, name: &str) -> CertificateDer<'static> {
        CertificateDer::from_pem_file(dir.join(name)).expect("a PEM certificate")
    }

    /// Verifies `name` in `dir` as rustls would: chained to `dir`'s CA at `at`, for `usage`.
    fn verify(
        dir: &Path,
        name: &str,
        at: SystemTime,
        usage: KeyUsage,
    ) -> Result<(), webpki::Error> {
        let ca = cert(dir, CA);
        let anchor = webpki::anchor_from_trusted_cert(&ca).expect("the CA is a trust anchor");
        let leaf = cert(dir, name);
        let leaf = EndEntityCert::try_from(&leaf).expect("an end-entity certificate");
        let since = at
            .duration_since(SystemTime::UNIX_EPOCH)
            .expect("after 1970");
        leaf.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &[anchor],
            &[],
            UnixTime::since_unix_epoch(since),
            usage,
            None,
            None,
        )
        .map(|_| ())
    }

    fn valid_for(dir: &Path, name: &str) -> Result<(), webpki::Error> {
        let der = cert(dir, SERVER);
        let leaf = EndEntityCert::try_from(&der).expect("an end-entity certificate");
        let name = ServerName::try_from(name).expect("a server name");
        leaf.verify_is_valid_for_subject_name(&name)
    }

    #[test]
    fn writes_every_file_with_its_mode_into_a_new_private_directory() {
        let scratch = Scratch::new("modes");
        let out = scratch.0.join("nested").join("pki");
        let a = args(&out, &["node1.example.com"]);
        run(&a.check().expect("valid flags")).expect("certs writes");
        assert_eq!(
            listing(&out),
            [CA_KEY, CA, CLIENT_KEY, CLIENT, SERVER_KEY, SERVER, TOKEN]
        );
        assert_eq!(mode(&out), 0o700);
        assert_eq!(mode(&scratch.0.join("nested")), 0o700);
        for (name, expected) in [
            (CA, 0o644),
            (SERVER, 0o644),
            (CLIENT, 0o644),
            (CA_KEY, 0o600),
            (SERVER_KEY, 0o600),
            (CLIENT_KEY, 0o600),
            (TOKEN, 0o600),
        ] {
            assert_eq!(mode(&out.join(name)), expected, "{name}");
        }
        // The token is what the coordinator and the agents accept, and random.
        let token = muster_proto::security::read_token_file(&out.join(TOKEN)).expect("a token");
        assert_eq!(token.len(), 64, "{token}");
        assert!(token.bytes().all(|b| b.is_ascii_hexdigit()), "{token}");
        let other = generate(&hosts(&["x"]), SystemTime::now()).expect("generate");
        let other_token = &other
            .iter()
            .find(|f| f.name == TOKEN)
            .expect("a token")
            .contents;
        assert_ne!(other_token.trim(), token);
    }

    #[test]
    fn a_directory_that_exists_keeps_its_mode_and_other_files() {
        let scratch = Scratch::new("existing");
        std::fs::create_dir(&scratch.0).expect("mkdir");
        std::fs::set_permissions(&scratch.0, Permissions::from_mode(0o750)).expect("chmod");
        std::fs::write(scratch.0.join("notes.txt"), "mine").expect("write");
        let a = args(&scratch.0, &["10.0.0.1"]);
        run(&a.check().expect("valid flags")).expect("certs writes");
        assert_eq!(mode(&scratch.0), 0o750);
        assert_eq!(listing(&scratch.0).len(), 8);
        assert_eq!(
            std::fs::read_to_string(scratch.0.join("notes.txt"))
                .ok()
                .as_deref(),
            Some("mine")
        );
    }

    #[test]
    fn the_server_certificate_names_each_host_and_chains_to_the_ca() {
        let scratch = Scratch::new("sans");
        let a = args(
            &scratch.0,
            &[
                "node1.example.com",
                "10.0.0.1",
                "fd00::7",
                "localhost",
                "NODE1.example.com",
            ],
        );
        let plan = a.check().expect("valid flags");
        assert_eq!(
            plan.hosts,
            ["node1.example.com", "10.0.0.1", "fd00::7", "localhost"]
        );
        run(&plan).expect("certs writes");
        let now = SystemTime::now();
        let dir = &scratch.0;

        for name in ["node1.example.com", "10.0.0.1", "fd00::7", "localhost"] {
            assert_eq!(valid_for(dir, name), Ok(()), "{name}");
        }
        for name in ["node2.example.com", "10.0.0.2", "127.0.0.1", "example.com"] {
            assert!(valid_for(dir, name).is_err(), "{name} is not a --host");
        }
        assert_eq!(verify(dir, SERVER, now, KeyUsage::server_auth()), Ok(()));
        assert_eq!(verify(dir, CLIENT, now, KeyUsage::client_auth()), Ok(()));
        // Each certificate is for its side only.
        assert!(verify(dir, SERVER, now, KeyUsage::client_auth()).is_err());
        assert!(verify(dir, CLIENT, now, KeyUsage::server_auth()).is_err());
        // Valid from an hour ago for a year, no longer.
        let day = Duration::from_secs(24 * 60 * 60);
        assert_eq!(
            verify(dir, SERVER, now + day * 364, KeyUsage::server_auth()),
            Ok(())
        );
        assert!(matches!(
            verify(dir, SERVER, now + day * 366, KeyUsage::server_auth()),
            Err(webpki::Error::CertExpired { .. })
        ));
        assert!(matches!(
            verify(
                dir,
                CLIENT,
                now - Duration::from_secs(2 * 60 * 60),
                KeyUsage::client_auth()
            ),
            Err(webpki::Error::CertNotValidYet { .. })
        ));
        // Each key is its certificate's.
        for (c, k) in [(SERVER, SERVER_KEY), (CLIENT, CLIENT_KEY)] {
            let der = cert(dir, c);
            let leaf = EndEntityCert::try_from(&der).expect("an end-entity certificate");
            let pem = std::fs::read_to_string(dir.join(k)).expect("read the key");
            let key = KeyPair::from_pem(&pem).expect("a PEM key");
            assert_eq!(
                leaf.subject_public_key_info().as_ref(),
                key.subject_public_key_info().as_slice(),
                "{k}"
            );
        }
    }

    #[test]
    fn another_run_makes_another_ca_that_the_first_does_not_trust() {
        let (one, two) = (Scratch::new("ca-one"), Scratch::new("ca-two"));
        for s in [&one, &two] {
            let a = args(&s.0, &["localhost"]);
            run(&a.check().expect("valid flags")).expect("certs writes");
        }
        // Two's client certificate against one's CA.
        std::fs::copy(two.0.join(CLIENT), one.0.join("foreign.pem")).expect("copy");
        assert_eq!(
            verify(
                &one.0,
                "foreign.pem",
                SystemTime::now(),
                KeyUsage::client_auth()
            ),
            Err(webpki::Error::UnknownIssuer)
        );
    }

    #[test]
    fn existing_files_are_refused_and_nothing_is_written_unless_forced() {
        let scratch = Scratch::new("force");
        std::fs::create_dir(&scratch.0).expect("mkdir");
        std::fs::write(scratch.0.join(TOKEN), "an-old-token-0123456789\n").expect("write");
        std::fs::write(scratch.0.join(SERVER), "old").expect("write");
        let mut a = args(&scratch.0, &["localhost"]);
        let e = run(&a.check().expect("valid flags")).expect_err("existing files");
        assert_eq!(
            e.to_string(),
            format!(
                "{} already holds server.pem, token; nothing was written (pass --force to replace them)",
                scratch.0.display()
            )
        );
        assert_eq!(listing(&scratch.0), [SERVER, TOKEN]);
        assert_eq!(
            std::fs::read_to_string(scratch.0.join(SERVER))
                .ok()
                .as_deref(),
            Some("old")
        );

        a.force = true;
        run(&a.check().expect("valid flags")).expect("--force replaces");
        assert_eq!(listing(&scratch.0).len(), 7);
        assert_eq!(mode(&scratch.0.join(TOKEN)), 0o600);
        assert_eq!(valid_for(&scratch.0, "localhost"), Ok(()));
    }

    #[test]
    fn a_directory_that_cannot_be_made_or_is_a_file_gets_nothing() {
        let scratch = Scratch::new("unwritable");
        std::fs::create_dir(&scratch.0).expect("mkdir");
        let file = scratch.0.join("plain-file");
        std::fs::write(&file, "x").expect("write");
        let a = args(&file, &["localhost"]);
        let e = run(&a.check().expect("valid flags")).expect_err("a file");
        assert_eq!(
            e.to_string(),
            format!("--out {} is not a directory", file.display())
        );

        let under = file.join("pki");
        let a = args(&under, &["localhost"]);
        let e = run(&a.check().expect("valid flags")).expect_err("under a file");
        let message = e.to_string();
        assert!(
            message.starts_with(&format!("cannot use {}: Not a directory", under.display()))
                && message.ends_with("; nothing was written"),
            "{message}"
        );
        assert_eq!(listing(&scratch.0), ["plain-file"]);
        assert_eq!(std::fs::read_to_string(&file).ok().as_deref(), Some("x"));

        // Where no one may make a directory, root included.
        let sys = Path::new("/sys/muster-certs-test/pki");
        let a = args(sys, &["localhost"]);
        let e = run(&a.check().expect("valid flags")).expect_err("in /sys");
        let message = e.to_string();
        assert!(
            message.starts_with(&format!("cannot create {}: ", sys.display()))
                && message.ends_with("; nothing was written"),
            "{message}"
        );
        assert!(!Path::new("/sys/muster-certs-test").exists());
    }

    #[test]
    fn a_failed_write_removes_what_it_wrote_and_the_directories_it_made() {
        let scratch = Scratch::new("undo");
        let out = scratch.0.join("a").join("b");
        let mut files = generate(&hosts(&["localhost"]), SystemTime::now()).expect("generate");
        // A name that cannot be a file in `out`: the fifth write fails.
        files[4].name = "no/such/dir";
        let e = write(&out, &files, false).expect_err("the bad name fails");
        assert!(e.to_string().contains("no/such/dir"), "{e}");
        assert!(!scratch.0.join("a").exists(), "{e}");
    }

    #[test]
    fn hosts_are_checked_before_anything_is_written() {
        let scratch = Scratch::new("hosts");
        let check = |names: &[&str]| {
            args(&scratch.0, names)
                .check()
                .map(|p| p.hosts)
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            check(&[]),
            Err("certs needs at least one --host: the name or IP address agents reach the coordinator at, as in --host node1.example.com --host 10.0.0.1".into())
        );
        assert_eq!(
            check(&["node1:29470"]),
            Err("--host 'node1:29470' must be a host name or IP address, without a port".into())
        );
        assert_eq!(
            check(&["a b"]),
            Err("--host 'a b' is not a host name or IP address (it contains ' ')".into())
        );
        assert_eq!(
            check(&["ok", "", "x"]),
            Err("--host '' is not a host name or IP address".into())
        );
        let mut no_out = args(&scratch.0, &["x"]);
        no_out.out = None;
        assert_eq!(
            no_out.check().map_err(|e| e.to_string()),
            Err("certs needs --out DIR: the directory to write the files into".into())
        );
        assert!(!scratch.0.exists());
    }

    /// What `certs` prints is a command line the coordinator takes and flags the agent
    /// takes, with the files just written (paths with blanks quoted).
    #[test]
    fn the_printed_flags_name_the_files_and_the_agent_accepts_them() {
        let scratch = Scratch::new("next steps");
        let a = args(&scratch.0, &["fd00::7", "node1"]);
        let plan = a.check().expect("valid flags");
        run(&plan).expect("certs writes");
        let text = next_steps(&scratch.0, &plan.hosts);
        let words = |prefix: &str| -> Vec<String> {
            let line = text
                .lines()
                .find(|l| l.trim_start().starts_with(prefix))
                .unwrap_or_else(|| panic!("no line starting with {prefix}:\n{text}"));
            shlex::split(line).expect("shell words")
        };
        let path = |name: &str| scratch.0.join(name).display().to_string();
        assert_eq!(
            words("muster-coordinator"),
            [
                "muster-coordinator",
                "--listen",
                "0.0.0.0:29470",
                "--tls-cert",
                &path(SERVER),
                "--tls-key",
                &path(SERVER_KEY),
                "--tls-client-ca",
                &path(CA),
                "--auth-token-file",
                &path(TOKEN),
            ]
        );
        let agent = words("--coordinator");
        assert_eq!(
            agent,
            [
                "--coordinator",
                "[fd00::7]:29470",
                "--tls-ca",
                &path(CA),
                "--tls-cert",
                &path(CLIENT),
                "--tls-key",
                &path(CLIENT_KEY),
                "--auth-token-file",
                &path(TOKEN),
            ]
        );
        // The agent's own parser takes them and reads every file (CA, identity, token).
        let argv = ["muster-agent", "status"]
            .into_iter()
            .map(str::to_owned)
            .chain(agent);
        let parsed = crate::cli::parse(argv, None);
        assert!(matches!(parsed, Ok(crate::Parsed::Daemon(_))), "{parsed:?}");
    }
}
