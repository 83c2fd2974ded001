"""Where a program's generation calls go: the local engine, or (later) a server."""
