"""A plugin module that fails to import."""

raise RuntimeError("this plugin module is broken on purpose")
