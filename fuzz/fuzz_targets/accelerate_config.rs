//! Fuzz target `accelerate_config`: arbitrary text as an Accelerate config file (YAML or
//! JSON) for `muster-agent launch --config-file`, and as a mixed-precision setting. Errors are
//! expected; a panic is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;
use muster_agent::accelerate_config::{mixed_precision, parse};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = parse(text);
    let _ = mixed_precision(text);
});
