"""Bundled example training entrypoints: the default job of `elasticd run`."""
