"""frontend_dsl package."""
