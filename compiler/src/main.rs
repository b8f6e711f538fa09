use clap::Parser;

/// Stack of the thread the compiler runs on. The front end lowers expressions recursively
/// (a 10,000-term sum is a tree 10,000 deep) and the main thread's 8 MiB overflowed on such
/// programs; the pages are reserved, not committed, until used.
const STACK_BYTES: usize = 1 << 30;

fn main() -> std::process::ExitCode {
    let cli = tcc::cli::Cli::parse();
    match std::thread::Builder::new()
        .name("tcc".into())
        .stack_size(STACK_BYTES)
        .spawn(move || tcc::cli::run(cli))
    {
        Ok(h) => h.join().unwrap_or(std::process::ExitCode::from(101)),
        Err(e) => {
            eprintln!("error: cannot start the compiler thread: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
