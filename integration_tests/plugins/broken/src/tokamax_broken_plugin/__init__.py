"""A backend whose registration fails, as a plugin with a missing dependency would."""

raise RuntimeError("tokamax_broken_plugin: deliberately broken for the isolation test")
