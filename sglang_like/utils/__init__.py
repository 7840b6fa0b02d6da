"""Process-level helpers with no model in them: CPU pinning, rolling statistics, fault
injection for tests."""
