"""Database URLs fit to show anywhere: any password replaced by ``***``. Plain text work, no
database library, so every layer (the host lock's record of a command line included) uses the
one definition."""

from __future__ import annotations

import re

#: ``user:password@`` in a URL, up to the last ``@``: a password may hold an unencoded ``@``.
URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)(.*)@")
#: ``password=...`` in a URL's query or a libpq DSN.
KEY_PASSWORD = re.compile(r"(?i)(\bpassword\s*=\s*)([^&\s]*)")


def display_url(url: str) -> str:
    """``url`` as it may be shown or written anywhere (messages, reports, the host lock): any
    password replaced by ``***``, whether SQLAlchemy could parse the URL or not."""
    return KEY_PASSWORD.sub(r"\1***", URL_PASSWORD.sub(r"\1***@", url))
