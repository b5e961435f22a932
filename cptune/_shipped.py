"""Folders shipped beside the package: the migrations (``db/``) and the search spaces
(``search_spaces/``) live at the top of the repository and install as ``cptune.db`` and
``cptune.search_spaces``. Python started in a checkout's root imports ``cptune`` from the
source tree, where those subpackages do not exist; there the folders themselves serve."""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

#: Installed subpackage -> its folder at the top of a checkout.
_CHECKOUT_FOLDERS = {"cptune.db": "db", "cptune.search_spaces": "search_spaces"}


def shipped(package: str) -> Traversable:
    """The installed ``package`` (one of ``_CHECKOUT_FOLDERS``), or its folder in the
    checkout this cptune is imported from."""
    try:
        return resources.files(package)
    except ModuleNotFoundError:
        checkout = Path(__file__).resolve().parent.parent / _CHECKOUT_FOLDERS[package]
        if not checkout.is_dir():
            raise
        return checkout
