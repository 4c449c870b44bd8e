"""The shared secret that sampler and env servers require on every request.

A server refuses to start without a token; every request must present it (constant-time
comparison). Where it comes from, first found wins: an explicit argument or `--token_file`, the
`JAXRL_AGENT_TOKEN` environment variable, the file named by `JAXRL_AGENT_TOKEN_FILE`. The trainer
generates one for the sampler servers it starts and hands it to them in their environment (never on
a command line, which other users of the machine can read).

TLS (for servers on other hosts): a server given a certificate and key serves only TLS; a client
given the CA file that signed it verifies the server against it (and its host name). The token
still travels on every request, now encrypted. Loopback servers the trainer starts need neither.
"""

from __future__ import annotations

import hmac
import os
import secrets
import ssl

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


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise AuthError(f"cannot read the TLS {what} {path!r}: {err}") from None


def check_tls_pair(cert_file: str | None, key_file: str | None) -> bool:
    """Whether TLS is asked for: both files given (True), neither (False); one alone is an error."""
    if bool(cert_file) != bool(key_file):
        raise AuthError(f"TLS needs both a certificate and its key (got cert_file={cert_file!r}, "
                        f"key_file={key_file!r})")
    return bool(cert_file)


def server_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A TLS (1.2+) server context from a PEM certificate (chain) and its private key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as err:
        raise AuthError(f"cannot load the TLS certificate {cert_file!r} with key {key_file!r}: {err}") from None
    return context


def client_ssl_context(ca_file: str) -> ssl.SSLContext:
    """A TLS client context that trusts only `ca_file`'s certificates and checks the host name."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the certificate and the host name
    try:
        context.load_verify_locations(cadata=_read(ca_file, "CA file").decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError) as err:
        raise AuthError(f"the TLS CA file {ca_file!r} holds no PEM certificate: {err}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def grpc_server_credentials(cert_file: str, key_file: str):
    """gRPC server credentials from PEM files (`grpc.ssl_server_credentials`)."""
    import grpc

    server_ssl_context(cert_file, key_file)  # a clear error for a bad pair, before gRPC's
    return grpc.ssl_server_credentials([(_read(key_file, "key"), _read(cert_file, "certificate"))])


def grpc_channel_credentials(ca_file: str):
    """gRPC channel credentials trusting only `ca_file` (`grpc.ssl_channel_credentials`)."""
    import grpc

    return grpc.ssl_channel_credentials(root_certificates=_read(ca_file, "CA file"))
