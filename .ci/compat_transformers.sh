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
# Where this checkout has the main environment (.venv, which .ci/run's first command makes), the venv is a layer
# over it: a .pth line puts the main environment's site-packages after the venv's own, so pip installs only what
# differs from it (that transformers release and what it needs in other releases, e.g. an older tokenizers); torch
# and the rest are the main environment's, not unpacked a second time. Without a main environment (or under another
# Python) everything is installed in the venv.
#
#   .ci/compat_transformers.sh [PYTEST_ARG ...]
#   HYBRIDTUNE_COMPAT_TRANSFORMERS=5.24.0 .ci/compat_transformers.sh    # another release
#   HYBRIDTUNE_COMPAT_VENV=/path/to/venv                                # where the venv lives
#   HYBRIDTUNE_COMPAT_BASE=/path/to/venv                                # the environment to layer over (none: "")
set -euo pipefail
cd "$(dirname "$0")/.."

version="${HYBRIDTUNE_COMPAT_TRANSFORMERS:-5.14.1}"
venv="${HYBRIDTUNE_COMPAT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/hybridtune/venv-transformers-$version}"
base="${HYBRIDTUNE_COMPAT_BASE-.venv}"
py="$venv/bin/python"

have_version() {
  "$py" -c "import sys, transformers, hybridtune; sys.exit(transformers.__version__ != '$version')" 2>/dev/null
}

site_packages() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# The layer's link to the main environment is written on every run (a venv made over another checkout's, or one
# made before, must not keep reading that one), or removed when there is none to layer over.
python=python3
if [ -n "$base" ] && "$base/bin/python" -c "import torch, pytest, xdist" 2>/dev/null; then
  python="$base/bin/python"
fi
if [ ! -x "$py" ]; then
  echo "+ creating $venv (transformers==$version)"
  "$python" -m venv "$venv"
fi
same_python() { [ "$("$1" -c 'import sys; print(sys.version_info[:2])')" = "$("$2" -c 'import sys; print(sys.version_info[:2])')" ]; }
link="$(site_packages "$py")/_hybridtune_compat_base.pth"
if [ "$python" != python3 ] && same_python "$py" "$python"; then
  base_site="$(site_packages "$python")"
  [ "$(cat "$link" 2>/dev/null)" = "$base_site" ] || echo "$base_site" > "$link"
  echo "+ $venv layered over $base_site"
else
  rm -f "$link"
fi

if ! have_version; then
  echo "+ installing transformers==$version in $venv (and what it needs that is not there yet)"
  # torch==2.13.0 is the local CPU wheel; a bare `torch` would pull a multi-GB CUDA build. Over the main
  # environment each requirement it already meets is left as it is there.
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
