"""The admin gate: no request under ``/admin`` reaches a handler without the admin's credential.

The ASGI front (``app.FastPath``) asks it of every request before Starlette routes it, so
what it closes is a class, not a list of routes: a handler that forgets its own check, a
sub-path a handler dispatches itself, a method or a query it branches on, a route registered
outside ``routes()`` or with no method list — all are behind the gate.

- The inspector (``/admin/ui`` and below): a valid login cookie (signed with the admin key,
  its time not over), else a 303 to the login page. Open to anyone only ``OPEN``: the login
  form, logging in (which checks the key it is given), logging out.
- The admin API (everything else under ``/admin``): the admin key as Bearer (or ``api-key``,
  ``x-api-key``), else 401 ``invalid_api_key``; 404 "disabled" when no admin key is set.

"Under /admin" is read loosely (case folded, leading slashes collapsed, with and without the
app's root path), the way open is read strictly (an exact method and path): a path the
router would not serve is refused rather than told apart. The handlers keep their own checks;
the gate is what holds when one of them is wrong.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.types import Scope

from ..api.http import error_response
from ..errors import ClientError
from ..state import AppState
from .admin import check_admin_key
from .inspector_shell import BASE, login_ok

ADMIN = "/admin"
# what anyone may ask of the inspector: exact method and path, nothing below them
OPEN = frozenset({("GET", f"{BASE}/login"), ("HEAD", f"{BASE}/login"),
                  ("POST", f"{BASE}/login"), ("POST", f"{BASE}/logout")})


def route_path(scope: Scope) -> str:
    """The path Starlette routes by: the request's, less the app's root path."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] == "/":
        return path[len(root):]
    return path


def area(scope: Scope) -> str | None:
    """"inspector" or "api" for a request under /admin, else None."""
    return _area(route_path(scope)) or _area(scope["path"])


def _area(path: str) -> str | None:
    folded = "/" + path.lstrip("/").lower()
    if not folded.startswith(ADMIN):
        return None
    return "inspector" if folded == BASE or folded.startswith(BASE + "/") else "api"


async def refusal(state: AppState, scope: Scope) -> Response | None:
    """The answer a request under /admin gets instead of its handler; None to let it pass
    (a request elsewhere, an open one, or one with the right credential)."""
    where = area(scope)
    if where is None:
        return None
    path, request = route_path(scope), Request(scope)
    if where == "inspector":
        if (scope.get("method"), path) in OPEN or await login_ok(state, request) is not None:
            return None
        return RedirectResponse(f"{BASE}/login", 303)
    try:
        check_admin_key(state, request)
    except ClientError as exc:  # 401 invalid_api_key; 404 when no admin key is configured
        return error_response(path, exc.status, exc.body(), exc)
    return None
