#!/usr/bin/env bash
# Installs the Debian packages mha needs to build, test and run (see ../shared/DESIGN.md, section 3).
# Idempotent: installs only what is missing, and runs apt-get update only when something is.
# With arguments, installs just those packages instead (make format, format-check and api-docs do).
set -euo pipefail

packages=(
  build-essential cmake pkg-config ninja-build
  libdnnl-dev          # oneDNN: GEMM for the projections
  libhwy-dev           # Google Highway: SIMD with run-time dispatch (fused kernel)
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev libstb-dev
  python3-dev pybind11-dev python3-numpy python3-torch python3-pytest python3-hypothesis
  libtorch-dev         # mha_torch_ops: the registered PyTorch operators (python/torch_ops, examples/libtorch)
  python3-venv python3-pip python3-setuptools python3-wheel   # pip install of the package (test-pip)
  libclang-rt-14-dev   # sanitizer runtimes for the ASan + UBSan build
  clang-14             # libFuzzer targets of the file readers (make test-fuzz)
  clang-format         # make format, make format-check (.clang-format)
  libopenmpi-dev openmpi-bin python3-mpi4py   # mha::distributed: ring attention over MPI
  libcpp-httplib-dev   # cpp-httplib: the HTTP server of `mha explore`
  chromium chromium-driver python3-selenium  # tests/python/test_demo_report.py opens the demo's report in headless Chromium
)
[ $# -eq 0 ] || packages=("$@")

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: nothing missing (${#packages[@]} packages checked)"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=sudo
  else
    echo "install-deps: not root. Run this once as root, then retry:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
else
  SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
