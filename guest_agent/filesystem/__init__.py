"""Blocking filesystem work, run in worker threads by services/files.py; no protocol, no trio."""
