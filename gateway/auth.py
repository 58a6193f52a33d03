"""API keys and tenants.

A *tenant* is whoever pays for a request: it has a name, the hashes of its API keys and its
rate limits (``{unit: amount per minute}``, see ``gateway.ratelimit.UNITS``). Keys are stored
as ``sha256:<hex>`` digests only: keys are long random strings (``mmserve keys add`` makes
256-bit ones), so a fast hash is safe here (slow hashes protect low-entropy passwords) and lets
every request be checked without a per-request scrypt. Checking a key compares its digest with
*every* stored digest in constant time, so timing reveals nothing about which one matched.

The keys file (``mmserve serve --keys-file keys.json``, or ``.toml`` with the same structure)::

    {
      "default_limits": {"llm_tokens": 100000},          # optional; per minute; for every tenant
      "tenants": {
        "acme": {"keys": ["sha256:9f86d0..."], "limits": {"llm_tokens": 20000, "embed_inputs": 600}},
        "beta": {"keys": ["sha256:..."]}                   # default limits only
      }
    }

A unit missing from a tenant's limits falls back to ``default_limits``; missing from both, it is
unlimited. ``--api-key KEY`` adds a tenant ``default`` with that key; with neither option,
requests are not authenticated and run as tenant ``anonymous`` (with the default limits).
Create entries with ``mmserve keys add --keys-file keys.json --tenant acme --limit llm_tokens=20000``
(prints the new key once, stores its hash) or ``mmserve keys hash`` (hash a key read from stdin).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import math
import os
import secrets
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import argtypes
from gateway.errors import APIError

HASH_PREFIX = "sha256:"
ANONYMOUS = "anonymous"
KEYED_PREFIX = "/v1/"  # every route under it takes a key (``create_app``); /health, /ready and /metrics do not


def hash_key(key: str) -> str:
    """The stored form of an API key: ``sha256:<hex digest>``."""
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh random API key (256 bits)."""
    return "mms-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Tenant:
    """A caller: its name and effective limits (unit -> amount per minute)."""

    name: str
    limits: dict[str, float] = field(default_factory=dict)


def _check_limits(limits: Any, where: str) -> dict[str, float]:
    from gateway.ratelimit import UNITS

    if not isinstance(limits, dict):
        raise ValueError(f"{where}: limits must be a table of unit -> amount per minute")
    out: dict[str, float] = {}
    for unit, value in limits.items():
        if unit not in UNITS:
            raise ValueError(f"{where}: unknown limit unit {unit!r}; choose from {', '.join(UNITS)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ValueError(f"{where}: limit {unit} must be a positive number per minute, got {value!r}")
        out[unit] = float(value)
    return out


class KeyStore:
    """Tenants and the digests of their keys; ``authenticate`` maps a bearer token to a tenant."""

    def __init__(self, default_limits: dict[str, float] | None = None) -> None:
        self.default_limits = dict(default_limits or {})
        self._tenants: dict[str, Tenant] = {}
        self._digests: list[tuple[bytes, str]] = []  # (sha256 digest, tenant name)

    @property
    def enabled(self) -> bool:
        """True when at least one key is configured (requests must then authenticate)."""
        return bool(self._digests)

    def add_tenant(self, name: str, key_hashes: list[str], limits: dict[str, float] | None = None) -> Tenant:
        if not name or name == ANONYMOUS:
            raise ValueError(f"invalid tenant name {name!r}")
        if name in self._tenants:
            raise ValueError(f"tenant {name!r} is defined twice")
        tenant = Tenant(name, {**self.default_limits, **(limits or {})})
        self._tenants[name] = tenant
        for h in key_hashes:
            if not isinstance(h, str) or not h.startswith(HASH_PREFIX) or len(h) != len(HASH_PREFIX) + 64:
                raise ValueError(f"tenant {name!r}: keys must be 'sha256:<64 hex>' (see `mmserve keys hash`)")
            self._digests.append((bytes.fromhex(h[len(HASH_PREFIX) :]), name))
        return tenant

    def add_plain_key(self, name: str, key: str) -> Tenant:
        """Register a plaintext key (``--api-key``); only its hash is kept."""
        return self.add_tenant(name, [hash_key(key)])

    def anonymous(self) -> Tenant:
        return Tenant(ANONYMOUS, dict(self.default_limits))

    def authenticate(self, token: str) -> Tenant | None:
        """The tenant owning ``token``, or None. Compares against every digest (constant time)."""
        digest = hashlib.sha256(token.encode()).digest()
        found: str | None = None
        for stored, name in self._digests:
            if hmac.compare_digest(stored, digest):
                found = name
        return self._tenants[found] if found is not None else None

    @classmethod
    def from_file(cls, path: str | Path, default_limits: dict[str, float] | None = None) -> KeyStore:
        """Load a JSON or TOML keys file (structure in the module docstring). ``default_limits``
        (from the command line) override the file's ``default_limits`` unit by unit."""
        return cls.from_data(read_keys_file(path), str(path), default_limits)

    @classmethod
    def from_data(cls, data: dict[str, Any], where: str, default_limits: dict[str, float] | None = None) -> KeyStore:
        defaults = {**_check_limits(data.get("default_limits", {}), where), **(default_limits or {})}
        store = cls(defaults)
        tenants = data.get("tenants", {})
        if not isinstance(tenants, dict):
            raise ValueError(f"{where}: 'tenants' must be a table of name -> {{keys, limits}}")
        for name, entry in tenants.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("keys", []), list):
                raise ValueError(f"{where}: tenant {name!r} must have a 'keys' list")
            store.add_tenant(name, entry.get("keys", []), _check_limits(entry.get("limits", {}), f"{where}: {name}"))
        return store


def read_keys_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # (Python 3.10)
            raise ValueError(f"{path}: TOML keys files need Python 3.11 or later; use JSON") from None
        data = tomllib.loads(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a table at the top level")
    return data


def _toml(data: dict[str, Any]) -> str:
    """TOML for the keys-file structure (string lists and number tables only)."""
    lines: list[str] = []

    def table(header: str, values: dict[str, Any]) -> None:
        lines.append(f"[{header}]")
        for k, v in values.items():
            lines.append(f"{json.dumps(k)} = {json.dumps(v)}")
        lines.append("")

    if data.get("default_limits"):
        table("default_limits", data["default_limits"])
    for name, entry in data.get("tenants", {}).items():
        table(f"tenants.{json.dumps(name)}", {"keys": entry.get("keys", [])})
        if entry.get("limits"):
            table(f"tenants.{json.dumps(name)}.limits", entry["limits"])
    return "\n".join(lines)


def write_keys_file(path: str | Path, data: dict[str, Any]) -> None:
    """Write atomically (temp file + rename), readable by the owner only; a symlink's target is
    the file written (the one a server reads through the link)."""
    path = Path(os.path.realpath(path))
    text = _toml(data) if path.suffix == ".toml" else json.dumps(data, indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


WS_KEY_PROTOCOL = "openai-insecure-api-key."


def ws_subprotocol(ws: HTTPConnection, preferred: str | None = None) -> str | None:
    """The subprotocol a WebSocket route accepts: ``preferred`` if offered, else the first offered
    that carries no key, else the key's (a browser fails a handshake whose answer names none of
    the protocols it offered: one that sends only ``openai-insecure-api-key.<key>`` could not
    connect); ``None`` when none is offered."""
    offered = [p.strip() for p in ws.scope.get("subprotocols", []) if p.strip()]
    if preferred in offered:
        return preferred
    return next((p for p in offered if not p.startswith(WS_KEY_PROTOCOL)), offered[0] if offered else None)


def bearer_token(request: HTTPConnection) -> str | None:
    """The key from ``Authorization: Bearer``; on WebSockets also from the subprotocol
    ``openai-insecure-api-key.<key>`` (how OpenAI Realtime browser clients, which cannot set
    headers, send it)."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    if request.scope["type"] == "websocket":
        for proto in request.headers.get("sec-websocket-protocol", "").split(","):
            if proto.strip().startswith(WS_KEY_PROTOCOL):
                return proto.strip()[len(WS_KEY_PROTOCOL) :] or None
    return None


def tenant_of(store: KeyStore, request: HTTPConnection) -> Tenant:
    """The tenant whose key ``request`` carries (the anonymous one when no keys are configured);
    a 401 (OpenAI error JSON) ``APIError`` when keys are configured and it carries none of them."""
    if not store.enabled:
        return store.anonymous()
    token = bearer_token(request)
    tenant = store.authenticate(token) if token is not None else None
    if tenant is None:
        raise APIError(
            401,
            "Incorrect API key provided." if token else "You didn't provide an API key (Authorization: Bearer ...).",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return tenant


def auth_dependency(store: KeyStore) -> Any:
    """FastAPI dependency: sets ``request.state.tenant`` (``tenant_of``: a 401 without a key)."""

    async def authenticate(request: HTTPConnection) -> None:  # HTTPConnection: WebSocket routes too
        request.state.tenant = tenant_of(store, request)

    return authenticate


class KeyCheckMiddleware:
    """A request to a keyed route (``KEYED_PREFIX``) without a valid key gets its 401 before
    anything reads its body: an unauthenticated client can make the server neither buffer nor
    inflate nor parse one, and gets the 401 rather than a body's 400/413/415 (as OpenAI answers).
    WebSockets pass: they have no body, and the route's dependency refuses them."""

    def __init__(self, app: ASGIApp, store: KeyStore) -> None:
        self.app, self.store = app, store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.store.enabled and scope["path"].startswith(KEYED_PREFIX):
            try:
                tenant_of(self.store, HTTPConnection(scope))
            except APIError as exc:
                await exc.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- command line ----------------------------------------------------------------------------------


def parse_limit(value: str) -> tuple[str, float]:
    """``UNIT=AMOUNT`` (per minute) for ``--limit``."""
    unit, sep, amount = value.partition("=")
    try:
        if not sep:
            raise ValueError(f"expected UNIT=AMOUNT, got {value!r}")
        return next(iter(_check_limits({unit.strip(): float(amount)}, "--limit").items()))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--limit: ")) from exc


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("auth and limits")
    g.add_argument("--keys-file", default=None, help="JSON/TOML file of tenants, key hashes and limits")
    g.add_argument(
        "--limit",
        type=parse_limit,
        action="append",
        default=None,
        metavar="UNIT=PER_MIN",
        help="default per-tenant rate limit (units: llm_tokens, embed_inputs, audio_seconds, image_steps)",
    )
    g.add_argument(
        "--drain-timeout",
        type=argtypes.at_least(float, 0),
        default=30.0,
        help="seconds to let in-flight requests finish",
    )
    g.add_argument(
        "--drain-grace",
        type=argtypes.at_least(float, 0),
        default=0.0,
        help="seconds to keep serving after /ready turns 503",
    )
    g.add_argument("--log-format", choices=["json", "text"], default="json", help="request log format")


def keystore_from_args(args: Any) -> KeyStore:
    """The key store for ``mmserve serve`` arguments (``--keys-file``, ``--api-key``, ``--limit``)."""
    defaults = dict(getattr(args, "limit", None) or [])
    keys_file = getattr(args, "keys_file", None)
    store = KeyStore.from_file(keys_file, defaults) if keys_file else KeyStore(defaults)
    api_key = getattr(args, "api_key", None)
    if api_key:
        store.add_plain_key("default", api_key)
    return store


def _keys_hash(args: argparse.Namespace) -> int:
    key = args.key if args.key is not None else sys.stdin.readline().strip()
    if not key:
        print("no key given (pass it as an argument or on stdin)", file=sys.stderr)
        return 1
    print(hash_key(key))
    return 0


def _keys_add(args: argparse.Namespace) -> int:
    path = Path(args.keys_file)
    data = read_keys_file(path) if path.exists() else {"tenants": {}}
    entry = data.setdefault("tenants", {}).setdefault(args.tenant, {"keys": []})
    key = new_key()
    entry.setdefault("keys", []).append(hash_key(key))
    if args.limit:
        entry["limits"] = {**entry.get("limits", {}), **dict(args.limit)}
    KeyStore.from_data(data, str(path))  # fail now rather than at the next `serve`
    write_keys_file(path, data)
    print(key)
    print(f"added a key for tenant {args.tenant!r} to {path} (only its hash is stored)", file=sys.stderr)
    return 0


def add_keys_command(sub: Any) -> None:
    """``mmserve keys hash [KEY]`` and ``mmserve keys add --keys-file F --tenant T [--limit U=N]``."""
    keys = sub.add_parser("keys", help="create API keys for --keys-file (stores only hashes)")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    h = ksub.add_parser("hash", help="print the stored form of a key (reads stdin without KEY)")
    h.add_argument("key", nargs="?", default=None)
    h.set_defaults(func=_keys_hash)
    a = ksub.add_parser("add", help="generate a key for a tenant, store its hash, print the key once")
    a.add_argument("--keys-file", required=True)
    a.add_argument("--tenant", required=True)
    a.add_argument("--limit", type=parse_limit, action="append", default=None, metavar="UNIT=PER_MIN")
    a.set_defaults(func=_keys_add)
