"""The package version, in a module of its own so that any module can read it
without importing the package root (which imports everything)."""

__version__ = "0.2.0"
