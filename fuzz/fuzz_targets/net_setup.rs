//! Every network's connection handle decoder and setup message parser (what a listener reads
//! from a connector after the tag checked, and what a connector reads back): TCP's handle and
//! hello, RoCE v2's handle and setup message (both ways), shared memory's handle and
//! segment-name message, and `NetHandle::from_bytes`. The first byte picks the network, the
//! next one the handle's length (at most 128 bytes; longer is refused).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [net, hlen, rest @ ..] = data else {
        return;
    };
    let hlen = usize::from(*hlen).min(rest.len());
    let (handle, msg) = rest.split_at(hlen);
    roccl::fuzzing::net_setup(*net % 4, handle, msg);
});
