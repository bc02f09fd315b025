"""Benchmarks that run through the product path: the needle-in-a-haystack (NIAH) harness.

- `haystack`: real prose split at sentence boundaries, needles inserted at requested depths,
  fitted to a token budget with the model's own tokenizer and prompt layout;
- `niah`: RULER-style tasks, the length x depth x KV-preset grid, scoring, structured results;
- `niah_segments`: past the model's context: segment caches, literal and paraphrased questions,
  recall@1/@2 of the needle's segment and accuracy per ranker;
- `plot`: depth x length heatmaps (matplotlib, optional).
"""
