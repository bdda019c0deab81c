"""``opforge abi``: which of torch's symbols a built library or wheel uses, and from which torch on it loads."""

from opforge.abi.audit import FLOOR, LibraryAudit, audit_library, audit_path, parse_shim_header, render, run, shim_table, torch_include

__all__ = ["FLOOR", "LibraryAudit", "audit_library", "audit_path", "parse_shim_header", "render", "run", "shim_table", "torch_include"]
