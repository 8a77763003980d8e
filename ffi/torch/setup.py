"""Builds roccl's torch.distributed backend: the Rust core and the cxx bridge with cargo
(ffi/torch/bridge, a static library; CARGO_TARGET_DIR is honoured), then the C++ extension
roccl._C against the torch of this environment (torch.utils.cpp_extension). The package also
carries roccl's NCCL-named library and its NCCL/RCCL network plugin (roccl/lib/), for
roccl.nccl_library_path() and roccl.net_plugin_path().

    pip install --no-build-isolation ./ffi/torch
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MANIFEST = ROOT / "Cargo.toml"


def target_dir() -> Path:
    meta = subprocess.check_output(
        ["cargo", "metadata", "--format-version", "1", "--no-deps", "--manifest-path", str(MANIFEST)]
    )
    return Path(json.loads(meta)["target_directory"])


class Build(BuildExtension):
    def run(self):
        if not MANIFEST.exists():
            raise RuntimeError(
                f"roccl: {MANIFEST} not found: build from a roccl checkout (pip install "
                "--no-build-isolation ./ffi/torch from the repository's root)"
            )
        subprocess.check_call(
            ["cargo", "build", "--release", "-p", "roccl-torch", "-p", "roccl-nccl",
             "-p", "roccl-netplugin", "--manifest-path", str(MANIFEST)]
        )
        release = target_dir() / "release"
        library = release / "libroccl_torch.a"
        headers = [
            p
            for p in release.glob("build/roccl-torch-*/out/cxxbridge/include")
            if (p / "roccl-torch/src/lib.rs.h").exists()
        ]
        if not headers or not library.exists():
            raise RuntimeError(f"roccl: cargo built no bridge under {release}")
        # The header cargo generated last (older build directories may linger).
        include = max(headers, key=lambda p: (p / "roccl-torch/src/lib.rs.h").stat().st_mtime)
        for ext in self.extensions:
            ext.include_dirs.append(str(include))
            ext.extra_objects.append(str(library))
            ext.depends.append(str(library))
        super().run()
        # The NCCL-named library and the network plugin, under the names NCCL, RCCL and
        # vLLM look for, without their debug information.
        lib = (HERE if self.inplace else Path(self.build_lib)) / "roccl" / "lib"
        lib.mkdir(parents=True, exist_ok=True)
        for built, names in [
            ("libroccl_nccl.so", ["libroccl-nccl.so"]),
            ("libnccl_net_roccl.so", ["libnccl-net-roccl.so", "librccl-net-roccl.so"]),
        ]:
            for name in names:
                dest = lib / name
                shutil.copyfile(release / built, dest)
                dest.chmod(0o755)
                if shutil.which("strip"):
                    subprocess.call(["strip", "--strip-debug", str(dest)])


setup(
    ext_modules=[
        CppExtension(
            "roccl._C",
            sources=[str(Path("csrc") / f) for f in ("backend.cpp", "ops.cpp", "fastpath.cpp", "monitored.cpp", "communicator.cpp", "module.cpp")],
            depends=[str(Path("csrc") / "backend.hpp")],
            extra_compile_args=["-O2"],
            # The Rust library's symbols stay inside the extension; its debug information
            # is left out (a smaller module).
            extra_link_args=["-Wl,--exclude-libs,ALL", "-Wl,--strip-debug", "-lpthread", "-ldl", "-lm"],
        )
    ],
    cmdclass={"build_ext": Build},
)
