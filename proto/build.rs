//! Compiles `proto/muster/v1/*.proto` with protox (no `protoc` needed) into Rust code and a
//! file descriptor set for gRPC server reflection.

use prost::Message;
use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["muster/v1/muster.proto"], ["proto"])?;
    let out = PathBuf::from(env::var("OUT_DIR")?);
    std::fs::write(out.join("muster_v1_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(env::var_os("CARGO_FEATURE_CLIENT").is_some())
        .build_server(env::var_os("CARGO_FEATURE_SERVER").is_some())
        .compile_fds(fds)?;
    Ok(())
}
