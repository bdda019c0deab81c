"""Hugging Face kernel-builder projects (a ``build.toml``): read, laid out, built
by the engine and checked."""
