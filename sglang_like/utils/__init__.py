"""Process-level helpers with no model in them: CPU pinning, rolling statistics, fault
injection for tests, packing a step's host data into one device copy."""
