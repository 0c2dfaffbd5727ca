"""One node's shared parts: what the pool (INIT stage) and the executor (RUN stage) both use.

Settings, session paths and runtimes, harness presets, artifacts, heartbeats, and the
reaper that recovers a node's sessions after a crash. The pool and the executor import
this package; it imports neither of them.
"""
