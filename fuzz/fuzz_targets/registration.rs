//! The bootstrap root's registration parser on everything a connection sent so far: as
//! sent, or first signed for the root's job (its nonce and a good tag), so that the checks
//! after authentication are reached too.
#![no_main]

use libfuzzer_sys::fuzz_target;

// Layout: flags (bit 0: sign first), then the bytes the connection sent.
fuzz_target!(|data: &[u8]| {
    let [flags, sent @ ..] = data else {
        return;
    };
    roccl::fuzzing::registration(sent, flags & 1 != 0);
});
