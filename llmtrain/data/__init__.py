"""Data pipeline: rows -> tokens with targets -> (optionally packed) examples -> batches.

- `sources`: load rows from local jsonl/json/parquet files or a `datasets` name; seeded eval split.
- `formats`: text / prompt_response / alpaca / messages rows -> input_ids + aligned labels,
  with the over-long policy and the counts (`DataStats`).
- `packing`: group samples into rows of at most max_seq_len tokens; merge a group.
- `dataset`: `build_examples`, the torch `Dataset` of tokenised (packed) examples.
- `collate`: pad examples into a `Batch` with the right attention mask.

Submodules are imported on use so that `import llmtrain.data` stays cheap.
"""
