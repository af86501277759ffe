//! A coordinator-replica stand-in for the election tests (`tests/tests/election.rs`): it
//! campaigns and, while it leads, writes a counter with fenced puts every 100 ms, printing one
//! line per event so that a test can follow it from outside (and SIGSTOP it).
//!
//! Usage: `candidate <endpoints,comma,separated> <prefix> <id> <ttl-seconds> <counter-key>`.
//! Lines on stdout: `leading token=<t>`, `wrote <id>:<n> revision=<r>`,
//! `refused <id>:<n>: <error>`, `stepped down: <reason>`.

use muster_coordinator::election::{Election, ElectionConfig};
use std::time::Duration;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [endpoints, prefix, id, ttl, counter] = args.as_slice() else {
        anyhow::bail!("usage: candidate <endpoints> <prefix> <id> <ttl-seconds> <counter-key>");
    };
    let endpoints: Vec<String> = endpoints.split(',').map(str::to_owned).collect();
    let config =
        ElectionConfig::new(id.clone(), prefix.clone()).with_ttl(Duration::from_secs(ttl.parse()?));
    let election = Election::connect(&endpoints, config).await?;
    let mut n = 0u64;
    loop {
        let leadership = election.campaign().await?;
        println!("leading token={}", leadership.token());
        loop {
            tokio::select! {
                reason = leadership.lost() => {
                    println!("stepped down: {reason}");
                    break;
                }
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
            n += 1;
            let value = format!("{id}:{n}");
            match leadership
                .put_fenced(counter.as_bytes(), value.as_bytes())
                .await
            {
                Ok(revision) => println!("wrote {value} revision={revision}"),
                Err(e) => println!("refused {value}: {e}"),
            }
        }
    }
}
