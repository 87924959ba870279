"""The demo: an emulated P/D cluster behind the gateway, replaying a trace."""
