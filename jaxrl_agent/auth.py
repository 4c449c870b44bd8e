"""The shared secret that sampler and env servers require on every request.

A server refuses to start without a token; every request must present it (constant-time
comparison). Where it comes from, first found wins: an explicit argument or `--token_file`, the
`JAXRL_AGENT_TOKEN` environment variable, the file named by `JAXRL_AGENT_TOKEN_FILE`. The trainer
generates one for the sampler servers it starts and hands it to them in their environment (never on
a command line, which other users of the machine can read).
"""

from __future__ import annotations

import hmac
import os
import secrets

TOKEN_ENV = "JAXRL_AGENT_TOKEN"
TOKEN_FILE_ENV = "JAXRL_AGENT_TOKEN_FILE"
METADATA_KEY = "authorization"  # gRPC metadata: "Bearer <token>"


class AuthError(RuntimeError):
    """No token could be found, or a token file could not be read."""


def new_token() -> str:
    """A fresh 256-bit token (hex)."""
    return secrets.token_hex(32)


def load_token(token_file: str | None = None, *, required: bool = True) -> str | None:
    """The token from `token_file`, $JAXRL_AGENT_TOKEN or the file $JAXRL_AGENT_TOKEN_FILE names."""
    path = token_file or os.environ.get(TOKEN_FILE_ENV, "")
    if token_file or (path and not os.environ.get(TOKEN_ENV)):
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as err:
            raise AuthError(f"cannot read the token file {path!r}: {err}") from None
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if not token and required:
        raise AuthError(f"no authentication token: set {TOKEN_ENV} (e.g. export {TOKEN_ENV}=$(python3 -c "
                        f"'import secrets; print(secrets.token_hex(32))')) or {TOKEN_FILE_ENV}, on the server and "
                        "on its clients")
    return token or None


def matches(presented, expected: str) -> bool:
    """Constant-time comparison; anything that is not a string never matches."""
    return isinstance(presented, str) and hmac.compare_digest(presented.encode(), expected.encode())
