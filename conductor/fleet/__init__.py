"""The fleet: instances and their state, health probes, and membership changes at run time."""
