//! Addresses as the agent's flags and config files give them: a host without a port, a
//! `host:port`. Kept apart from the command line because the security settings and the
//! Accelerate config file check hosts too, and must not depend on the command line for it.

use std::net::Ipv6Addr;

/// Checks a host name or IP address given without a port (`--advertise-addr`,
/// `--master-addr`, `main_process_ip`); the error says what is wrong with it.
pub fn plain_host(s: &str) -> Result<&str, String> {
    let bad = || format!("'{s}' must be a host name or IP address, without a port");
    if s.contains(':') {
        // Only an IPv6 address has colons.
        return s.parse::<Ipv6Addr>().map(|_| s).map_err(|_| bad());
    }
    if s.is_empty() || s.len() > 253 {
        return Err(format!("'{s}' is not a host name or IP address"));
    }
    match s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        Some(c) => Err(format!(
            "'{s}' is not a host name or IP address (it contains {c:?})"
        )),
        None => Ok(s),
    }
}

/// `host:port`, with brackets around an IPv6 address.
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// `host:port` with a non-empty host and a port in 1..=65535 (`[v6]:port` included).
pub fn is_host_port(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    let host_ok = !host.is_empty()
        && !host.contains('/')
        && (!host.contains(':') || (host.starts_with('[') && host.ends_with(']')));
    host_ok && matches!(port.parse::<u16>(), Ok(p) if p > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names() {
        for ok in ["a", "node-1.example.com", "10.0.0.1", "::1", "fe80::1:2"] {
            assert_eq!(plain_host(ok), Ok(ok));
        }
        for bad in ["", "a:1", "[::1]", "a b", "fe80::1%eth0"] {
            assert!(plain_host(bad).is_err(), "{bad} accepted");
        }
        assert_eq!(host_port("fe80::1", 80), "[fe80::1]:80");
        assert!(is_host_port("[fe80::1]:80") && !is_host_port("fe80::1:0"));
    }
}
