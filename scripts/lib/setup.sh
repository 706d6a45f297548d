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
  emsa_apt_install build-essential cmake libgtest-dev libgmock-dev python3 python3-venv
}

# emsa_build DIR [cmake args...]: configure once, then build everything.
emsa_build() {
  local dir="$1"; shift
  local jobs; jobs=$(nproc)
  if [ ! -f "$EMSA_ROOT/$dir/CMakeCache.txt" ]; then
    cmake -S "$EMSA_ROOT" -B "$EMSA_ROOT/$dir" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
  fi
  cmake --build "$EMSA_ROOT/$dir" -j"$jobs"
}

# The Python environment for the front end's tests and the benchmarks: one venv outside the repo,
# created once and reused by every clone ($EMSA_VENV to put it elsewhere). torch comes from PyPI
# (a CUDA build; it runs on the CPU too).
EMSA_VENV=${EMSA_VENV:-$HOME/.cache/emsa/venv}
export EMSA_VENV
emsa_python_env() {
  if [ ! -x "$EMSA_VENV/bin/python" ]; then
    echo "emsa: creating $EMSA_VENV"
    python3 -m venv "$EMSA_VENV"
  fi
  if ! "$EMSA_VENV/bin/python" -c "import torch, numpy, pytest" >/dev/null 2>&1; then
    echo "emsa: installing torch, numpy, pytest into $EMSA_VENV (several GB, once)"
    "$EMSA_VENV/bin/python" -m pip install -q --upgrade pip
    "$EMSA_VENV/bin/python" -m pip install -q torch numpy pytest
  fi
}
