"""A model-free serving loop over a pool protocol, the kvchain pool behind it, and (later)
workloads and baseline pools for side-by-side comparisons."""
