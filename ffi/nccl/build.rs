fn main() {
    // Export NCCL's names only (the roccl* functions it forwards to stay inside), under a
    // soname of its own: installed as libnccl.so.2 it is still loaded by file name.
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/exports.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libroccl-nccl.so");
    // rustc also exports the roccl* functions of the C layer linked in; bind this library's
    // own calls to them inside it, so a libroccl.so loaded in the same process never
    // interposes (each library keeps its own communicator table).
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
    // NCCL's profiling aliases: every pnccl name the export list holds is the function of
    // the same name without the p (the linker binds both to one address).
    let map = std::fs::read_to_string(format!("{dir}/exports.map")).expect("exports.map");
    for name in map
        .lines()
        .map(|l| l.trim().trim_end_matches(';'))
        .filter(|l| l.starts_with("pnccl"))
    {
        println!(
            "cargo:rustc-cdylib-link-arg=-Wl,--defsym={name}={}",
            &name[1..]
        );
    }
    println!("cargo:rerun-if-changed=exports.map");
}
