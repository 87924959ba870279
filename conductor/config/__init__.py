"""Configuration: the typed settings object, its environment variables and the KV options."""
