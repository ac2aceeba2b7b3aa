"""Private helpers that several features share (no public API here)."""
