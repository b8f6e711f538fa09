use clap::Parser;

/// Stack of the thread the compiler runs on. The front end lowers expressions recursively
/// (a 10,000-term sum is a tree 10,000 deep) and the main thread's 8 MiB overflowed on such
/// programs; the pages are reserved, not committed, until used.
const STACK_BYTES: usize = 1 << 30;

fn main() -> std::process::ExitCode {
    // NVLink SHARP (multicast) stays off for NCCL (`--gpus`), set here while this is the
    // process's only thread (the runtime sets it too, for library users, unless set).
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
    // No NCCL buffer registration inside a captured step (see the runtime's `nccl.rs`).
    if std::env::var_os("NCCL_GRAPH_REGISTER").is_none() {
        std::env::set_var("NCCL_GRAPH_REGISTER", "0");
    }
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
