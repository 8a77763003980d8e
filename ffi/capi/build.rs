fn main() {
    // A soname, so programs link against libroccl.so.0 and survive compatible upgrades.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libroccl.so.0");
}
