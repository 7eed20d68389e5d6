"""toolsetd wire protocol: pure models, framing and error codes (no I/O)."""
__version__ = "0.1.0"
