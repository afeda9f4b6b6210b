//! The `granary` binary: parse the command line, run it, map the outcome to an exit code.

use clap::Parser;

fn main() -> std::process::ExitCode {
    granary_cli::main(granary_cli::args::Cli::parse())
}
