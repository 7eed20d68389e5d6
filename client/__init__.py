"""toolsetd client library and CLI."""
