"""toolsetd daemon."""
