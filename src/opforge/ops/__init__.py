"""The library's operator specs: one module per folder under ``csrc/ops``.

Every public module here defines ``SPECS``; ``opforge.registry.register_module``
finds them, so adding an operator edits no list.
"""
