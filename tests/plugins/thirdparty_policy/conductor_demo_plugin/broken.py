"""A plugin whose module cannot be imported (a missing dependency)."""

import conductor_demo_plugin_missing_dependency  # noqa: F401


class BrokenPolicy:
    name = "demo_broken"
