"""The only place that starts processes: spawning, cgroups, output buffers, exec lifecycle."""
