//! The hash behind the random numbers (dropout masks, parameter initialisation), below the
//! interpreter and both back ends so that all three draw the same values.

/// A splitmix64 step: the hash behind dropout masks and parameter initialisation.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
