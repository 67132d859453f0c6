"""Platform adapters: verify, parse and (later) send, one module per platform."""
