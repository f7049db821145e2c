"""Operating the proxy: metrics, logs, the admin API, the replay benchmark."""
