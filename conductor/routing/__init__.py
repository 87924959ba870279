"""Routing a request: deciding, relaying its legs, batches, deadlines and prefix pulls."""
