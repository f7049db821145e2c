"""runloop-proxy: an OpenAI-compatible reverse proxy that keeps long agent sessions inside the
context window and cheap.

The layers, each a folder: ``api`` (the HTTP surface: chat completions, Responses, pass-through),
``conversation`` (the one conversation model both APIs map to: messages, run loops, identity),
``window`` (what goes to the LLM, pure), ``pipeline`` (one request's path: reconcile, window,
upstream, the proxy's tool rounds, record), ``history`` (the Redis store) and ``ops`` (config
reload, metrics, logs, the admin API, replay).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("runloop-proxy")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+local"
