"""One request's path: reconcile, window, upstream, the proxy's tool rounds, record."""
