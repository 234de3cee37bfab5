"""Data pipeline: rows -> tokens with targets -> (optionally packed) examples -> batches.

- `sources`: load rows from local jsonl/json/parquet files or a `datasets` name; seeded eval split.
- `formats`: text / prompt_response / alpaca / messages rows -> input_ids + aligned labels,
  with the over-long policy and the counts (`DataStats`); `preference` rows -> a chosen and a
  rejected sequence sharing a loss-free prompt (reward model, DPO); `unpaired` rows (or pairs unpaired) -> one
  completion, its desirable/undesirable label and its KL sequence (KTO). Each format is a `format_spec.DataFormat`
  declared by its module; `formats.FORMAT_SPECS` is the registry.
- `packing`: group samples into rows of at most max_seq_len tokens; merge a group.
- `dataset`: `build_examples`, the torch `Dataset` of tokenised (packed) examples or pairs.
- `collate`: pad examples into a `Batch` with the right attention mask.
- `synthetic`: the deterministic data of the tiny recipes (llmtrain/assets/data).

Submodules are imported on use so that `import llmtrain.data` stays cheap.
"""

# Formats whose examples are chosen/rejected pairs rather than one sequence. Defined here, not in
# `formats`, so the config validator can read it without importing torch.
PREFERENCE_FORMATS = ("preference",)
