"""One JAX primitive per file: abstract eval, lowerings, autodiff and batching rules."""
