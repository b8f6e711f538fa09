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
    quiet_on_closed_stdout();
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

/// The exit status of a process that a closed pipe stopped (128 + SIGPIPE), as a shell
/// reports a C tool's.
const CLOSED_PIPE_EXIT: i32 = 141;

/// `tcc run … | head` closes standard output early, and Rust's `println!` then panics
/// ("failed printing to stdout: Broken pipe"). Like a C tool killed by SIGPIPE, tcc then
/// stops at once with status 141 and no message; every other panic keeps the default
/// report. (Files tcc writes are written atomically, so stopping mid-run loses none.)
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(CLOSED_PIPE_EXIT);
        }
        default(info);
    }));
}
