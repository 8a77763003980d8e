fn main() {
    // Export only the plugin symbols NCCL and RCCL look up.
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/exports.map");
    println!("cargo:rerun-if-changed=exports.map");
}
