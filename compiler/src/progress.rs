//! Progress of long work (a compile of a large model, a rematerialization search, loading an
//! artifact's kernels): a spinner on stderr with what is running and the time so far,
//! drawn only while one is active, stderr is a terminal and `-q` is off.
//!
//! The library reports through [`step`] (the pipeline names each stage); nothing is drawn
//! unless the command line started a [`Spinner`], so library users see nothing.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::Duration;

/// The active spinner and the label its steps are shown under.
static ACTIVE: Mutex<Option<(ProgressBar, String)>> = Mutex::new(None);

fn with_active<R>(f: impl FnOnce(&mut Option<(ProgressBar, String)>) -> R) -> R {
    match ACTIVE.lock() {
        Ok(mut g) => f(&mut g),
        Err(poisoned) => f(&mut poisoned.into_inner()),
    }
}

/// Says what the work is doing now (shown after the spinner's label).
pub fn step(what: &str) {
    with_active(|a| {
        if let Some((bar, label)) = a {
            bar.set_message(format!("{label}: {what}"));
        }
    });
}

/// Runs `f` (which prints) with the spinner hidden, so lines do not mix with it.
pub fn suspend<R>(f: impl FnOnce() -> R) -> R {
    let bar = with_active(|a| a.as_ref().map(|(b, _)| b.clone()));
    match bar {
        Some(b) => b.suspend(f),
        None => f(),
    }
}

/// A spinner for as long as it lives (cleared on drop). A no-op where stderr is not a
/// terminal or `quiet` is set.
pub struct Spinner {
    live: bool,
}

impl Spinner {
    pub fn start(label: &str, quiet: bool) -> Spinner {
        if quiet || !std::io::stderr().is_terminal() {
            return Spinner { live: false };
        }
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} ({elapsed})") {
            bar.set_style(style);
        }
        bar.set_message(label.to_string());
        bar.enable_steady_tick(Duration::from_millis(120));
        with_active(|a| {
            if let Some((old, _)) = a.take() {
                old.finish_and_clear();
            }
            *a = Some((bar, label.to_string()));
        });
        Spinner { live: true }
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        if self.live {
            with_active(|a| {
                if let Some((bar, _)) = a.take() {
                    bar.finish_and_clear();
                }
            });
        }
    }
}
