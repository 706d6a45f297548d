# setup.sh — sourced by the scripts: installs what a fresh Debian 12 machine lacks, then builds.
# Idempotent: installs only missing packages; reuses build directories.
set -euo pipefail

EMSA_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export EMSA_ROOT

# nvcc is in the CUDA toolkit's folder on these machines; CMake enables CUDA when it finds it.
if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi

emsa_apt_install() {
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "emsa: installing ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

emsa_build_deps() {
  emsa_apt_install build-essential cmake ccache libgtest-dev libgmock-dev nlohmann-json3-dev \
    python3 python3-venv
}

# ccache, when installed, in front of every compiler (nvcc included); paths are made relative
# to the repo, so clones elsewhere share the cache.
emsa_launchers=()
if command -v ccache >/dev/null 2>&1; then
  export CCACHE_BASEDIR="$EMSA_ROOT"
  emsa_launchers=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
                  -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi

# emsa_build DIR [cmake args...]: configure (again: cheap, and the arguments always apply), then
# build everything.
emsa_build() {
  local dir="$1"; shift
  local jobs; jobs=$(nproc)
  cmake -S "$EMSA_ROOT" -B "$EMSA_ROOT/$dir" -DCMAKE_BUILD_TYPE=Release "${emsa_launchers[@]}" \
    "$@" >/dev/null
  cmake --build "$EMSA_ROOT/$dir" -j"$jobs"
}

# emsa_build_libcxx DIR: the C++ tree built by clang against libc++ (-stdlib=libc++), warnings
# as errors, so missing includes and non-portable code fail. CUDA is off: nvcc's host compiler
# is GCC, and libc++ objects do not mix with libstdc++ ones. GoogleTest is built from Debian's
# source (/usr/src/googletest) with the same compiler and library into DIR/googletest, since
# libgtest-dev's libraries are built against libstdc++.
emsa_build_libcxx() {
  local dir="$EMSA_ROOT/$1"
  local jobs; jobs=$(nproc)
  emsa_apt_install clang libc++-dev libc++abi-dev googletest
  local libcxx=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
                -DCMAKE_CXX_FLAGS=-stdlib=libc++ -DCMAKE_EXE_LINKER_FLAGS=-stdlib=libc++
                -DCMAKE_SHARED_LINKER_FLAGS=-stdlib=libc++ -DCMAKE_BUILD_TYPE=Release
                "${emsa_launchers[@]}")
  if [ ! -f "$dir/googletest/lib/cmake/GTest/GTestConfig.cmake" ]; then
    cmake -S /usr/src/googletest -B "$dir/googletest-build" "${libcxx[@]}" \
      -DCMAKE_INSTALL_PREFIX="$dir/googletest" >/dev/null
    cmake --build "$dir/googletest-build" -j"$jobs" >/dev/null
    cmake --install "$dir/googletest-build" >/dev/null
  fi
  cmake -S "$EMSA_ROOT" -B "$dir" "${libcxx[@]}" -DEMSA_WITH_CUDA=OFF -DEMSA_WERROR=ON \
    -DEMSA_BUILD_BENCH=ON -DGTest_DIR="$dir/googletest/lib/cmake/GTest" >/dev/null
  cmake --build "$dir" -j"$jobs"
}

# The Python environment for the front end's tests, the demo and the benchmarks: one venv outside
# the repo, created once and reused by every clone ($EMSA_VENV to put it elsewhere). torch comes
# from PyPI (a CUDA build; it runs on the CPU too); matplotlib draws `emsa report`'s plots;
# transformers and accelerate run the recipe tests' Hugging Face models and Trainer, lightning
# the Lightning Trainer's; expecttest lets torch's own optimizer inputs
# (torch.testing._internal.common_optimizers) be imported by the conformance test.
# Installs only the packages the venv lacks.
EMSA_VENV=${EMSA_VENV:-$HOME/.cache/emsa/venv}
export EMSA_VENV
emsa_python_env() {
  if [ ! -x "$EMSA_VENV/bin/python" ]; then
    echo "emsa: creating $EMSA_VENV"
    python3 -m venv "$EMSA_VENV"
  fi
  local missing
  missing=$("$EMSA_VENV/bin/python" -c 'import importlib.util as u
print(" ".join(m for m in ("torch", "numpy", "pytest", "matplotlib", "transformers",
                          "accelerate", "lightning", "expecttest") if not u.find_spec(m)))')
  if [ -n "$missing" ]; then
    echo "emsa: installing $missing into $EMSA_VENV (torch is several GB, once)"
    "$EMSA_VENV/bin/python" -m pip install -q --upgrade pip
    # shellcheck disable=SC2086 # one word per package
    "$EMSA_VENV/bin/python" -m pip install -q $missing
  fi
}
