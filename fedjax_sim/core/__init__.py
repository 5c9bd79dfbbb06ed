"""Layer 0: value checks, the user-error type, optional dependencies and the per-client rows
type with its row functions (`rows`; no JAX state, no imports from any other layer)."""
