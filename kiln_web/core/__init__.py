"""Project-wide pieces with no other home: health check, first admin, system checks."""
