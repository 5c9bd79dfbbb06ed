"""Layer 0: value checks, the user-error type and optional dependencies (no JAX state, no
imports from any other layer)."""
