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
if ! python -c 'import sys, torch; v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 10))' 2>/dev/null; then
  echo "installing $TORCH_SPEC (CPU build where no CUDA is wanted)" >&2
  python -m pip install -q "$TORCH_SPEC"
fi
# Installed already from this checkout, with these packaging files: nothing to do (the install is
# editable, so source edits need no reinstall).
stamp=.venv/opforge-installed
want=$(cat pyproject.toml setup.py | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # One retry (PIP_RETRIES reaches the build-dependency step's own pip too): a machine with no
  # route to an index fails in a second instead of retrying for ten.
  if ! PIP_RETRIES=1 python -m pip install -q -e ".[test]"; then
    # A machine with no package index (PIP_NO_INDEX=1 says so at once) but the
    # dependencies already installed, as a GPU image: the project alone.
    # Without build isolation setup.py would see torch and compile the prebuilt
    # library, which a checkout does not use: the JIT cache builds it, incrementally.
    echo "opforge: installing the project without its test extras (no package index reached)" >&2
    OPFORGE_PREBUILT=0 python -m pip install -q --no-deps --no-build-isolation -e .
  fi
  echo "$want" > "$stamp"
fi
