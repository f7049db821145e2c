"""``runloop-proxy init DIR``: a config directory to start from, with keys made for it.

It writes ``runloop.toml`` (the upstream, the port, the admin key) and one tenant under
``tenants/``, with a proxy key and an admin key generated here. The files keep only the keys'
SHA-256 hashes (``sha256:…``): the keys themselves are printed once, with the settings a client
needs, and kept nowhere. The upstream's API key stays in the environment (``${VAR}``), read
when the proxy starts. A directory that already holds a config is never overwritten.
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from ..config import GLOBAL_FILE, TENANTS_DIR, hash_key

PROXY_KEY_PREFIX = "rlp-"  # a proxy key's: told apart from a provider's key at a glance
ADMIN_KEY_PREFIX = "rla-"
KEY_BYTES = 32  # 43 URL-safe characters after the prefix
DEFAULT_UPSTREAM = "https://api.openai.com/v1"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "init", help="write a config directory with generated proxy and admin keys",
        description="Write a config directory (runloop.toml and one tenant) with a proxy key "
                    "and an admin key generated for it. The files keep only the keys' "
                    "hashes: the keys are printed once, with the settings to give clients.")
    p.add_argument("dir", nargs="?", default="runloop-config",
                   help="the directory to write (default ./runloop-config); must not hold a "
                        "config already")
    p.add_argument("--upstream", default=DEFAULT_UPSTREAM,
                   help=f"where the proxy forwards (default {DEFAULT_UPSTREAM})")
    p.add_argument("--upstream-key-env", default="OPENAI_API_KEY", metavar="VAR",
                   help="the environment variable holding the upstream's API key, read when "
                        "the proxy starts (default OPENAI_API_KEY)")
    p.add_argument("--tenant", default="default", help="the tenant's name (default 'default')")
    p.add_argument("--port", type=int, default=8080, help="the proxy's port (default 8080)")


def new_key(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(KEY_BYTES)


def global_toml(upstream: str, key_env: str, port: int, admin_key: str) -> str:
    return f"""# runloop-proxy configuration, written by `runloop-proxy init`.
# Tenant files in tenants/*.toml override [defaults] field by field; `runloop-proxy
# check-config DIR` lists every field with its value.

[server]
port = {port}
# the admin key's hash (the key was printed once by init; a new one: printf %s "$KEY" |
# sha256sum, or run init again in another directory)
admin_key = "sha256:{hash_key(admin_key)}"

[upstreams.main]
url = "{upstream}"
api_key = "${{{key_env}}}"        # read from the environment when the proxy starts

[defaults]
upstream = "main"
"""


def tenant_toml(name: str, proxy_key: str, key_env: str) -> str:
    return f"""# Tenant "{name}", written by `runloop-proxy init`.
name = "{name}"
# the proxy key's hash: clients send the key itself (printed once by init)
keys = ["sha256:{hash_key(proxy_key)}"]
upstream = "main"
upstream_key = "${{{key_env}}}"
"""


def run_init(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", args.tenant):
        print(f"init: --tenant {args.tenant!r}: letters, digits, '_', '.', '-' only",
              file=sys.stderr)
        return 2
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", args.upstream_key_env):
        print(f"init: --upstream-key-env {args.upstream_key_env!r}: not a variable name",
              file=sys.stderr)
        return 2
    if not re.fullmatch(r"https?://[^\s\"'\\]+", args.upstream):
        print(f"init: --upstream {args.upstream!r}: expected an http(s):// URL",
              file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"init: --port {args.port}: not a port number (1-65535)", file=sys.stderr)
        return 2
    if (root / GLOBAL_FILE).exists() or (root / TENANTS_DIR).exists():
        print(f"init: {root} already holds a config: not overwritten (give another "
              f"directory)", file=sys.stderr)
        return 1
    if root.exists() and not root.is_dir():
        print(f"init: {root}: not a directory", file=sys.stderr)
        return 1
    path = urllib.parse.urlsplit(args.upstream).path
    if path in ("", "/"):
        print(f"init: hint: {args.upstream} has no /v1 — OpenAI-compatible servers (and "
              f"Anthropic's API) answer under /v1: did you mean {args.upstream.rstrip('/')}/v1? "
              f"(written as given)", file=sys.stderr)
    proxy_key, admin_key = new_key(PROXY_KEY_PREFIX), new_key(ADMIN_KEY_PREFIX)
    (root / TENANTS_DIR).mkdir(parents=True, exist_ok=True)
    (root / GLOBAL_FILE).write_text(global_toml(args.upstream, args.upstream_key_env,
                                                args.port, admin_key), encoding="utf-8")
    (root / TENANTS_DIR / f"{args.tenant}.toml").write_text(
        tenant_toml(args.tenant, proxy_key, args.upstream_key_env), encoding="utf-8")
    base = f"http://127.0.0.1:{args.port}"
    print(f"wrote {root / GLOBAL_FILE} and {root / TENANTS_DIR / (args.tenant + '.toml')}\n"
          f"\n"
          f"These keys are shown once and kept nowhere (the files hold their hashes):\n"
          f"  proxy key (tenant {args.tenant}): {proxy_key}\n"
          f"  admin key:                  {admin_key}\n"
          f"\n"
          f"Start the proxy ({args.upstream_key_env} must hold the upstream's API key):\n"
          f"  runloop-proxy serve --config {root}\n"
          f"\n"
          f"Then point clients at it:\n"
          f"  OpenAI SDKs:    OPENAI_BASE_URL={base}/v1  OPENAI_API_KEY={proxy_key}\n"
          f"  Anthropic SDKs: ANTHROPIC_BASE_URL={base}  ANTHROPIC_API_KEY={proxy_key}\n"
          f"  inspector:      {base}/admin/ui  (log in with the admin key)")
    return 0
