"""The library version (its own module, so any module can read it without importing the package)."""
__version__ = "0.1.0"
