# Sourced by main.sh and test.sh: a virtual environment with torch and opforge
# in it, made once in .venv and reused. It installs torch explicitly before the
# project: a bare `torch` requirement with none installed pulls a multi-GB CUDA
# build. Where a torch >= 2.10 is already installed for python3 (a GPU machine's
# CUDA build), the venv sees it and uses it instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${OPFORGE_TORCH:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
  # A python3 that is itself a virtualenv's (a GPU image's /opt/.../.venv with
  # its CUDA torch): --system-site-packages reaches only the base interpreter's
  # packages, so a .pth file adds that virtualenv's own, behind .venv's.
  outer=$("$PY" -c 'import sys, sysconfig; print(sysconfig.get_paths()["purelib"] if sys.prefix != sys.base_prefix else "")')
  if [ -n "$outer" ]; then
    echo "$outer" > "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_opforge_outer_venv.pth"
  fi
fi
export PATH="$PWD/.venv/bin:$PATH"
# An image that sets PYTHONDONTWRITEBYTECODE and ships torch without its .pyc files compiles
# torch's Python sources in every process (about 10 s for torch.compile's modules on a GPU
# image): every check, test and compile worker pays it again. There the bytecode goes to
# opforge's cache instead, outside the image's own tree.
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] && [ -z "${PYTHONPYCACHEPREFIX:-}" ] &&
  python -c 'import importlib.util as u, os, sys; sys.exit(os.path.isdir(os.path.join(u.find_spec("torch").submodule_search_locations[0], "__pycache__")))' 2>/dev/null; then
  export PYTHONPYCACHEPREFIX="${OPFORGE_CACHE_DIR:-$HOME/.cache/opforge}/pycache"
  unset PYTHONDONTWRITEBYTECODE
  echo "opforge: torch's bytecode is not installed and PYTHONDONTWRITEBYTECODE is set: Python keeps it in $PYTHONPYCACHEPREFIX instead" >&2
fi
if ! python -c 'import sys, torch; v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 10))' 2>/dev/null; then
  echo "installing $TORCH_SPEC (CPU build where no CUDA is wanted)" >&2
  python -m pip install -q "$TORCH_SPEC"
fi
# Installed already from this checkout, with these packaging files: nothing to do (the install is
# editable, so source edits need no reinstall).
stamp=.venv/opforge-installed
want=$(cat pyproject.toml setup.py | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # OPFORGE_PREBUILT=0: a checkout's editable install is pure Python; the JIT cache builds the op
  # library, incrementally. First without an index, for a machine that has every dependency
  # already (setuptools >= 77 too: the build runs in this environment; the tests' own, ruff aside,
  # which test.sh skips when missing); then from the index, with one
  # retry (PIP_RETRIES reaches the build-dependency step's own pip too): a machine with no route to
  # an index fails in a second instead of retrying for ten.
  if python -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null &&
    python -c 'import pytest, xdist, numpy' 2>/dev/null &&
    OPFORGE_PREBUILT=0 python -m pip install -q --no-index --no-build-isolation -e . >/dev/null 2>&1; then
    :
  elif ! OPFORGE_PREBUILT=0 PIP_RETRIES=1 python -m pip install -q -e ".[test]"; then
    # A machine with no package index (PIP_NO_INDEX=1 says so at once) but the
    # dependencies already installed, as a GPU image: the project alone.
    echo "opforge: installing the project without its test extras (no package index reached)" >&2
    OPFORGE_PREBUILT=0 python -m pip install -q --no-deps --no-build-isolation -e .
  fi
  echo "$want" > "$stamp"
fi
# kernels (the Hugging Face Kernel Hub's loader), which the kernel-builder tests load builds with, in
# a folder of its own that only those tests put on their path: its 0.17.0 wheel declares a setuptools
# egg_info writer (kernels.lockfile) that it does not ship, and in the venv it breaks every setuptools
# metadata step (pip install -e ., the wheel tests). Its dependencies come with it.
export OPFORGE_KERNELS_SITE=${OPFORGE_KERNELS_SITE:-$PWD/.venv/kernels-site}
# A machine with no package index (a GPU machine) takes it from wheels carried in the checkout's
# .whl/ folder (`pip download --no-deps kernels==0.17.0 tomlkit` there); where neither works, the
# folder says why in .unavailable and the tests that load with kernels skip with that reason.
if [ ! -f "$OPFORGE_KERNELS_SITE/.installed-0.17.0" ]; then
  if PIP_RETRIES=1 python -m pip install -q --target "$OPFORGE_KERNELS_SITE" kernels==0.17.0 >/dev/null 2>&1 ||
    { [ -d .whl ] && python -m pip install -q --no-index --no-deps --find-links .whl --target "$OPFORGE_KERNELS_SITE" kernels==0.17.0 tomlkit >/dev/null 2>&1; }; then
    rm -f "$OPFORGE_KERNELS_SITE/.unavailable"
    touch "$OPFORGE_KERNELS_SITE/.installed-0.17.0"
  else
    mkdir -p "$OPFORGE_KERNELS_SITE"
    echo "kernels==0.17.0 could not be installed: no package index reached, and no wheel of it in $PWD/.whl" >"$OPFORGE_KERNELS_SITE/.unavailable"
    echo "opforge: kernels==0.17.0 could not be installed into $OPFORGE_KERNELS_SITE (no package index, no .whl/ wheel): the kernel-builder tests that load with it skip" >&2
  fi
fi
