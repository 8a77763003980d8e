//! The hello protocol between ranks (first messages and notices) as a listener reads it,
//! and back: what reads must encode to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

// Layout: the communicator id the listener expects, then the bytes that arrived. The
// listener's job has 4 ranks.
fuzz_target!(|data: &[u8]| {
    let [a, b, c, d, sent @ ..] = data else {
        return;
    };
    roccl::fuzzing::hello(sent, u32::from_le_bytes([*a, *b, *c, *d]), 4);
});
