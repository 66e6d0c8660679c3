//! burn-collective's global orchestrator, for data-parallel training over several processes or
//! machines (`train_tiny --nodes N`, `kimi_burn::parallel::Peer::global`). It runs until
//! Ctrl-C or SIGTERM.
//!
//! ```text
//! cargo run --release --features collective --example orchestrator -- --port 3000
//! ```
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use clap::Parser;

/// Run burn-collective's global orchestrator.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// The port the nodes connect to (`ws://host:PORT`).
    #[arg(long, default_value_t = 3000)]
    port: u16,
}

fn main() {
    let args = Args::parse();
    println!("orchestrator listening on port {}", args.port);
    if let Err(e) = kimi_burn::parallel::run_orchestrator(args.port) {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}
