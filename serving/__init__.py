"""What every service process shares: serve() and its health, TLS, tracing, metrics, logs and heap settings."""
