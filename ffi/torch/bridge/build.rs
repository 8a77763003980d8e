//! Generates the C++ side of the bridge (`lib.rs.h`, `lib.rs.cc`); ffi/torch/setup.py
//! compiles the backend against the header under `$OUT_DIR/cxxbridge/include`.
fn main() {
    cxx_build::bridge("src/lib.rs")
        .std("c++17")
        .compile("roccl-torch-bridge");
    println!("cargo:rerun-if-changed=src/lib.rs");
}
