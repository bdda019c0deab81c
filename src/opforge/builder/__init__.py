"""Building op libraries: sources -> shared library -> ``torch.ops``.

``library_config`` describes opforge's own op library (every folder under
``csrc/ops``); ``load_library`` builds it through the JIT route when the cache
has no good copy and loads it.
"""

from opforge.builder.archs import cuda_archs, cuda_home, gencode_flags
from opforge.builder.config import (
    LIBRARY_TARGET,
    build_cuda_flag,
    csrc_dir,
    env_cxxflags,
    fast_config,
    folder_config,
    is_stable_folder,
    library_config,
    op_sources,
    want_cuda,
)
from opforge.builder.errors import BuildError, Diagnostic, parse_diagnostics
from opforge.builder.jit import BuildConfig, Library, build_library, cache_root, check_safe_to_load, load_library, load_module

__all__ = [
    "LIBRARY_TARGET",
    "BuildConfig",
    "BuildError",
    "Diagnostic",
    "Library",
    "build_cuda_flag",
    "build_library",
    "cache_root",
    "check_safe_to_load",
    "csrc_dir",
    "cuda_archs",
    "cuda_home",
    "env_cxxflags",
    "fast_config",
    "folder_config",
    "gencode_flags",
    "is_stable_folder",
    "library_config",
    "load_library",
    "load_module",
    "op_sources",
    "parse_diagnostics",
    "want_cuda",
]
