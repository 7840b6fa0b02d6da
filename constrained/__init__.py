"""constrained package."""
