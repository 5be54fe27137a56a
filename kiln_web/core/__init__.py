"""Project-wide pieces with no other home: health check, landing page, first admin, system checks."""
