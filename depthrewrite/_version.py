"""The package version (its own module: the saved recipe records it, below the package's __init__)."""

__version__ = "0.1.0"
