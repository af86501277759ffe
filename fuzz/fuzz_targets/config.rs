//! Fuzz target `config`: arbitrary text as the coordinator's TOML config file and as its
//! `MUSTER_COORDINATOR_*` environment, layered and validated as `main.rs` does. Errors are
//! expected; a panic, or an error message spanning lines, is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;
use muster_coordinator::config::{Config, Layer};
use std::collections::HashMap;

fn check(config: Config) {
    if let Err(e) = config.validate() {
        assert!(!e.contains('\n'), "multi-line validation error: {e:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // The whole input as a config file.
    match Layer::from_toml_str(text) {
        Ok(layer) => check(Config::default().apply(&layer)),
        Err(e) => assert!(!e.contains('\n'), "multi-line parse error: {e:?}"),
    }
    // The same input as `NAME=value` lines of an environment; short names are completed to
    // `MUSTER_COORDINATOR_<NAME>` so that the fuzzer reaches every variable quickly.
    let env: HashMap<String, String> = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| {
            let k = k.trim().to_ascii_uppercase();
            let k = if k.starts_with("MUSTER_COORDINATOR_") {
                k
            } else {
                format!("MUSTER_COORDINATOR_{k}")
            };
            (k, v.to_owned())
        })
        .collect();
    match Layer::from_env(|k| env.get(k).cloned()) {
        Ok(layer) => check(Config::default().apply(&layer)),
        Err(e) => assert!(!e.contains('\n'), "multi-line environment error: {e:?}"),
    }
});
