//! The `neuraldbg` command (see the library for what it does).

use std::process::ExitCode;

fn main() -> ExitCode {
    let code = neuraldbg_cli::run(std::env::args_os());
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
