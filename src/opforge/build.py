"""The old name of ``opforge.builder``, kept for one release.

``import opforge.build`` (and ``opforge.build.jit`` and the other submodules)
still works and warns once; the name was a build output's, which hid the
package from tools that skip ``build/`` folders (.gitignore, source walks)."""

import importlib
import pkgutil
import sys
import warnings

import opforge.builder as _builder
from opforge.builder import *  # noqa: F403 - the alias re-exports the package's names
from opforge.builder import __all__  # noqa: F401

warnings.warn("opforge.build is now opforge.builder; the old name goes away in the next release", DeprecationWarning, stacklevel=2)

# So that `import opforge.build.jit` finds the submodule: the import system looks
# in sys.modules for the dotted name once the parent is imported.
__path__: list[str] = []
for _info in pkgutil.iter_modules(_builder.__path__):
    sys.modules[f"{__name__}.{_info.name}"] = importlib.import_module(f"opforge.builder.{_info.name}")
