"""fxparallel's version, importable without the package's API (the graph cache's key reads it)."""
__version__ = "0.1.0"
