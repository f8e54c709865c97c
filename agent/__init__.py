"""infire-agent control plane: config, HTTP APIs, model manager, worker supervision."""

__version__ = "0.1.0"
