"""Ahead-of-time build of opforge's op library as ``opforge._C``.

    pip install --no-build-isolation .        # prebuilt library, against the installed torch

Everything about the library (sources, flags, CUDA archs) comes from
``opforge.builder.library_config``, the JIT route's own definition; this file
only hands it to setuptools. ``OPFORGE_BUILD_CUDA=0|1``, ``TORCH_CUDA_ARCH_LIST``
and ``MAX_JOBS`` are honoured. The library is on PyTorch's stable ABI: it is
``opforge/_C.abi3.so``, loads in every torch from 2.10 on, and the wheel is
tagged ``cp310-abi3`` (one wheel for every Python from 3.10 on).

With build isolation (plain ``pip install .``) pip builds in a fresh
environment without torch: installing torch there would pull a multi-GB build
that need not match the one the library will be loaded into. The wheel is
then pure Python and ``import opforge`` builds the library on first use
(JIT); ``OPFORGE_REQUIRE_PREBUILT=1`` makes that case an error instead.
``OPFORGE_PREBUILT=0`` asks for that pure-Python install on purpose (a source
checkout's editable install: the JIT cache rebuilds only what an edit touches).
"""

import contextlib
import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "src"))
os.environ["OPFORGE_NO_AUTOLOAD"] = "1"  # import opforge's build code, build nothing at import

# torch is imported only where a prebuilt library may be wanted: pip runs this file three times for
# an editable install, and an import of torch costs seconds where its bytecode is not cached.
pure_python = os.environ.get("OPFORGE_PREBUILT") == "0"
torch = None
if not pure_python:
    with contextlib.suppress(ImportError):
        import torch

if pure_python:
    print("opforge: OPFORGE_PREBUILT=0: no prebuilt op library; `import opforge` builds it on first use (JIT)", file=sys.stderr)
    setup()
elif torch is None:
    message = (
        "opforge: torch is not importable in the build environment, so the wheel has no prebuilt op library; "
        "`import opforge` will build it on first use (JIT). For a prebuilt library, install torch first and "
        "run `pip install --no-build-isolation .`"
    )
    if os.environ.get("OPFORGE_REQUIRE_PREBUILT") == "1":
        sys.exit(message.replace("so the wheel has no", "and OPFORGE_REQUIRE_PREBUILT=1 asks for a"))
    print(message, file=sys.stderr)
    setup()
else:
    from opforge.builder.setuptools_ext import BuildExtension, library_extension, wheel_options

    ext = library_extension(HERE)
    setup(ext_modules=[ext], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)}, options=wheel_options(ext))
