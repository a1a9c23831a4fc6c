#!/usr/bin/env bash
# CI: the module compiler under another transformers release than the main environment's.
#
# transformers 5.14.1 is the last release whose `force_accelerate_hooks` returns a bare closure
# (no functools.wraps) around the GDN and Mamba mixer forwards: the case the compiler must read
# through. This script builds (once, then reuses) a separate venv with that release and CPU torch,
# runs there the tests marked `transformers_compat` (slow ones included: the module compiler, the kernel
# resolver's gates and paths, the GDN model patch) on two workers, with any extra pytest arguments given
# (test paths among them), and `hybridtune compile --sweep`, which must report zero failures.
#
#   .ci/compat_transformers.sh [PYTEST_ARG ...]
#   HYBRIDTUNE_COMPAT_TRANSFORMERS=5.24.0 .ci/compat_transformers.sh    # another release
#   HYBRIDTUNE_COMPAT_VENV=/path/to/venv                                # where the venv lives
set -euo pipefail
cd "$(dirname "$0")/.."

version="${HYBRIDTUNE_COMPAT_TRANSFORMERS:-5.14.1}"
venv="${HYBRIDTUNE_COMPAT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/hybridtune/venv-transformers-$version}"
py="$venv/bin/python"

have_version() {
  "$py" -c "import sys, transformers, hybridtune; sys.exit(transformers.__version__ != '$version')" 2>/dev/null
}

if ! have_version; then
  echo "+ creating $venv (transformers==$version, CPU torch)"
  python3 -m venv "$venv"
  # torch==2.13.0 is the local CPU wheel; a bare `torch` would pull a multi-GB CUDA build.
  "$py" -m pip install -q torch==2.13.0 "transformers==$version" "peft>=0.18,<0.22" safetensors tokenizers \
    pyyaml rich matplotlib pyarrow pytest pytest-xdist
  # --no-deps: the project pins the main environment's transformers; this venv keeps $version.
  "$py" -m pip install -q --no-deps -e .
  have_version || { echo "error: $venv does not import transformers $version and hybridtune" >&2; exit 2; }
fi

# A reused venv must import THIS checkout: an editable install made from another clone would test stale code.
here="$(pwd -P)/src/hybridtune/__init__.py"
if [ "$("$py" -c 'import os, hybridtune; print(os.path.realpath(hybridtune.__file__))')" != "$here" ]; then
  echo "+ pointing $venv at this checkout"
  "$py" -m pip install -q --no-deps -e .
fi
"$py" -c "import os, sys, hybridtune; sys.exit(os.path.realpath(hybridtune.__file__) != '$here')" \
  || { echo "error: $venv imports hybridtune from elsewhere than $here" >&2; exit 2; }
echo "+ hybridtune from $here"
echo "+ transformers $("$py" -c 'import transformers; print(transformers.__version__)'), torch $("$py" -c 'import torch; print(torch.__version__)')"
# A venv made before the tests ran on two workers lacks pytest-xdist.
"$py" -c "import xdist" 2>/dev/null || "$py" -m pip install -q pytest-xdist
# Only the folders that hold transformers_compat tests are collected: this venv has no datasets (data's tests).
[ $# -gt 0 ] || set -- tests/compiler tests/kernels tests/mixers
echo "+ pytest -m transformers_compat -n 2 $*"
"$py" -m pytest -q -p no:cacheprovider -m transformers_compat -n 2 "$@"
echo "+ hybridtune compile --sweep"
"$venv/bin/hybridtune" compile --sweep
