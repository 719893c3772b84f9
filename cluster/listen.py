"""Where the front end listens, decided before anything heavy starts: the API key from the config
or the ``LOCKSERVE_API_KEY`` environment variable, refusing a non-loopback bind without one
(``resolve_server_config``), and the listening socket bound up front (``bind_socket``: a busy port
is a clear ``BindError``, port 0 a free port whose number is known). Light (no web framework), so
the CLI's other commands do not import the server.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from collections.abc import Mapping

from lockserve.configs.loader import ConfigError
from lockserve.configs.schema import ServerConfig
from pydantic import SecretStr

API_KEY_ENV = "LOCKSERVE_API_KEY"


class BindError(OSError):
    """The listen address cannot be bound (in use, not local, no permission)."""


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IPs; other host names count as non-loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_server_config(config: ServerConfig, env: Mapping[str, str] | None = None) -> ServerConfig:
    """``config`` with the API key filled from ``env[LOCKSERVE_API_KEY]`` when the config has none.

    Raises ConfigError when ``config.host`` is not loopback and no key is available:
    an unauthenticated server reachable from the network is never started.
    """
    env = os.environ if env is None else env
    key = config.api_key
    if key is None and env.get(API_KEY_ENV, "").strip():
        key = SecretStr(env[API_KEY_ENV].strip())
    if key is None and not is_loopback(config.host):
        raise ConfigError(
            f"server.host ({config.host!r}) is not a loopback address, so an API key is required: "
            f"set server.api_key, pass --api-key, or export {API_KEY_ENV} (or bind 127.0.0.1)"
        )
    return config.model_copy(update={"api_key": key})


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free port."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as err:
        reason = os.strerror(err.errno) if err.errno else str(err)
        hint = " (another server? stop it or pass --port)" if err.errno == errno.EADDRINUSE else ""
        raise BindError(f"cannot listen on {host}:{port}: {reason}{hint}") from None
    sock.set_inheritable(True)
    return sock
