"""Benchmarks that run through the product path: the needle-in-a-haystack (NIAH) harness.

- `haystack`: real prose split at sentence boundaries, needles inserted at requested depths,
  fitted to a token budget with the model's own tokenizer and prompt layout;
- `niah`: RULER-style tasks, the length x depth x KV-preset grid, scoring, structured results;
- `plot`: depth x length heatmaps (matplotlib, optional).
"""
