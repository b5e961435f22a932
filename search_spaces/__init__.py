"""Shipped search spaces (TOML), installed as ``cptune.search_spaces``."""
