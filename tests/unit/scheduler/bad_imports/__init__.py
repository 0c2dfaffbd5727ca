"""Modules whose import-time code is hostile, named as plugins by the plugin-check tests:
only ever imported in the scheduler's checking child, never by a test itself."""
