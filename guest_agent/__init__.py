"""guest-agent: the trusted per-VM agent that runs commands and moves files for the host."""

__version__ = "0.1.0"
