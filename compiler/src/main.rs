use clap::Parser;

fn main() -> std::process::ExitCode {
    tcc::cli::run(tcc::cli::Cli::parse())
}
