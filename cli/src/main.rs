//! The `granary` binary: read the config file (if any), parse the command line, run it,
//! map the outcome to an exit code.

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use granary_cli::args::Cli;

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    if let Some(file) = granary_cli::config::config_path(&args) {
        if let Err(e) = granary_cli::config::apply(&Cli::command(), &args, &file) {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    granary_cli::main(Cli::parse_from(args))
}
