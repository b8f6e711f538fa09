//! The hash behind the random numbers (dropout masks, parameter initialisation), below the
//! interpreter and both back ends so that all three draw the same values. It lives in the
//! runtime, which materialises params from their initialisers at load
//! (`tcc_runtime::init`).

pub use tcc_runtime::init::splitmix64;
