"""Built-in diagnostics task types for operators' smoke tests and the runtime's own tests."""
