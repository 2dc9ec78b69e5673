"""The bearer-token file format, shared by the server (every token it accepts)
and clients (``batchwire health --token-file`` sends the first).

One token per line; surrounding whitespace, blank lines and lines starting with
``#`` are ignored. A token is non-empty printable ASCII without whitespace, so it
can travel as gRPC metadata ``authorization: Bearer <token>``.
"""

from __future__ import annotations

__all__ = ["parse_tokens", "valid_token"]


def valid_token(token: str) -> bool:
    """Whether ``token`` can travel as ``authorization: Bearer <token>``."""
    return (
        bool(token)
        and token.isascii()
        and token.isprintable()
        and not any(c.isspace() for c in token)
    )


def parse_tokens(text: str) -> list[str]:
    """The tokens in a token file's ``text``, in file order (possibly none).

    Raises ``ValueError`` naming the first line that is not a valid token; the
    message never contains the line itself, which may be a mistyped secret.
    """
    tokens = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not valid_token(line):
            raise ValueError(
                f"line {number} is not a token (printable ASCII without spaces expected)"
            )
        tokens.append(line)
    return tokens
