"""autotune: find the fastest safe SGLang server configuration, and roll it out."""

__version__ = "0.1.0"
