//! A global allocator that counts allocations, for the tests that check `run()` allocates
//! nothing. A test binary declares it with
//! `#[global_allocator] static GLOBAL: counting::Counting = counting::Counting;`.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub struct Counting;

pub static COUNTING: AtomicBool = AtomicBool::new(false);
pub static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
/// Allocations with exactly this (size, align) are counted in `MATCHING`.
pub static MATCH_SIZE: AtomicUsize = AtomicUsize::new(usize::MAX);
pub static MATCH_ALIGN: AtomicUsize = AtomicUsize::new(0);
pub static MATCHING: AtomicUsize = AtomicUsize::new(0);

fn count(layout: Layout) {
    if COUNTING.load(Ordering::SeqCst) {
        ALLOCATIONS.fetch_add(1, Ordering::SeqCst);
    }
    if layout.size() == MATCH_SIZE.load(Ordering::SeqCst)
        && layout.align() == MATCH_ALIGN.load(Ordering::SeqCst)
    {
        MATCHING.fetch_add(1, Ordering::SeqCst);
    }
}

// SAFETY: forwards every call to `System` unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which `System` shares.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::SeqCst) {
            ALLOCATIONS.fetch_add(1, Ordering::SeqCst);
        }
        // SAFETY: `ptr` came from this allocator, i.e. from `System`, with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, i.e. from `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

pub fn allocations_during(f: impl FnOnce()) -> usize {
    ALLOCATIONS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    f();
    COUNTING.store(false, Ordering::SeqCst);
    ALLOCATIONS.load(Ordering::SeqCst)
}
