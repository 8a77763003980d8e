//! Scratch buffers a communicator keeps from call to call (averages of narrow floats, the
//! staging of calls by host): a warm call takes no allocation, and one big call does not hold
//! its size for the communicator's life.

/// Bytes of capacity a scratch buffer keeps between calls.
pub(super) const KEEP: usize = 4 << 20;

/// `scratch` as kept for the next call: given back (empty) when a call grew it past [`KEEP`].
pub(super) fn kept(scratch: Vec<u8>) -> Vec<u8> {
    if scratch.capacity() > KEEP {
        Vec::new()
    } else {
        scratch
    }
}
