"""In-memory stand-ins for the unit tests (the integration tests use the real services)."""
